"""Cost model of one outer step (bytes per worker, time on a link, against H inner steps of compute), and
of goodput under failures (fail-fast + restart from a checkpoint against elastic workers).

``python -m megatron_sparseloco.costmodel --preset llama-8b --workers 4,16,64 --bandwidth-gbps 1,10,100``
``python -m megatron_sparseloco.costmodel --failures --mtbf-hours 6,24,168 --downtime-hours 0,0.5,4``

**Shards.** A worker is ``TP·PP·DP`` ranks (DP = data-parallel ranks inside the worker). The model is
a list of parameter shapes (presets :data:`PRESETS`, or ``--params N`` for a synthetic stack of
4096-wide matrices). A rank's piece is built like megatron-core lays it out, with the evenness the
brief assumes:

* TP: column-parallel weights (QKV, FC1, embedding and output layer, vocabulary-parallel) are cut
  along dim 0, row-parallel ones (attention projection, FC2) along dim 1, 1-D norms are replicated;
  every TP rank holds the same shapes, so its payload is computed once and counted ``TP`` times.
* PP: stage ``p`` holds layers ``[p·L/PP, (p+1)·L/PP)``; the embedding is on the first stage, the
  final norm and the output layer on the last.
* DP (distributed optimizer): the stage's parameters, concatenated in model order, are cut into DP
  contiguous ranges of equal size (``[j·M/DP, (j+1)·M/DP)``); a range cuts 2-D weights mid-row
  anywhere, as Megatron's does. (Megatron shards each of its gradient buckets, not the whole buffer,
  and orders parameters in reverse; both move a few mid-row cuts, i.e. a few hundred bytes.)

Each rank's SparseLoCo payload is then **exact** for packed indices: the strategy's own planner
(``compress.segments.plan_buckets``, ``bucket_payload_nbytes``) over the rank's slices, with the
strategy's bucket size. ``P_rank`` below is that sum over the rank's buckets, ``P = Σ_ranks P_rank``
the worker's payload, ``b_rank`` the rank's bucket count, ``n_rank`` its element count.

**Counted bytes** (what the strategies' ``CommCounter`` reports: the bytes a rank hands to each
collective, summed over the worker's ranks; a 4-byte fp32 non-finite flag all-reduce per rank and
step; nothing at W = 1):

    allgather       sent = Σ_r (4 + P_r)            received = Σ_r (4 + (W−1)·P_r)
    DiLoCo fp32     sent = received = Σ_r (4 + 4·n_r)          (bf16: 2·n_r)

**Wire bytes and time.** A worker's ranks share one link of bandwidth ``bw`` (bit/s, full duplex)
and one-way latency ``α``; the cross-worker groups (one per rank position) run at the same time, so
the bytes add up on the link and the latencies of each group's sequential collectives do not:

    allgather (ring)       wire = (W−1)·P                   T = c·(W−1)·α + 8·(W−1)·P / bw
    DiLoCo (ring all-red.) wire = 2·(W−1)/W · D              T = c·2(W−1)·α + 8·wire / bw,  D = Σ_r s·n_r
    reduce-scatter         wire = 2·(W−1)/W · P + 2(W−1)·O   T = c·2(W−1)·α + 8·wire / bw

``hierarchical`` (``--sparseloco-aggregation hierarchical``, G = ``--sites`` site groups of g = W/G
workers; every worker moves the same bytes): counted exactly as the strategy counts

    hierarchical    sent = received = Σ_r (4 + (W−1)·P_r)      (G−1)·P over the WAN + (g−1)·G·P over the LAN
                    wire = (G−1)·P on the worker's WAN link,  lan = (g−1)·G·P on its LAN link
                    T = c·(α + α_lan) + 8·wire / bw + 8·lan / bw_lan

i.e. one WAN round per collective (the rail exchange with member i of every other site) and one LAN
round (the site gather of the rail sets; ``--lan-gbps``, ``--lan-latency-ms``).

with ``c = max_r (b_r + 1)`` sequential collectives per group (its buckets and the flag, whose
``2(W−1)`` latency hops are counted as those of one more collective) and ``s`` = 4 (fp32) or 2 (bf16).
Reduce-scatter is the design of ``--sparseloco-aggregation reduce-scatter`` (docs/scaling.md):
each bucket is cut into W owner ranges; a worker sends owner ``j`` only its payload's part in range
``j`` (an all-to-all, ``(W−1)/W·P`` out and in), the owner re-encodes the contributor mean of its
range at the same density, and an all-gather of the W re-encoded ranges (``(W−1)/W·P`` in) gives
everyone the update. ``O`` is the per-piece overhead, estimated as a 32-byte bucket header plus the
44 bytes of table entry and 2-bit side info of ``⌈s_b/W⌉ + 1`` segments per piece (``s_b`` segments
in the bucket), summed over buckets; the reduce-scatter numbers are this formula, not a measurement.

**Compute.** One inner step costs ``6·N·T`` FLOPs (N model parameters, T tokens per inner step per
worker); a worker of ``G = TP·PP·DP`` accelerators at peak ``F`` FLOP/s and utilisation ``u`` spends

    T_compute = H · 6·N·T / (u·F·G)

on H inner steps; ``ratio = T_outer / T_compute`` is the share of an un-overlapped outer step, and a
mode *fits* a budget (10 % by default) when ``ratio ≤ budget``. ``max W`` is the largest W that fits
(every time above is non-decreasing in W). For an MoE preset N is the parameters a token uses
(:attr:`Model.active_numel`: the expert weights count ``topk / experts``); the byte tables cut the
expert weights like dense ones (expert parallelism is not modelled: totals hold, per-rank cuts move).

**Failures** (``--failures``; the recipes' models :data:`RECIPE_WORKERS`: accelerators G per worker,
tokens T per inner step, W workers). Goodput is the share of the failure-free run's inner steps that
end up in θ_outer. Inputs: M, the mean time between failures of ONE worker (failures independent,
exponential); D, from a failure's detection until the failed worker's nodes can run again; t_det, a
failure until the others stop waiting for it (the collective / outer timeout, or a connection reset);
t_restart, requeue + process start + model build; the storage bandwidth per accelerator B_w, B_r
(GB/s); the link b a heal crosses (Gbit/s); q, the quorum + round header per round. Derived:

    t_step = 6·N·T / (u·F·G)            R = H·t_step               (a round; its outer step not counted)
    C = 22·N bytes (bf16 params 2, fp32 main 4, Adam 8, θ_outer 4, error feedback / momentum 4)
    t_save = C / (G·B_w)   t_load = C / (G·B_r)   t_heal = 8·12·N / b   (θ_outer + Adam moments, fp32)

*Fail-fast + restart from the last checkpoint* (today: W fixed, every failure stops all W workers).
The run fails at rate λ = W/M while it runs; it checkpoints every τ (default Young's interval
τ = sqrt(2·t_save/λ)), each save stalling it t_save. A cycle is an up time U ~ Exp(λ) followed by
the stall S = t_det + D + t_restart + t_load; of U only the whole checkpoint intervals survive
(the work since the last checkpoint is recomputed), E[⌊U/τ⌋·τ] = τ / (e^{λτ} − 1):

    G_ff = (1 − t_save/τ) · [τ / (e^{λτ} − 1)] / (1/λ + S)

*Elastic* (one job per worker; a failure drops one worker's share until it heals, no checkpoint
needed). Each worker alternates an up time of mean M and an outage O; the others lose c per failure
of another worker:

    O = t_det + D + t_restart + t_heal + R/2     (the failed job restarts, waits R/2 on average for
                                                  the next quorum, heals; its first round contributes
                                                  nothing and its next one does)
    c = t_det + t_heal + ρ·R                     (the failed round's detection, the heal the quorum
                                                  waits for, and the failed round's work: ρ = 0 when
                                                  the survivors keep their local progress, 1 when
                                                  they discard it)
    G_e = (1 − q/R) · [M − R/2 − (W−1)·M/(M + O)·c] / (M + O)

(R/2: the failed worker's progress since its last commit; (W−1)·M/(M+O): the failures of the others
during one up time). For M ≫ O this is (1 − q/R)·(1 − L/M) with L = O + R/2 + (W−1)·c, the
worker-seconds one failure costs. Not modelled: failures that overlap (elastic stays valid while at
least ``--sparseloco-min-workers`` are up), the outer step's own time, asynchronous checkpointing
(set ``--ckpt-write-gbps`` to the blocking part).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.segments import (
    BUCKET_HEADER_BYTES,
    SEGMENT_ENTRY_BYTES,
    TensorSlice,
    bucket_payload_nbytes,
    plan_buckets,
)

FLAG_BYTES = 4  #: the non-finite flag all-reduce (one fp32) of every outer step
MODES = ("allgather", "reduce-scatter", "diloco-fp32", "diloco-bf16")
#: modes selectable with ``--modes`` but not in the default tables
EXTRA_MODES = ("hierarchical",)
DENSE_ITEMSIZE = {"diloco-fp32": 4, "diloco-bf16": 2}
#: hierarchical: the sites' LAN per worker (``--lan-gbps``, ``--lan-latency-ms``)
LAN_BANDWIDTH_BPS = 400e9
LAN_LATENCY_S = 1e-5


# ---------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class Param:
    """One model parameter: ``tp_dim`` is the dim TP cuts (None: replicated); ``stage`` is
    ``"first"`` (embedding), ``"last"`` (final norm, output layer) or the layer index."""

    name: str
    shape: Tuple[int, ...]
    tp_dim: Optional[int]
    stage: object
    expert: bool = False   # an MoE expert's weight (a token uses ``topk`` of ``experts`` of them)


@dataclass(frozen=True)
class Model:
    name: str
    params: Tuple[Param, ...]
    layers: int
    experts: int = 0       # MoE: experts per layer (0: dense)
    topk: int = 0          # MoE: experts each token is routed to

    @property
    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def active_numel(self) -> int:
        """Parameters one token uses (dense: all; MoE: the expert weights count ``topk / experts``)."""
        if not self.experts:
            return self.numel
        expert = sum(math.prod(p.shape) for p in self.params if p.expert)
        return self.numel - expert + expert * self.topk // self.experts


def llama_like(name: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
               qkv_bias: bool = False, tied: bool = False, experts: int = 0, topk: int = 0) -> Model:
    """A Llama / Qwen2 style decoder in megatron-core's naming (SwiGLU FC1 = 2·ffn rows, GQA); with
    ``experts`` > 0 a Mixtral-style MoE: every layer's MLP is ``experts`` SwiGLU experts and a router,
    each token routed to ``topk`` of them."""
    head_dim = hidden // heads
    qkv_rows = hidden + 2 * kv_heads * head_dim
    ps = [Param("embedding.word_embeddings.weight", (vocab, hidden), 0, "first")]
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        ps += [Param(pre + "self_attention.linear_qkv.layer_norm_weight", (hidden,), None, i),
               Param(pre + "self_attention.linear_qkv.weight", (qkv_rows, hidden), 0, i)]
        if qkv_bias:
            ps.append(Param(pre + "self_attention.linear_qkv.bias", (qkv_rows,), 0, i))
        ps.append(Param(pre + "self_attention.linear_proj.weight", (hidden, hidden), 1, i))
        if not experts:
            ps += [Param(pre + "mlp.linear_fc1.layer_norm_weight", (hidden,), None, i),
                   Param(pre + "mlp.linear_fc1.weight", (2 * ffn, hidden), 0, i),
                   Param(pre + "mlp.linear_fc2.weight", (hidden, ffn), 1, i)]
            continue
        ps += [Param(pre + "pre_mlp_layernorm.weight", (hidden,), None, i),
               Param(pre + "mlp.router.weight", (experts, hidden), None, i)]
        for e in range(experts):
            ex = pre + f"mlp.experts.local_experts.{e}."
            ps += [Param(ex + "linear_fc1.weight", (2 * ffn, hidden), 0, i, expert=True),
                   Param(ex + "linear_fc2.weight", (hidden, ffn), 1, i, expert=True)]
    ps.append(Param("decoder.final_layernorm.weight", (hidden,), None, "last"))
    if not tied:
        ps.append(Param("output_layer.weight", (vocab, hidden), 0, "last"))
    return Model(name, tuple(ps), layers, experts, topk)


#: named shape sets (public model configurations)
PRESETS = {
    "llama-1b": lambda: llama_like("llama-1b", 128256, 2048, 16, 32, 8, 8192, tied=True),
    "llama-8b": lambda: llama_like("llama-8b", 128256, 4096, 32, 32, 8, 14336),
    "72b": lambda: llama_like("72b", 152064, 8192, 80, 64, 8, 29568, qkv_bias=True),  # Qwen2-72B shapes
    "mixtral-8x7b": lambda: llama_like("mixtral-8x7b", 32000, 4096, 32, 32, 8, 14336, experts=8, topk=2),
}

#: per preset: a plausible worker (TP, PP, DP) and tokens per inner step per worker for the doc table
PRESET_WORKER = {
    "llama-1b": dict(tp=1, pp=1, dp=8, tokens=1 << 20),
    "llama-8b": dict(tp=1, pp=1, dp=8, tokens=1 << 20),
    "72b": dict(tp=8, pp=4, dp=2, tokens=1 << 21),
    "mixtral-8x7b": dict(tp=1, pp=1, dp=32, tokens=1 << 19),
}


def synthetic(numel: int, width: int = 4096) -> Model:
    """``--params N``: ⌊N/width²⌋ square ``width x width`` matrices, the rest as one ragged matrix
    of ``width`` columns plus a 1-D tensor (one layer each, TP along dim 0)."""
    n_sq, rest = divmod(int(numel), width * width)
    ps = [Param(f"w{i}", (width, width), 0, i) for i in range(n_sq)]
    rows, tail = divmod(rest, width)
    if rows:
        ps.append(Param("w_rest", (rows, width), 0, n_sq))
    if tail:
        ps.append(Param("b_rest", (tail,), None, n_sq))
    return Model(f"synthetic-{numel}", tuple(ps), max(1, len(ps)))


# ---------------------------------------------------------------------------------- shards
class CostModelError(ValueError):
    pass


def _tp_shape(p: Param, tp: int) -> Tuple[int, ...]:
    if p.tp_dim is None or tp == 1:
        return p.shape
    if p.shape[p.tp_dim] % tp:
        raise CostModelError(f"{p.name}: dim {p.tp_dim} of {p.shape} is not divisible by TP={tp}")
    s = list(p.shape)
    s[p.tp_dim] //= tp
    return tuple(s)


def stage_params(model: Model, tp: int, pp: int, stage: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, TP-local shape) of the parameters of pipeline stage ``stage``, in model order."""
    lo, hi = stage * model.layers // pp, (stage + 1) * model.layers // pp
    out = []
    for p in model.params:
        on = (p.stage == "first" and stage == 0) or (p.stage == "last" and stage == pp - 1) \
            or (isinstance(p.stage, int) and lo <= p.stage < hi)
        if on:
            out.append((p.name, _tp_shape(p, tp)))
    return out


