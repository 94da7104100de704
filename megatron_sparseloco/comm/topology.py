"""Gossip topologies: who mixes with whom, with which weight, at each round.

A topology over ``W`` workers gives, for every round ``r``, a symmetric doubly-stochastic mixing
matrix ``M_r`` (``M_r = M_rᵀ``, every row and column sums to 1, entries ≥ 0). A gossip step maps
the workers' vectors ``x_1..x_W`` to ``x_i' = Σ_j M_r[i, j] x_j``; it preserves the mean
``x̄ = (1/W) Σ_i x_i`` (columns sum to 1) and contracts the disagreement

    Σ_i ||x_i' − x̄||²  ≤  λ₂(M_r²) · Σ_i ||x_i − x̄||²,    λ₂(M²) = max(|λ₂(M)|, |λ_W(M)|)²,

because ``M − J`` (``J = 11ᵀ/W``) has spectral norm max(|λ₂|, |λ_W|) on the subspace orthogonal
to ``1``. ``spectral_gap(M) = 1 − max(|λ₂|, |λ_W|)``.

Every matrix here is built from undirected weighted edges ``(i, j, w)``:
``M = I − Σ_edges w (e_i − e_j)(e_i − e_j)ᵀ``. Each edge moves weight ``w`` from the diagonal of
``i`` and ``j`` to the off-diagonal pair, so ``M`` is symmetric and doubly stochastic by
construction; it is nonnegative iff every worker's edge weights sum to ≤ 1 (checked).

Topologies (``weight`` = the weight of each edge; ``None`` picks the default):

``ring``         worker i mixes with i−1 and i+1 (mod W); default weight 1/3, so
                 ``x_i' = (x_{i−1} + x_i + x_{i+1})/3``. W = 2: both neighbours are the same worker,
                 the two edges add up (weight 2w). W = 1: identity.
``exponential``  one-peer exponential (hypercube) graph: at round r, with k = r mod ⌈log2 W⌉,
                 worker i pairs with i XOR 2^k; default weight 1/2 (pairwise average). For W a
                 power of two, ⌈log2 W⌉ consecutive rounds with weight 1/2 average exactly.
                 Fallback for other W [our choice]: the partner i XOR 2^k is used only when it is
                 < W, otherwise i idles that round. XOR is an involution, so this is still a
                 matching, and the union over one period is connected (clear the bits of i not in
                 j, then set those of j not in i: every intermediate index is ≤ max(i, j) < W);
                 exact averaging in log2 W rounds is lost.
``random1``      one random perfect matching per round; default weight 1/2. The matching is a
                 permutation drawn from a generator seeded by (seed, round), paired off two by two,
                 so every worker computes the same matching without communicating. Odd W: the last
                 worker of the permutation idles that round.
``random2``      two independent random matchings per round, mixed at once; default weight 1/3
                 (if both matchings pair the same two workers, the edge weight doubles).
``complete``     exact average, ``M = J``; no weight may be given.
``bandwidth``    one-peer matchings drawn from a table of measured link costs (seconds per byte,
                 ``costs[i][j]``; see ``bandwidth_matching``) so that a slow link is used no more
                 often than its bandwidth share; default weight 1/2. Without a table (``costs=None``,
                 e.g. before the first measurement) every link counts as equally fast and the
                 matching is a uniformly random perfect matching (drawn like ``random1`` but from
                 its own stream). The table must be the same on every worker (GASLoC agrees on it
                 with a tiny point-to-point exchange, outer/gasloc.py).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

TOPOLOGIES = ("ring", "exponential", "random1", "random2", "complete", "bandwidth")

#: default edge weight per topology (None: fixed by the topology)
DEFAULT_WEIGHT: Dict[str, Optional[float]] = {
    "ring": 1.0 / 3.0, "exponential": 0.5, "random1": 0.5, "random2": 1.0 / 3.0, "complete": None,
    "bandwidth": 0.5}

#: largest number of edges at one worker in one round (the bound the weight is checked against)
MAX_DEGREE: Dict[str, int] = {"ring": 2, "exponential": 1, "random1": 1, "random2": 2, "bandwidth": 1}

#: link-cost table of the ``bandwidth`` topology: ``costs[i][j]`` seconds per byte (0: not measured)
Costs = Optional[Sequence[Sequence[float]]]

Edge = Tuple[int, int, float]

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, round: int, draw: int) -> int:
    """A 63-bit generator seed from (seed, round, draw): splitmix64 finaliser over the three."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(round) * 0xBF58476D1CE4E5B9 + int(draw) * 0x94D049BB133111EB
         + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


