"""Gossip topologies: matrices symmetric and doubly stochastic, neighbour lists agree with them,
random matchings identical when computed in separate processes, and the expected spectra."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sparseloco.comm.topology import (TOPOLOGIES, consensus_rate, edges, mixing_matrix, neighbours,
                                               random_matching, spectral_gap)
from megatron_sparseloco.testing.multirank import run_ranks


def _check_matrix(M: torch.Tensor) -> None:
    W = M.shape[0]
    assert M.shape == (W, W)
    assert torch.equal(M, M.T)
    assert torch.allclose(M.sum(0), torch.ones(W, dtype=M.dtype), atol=1e-12)
    assert torch.allclose(M.sum(1), torch.ones(W, dtype=M.dtype), atol=1e-12)
    assert (M >= -1e-15).all()


@settings(max_examples=60, deadline=None)
@given(topology=st.sampled_from(TOPOLOGIES), W=st.integers(1, 17), rnd=st.integers(0, 50),
       seed=st.integers(0, 2**31))
def test_matrix_symmetric_doubly_stochastic_and_rows_match_neighbours(topology, W, rnd, seed):
    M = mixing_matrix(topology, W, rnd, seed)
    _check_matrix(M)
    for me in range(W):
        nb = neighbours(topology, W, rnd, seed, me)
        row = torch.zeros(W, dtype=torch.float64)
        for p, w in nb:
            assert p != me and w > 0
            row[p] = w
        row[me] = 1.0 - sum(w for _, w in nb)
        assert torch.allclose(row, M[me], atol=1e-12), (topology, W, rnd, me)
        assert [p for p, _ in nb] == sorted({p for p, _ in nb})


def test_ring_weights_and_small_cases():
    M = mixing_matrix("ring", 5, 0)
    assert torch.allclose(M[2], torch.tensor([0, 1 / 3, 1 / 3, 1 / 3, 0], dtype=torch.float64))
    assert neighbours("ring", 5, 7, me=0) == [(1, pytest.approx(1 / 3)), (4, pytest.approx(1 / 3))]
    # W = 2: both neighbours are the same worker; the weights add up.
    assert neighbours("ring", 2, 0, me=0) == [(1, pytest.approx(2 / 3))]
    assert torch.equal(mixing_matrix("ring", 1, 0), torch.ones(1, 1, dtype=torch.float64))
    assert neighbours("ring", 4, 0, me=1, weight=0.25) == [(0, 0.25), (2, 0.25)]


def test_exponential_power_of_two_pairs_and_exact_average_over_period():
    W = 8
    for r in range(6):
        bit = 1 << (r % 3)
        for i in range(W):
            assert neighbours("exponential", W, r, me=i) == [(i ^ bit, 0.5)]
    P = mixing_matrix("exponential", W, 0) @ mixing_matrix("exponential", W, 1) @ mixing_matrix("exponential", W, 2)
    assert torch.allclose(P, torch.full((W, W), 1 / W, dtype=torch.float64), atol=1e-12)


def test_exponential_fallback_other_w_is_matching_and_connected_over_period():
    W = 6  # period ⌈log2 6⌉ = 3; bit 4 pairs only 0↔4, 1↔5; 2, 3 idle that round
    assert neighbours("exponential", W, 2, me=2) == []
    assert neighbours("exponential", W, 2, me=0) == [(4, 0.5)]
    P = torch.eye(W, dtype=torch.float64)
    for r in range(3):
        P = mixing_matrix("exponential", W, r) @ P
    assert consensus_rate(P.T @ P) < 1 - 1e-9  # the union over one period is connected
    Q = torch.linalg.matrix_power(P, 40)
    assert torch.allclose(Q, torch.full((W, W), 1 / W, dtype=torch.float64), atol=1e-6)


def test_random_matchings_are_matchings_and_idle_one_when_odd():
    for W in (4, 7):
        for r in range(20):
            pairs = random_matching(W, r, seed=3)
            flat = [x for pr in pairs for x in pr]
            assert len(flat) == len(set(flat)) == 2 * (W // 2)
            idle = [i for i in range(W) if neighbours("random1", W, r, 3, i) == []]
            assert len(idle) == W % 2
    # the matching changes with the round and with the seed
    assert len({tuple(random_matching(8, r, 0)) for r in range(10)}) > 1
    assert any(random_matching(8, r, 0) != random_matching(8, r, 1) for r in range(10))


def test_random2_edge_weight_doubles_when_matchings_coincide():
    W = 2  # both matchings are necessarily {0, 1}
    assert neighbours("random2", W, 0, me=0) == [(1, pytest.approx(2 / 3))]


def test_complete_is_exact_average_and_rejects_weight():
    M = mixing_matrix("complete", 5, 3)
    assert torch.allclose(M, torch.full((5, 5), 0.2, dtype=torch.float64))
    assert spectral_gap(M) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="complete"):
        mixing_matrix("complete", 5, 0, weight=0.2)


def test_invalid_arguments_name_the_field():
    with pytest.raises(ValueError, match="topology must be one of"):
        mixing_matrix("torus", 4, 0)
    with pytest.raises(ValueError, match=r"mixing weight .*ring.*\(0, 0.5\]"):
        mixing_matrix("ring", 4, 0, weight=0.6)
    with pytest.raises(ValueError, match="round"):
        edges("ring", 4, -1)
    with pytest.raises(ValueError, match="me must be"):
        neighbours("ring", 4, 0, me=4)


def test_ring_spectral_gap_matches_closed_form():
    # ring with weight 1/3: eigenvalues (1 + 2cos(2πk/W))/3; the largest |·| below 1 is at k = 1 or W/2
    for W in (3, 4, 8, 16):
        ev = [(1 + 2 * math.cos(2 * math.pi * k / W)) / 3 for k in range(1, W)]
        lam = max(abs(v) for v in ev)
        M = mixing_matrix("ring", W, 0)
        assert consensus_rate(M) == pytest.approx(lam ** 2, abs=1e-12)
        assert spectral_gap(M) == pytest.approx(1 - lam, abs=1e-12)


def _rank_views(rank, world_size, topologies, W, rounds, seed):
    return {t: [neighbours(t, W, r, seed, me) for r in range(rounds) for me in range(W)] for t in topologies}


def test_matchings_identical_across_processes():
    topologies = ("random1", "random2", "exponential", "ring")
    views = run_ranks(_rank_views, world_size=2, args=(topologies, 9, 25, 1234), timeout=90)
    local = _rank_views(0, 1, topologies, 9, 25, 1234)
    assert views[0] == views[1] == local