def dp_slices(params: Sequence[Tuple[str, Tuple[int, ...]]], dp: int, pos: int) -> List[Tuple[str, TensorSlice]]:
    """The slices of range ``[pos·M/dp, (pos+1)·M/dp)`` of the concatenated parameters."""
    sizes = [math.prod(s) for _, s in params]
    total = sum(sizes)
    lo, hi = pos * total // dp, (pos + 1) * total // dp
    out, off = [], 0
    for (name, shape), n in zip(params, sizes):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((name, TensorSlice(tuple(shape), a - off, b - off)))
        off += n
    return out


@dataclass
class SparseSettings:
    chunk: int = 4096
    k: int = 64
    value_bits: int = 2
    bucket_numel: int = 1 << 24
    dense_1d: bool = True

    def codec(self) -> CodecConfig:
        return CodecConfig(chunk=self.chunk, k=self.k, value_bits=self.value_bits, index_coding="packed")


@dataclass
class RankCost:
    """What one rank holds and sends (packed indices: exact)."""

    numel: int
    payload: int        # Σ bucket_payload_nbytes over its buckets
    buckets: int        # SparseLoCo buckets (sequential all-gathers)
    dense_buckets: int  # DiLoCo buckets (sequential all-reduces)
    segments: Tuple[int, ...] = ()  # segments per SparseLoCo bucket
    side_bytes: int = 20            # side info per segment (4·(1 + 2^value_bits); 0 for raw values)

    def piece_overhead(self, W: int) -> int:
        """Reduce-scatter estimate O: per bucket 32 + (24 + side)·(⌈s_b/W⌉ + 1) bytes."""
        return sum(BUCKET_HEADER_BYTES + (SEGMENT_ENTRY_BYTES + self.side_bytes) * (-(-s // W) + 1)
                   for s in self.segments)


def rank_cost(slices: Sequence[TensorSlice], sparse: SparseSettings,
              names: Optional[Sequence[str]] = None) -> RankCost:
    """Exact SparseLoCo payload of one rank holding ``slices``, via the strategy's own planner."""
    numel = sum(sl.numel for sl in slices)
    plans = plan_buckets(list(slices), sparse.codec(), sparse.bucket_numel, sparse.dense_1d, names)
    side = 4 * (1 + (1 << sparse.value_bits)) if sparse.value_bits < 16 else 0
    return RankCost(numel=numel, payload=sum(bucket_payload_nbytes(p) for p in plans), buckets=len(plans),
                    dense_buckets=-(-numel // sparse.bucket_numel), segments=tuple(len(p.segments) for p in plans),
                    side_bytes=side)


def worker_ranks(model: Model, tp: int, pp: int, dp: int, sparse: SparseSettings) -> List[Tuple[RankCost, int]]:
    """[(cost of a rank, how many ranks of the worker have it)]: one entry per (stage, DP position);
    the TP ranks of a position hold the same shapes (multiplicity ``tp``)."""
    if pp > model.layers:
        raise CostModelError(f"PP={pp} exceeds the model's {model.layers} layers")
    out = []
    for stage in range(pp):
        params = stage_params(model, tp, pp, stage)
        for pos in range(dp):
            sls = dp_slices(params, dp, pos)
            out.append((rank_cost([s for _, s in sls], sparse, [n for n, _ in sls]), tp))
    return out


# ---------------------------------------------------------------------------------- the model
@dataclass
class Link:
    bandwidth_bps: float   # bit/s, each direction
    latency_s: float       # one-way, per ring hop
    lan_bandwidth_bps: float = LAN_BANDWIDTH_BPS   # hierarchical: the site's LAN (bit/s per worker link)
    lan_latency_s: float = LAN_LATENCY_S           # hierarchical: one-way LAN latency


@dataclass
class Compute:
    inner_steps: int       # H
    tokens: float          # per inner step per worker
    mfu: float
    peak_flops: float      # per accelerator


@dataclass
class ModeCost:
    mode: str
    W: int
    payload_bytes: int          # the worker's own payload per outer step (dense: the dense vector)
    bytes_sent: int             # counted (CommCounter), summed over the worker's ranks
    bytes_received: int
    wire_bytes: float           # per direction on the worker's link
    time_s: float
    compute_s: float
    ratio: float
    exact: bool                 # counted bytes exact (False: the reduce-scatter design estimate)


def mode_cost(mode: str, ranks: Sequence[Tuple[RankCost, int]], W: int, link: Link,
              compute_s: float, sites: int = 2) -> ModeCost:
    """One mode at W workers (``sites``: G for ``hierarchical``); see the module docstring for every formula."""
    if mode not in MODES + EXTRA_MODES:
        raise CostModelError(f"mode must be one of {MODES + EXTRA_MODES}, got {mode!r}")
    flag = FLAG_BYTES if W > 1 else 0
    n_ranks = sum(m for _, m in ranks)
    lan_t = 0.0  # hierarchical: the LAN round's latency and bytes
    if mode in DENSE_ITEMSIZE:
        s = DENSE_ITEMSIZE[mode]
        payload = sum(m * s * r.numel for r, m in ranks)
        sent = recv = (n_ranks * flag + payload) if W > 1 else 0
        wire = 2 * (W - 1) / W * payload
        hops = max(r.dense_buckets + 1 for r, _ in ranks) * 2 * (W - 1)
        exact = True
    else:
        payload = sum(m * r.payload for r, m in ranks)
        if mode == "hierarchical":
            G = min(sites, W)
            if G < 1 or W % G:
                raise CostModelError(f"hierarchical: {sites} sites do not divide W = {W} workers into equal groups")
            g = W // G
            sent = recv = n_ranks * flag + (W - 1) * payload if W > 1 else 0
            wire = (G - 1) * payload
            hops = max(r.buckets + 1 for r, _ in ranks) if W > 1 else 0   # one WAN round per collective
            lan_t = hops * link.lan_latency_s + 8.0 * (g - 1) * G * payload / link.lan_bandwidth_bps
            exact = True
        elif mode == "allgather":
            sent = n_ranks * flag + payload if W > 1 else 0
            recv = n_ranks * flag + (W - 1) * payload if W > 1 else 0
            wire = (W - 1) * payload
            hops = max(r.buckets + 1 for r, _ in ranks) * (W - 1)
            exact = True
        else:  # reduce-scatter: the design formula (estimate)
            over = sum(m * r.piece_overhead(W) for r, m in ranks)
            wire = 2 * (W - 1) / W * payload + 2 * (W - 1) * over
            sent = recv = int(round(n_ranks * flag + wire)) if W > 1 else 0
            hops = max(r.buckets + 1 for r, _ in ranks) * 2 * (W - 1)
            exact = False
    t = hops * link.latency_s + 8.0 * wire / link.bandwidth_bps + lan_t
    return ModeCost(mode, W, int(payload), int(sent), int(recv), float(wire), t, compute_s,
                    t / compute_s if compute_s > 0 else math.inf, exact)


def compute_seconds(numel: int, c: Compute, gpus: int) -> float:
    """H · 6·N·T / (u·F·G)."""
    return c.inner_steps * 6.0 * numel * c.tokens / (c.mfu * c.peak_flops * gpus)


def max_workers(mode: str, ranks, link: Link, compute_s: float, budget: float, limit: int = 1 << 20,
                sites: int = 2) -> int:
    """Largest W in [1, limit] with ratio ≤ budget (1 if none: W = 1 communicates nothing);
    ``hierarchical`` searches the multiples of ``sites`` (and W < sites)."""
    fits = lambda w: mode_cost(mode, ranks, w, link, compute_s, sites).ratio <= budget  # noqa: E731
    if mode != "hierarchical":
        return _largest_fitting(fits, limit)
    if fits(sites):
        return sites * _largest_fitting(lambda m: fits(m * sites), limit // sites)
    return max((w for w in range(1, sites) if fits(w)), default=1)


def _largest_fitting(fits, limit: int) -> int:
    """Largest n in [1, limit] with ``fits(n)``, for ``fits`` true up to some n and false after (1 if none)."""
    if fits(limit):
        return limit
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass
class Scenario:
    model: str
    numel: int
    tp: int
    pp: int
    dp: int
    payload_bytes: int
    bits_per_param: float
    compute_s: float
    rows: List[dict] = field(default_factory=list)
    max_w: List[dict] = field(default_factory=list)


def scenario(model: Model, tp: int, pp: int, dp: int, sparse: SparseSettings, compute: Compute,
             workers: Sequence[int], bandwidths_gbps: Sequence[float], latency_s: float,
             budget: float = 0.1, modes: Sequence[str] = MODES, sites: int = 2,
             lan_bandwidth_bps: float = LAN_BANDWIDTH_BPS, lan_latency_s: float = LAN_LATENCY_S) -> Scenario:
    """Every (bandwidth, W, mode) row and the largest W per mode (``sites`` and the LAN: hierarchical)."""
    ranks = worker_ranks(model, tp, pp, dp, sparse)
    comp = compute_seconds(model.active_numel, compute, tp * pp * dp)
    payload = sum(m * r.payload for r, m in ranks)
    sc = Scenario(model.name, model.numel, tp, pp, dp, payload, 8.0 * payload / model.numel, comp)
    for bw in bandwidths_gbps:
        link = Link(bw * 1e9, latency_s, lan_bandwidth_bps, lan_latency_s)
        for W in workers:
            for mode in modes:
                sc.rows.append({"bandwidth_gbps": bw, **asdict(mode_cost(mode, ranks, W, link, comp, sites))})
        for mode in modes:
            sc.max_w.append({"bandwidth_gbps": bw, "mode": mode,
                             "max_w": max_workers(mode, ranks, link, comp, budget, sites=sites)})
    return sc


# ---------------------------------------------------------------------------------- failures
#: the recipes' workers (examples/recipes/*.sh): accelerators per worker, tokens per inner step per
#: worker, workers W, and the recipe
@dataclass(frozen=True)
class RecipeWorker:
    gpus: int          # accelerators per worker
    tokens: int        # per inner step per worker
    workers: int       # W
    recipe: str


RECIPE_WORKERS = {
    "llama-1b": RecipeWorker(8, 256 * 2048, 8, "examples/recipes/llama_1b.sh"),
    "llama-8b": RecipeWorker(16, 128 * 4096, 4, "examples/recipes/llama_8b.sh"),
    "mixtral-8x7b": RecipeWorker(32, 128 * 4096, 4, "examples/recipes/mixtral_8x7b.sh"),
}
#: bytes per parameter of a worker's checkpoint: bf16 params 2, fp32 main params 4, Adam moments 8,
#: θ_outer 4, error feedback (SparseLoCo) or outer momentum (DiLoCo) 4
CHECKPOINT_BYTES_PER_PARAM = 22
#: bytes per parameter of a heal: θ_outer 4 + the two Adam moments 8 (SparseLoCo's error feedback is
#: never sent; the model params are θ_outer)
HEAL_BYTES_PER_PARAM = 12


@dataclass
class FailureSettings:
    """The inputs of the failure model (module docstring, **Failures**); seconds unless named."""

    mtbf_s: float                   # M: mean time between failures of one worker
    downtime_s: float               # D: from the detection until the failed worker's nodes can run again
    detect_s: float = 60.0          # t_det: a failure until the others stop waiting for it
    restart_s: float = 300.0        # t_restart: (re)queue the job, start the processes, build the model
    ckpt_write_gbps: float = 1.0    # GB/s per accelerator, checkpoint save (blocking)
    ckpt_read_gbps: float = 1.0     # GB/s per accelerator, checkpoint load
    ckpt_interval_s: Optional[float] = None   # τ; None: Young's interval sqrt(2·t_save / λ)
    heal_gbps: float = 10.0         # Gbit/s, the worker's link the heal crosses
    quorum_s: float = 0.5           # q: quorum + round header per round (elastic)
    keep_local_progress: bool = True   # after a failed round: kept (ρ = 0) or discarded (ρ = 1)


@dataclass
class FailureCost:
    model: str
    workers: int
    mtbf_h: float
    downtime_h: float
    step_s: float                   # one inner step
    round_s: float                  # R = H inner steps
    checkpoint_bytes: float         # per worker
    heal_bytes: float               # per worker
    save_s: float
    load_s: float
    heal_s: float
    failures_per_day: float         # of the whole run (λ · 86400)
    ckpt_interval_s: float          # τ used by fail-fast
    failfast_stall_s: float         # S: wall time every worker loses per failure (before recompute)
    failfast_goodput: float         # G_ff, fraction of the failure-free run
    elastic_lost_worker_s: float    # L = O + R/2 + (W−1)·c: worker-seconds lost per failure (M ≫ O)
    elastic_goodput: float          # G_e, fraction of the failure-free run
    keep_local_progress: bool       # the elastic policy after a failed round (ρ = 0 when kept)


def failure_cost(model: Model, gpus: int, tokens: float, workers: int, inner_steps: int, mfu: float,
                 peak_flops: float, f: FailureSettings) -> FailureCost:
    """Goodput of fail-fast + restart from the last checkpoint and of elastic workers (module docstring)."""
    if f.mtbf_s <= 0 or workers < 1 or gpus < 1:
        raise CostModelError("failures: MTBF, workers and accelerators must be positive")
    step = 6.0 * model.active_numel * tokens / (mfu * peak_flops * gpus)
    R = inner_steps * step
    ckpt = CHECKPOINT_BYTES_PER_PARAM * model.numel      # each worker holds (and saves) the whole model
    heal = HEAL_BYTES_PER_PARAM * model.numel
    t_save = ckpt / (gpus * f.ckpt_write_gbps * 1e9)
    t_load = ckpt / (gpus * f.ckpt_read_gbps * 1e9)
    t_heal = 8.0 * heal / (f.heal_gbps * 1e9)
    lam = workers / f.mtbf_s
    tau = f.ckpt_interval_s if f.ckpt_interval_s is not None else math.sqrt(2.0 * t_save / lam)
    if tau <= t_save:
        raise CostModelError(f"failures: the checkpoint interval {tau:g} s is not longer than a save ({t_save:g} s)")
    S = f.detect_s + f.downtime_s + f.restart_s + t_load
    kept_per_up = tau / math.expm1(lam * tau)            # E[⌊U/τ⌋·τ], U ~ Exp(λ)
    g_ff = (1.0 - t_save / tau) * kept_per_up / (1.0 / lam + S)
    rho = 0.0 if f.keep_local_progress else 1.0
    M = f.mtbf_s
    O = f.detect_s + f.downtime_s + f.restart_s + t_heal + R / 2     # the failed worker's outage
    c = f.detect_s + t_heal + rho * R                                # a survivor's loss per failure of another
    L = O + R / 2 + (workers - 1) * c
    useful = M - R / 2 - (workers - 1) * M / (M + O) * c
    g_e = (1.0 - f.quorum_s / R) * max(0.0, useful / (M + O))
    return FailureCost(model.name, workers, f.mtbf_s / 3600, f.downtime_s / 3600, step, R, ckpt, heal, t_save,
                       t_load, t_heal, lam * 86400, tau, S, g_ff, L, g_e, f.keep_local_progress)


def failure_markdown(rows: Sequence[FailureCost], f: FailureSettings, inner_steps: int, mfu: float,
                     peak_tflops: float) -> str:
    """One table per model: fail-fast and elastic (kept / discarded) goodput per (MTBF, downtime)."""
    out = []
    for name, W in dict.fromkeys((r.model, r.workers) for r in rows):
        rs = [r for r in rows if (r.model, r.workers) == (name, W) and r.keep_local_progress]
        r0 = rs[0]
        out += [f"### {name}: {r0.workers} workers, inner step {r0.step_s:.3g} s, round R = {inner_steps} steps = "
                f"{r0.round_s:.3g} s", "",
                f"Checkpoint {r0.checkpoint_bytes / 1e9:.3g} GB per worker (save {r0.save_s:.3g} s, load "
                f"{r0.load_s:.3g} s); heal {r0.heal_bytes / 1e9:.3g} GB in {r0.heal_s:.3g} s; detection "
                f"{f.detect_s:g} s, restart {f.restart_s:g} s, quorum {f.quorum_s:g} s per round "
                f"(MFU {mfu}, {peak_tflops:g} TFLOP/s peak).", "",
                "| MTBF / worker (h) | downtime (h) | failures / day | fail-fast τ (min) | fail-fast goodput | "
                "elastic, kept | elastic, discarded |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rs:
            key = (name, W, r.mtbf_h, r.downtime_h)
            d = next(x for x in rows
                     if (x.model, x.workers, x.mtbf_h, x.downtime_h) == key and not x.keep_local_progress)
            out.append(f"| {r.mtbf_h:g} | {r.downtime_h:g} | {r.failures_per_day:.3g} | {r.ckpt_interval_s / 60:.3g} | "
                       f"{r.failfast_goodput:.1%} | {r.elastic_goodput:.1%} | {d.elastic_goodput:.1%} |")
        out.append("")
    return "\n".join(out)


def failure_rows(presets: Sequence[str], mtbf_h: Sequence[float], downtime_h: Sequence[float], inner_steps: int,
                 mfu: float, peak_flops: float, base: FailureSettings,
                 workers: Optional[Sequence[int]] = None) -> List[FailureCost]:
    """Every (model, W, MTBF, downtime, kept / discarded) row; W defaults to each recipe's."""
    import dataclasses
    rows = []
    for name in presets:
        rw, model = RECIPE_WORKERS[name], PRESETS[name]()
        for W in (workers or [rw.workers]):
            for m in mtbf_h:
                for d in downtime_h:
                    for keep in (True, False):
                        f = dataclasses.replace(base, mtbf_s=m * 3600, downtime_s=d * 3600, keep_local_progress=keep)
                        rows.append(failure_cost(model, rw.gpus, rw.tokens, W, inner_steps, mfu, peak_flops, f))
    return rows


# ---------------------------------------------------------------------------------- output
def _gb(b: float) -> str:
    return f"{b / 1e9:.3g}"


def _time(t: float) -> str:
    return f"{t:.3g}" if t < 1e4 else f"{t:.3e}"


def markdown(sc: Scenario, budget: float, compute: Compute, latency_s: float) -> str:
    lines = [f"### {sc.model}: N = {sc.numel / 1e9:.3f} B parameters, worker TP={sc.tp} PP={sc.pp} DP={sc.dp} "
             f"({sc.tp * sc.pp * sc.dp} accelerators)", "",
             f"SparseLoCo payload per worker: {sc.payload_bytes} B ({_gb(sc.payload_bytes)} GB, "
             f"{sc.bits_per_param:.4f} bit/param, {32 / sc.bits_per_param:.1f}x below fp32); "
             f"H = {compute.inner_steps} inner steps of {compute.tokens:.4g} tokens = {_time(sc.compute_s)} s "
             f"(MFU {compute.mfu}, {compute.peak_flops / 1e12:g} TFLOP/s peak); latency {latency_s * 1e3:g} ms.", "",
             "Each cell: bytes received per worker per outer step (counted, GB) / outer-step time (s) / "
             f"ratio to the compute time; ✗ = over the {budget:.0%} budget; ~ = design estimate.", ""]
    modes = list(dict.fromkeys(r["mode"] for r in sc.rows))
    lines += ["| link Gbit/s | W | " + " | ".join(m + (" ~" if m == "reduce-scatter" else "") for m in modes) + " |",
              "|---:|---:|" + "---:|" * len(modes)]
    cells: Dict[tuple, List[str]] = {}
    for r in sc.rows:
        mark = "" if r["ratio"] <= budget else " ✗"
        cells.setdefault((r["bandwidth_gbps"], r["W"]), []).append(
            f"{_gb(r['bytes_received'])} / {_time(r['time_s'])} / {r['ratio']:.3g}{mark}")
    for (bw, W), cs in cells.items():
        lines.append(f"| {bw:g} | {W} | " + " | ".join(cs) + " |")
    lines += ["", f"Largest W within the {budget:.0%} budget:", "",
              "| link Gbit/s | " + " | ".join(dict.fromkeys(m["mode"] for m in sc.max_w)) + " |",
              "|---:|" + "---:|" * len(dict.fromkeys(m["mode"] for m in sc.max_w))]
    for bw in dict.fromkeys(m["bandwidth_gbps"] for m in sc.max_w):
        best = [str(m["max_w"]) if m["max_w"] > 1 else "none" for m in sc.max_w if m["bandwidth_gbps"] == bw]
        lines.append(f"| {bw:g} | " + " | ".join(best) + " |")
    return "\n".join(lines) + "\n"


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_sparseloco.costmodel",
                                description="Bytes and time of one outer step per mode (docs/scaling.md); with "
                                            "--failures, goodput under failures (docs/elastic.md).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help=f"comma-separated presets ({', '.join(PRESETS)}); each uses its own worker layout "
                          "and tokens unless --tp/--pp/--dp/--tokens are given (default llama-8b; with --failures "
                          f"the recipes' models {', '.join(RECIPE_WORKERS)})")
    src.add_argument("--params", type=float, default=None, help="model size N (a synthetic 4096-wide stack)")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks inside one worker")
    p.add_argument("--workers", default=None,
                   help="W values, comma-separated (default 4,16,64,256,1024; with --failures each recipe's W)")
    p.add_argument("--bandwidth-gbps", default="1,10,100", help="link bandwidths, Gbit/s, comma-separated")
    p.add_argument("--latency-ms", type=float, default=20.0, help="one-way latency per hop")
    p.add_argument("--inner-steps", type=int, default=None, help="H (default 30; with --failures 15, the recipes')")
    p.add_argument("--tokens", type=float, default=None, help="tokens per inner step per worker")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per accelerator (H100 dense bf16: 989)")
    p.add_argument("--budget", type=float, default=0.1, help="fits when outer step / compute ≤ budget")
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--value-bits", type=int, default=2)
    p.add_argument("--bucket-size", type=int, default=1 << 24)
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES + EXTRA_MODES)} (default: the first four)")
    p.add_argument("--sites", type=int, default=2, help="hierarchical: site groups G (each W must be a multiple)")
    p.add_argument("--lan-gbps", type=float, default=LAN_BANDWIDTH_BPS / 1e9,
                   help="hierarchical: the sites' LAN bandwidth, Gbit/s")
    p.add_argument("--lan-latency-ms", type=float, default=LAN_LATENCY_S * 1e3,
                   help="hierarchical: one-way LAN latency")
    fail = p.add_argument_group("failures (--failures): fail-fast + restart from a checkpoint vs elastic workers")
    fail.add_argument("--failures", action="store_true", help="print the goodput under failures instead")
    fail.add_argument("--mtbf-hours", default="6,24,168", help="M: mean time between failures of ONE worker")
    fail.add_argument("--downtime-hours", default="0,0.5,4",
                      help="D: from the detection until the failed worker's nodes can run again")
    dflt = FailureSettings(0.0, 0.0)
    fail.add_argument("--detect-s", type=float, default=dflt.detect_s, help="t_det: a failure until the others stop "
                      "waiting (the outer / collective timeout)")
    fail.add_argument("--restart-s", type=float, default=dflt.restart_s,
                      help="t_restart: requeue, process start, model build")
    fail.add_argument("--ckpt-write-gbps", type=float, default=dflt.ckpt_write_gbps,
                      help="GB/s per accelerator, blocking checkpoint save")
    fail.add_argument("--ckpt-read-gbps", type=float, default=dflt.ckpt_read_gbps, help="GB/s per accelerator, load")
    fail.add_argument("--ckpt-interval-min", type=float, default=None,
                      help="fail-fast checkpoint interval τ (default: Young's sqrt(2·t_save/λ))")
    fail.add_argument("--heal-gbps", type=float, default=dflt.heal_gbps, help="Gbit/s of the link a heal crosses")
    fail.add_argument("--quorum-s", type=float, default=dflt.quorum_s,
                      help="elastic: quorum + round header per round, seconds")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.failures:
        return _main_failures(p, args)
    if args.params is not None:
        models = [(synthetic(int(args.params)), dict(tp=1, pp=1, dp=8, tokens=1 << 20))]
    else:
        names = [n for n in (args.preset or "llama-8b").split(",") if n]
        for n in names:
            if n not in PRESETS:
                p.error(f"unknown preset {n!r}; choose from {', '.join(PRESETS)}")
        models = [(PRESETS[n](), PRESET_WORKER[n]) for n in names]
    sparse = SparseSettings(chunk=args.chunk, k=args.topk, value_bits=args.value_bits, bucket_numel=args.bucket_size)
    modes = [m for m in args.modes.split(",") if m]
    inner_steps = 30 if args.inner_steps is None else args.inner_steps
    out = []
    for model, dflt_w in models:
        tp, pp, dp = (args.tp or dflt_w["tp"]), (args.pp or dflt_w["pp"]), (args.dp or dflt_w["dp"])
        compute = Compute(inner_steps, args.tokens or dflt_w["tokens"], args.mfu, args.peak_tflops * 1e12)
        try:
            sc = scenario(model, tp, pp, dp, sparse, compute, _ints(args.workers or "4,16,64,256,1024"),
                          _floats(args.bandwidth_gbps), args.latency_ms / 1e3, args.budget, modes, args.sites,
                          args.lan_gbps * 1e9, args.lan_latency_ms / 1e3)
        except CostModelError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(markdown(sc, args.budget, compute, args.latency_ms / 1e3))
        out.append(asdict(sc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _main_failures(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    names = [n for n in (args.preset or ",".join(RECIPE_WORKERS)).split(",") if n]
    bad = [n for n in names if n not in RECIPE_WORKERS]
    if args.params is not None or bad:
        p.error(f"--failures takes the recipes' models: --preset among {', '.join(RECIPE_WORKERS)}")
    inner_steps = 15 if args.inner_steps is None else args.inner_steps
    base = FailureSettings(0.0, 0.0, detect_s=args.detect_s, restart_s=args.restart_s,
                           ckpt_write_gbps=args.ckpt_write_gbps, ckpt_read_gbps=args.ckpt_read_gbps,
                           ckpt_interval_s=None if args.ckpt_interval_min is None else args.ckpt_interval_min * 60,
                           heal_gbps=args.heal_gbps, quorum_s=args.quorum_s)
    try:
        rows = failure_rows(names, _floats(args.mtbf_hours), _floats(args.downtime_hours), inner_steps, args.mfu,
                            args.peak_tflops * 1e12, base, _ints(args.workers) if args.workers else None)
    except CostModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(failure_markdown(rows, base, inner_steps, args.mfu, args.peak_tflops))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"inputs": {**asdict(base), "inner_steps": inner_steps, "mfu": args.mfu,
                                  "peak_tflops": args.peak_tflops}, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