def random_matching(W: int, round: int, seed: int, draw: int = 0) -> List[Tuple[int, int]]:
    """A random matching of ``range(W)``: pairs (perm[0], perm[1]), (perm[2], perm[3]), ...

    ``perm`` is ``torch.randperm(W)`` from a CPU generator seeded by ``(seed, round, draw)``, so
    every process computes the same matching. For odd W, ``perm[-1]`` has no partner.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(_mix_seed(seed, round, draw))
    perm = torch.randperm(W, generator=g).tolist()
    return [(perm[k], perm[k + 1]) for k in range(0, W - 1, 2)]


def symmetric_costs(costs: Costs, W: int) -> Optional[List[List[float]]]:
    """The table a matching is drawn from: ``c_ij = max(costs[i][j], costs[j][i])`` over the measured
    entries (> 0), ``None`` when nothing is measured. An unmeasured link (both entries 0) gets the
    cheapest measured cost, so it is tried as if fast and then measured. Pure Python floats in a
    fixed order, so identical inputs give identical outputs on every worker."""
    if costs is None:
        return None
    if len(costs) != W or any(len(row) != W for row in costs):
        raise ValueError(f"link costs must be a {W}x{W} table, got {len(costs)} rows")
    c = [[0.0] * W for _ in range(W)]
    for i in range(W):
        for j in range(W):
            v = float(costs[i][j])
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"link cost [{i}][{j}] must be a finite number >= 0 (0: not measured), got {v!r}")
    known = [max(float(costs[i][j]), float(costs[j][i])) for i in range(W) for j in range(i + 1, W)]
    known = [v for v in known if v > 0.0]
    if not known:
        return None
    fastest = min(known)
    for i in range(W):
        for j in range(i + 1, W):
            v = max(float(costs[i][j]), float(costs[j][i]))
            c[i][j] = c[j][i] = v if v > 0.0 else fastest
    return c


def bandwidth_matching(W: int, round: int, seed: int, costs: Costs = None) -> List[Tuple[int, int]]:
    """A one-peer matching of ``range(W)`` that uses each link at most in proportion to its bandwidth.

    From a CPU generator seeded by ``(seed, round, draw=7)``: an order ``perm = randperm(W)`` and
    2W uniforms ``u`` (float64). Walking ``perm``, each still unmatched worker i picks a partner j
    among the still unmatched workers with probability ∝ its bandwidth ``1/c_ij`` (inverse CDF on
    ``u[2k]``) and keeps the pair with probability ``c_min / c_ij`` (``u[2k+1]``; c_min = the fastest
    link of the table); a refused pair leaves i idle this round and j free for a later worker.
    So over rounds a link 10× slower than the fastest is used at most 1/10 as often as it would
    be proposed, and the expected time a worker spends on one exchange is at most about that of
    the fastest link (the slow link is used no more often than its bandwidth share). Every worker
    computes the same matching from the same (seed, round, table): pure Python arithmetic on the
    table's floats, in a fixed order. ``costs=None`` (or all unmeasured): every pair is kept, a
    uniformly random perfect matching (odd W: one idles).
    """
    c = symmetric_costs(costs, W)
    g = torch.Generator(device="cpu")
    g.manual_seed(_mix_seed(seed, round, 7))
    perm = torch.randperm(W, generator=g).tolist()
    u = torch.rand(2 * W, generator=g, dtype=torch.float64).tolist()
    cmin = min(c[i][j] for i in range(W) for j in range(W) if i != j) if c is not None and W > 1 else 1.0
    free = set(range(W))
    pairs: List[Tuple[int, int]] = []
    for k, i in enumerate(perm):
        if i not in free:
            continue
        free.discard(i)
        cand = sorted(free)
        if not cand:
            break
        bw = [1.0 if c is None else 1.0 / c[i][j] for j in cand]
        x, acc, pick = u[2 * k] * sum(bw), 0.0, cand[-1]
        for j, b in zip(cand, bw):
            acc += b
            if x < acc:
                pick = j
                break
        keep = 1.0 if c is None else cmin / c[i][pick]
        if u[2 * k + 1] < keep:
            free.discard(pick)
            pairs.append((min(i, pick), max(i, pick)))
    return sorted(pairs)


def check_topology(topology: str, W: int, weight: Optional[float] = None) -> float:
    """Validate the arguments; return the edge weight to use (or 1/W for ``complete``)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if not isinstance(W, int) or W < 1:
        raise ValueError(f"the number of workers W must be a positive integer, got {W!r}")
    if topology == "complete":
        if weight is not None:
            raise ValueError("topology 'complete' is the exact average (weight 1/W); leave the mixing weight "
                             f"unset (None), got {weight!r}")
        return 1.0 / W
    w = DEFAULT_WEIGHT[topology] if weight is None else weight
    bound = 1.0 / MAX_DEGREE[topology]
    if not (isinstance(w, (int, float)) and math.isfinite(w) and 0.0 < w <= bound):
        raise ValueError(f"mixing weight for topology {topology!r} must be in (0, {bound:g}] so that every "
                         f"worker keeps a nonnegative self-weight ({MAX_DEGREE[topology]} edges per round), got {w!r}")
    return float(w)


