"""The demo's trainer learns: its optimizer steps move HF's greedy answers to the target."""

from __future__ import annotations

import itertools

from integration.learner import ANSWER_TOKENS, Learner
from integration.tiny_model import build_tiny_model, hf_greedy


def test_the_trainer_moves_the_answers_to_the_target_word(tmp_path):
    learner = Learner(build_tiny_model(tmp_path / "model"))
    rewards = []
    for version in range(1, 9):
        if version > 1:
            learner.train()
        answers = hf_greedy(learner.model, learner.prompts, ANSWER_TOKENS,
                            state_dict=learner.state(), min_gap=0.0)
        rewards.append(learner.reward(answers))
    assert rewards[0] == 0.0
    assert rewards[-1] >= 0.9
    assert sum(b < a for a, b in itertools.pairwise(rewards)) <= 1  # it climbs


def test_a_published_state_does_not_change_with_later_steps(tmp_path):
    learner = Learner(build_tiny_model(tmp_path / "model"))
    state = learner.state()
    before = {k: v.clone() for k, v in state.items()}
    learner.train()
    assert all(state[k].equal(before[k]) for k in state)
    assert not all(learner.state()[k].equal(before[k]) for k in state)
