"""Expert placement and replication planning (`moe_jax.parallel.placement`, host-side NumPy)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_jax.parallel.placement import (
    Placement,
    align_placement,
    imbalance,
    imbalance_bound,
    placement_moves,
    plan_placement,
    rank_loads,
    slots_per_rank_for,
    split_counts,
)

FAST = settings(max_examples=40, deadline=None)


@st.composite
def problems(draw):
    """(load_E, R, S): E experts on R ranks x S slots, S*R >= E and S <= E (up to 3 redundant
    slots per rank)."""
    e = draw(st.integers(1, 24))
    r = draw(st.integers(1, 8))
    s_min = -(-e // r)
    s = draw(st.integers(s_min, min(e, s_min + 3)))
    load = draw(st.one_of(
        st.lists(st.integers(0, 1000), min_size=e, max_size=e),
        st.lists(st.floats(0, 1e4, allow_nan=False, allow_infinity=False), min_size=e, max_size=e),
    ))
    return np.asarray(load, np.float64), r, s


@st.composite
def divisible(draw):
    """(load_E, R) with E a multiple of R (the contiguous layout exists)."""
    r = draw(st.integers(1, 8))
    e = r * draw(st.integers(1, 4))
    load = draw(st.lists(st.integers(0, 1000), min_size=e, max_size=e))
    return np.asarray(load, np.float64), r


def check_valid(p: Placement, e: int, r: int, s: int):
    assert p.slot_expert_RS.shape == (r, s)
    assert p.num_experts == e and p.num_ranks == r and p.slots_per_rank == s
    assert p.num_redundant == r * s - e
    assert np.array_equal(np.bincount(p.slot_expert_RS.ravel(), minlength=e), p.replicas_E)
    assert p.replicas_E.min() >= 1 and p.replicas_E.sum() == r * s
    for row in p.slot_expert_RS:  # the planner never puts an expert twice on a rank
        assert len(set(row.tolist())) == s
    flat = p.slot_expert_RS.ravel()
    for ex in range(e):
        slots = p.expert_slots_EM[ex]
        real = slots[slots >= 0]
        assert real.size == p.replicas_E[ex] and np.all(np.diff(real) > 0)
        assert np.all(flat[real] == ex) and np.all(slots[real.size:] == -1)


# ---------------------------------------------------------------------------------------------
# the data structure


def test_uniform_is_the_contiguous_layout():
    p = Placement.uniform(12, 4)
    assert np.array_equal(p.slot_expert_RS, np.arange(12).reshape(4, 3))
    assert np.all(p.replicas_E == 1) and p.num_redundant == 0
    assert np.array_equal(p.expert_slots_EM[:, 0], np.arange(12))
    assert np.array_equal(p.expert_slots_EM[:, 0] // p.slots_per_rank, np.arange(12) // 3)  # e // (E/R)
    load = np.arange(12.0)
    assert np.allclose(rank_loads(p, load), load.reshape(4, 3).sum(axis=1))


@FAST
@given(divisible())
def test_uniform_rank_loads_are_contiguous_sums(case):
    load, r = case
    e = load.size
    assert np.allclose(rank_loads(Placement.uniform(e, r), load), load.reshape(r, e // r).sum(axis=1))


def test_placement_is_read_only_and_compares_by_value():
    p = Placement(np.array([[0, 1], [2, 0]]), 3)
    assert p == Placement(np.array([[0, 1], [2, 0]], np.int64), 3)
    assert p != Placement(np.array([[0, 1], [0, 2]]), 3)
    assert hash(p) == hash(Placement(np.array([[0, 1], [2, 0]]), 3))
    assert p.slot_expert_RS.dtype == np.int32
    with pytest.raises(ValueError):
        p.slot_expert_RS[0, 0] = 2
    assert p.replicas_E.tolist() == [2, 1, 1]
    assert p.expert_slots_EM.tolist() == [[0, 3], [1, -1], [2, -1]]


# ---------------------------------------------------------------------------------------------
# planner properties


@FAST
@given(problems())
def test_plan_is_a_valid_deterministic_placement(case):
    load, r, s = case
    p = plan_placement(load, r, s)
    check_valid(p, load.size, r, s)
    assert p.replicas_E.max() <= r
    assert plan_placement(load, r, s) == p
    # The load split conserves the total load; no placement beats the bound.
    assert np.isclose(rank_loads(p, load).sum(), load.sum())
    assert imbalance(p, load) >= imbalance_bound(load, r, s) - 1e-9


@FAST
@given(problems())
def test_refinement_never_loses_to_eplb_alone(case):
    load, r, s = case
    eplb = plan_placement(load, r, s, refine=False)
    check_valid(eplb, load.size, r, s)
    assert rank_loads(plan_placement(load, r, s), load).max() <= rank_loads(eplb, load).max() * (1 + 1e-12)


@FAST
@given(divisible())
def test_plan_never_worse_than_uniform_for_the_same_slots(case):
    load, r = case
    e = load.size
    p = plan_placement(load, r, e // r)
    assert rank_loads(p, load).max() <= rank_loads(Placement.uniform(e, r), load).max() * (1 + 1e-12)


@FAST
@given(problems(), st.integers(1, 4))
def test_several_layers_give_one_placement_each(case, layers):
    load, r, s = case
    load_LE = np.stack([np.roll(load, i) for i in range(layers)])
    out = plan_placement(load_LE, r, s)
    assert isinstance(out, tuple) and len(out) == layers
    assert all(p == plan_placement(row, r, s) for p, row in zip(out, load_LE))


@FAST
@given(problems(), st.integers(0, 1000))
def test_split_counts_deals_rows_evenly_and_conserves_them(case, salt):
    load, r, s = case
    counts = (np.round(load) + salt % 7).astype(np.int64)
    p = plan_placement(counts, r, s)
    rows_RS = split_counts(p, counts)
    assert rows_RS.sum() == counts.sum()
    per_expert = np.bincount(p.slot_expert_RS.ravel(), weights=rows_RS.ravel(), minlength=counts.size)
    assert np.array_equal(per_expert, counts)
    exact = (counts / p.replicas_E)[p.slot_expert_RS]
    assert np.all(np.abs(rows_RS - exact) < 1)
    # The first replicas (by slot id) take the remainder.
    for e in range(counts.size):
        slots = p.expert_slots_EM[e][: p.replicas_E[e]]
        assert np.all(np.diff(rows_RS.ravel()[slots]) <= 0)


def test_all_zero_load():
    p = plan_placement(np.zeros(6), 3, 3)
    check_valid(p, 6, 3, 3)
    assert imbalance(p, np.zeros(6)) == 1.0 and imbalance_bound(np.zeros(6), 3, 3) == 1.0


# ---------------------------------------------------------------------------------------------
# small cases by hand


def test_no_redundancy_pairs_the_hot_expert_with_a_cold_one():
    load = np.array([10.0, 1, 1, 0])
    assert imbalance(Placement.uniform(4, 2), load) == pytest.approx(11 / 6)
    p = plan_placement(load, 2, 2)
    assert p.slot_expert_RS.tolist() == [[0, 3], [1, 2]]
    assert rank_loads(p, load).tolist() == [10, 2]


def test_every_rank_holds_both_experts():
    p = plan_placement([3, 1], 2, 2)
    assert p.slot_expert_RS.tolist() == [[0, 1], [0, 1]]
    assert rank_loads(p, [3, 1]).tolist() == [2, 2]


def test_eplb_replicates_by_load_per_replica_and_packs_heaviest_first():
    # Replicas: 0 -> 2 (4 each; a third would exceed one per rank), then 1 -> 2 (2 each).
    # Packing 4, 4, 2, 2 | 2 (expert 2) | 2 (expert 3), each to the least-loaded rank.
    load = [8, 4, 2, 2]
    for refine in (False, True):
        p = plan_placement(load, 2, 3, refine=refine)
        assert p.slot_expert_RS.tolist() == [[0, 1, 2], [0, 1, 3]]
        assert p.replicas_E.tolist() == [2, 2, 1, 1]
        assert rank_loads(p, load).tolist() == [8, 8]


def test_swaps_improve_on_greedy_packing():
    # Heaviest first, least-loaded rank with a free slot: 9 -> r0, 8 -> r1, 7 -> r1, 6 -> r0,
    # 5 -> r0 (tie, lowest rank; now full), 3 -> r1: [20, 18]. Swapping 9 and 8 gives [19, 19].
    load = np.array([6.0, 8, 3, 7, 9, 5])
    eplb = plan_placement(load, 2, 3, refine=False)
    assert eplb.slot_expert_RS.tolist() == [[0, 4, 5], [1, 2, 3]]
    assert rank_loads(eplb, load).tolist() == [20, 18]
    best = plan_placement(load, 2, 3)
    assert best.slot_expert_RS.tolist() == [[0, 1, 5], [2, 3, 4]]
    assert rank_loads(best, load).tolist() == [19, 19]


def test_hierarchical_keeps_groups_and_replicas_on_one_node():
    # 4 nodes of 2 ranks, 8 groups of 2 experts; the hottest experts are replicated inside
    # their node only.
    rng = np.random.default_rng(0)
    load = rng.zipf(1.5, 16).astype(np.float64)
    p = plan_placement(load, 8, 3, ranks_per_node=2, num_groups=8)
    check_valid(p, 16, 8, 3)
    node_of_slot = np.repeat(np.arange(4), 2 * 3)
    for e in range(16):
        slots = p.expert_slots_EM[e][: p.replicas_E[e]]
        assert len(set(node_of_slot[slots].tolist())) == 1
    node_of_expert = np.array([node_of_slot[p.expert_slots_EM[e][0]] for e in range(16)])
    assert np.all(node_of_expert[0::2] == node_of_expert[1::2])  # groups {0,1}, {2,3}, ... stay whole
    assert np.bincount(node_of_expert, minlength=4).tolist() == [4, 4, 4, 4]


def test_hierarchical_by_hand():
    # Groups = experts; nodes take 5 (e0) and 5 (e3), then 1 (e1) and 1 (e2). In each node the
    # heavier expert goes to the node's first rank.
    p = plan_placement([5, 1, 1, 5], 4, 1, ranks_per_node=2)
    assert p.slot_expert_RS.ravel().tolist() == [0, 1, 3, 2]


@FAST
@given(problems(), st.sampled_from([1, 2]))
def test_hierarchical_is_valid(case, rpn):
    load, r, s = case
    r = r - r % rpn or rpn
    nodes = r // rpn
    e = load.size - load.size % nodes
    if e < 1 or s > e // nodes or s * r < e:
        return
    p = plan_placement(load[:e], r, s, ranks_per_node=rpn)
    check_valid(p, e, r, s)
    assert plan_placement(load[:e], r, s, ranks_per_node=rpn) == p


def test_bound_is_tight_for_a_hot_expert_without_replicas():
    # Expert 0 carries the mean rank load (4) by itself, and its rank holds two more experts, at
    # best the two lightest (0 and 1): 5 / 4, which the planner reaches.
    load = np.array([4.0, 1, 1, 1, 1, 0])
    assert imbalance_bound(load, 2, 3) == pytest.approx(5 / 4)
    assert imbalance(plan_placement(load, 2, 3), load) == pytest.approx(5 / 4)
    # One redundant slot per rank: expert 0 split in two, the bound drops to the mean.
    assert imbalance_bound(np.r_[load, 0, 0], 2, 5) == pytest.approx(1.0)
    assert imbalance(plan_placement(np.r_[load, 0, 0], 2, 5), np.r_[load, 0, 0]) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# moving between placements


def test_moves_between_placements():
    old = Placement.uniform(4, 2)
    new = Placement(np.array([[0, 2], [1, 3]]), 4)
    m = placement_moves(old, new)
    assert m.changed_RS.tolist() == [[False, True], [True, False]]
    assert m.source_RS.tolist() == [[0, 2], [1, 3]]  # e2 from old slot 2, e1 from old slot 1
    assert (m.num_changed, m.num_remote) == (2, 2)
    m = placement_moves(old, old)
    assert m.num_changed == 0 and m.source_RS.tolist() == [[0, 1], [2, 3]]


def test_moves_prefer_a_copy_on_the_same_rank():
    old = Placement(np.array([[0, 1], [2, 0]]), 3)
    new = Placement(np.array([[0, 1], [0, 2]]), 3)
    m = placement_moves(old, new)
    assert m.source_RS.tolist() == [[0, 1], [3, 2]]
    assert (m.num_changed, m.num_remote) == (2, 0)


def test_moves_spread_sends_over_replicas():
    # Expert 0 (old slots 0 and 2) is copied to ranks 2 and 3: one copy from each replica.
    old = Placement(np.array([[0, 1], [0, 2], [3, 1], [4, 2]]), 5)
    new = Placement(np.array([[0, 1], [0, 2], [3, 0], [4, 0]]), 5)
    m = placement_moves(old, new)
    assert m.source_RS[2, 1] == 0 and m.source_RS[3, 1] == 2
    assert (m.num_changed, m.num_remote) == (2, 2)


@FAST
@given(problems(), st.integers(0, 2**31 - 1))
def test_align_keeps_loads_and_never_adds_moves(case, seed):
    load, r, s = case
    old = plan_placement(load, r, s)
    shuffled = np.random.default_rng(seed).permutation(load)
    new = plan_placement(shuffled, r, s)
    aligned = align_placement(new, old)
    assert np.allclose(np.sort(rank_loads(aligned, shuffled)), np.sort(rank_loads(new, shuffled)))
    assert np.array_equal(aligned.replicas_E, new.replicas_E)
    assert placement_moves(old, aligned).num_changed <= placement_moves(old, new).num_changed
    assert plan_placement(shuffled, r, s, previous=old) == aligned
    # Planning the same load again against the placement in use moves nothing.
    assert placement_moves(old, plan_placement(load, r, s, previous=old)).num_changed == 0


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("call, match", [
    (lambda: plan_placement(np.ones(9), 2, 4), "slots_per_rank \\* num_ranks"),
    (lambda: plan_placement(np.ones(4), 2, 5), "slots_per_rank = 5 > num_experts"),
    (lambda: plan_placement([1, -1, 2, 3], 2, 2), "non-negative"),
    (lambda: plan_placement([1, np.nan, 2, 3], 2, 2), "finite"),
    (lambda: plan_placement(np.ones((2, 2, 4)), 2, 2), "1-D or 2-D"),
    (lambda: plan_placement(np.ones(4, bool), 2, 2), "real numeric"),
    (lambda: plan_placement(np.ones(4), 0, 2), "num_ranks"),
    (lambda: plan_placement(np.ones(4), 2, 2.0), "slots_per_rank"),
    (lambda: plan_placement(np.ones(8), 4, 2, ranks_per_node=3), "ranks_per_node = 3 must divide"),
    (lambda: plan_placement(np.ones(8), 4, 2, num_groups=4), "num_groups is used by the hierarchical"),
    (lambda: plan_placement(np.ones(8), 4, 2, ranks_per_node=2, num_groups=3), "num_groups = 3 must divide"),
    (lambda: plan_placement(np.ones(8), 4, 2, ranks_per_node=1, num_groups=2), "multiple of the number of nodes"),
    (lambda: plan_placement(np.ones(8), 4, 3, ranks_per_node=1), "experts per node"),
    (lambda: plan_placement(np.ones((2, 4)), 2, 2, previous=Placement.uniform(4, 2)), "one per layer"),
    (lambda: rank_loads(Placement.uniform(4, 2), np.ones(5)), "load_E must have shape \\(4,\\)"),
    (lambda: imbalance(np.zeros((2, 2)), np.ones(4)), "placement must be a Placement"),
    (lambda: split_counts(Placement.uniform(4, 2), [1.5, 1, 1, 1]), "whole row counts"),
    (lambda: Placement(np.array([[0, 1], [1, 1]]), 3), "without a slot"),
    (lambda: Placement(np.array([[0, 1], [2, 3]]), 3), "experts in \\[0, 3\\)"),
    (lambda: Placement(np.array([[0.0, 1.0]]), 2), "integers"),
    (lambda: Placement(np.arange(4), 4), "\\[R, S\\]"),
    (lambda: Placement.uniform(6, 4), "multiple of num_ranks"),
    (lambda: placement_moves(Placement.uniform(4, 2), Placement.uniform(4, 4)), "same experts and \\[R, S\\]"),
    (lambda: slots_per_rank_for(8, 2, -1), "redundant"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_slots_per_rank_for_rounds_up_to_whole_slots():
    assert slots_per_rank_for(128, 8, 16) == 18
    assert slots_per_rank_for(128, 16, 8) == 9  # 16 redundant: slots come in steps of R
    assert slots_per_rank_for(128, 64, 16) == 3  # 64 redundant
    assert slots_per_rank_for(128, 64) == 2
