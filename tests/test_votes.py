"""The ranks of an engine vote through the job's key-value store: a rank that does not
answer in time is named and counted as a no, and when it answers later it reads the same
outcome the others acted on. Ranks are threads here, over a real torch store."""

from __future__ import annotations

import torch.distributed as dist

from tensorhub.engines.votes import RankVote
from tensorhub_testing.ranks import on_every_rank


def votes_of(store, ranks: int = 2, timeout: float = 1.0) -> list[RankVote]:
    return [RankVote(list(range(ranks)), r, timeout, store=store) for r in range(ranks)]


def vote_together(votes: list[RankVote], oks: list[bool]) -> list[bool]:
    results: list[bool | None] = [None] * len(votes)

    def vote(rank: int) -> None:
        results[rank] = votes[rank](oks[rank])

    on_every_rank(vote, len(votes))
    return results


def test_every_rank_learns_whether_all_are_ready():
    votes = votes_of(dist.HashStore())
    assert vote_together(votes, [True, True]) == [True, True]
    assert vote_together(votes, [True, False]) == [False, False]
    assert vote_together(votes, [True, True]) == [True, True]  # rounds stay in step


def test_a_rank_that_does_not_answer_is_named_and_the_others_go_on_without_it():
    rank0, rank1 = votes_of(dist.HashStore(), timeout=0.5)
    assert rank0(True) is False  # rank 1 hangs
    assert rank0.missing == [1]
    assert rank1(True) is False  # it wakes up: the round was decided without it
    assert vote_together([rank0, rank1], [True, True]) == [True, True]


def test_the_first_rank_shares_its_bytes_with_the_others():
    rank0, rank1 = votes_of(dist.HashStore(), timeout=0.5)
    assert rank0.broadcast(b"where the copy is") == b"where the copy is"
    assert rank1.broadcast(None) == b"where the copy is"


def test_a_rank_whose_first_rank_never_shares_gets_nothing_after_the_bound():
    _, rank1 = votes_of(dist.HashStore(), timeout=0.2)
    assert rank1.broadcast(None) == b""