def edges(topology: str, W: int, round: int, seed: int = 0, weight: Optional[float] = None,
          costs: Costs = None) -> List[Edge]:
    """The undirected weighted edges ``(i, j, w)`` with i ≠ j of round ``round`` (may repeat a pair).
    ``costs``: the link-cost table of the ``bandwidth`` topology (ignored by the others)."""
    w = check_topology(topology, W, weight)
    if not isinstance(round, int) or round < 0:
        raise ValueError(f"round must be a nonnegative integer, got {round!r}")
    if W == 1:
        return []
    if topology == "complete":
        return [(i, j, w) for i in range(W) for j in range(i + 1, W)]
    if topology == "ring":
        return [(i, (i + 1) % W, w) for i in range(W)] if W > 2 else [(0, 1, w), (0, 1, w)]
    if topology == "exponential":
        period = max(1, math.ceil(math.log2(W)))
        bit = 1 << (round % period)
        return [(i, i ^ bit, w) for i in range(W) if i < (i ^ bit) < W]
    if topology == "bandwidth":
        return [(i, j, w) for i, j in bandwidth_matching(W, round, seed, costs)]
    draws = 1 if topology == "random1" else 2
    return [(i, j, w) for d in range(draws) for i, j in random_matching(W, round, seed, d)]


def mixing_matrix(topology: str, W: int, round: int, seed: int = 0, weight: Optional[float] = None,
                  dtype: torch.dtype = torch.float64, costs: Costs = None) -> torch.Tensor:
    """The W×W mixing matrix ``M_round`` (symmetric, doubly stochastic, nonnegative)."""
    if topology == "complete":
        check_topology(topology, W, weight)
        return torch.full((W, W), 1.0 / W, dtype=dtype)
    M = torch.eye(W, dtype=torch.float64)
    for i, j, w in edges(topology, W, round, seed, weight, costs):
        M[i, i] -= w
        M[j, j] -= w
        M[i, j] += w
        M[j, i] += w
    return M.to(dtype)


def neighbours(topology: str, W: int, round: int, seed: int = 0, me: int = 0,
               weight: Optional[float] = None, costs: Costs = None) -> List[Tuple[int, float]]:
    """This worker's row of ``M_round`` without the diagonal: ``[(peer, M[me, peer])]`` by peer.

    The self-weight is ``1 − Σ weights``. Computed from (topology, W, round, seed) alone, so every
    worker gets a view consistent with every other worker's without communicating.
    """
    if not isinstance(me, int) or not 0 <= me < W:
        raise ValueError(f"me must be a worker index in [0, {W}), got {me!r}")
    return neighbours_from_edges(edges(topology, W, round, seed, weight, costs), me)


def neighbours_from_edges(edge_list: Sequence[Edge], me: int) -> List[Tuple[int, float]]:
    """Worker ``me``'s row of the mixing matrix of ``edge_list`` without the diagonal, by peer."""
    acc: Dict[int, float] = {}
    for i, j, w in edge_list:
        if i == me:
            acc[j] = acc.get(j, 0.0) + w
        elif j == me:
            acc[i] = acc.get(i, 0.0) + w
    return sorted(acc.items())


def _sym_eigvals(M: torch.Tensor) -> torch.Tensor:
    M = M.to(torch.float64)
    if M.dim() != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(M.shape)}")
    if not torch.allclose(M, M.T, atol=1e-12):
        raise ValueError("expected a symmetric mixing matrix")
    return torch.linalg.eigvalsh(M)  # ascending


def consensus_rate(M: torch.Tensor) -> float:
    """λ₂(M²) = max(|λ₂(M)|, |λ_W(M)|)²: the worst per-round factor on Σ_i ||x_i − x̄||²."""
    ev = _sym_eigvals(M)
    if ev.numel() == 1:
        return 0.0
    rate = max(abs(ev[-2].item()), abs(ev[0].item())) ** 2
    return float(min(1.0, rate))  # ≤ 1 for a doubly-stochastic M; clamp eigvalsh's rounding


def spectral_gap(M: torch.Tensor) -> float:
    """1 − max(|λ₂(M)|, |λ_W(M)|) for a symmetric doubly-stochastic M (1 for the exact average)."""
    return 1.0 - math.sqrt(consensus_rate(M))
