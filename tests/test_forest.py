"""The striped forest: one parent per stripe, trees of logarithmic depth, no overload."""

from __future__ import annotations

import math

from tensorhub.coordinator.forest import Forest


def _fan_out(n: int, forest: Forest | None = None) -> Forest:
    forest = forest or Forest(stripes=2, fanout=2)
    forest.add_root("trainer")
    pending = [r for r in (f"r{i}" for i in range(n))
               if None in forest.join(r, "", n + 1, now=0.0)]
    for r in pending:  # once the fleet has arrived, every pending stripe finds a slot
        assert None not in forest.fill(r, now=0.01, expected=n + 1)
    return forest


def test_every_reader_has_a_parent_per_stripe_and_nobody_more_than_fanout_children():
    forest = _fan_out(4096)
    children: dict[str, int] = {}
    for m in forest.members.values():
        for p in m.parents:
            if p is not None:
                children[p] = children.get(p, 0) + 1
    assert all(None not in m.parents for m in forest.members.values() if not m.root)
    assert max(children.values()) == 2  # each uploads one model's worth at most
    assert children["trainer"] == 2  # one child per stripe: every byte leaves it once


def test_each_reader_forwards_one_stripe_so_the_trees_are_shallow():
    forest = _fan_out(4096)
    forwarded: dict[str, set[int]] = {}
    for m in forest.members.values():
        for s, p in enumerate(m.parents):
            if p is not None and p != "trainer":
                forwarded.setdefault(p, set()).add(s)
    assert all(len(stripes) == 1 for stripes in forwarded.values())
    assert forest.deepest <= math.ceil(math.log2(4096 / 2)) + 2  # 13, not a chain of 2048


def test_a_replacement_parent_is_shallower_so_never_a_descendant():
    forest = _fan_out(64)
    deep = max((m for m in forest.members.values() if not m.root), key=lambda m: m.depth[0])
    old_depth, old_parent = deep.depth[0], deep.parents[0]
    new = forest.replace(deep.worker_id, 0, {old_parent}, now=1.0)
    assert new not in (None, old_parent)
    assert forest.members[new].depth[0] < old_depth


def test_the_first_reader_of_a_second_datacenter_is_its_gateway():
    forest = Forest()
    forest.add_root("trainer", dc="dc0")
    for i in range(4):
        forest.join(f"a{i}", "dc0", expected=9, now=0.0)
    gateway = forest.join("b0", "dc1", expected=9, now=0.0)
    assert all(p is not None and forest.members[p].dc == "dc0" for p in gateway)
    for i in range(1, 4):
        parents = forest.join(f"b{i}", "dc1", expected=9, now=1.0)
        assert all(forest.members[p].dc == "dc1" for p in parents if p is not None)


def test_a_complete_reader_becomes_a_root_that_serves_any_stripe():
    forest = _fan_out(2)
    forest.complete("r0")
    assert forest.members["r0"].root and forest.members["r0"].depth == [0, 0]
    late = forest.join("late", "", expected=4, now=5.0)
    assert None not in late


def test_a_reader_that_left_frees_its_slots():
    forest = _fan_out(8)
    parent = forest.members["r3"].parents[0]
    before = forest.members[parent].children[0]
    forest.remove("r3")
    assert forest.members[parent].children[0] == before - 1


def test_a_reader_whose_parent_left_gets_another_when_it_asks_again():
    """A parent that died is removed before its child names it as failed: the child's next
    request gives it a parent that is still there."""
    forest = _fan_out(8)
    child = next(m for m in forest.members.values()
                 if not m.root and m.parents[0] not in (None, "trainer"))
    gone = child.parents[0]
    forest.remove(gone)
    parents = forest.fill(child.worker_id, now=1.0, expected=9)
    assert parents[0] not in (None, gone) and all(p in forest.members for p in parents)
    assert forest.members[parents[0]].depth[0] < child.depth[0]  # never its descendant


def test_a_chain_whose_middle_left_is_not_closed_into_a_loop():
    forest = Forest(stripes=1, fanout=1)
    forest.add_root("root")
    for i, name in enumerate("ABCD"):
        forest.join(name, "", expected=8, now=float(i))
    forest.remove("B")
    for i, name in enumerate("EFG"):
        forest.join(name, "", expected=8, now=10.0 + i)
    forest.fill("C", now=20.0, expected=8)
    seen, at = set(), "C"
    while at is not None and at != "root":  # walk up: the root is reached, no cycle
        assert at not in seen
        seen.add(at)
        at = forest.members[at].parents[0]


def test_the_next_version_takes_in_each_reader_with_its_parents_and_theirs_first():
    last = _fan_out(64)
    last.publisher = "trainer"
    for r in [w for w in last.members if w != "trainer"]:
        last.complete(r)  # everyone holds the last version
    nxt = Forest()
    nxt.publisher = "trainer-2"
    nxt.add_root("trainer-2", reader=False)
    leaf = "r63"
    parents = nxt.adopt(leaf, last)
    expected = ["trainer-2" if p == "trainer" else p for p in last.members[leaf].used]
    assert parents == expected
    assert all(p in nxt.members for p in expected)  # its parents came in with it
    for w in last.members:
        if w != "trainer":
            nxt.adopt(w, last)
    for w, m in last.members.items():
        if w != "trainer":
            assert nxt.members[w].parents == ["trainer-2" if p == "trainer" else p
                                              for p in m.used]
    assert nxt.members["trainer-2"].children == [1, 1]
    assert nxt.adopt("stranger", last) is None


def test_old_parents_that_form_a_loop_are_not_followed_round_it():
    """Two engines that let a version go and read it again, each from the other (restoring
    it after a failed load), left a loop of old parents: the next version takes them in
    without following it for ever, and places them afresh."""
    last = _fan_out(2)
    last.publisher = "trainer"
    last.members["r0"].used = ["r1", "r1"]
    last.members["r1"].used = ["r0", "r0"]
    nxt = Forest(stripes=2, fanout=2)
    nxt.publisher = "trainer-2"
    nxt.add_root("trainer-2", reader=False)
    assert nxt.adopt("r0", last) == [None, None]
    assert None not in nxt.fill("r0", now=0.0, expected=3)


def test_a_reader_that_left_the_fleet_is_not_taken_into_the_next_version():
    """A reader that withdrew v1 to pull v2 is adopted with its old parents; one that then
    died is not (no reader may be planned onto it)."""
    old = _fan_out(8)
    old.remove("r3", keep_history=True)
    assert Forest().adopt("r3", old) is not None
    old.forget("r3")
    assert Forest().adopt("r3", old) is None
