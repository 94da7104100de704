"""GASLoC: a decentralised gossip outer step with outer momentum (arXiv 2606.11081, grounded form).

No public code or pseudocode of GASLoC exists; this is the implementable form of docs/design.md §1.3,
built from the paper's summary (gossip outer step, momentum on the gossip-mixed increment, one- or
two-peer randomised matchings, reduces to DiLoCo on the complete graph). docs/gasloc.md lists which
parts are read and which are our assumptions.

Per worker i (worker index = rank in the cross-worker ``group``), per outer round r, per bucket:

    θ0_i  = θ_outer,i                          # this worker's OWN anchor (θ at the round's start)
    Δ_i   = θ0_i − θ_i                         # pseudo-gradient of the H_i local steps
    y_i   = θ0_i − η Δ_i                       # proposal (η = proposal_lr)
    exchange y with this round's neighbours    # point-to-point only (comm/p2p.py)
    m_i   = Σ_j M_r[i, j] y_j                  # M_r from comm/topology.py; sum in worker order
    d_i  ← γ d_i + (m_i − θ0_i)                # momentum on the gossip-mixed increment (γ = momentum)
    θ_i  ← θ0_i + d_i ;  θ_outer,i ← θ_i

Workers are *not* identical after a round on a sparse graph: each keeps its own anchor and
momentum. Nothing assumes equal H_i: Δ_i is whatever worker i did since its last outer step, so
workers that ran different numbers of inner steps (heterogeneous speed) mix the same way; choosing
H_i is the Megatron wrapper's job.

Properties (tested in tests/test_gasloc.py):

* Mean preservation. M_r is doubly stochastic, so (1/W) Σ_i m_i = (1/W) Σ_i y_i: with γ = 0 the
  workers' mean after the round equals the mean proposal.
* Consensus. With η = 1 and no local steps (θ_i = θ0_i, so y_i = θ0_i) and γ = 0 the round is
  θ ← M_r θ: the disagreement Σ_i ||θ_i − θ̄||² shrinks by at least λ₂(M_r²).
* Complete graph = DiLoCo with heavy-ball outer momentum. With M = 11ᵀ/W and identical anchors θ0
  (true at the start and kept by induction): m = θ0 − η Δ̄ with Δ̄ = (1/W) Σ_j Δ_j, so
          d ← γ d − η Δ̄ ,   θ ← θ0 + d.
  DiLoCo's outer ``torch.optim.SGD(lr=η, momentum=γ, nesterov=False, dampening=0)`` on grad Δ̄ does
          b ← γ b + Δ̄ (b = Δ̄ at the first step) ,   θ ← θ0 − η b.
  By induction d = −η b (both start at 0 and, for constant η, d' = γ(−η b) − η Δ̄ = −η(γ b + Δ̄)),
  so the two produce the same θ at every round, and all workers stay identical. (With a schedule
  η_t the identity becomes d_t = −Σ_s γ^{t−s} η_s Δ̄_s, the "lr inside the buffer" convention.)
  DiLoCo's default Nesterov variant is *not* reproduced; that needs d's look-ahead, not part of
  the §1.3 form.

Rule "laplacian-momentum" (``rule``; the form a summary of the paper gives, docs/gasloc.md §2.1):

    θ_{t+1} = (I − αΛ_t) y_t + γ (y_t − y_{t−1}),      I − αΛ_t = M_r,   y_{−1} := θ_0

i.e. momentum on successive *proposals* instead of successive iterates (ours: θ_{t+1} = M y_t + γ(θ_t − θ_{t−1})).
State ``proposal_lag`` v = y_{t−1} − θ_t (0 at the start): θ_{t+1} = m + γ((y_t − θ_t) − v), v ← y_t − θ_{t+1}.
On the complete graph the workers' mean follows DiLoCo with *Nesterov* outer momentum exactly
(torch SGD nesterov=True, lr η, momentum γ); each worker is off the mean by γ times its own proposal
difference minus the mean one.

Rule "mixed-nesterov" (our variant, docs/gasloc.md §2.2): the same look-ahead, but mixed with the proposal,

    z_t = y_t + γ (y_t − y_{t−1}) ,   θ_{t+1} = M_r z_t ,   v ← y_t − θ_{t+1}     (same state v as above)

so the momentum term is averaged with the neighbours' instead of staying each worker's own. The mean
follows the same Nesterov recursion (M_r doubly stochastic); under exact averaging (complete graph, or
exponential with ``gossip_rounds`` = log2 W) every worker holds the same θ after every round and the
step IS DiLoCo with Nesterov outer momentum (lr η, momentum γ), point to point only.

``gossip_rounds`` R (uncompressed proposals only): one outer round mixes R times,
x⁽⁰⁾ = y (or z), x⁽q+1⁾ = M_{t·R+q} x⁽q⁾, m = x⁽R⁾, each step with the topology's next matching and
one fp32 proposal per neighbour per step (R× the bytes of R = 1). For the exponential topology with W
a power of two and R = log2 W the product of the R pairwise averages is exactly 11ᵀ/W (every worker
ends with the same floats: each pair computes the same two-term sum in rank order).

Topology "bandwidth": one-peer matchings drawn (comm.topology.bandwidth_matching) from a table of measured
link costs that all workers agree on every ``bandwidth_refresh`` rounds by a W-float point-to-point
exchange; a link k× slower than the fastest is used at most 1/k as often as proposed. Compressed copies
of dynamic topologies are capped at ``max_copies`` peers (an LRU per worker, simulated for all workers
from the shared matchings so both ends of a pair agree); static ones refuse a cap below their degree.

Non-finite guard (replaces the base class's global one): the base guard all-reduces a flag over
the whole group, a global collective, which GASLoC must not issue. Here each worker checks only
its own tensors, and one extra fp32 element (the flag) travels with every bucket's proposal to
this round's neighbours (4 bytes per peer per bucket, counted). ``"skip"``: a worker with
non-finite params discards its local progress (θ_i ← θ0_i, so y_i = θ0_i) and still mixes; its
neighbours mix normally (its proposal is finite); the skip is local, not all workers'.
``"abort"``: after the first bucket's exchange, the worker that saw it and every neighbour that
received its flag raise ``NonFiniteError`` with θ_outer untouched; workers further away learn of
it only when their next exchange with an aborted worker fails (the job is going down anyway).

Compressed proposals (``compress=True``; CHOCO-style public copies, our own code; docs/gasloc.md §7).
Each ordered pair (i→j) of workers that has met keeps a *public copy* x̂_{i→j}, held bit-identically
by i (as ``own[j]``) and by j (as ``heard[i]``). Per round, per bucket, worker i sends to each peer j

    q_{i→j} = C(y_i − x̂_{i→j})            SparseLoCo codec (top-k per chunk + quantised values)
    x̂_{i→j} += decode(q_{i→j})            on both ends (decode is deterministic: identical floats)
    m_i = y_i + ξ Σ_j M_r[i, j] (x̂_{j→i} − x̂_{i→j})        ξ = gossip_step (CHOCO's consensus step)

then the momentum update as above with m_i. The residual y − x̂ is the error feedback: whatever the
codec drops stays in it and is offered again next round (β = 1 by construction; ``ef_beta`` is not
used here, since decaying the residual would keep x̂ away from y for good). The first time a pair
meets (and after ``load_state_dict``) both send their y densely (raw fp32) and set x̂ := y, so the
copies never depend on equal initialisation. Invariant: the correction terms of i and j are exact
negatives of each other in floating point (w·(a − b) = −w·(b − a)), so Σ_i m_i = Σ_i y_i up to the
rounding of the additions, for any copies, codec, ξ and topology. Static topologies (ring, complete)
send the same payload to all neighbours, so one own copy serves every peer (ring: 3 shard copies);
dynamic ones (exponential, random1, random2) keep own[j] and heard[j] per distinct peer met (up to
2(W − 1) shard copies). Measured: ξ = 1 diverges at k = 64/4096; the default ξ = 0.05 contracts.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_sparseloco.compress import CodecConfig, decode, encode, payload_nbytes
from megatron_sparseloco.comm.topology import (MAX_DEGREE, TOPOLOGIES, check_topology, edges, neighbours_from_edges,
                                               symmetric_costs)
from megatron_sparseloco.outer.base import (ConfigError, NonFiniteError, OuterConfig, OuterGroup, OuterStepStats,
                                            OuterStrategy)
from megatron_sparseloco.outer.codec_fields import (check_bucket_holds_a_chunk, check_codec, codec_chunk_field,
                                                    codec_index_coding_field, codec_k_field, codec_value_bits_field)
from megatron_sparseloco.outer.config_fields import config_field, flag_field
from megatron_sparseloco.outer.registry import register_outer_strategy
from megatron_sparseloco.outer.round import Capabilities
from megatron_sparseloco.outer.sgd import momentum_field

VALUE_BITS = (2, 4, 8, 32)
#: the codec fields apply to compressed proposals only
_COMPRESSED = {"compress": True}
#: topologies whose neighbour set never changes: one own public copy serves every neighbour
STATIC_TOPOLOGIES = ("ring", "complete")
#: update rules (docs/gasloc.md §2): "ours" d ← γd + (My − θ0), θ ← θ0 + d (momentum on the mixed
#: increment); "laplacian-momentum" θ ← (I − αΛ)y + γ(y − y_prev) (momentum on successive proposals);
#: "mixed-nesterov" θ ← M(y + γ(y − y_prev)) (the same look-ahead, mixed with the proposal)
RULES = ("ours", "laplacian-momentum", "mixed-nesterov")
#: the rules that keep the proposal lag v = y_prev − θ0 (the others keep the momentum d)
LAG_RULES = ("laplacian-momentum", "mixed-nesterov")


@dataclass
class GASLoCConfig(OuterConfig):
    """Configuration of the GASLoC outer step (see the module docstring for the math)."""

    topology: str = flag_field("ring", flag="gossip-topology", choices=TOPOLOGIES)
    """Gossip graph (``comm.topology``): ring, exponential (needs a power-of-two W), random1, random2,
    complete, or bandwidth (one-peer matchings that use slow links less, drawn from measured link times)."""
    seed: int = flag_field(0, flag="gossip-seed", low=0)
    """Seed shared by all workers: the random matchings are drawn from (seed, round)."""
    # defaults η 0.7, γ 0.6: DiLoCo's tuned outer values, which the quality benchmark (3 seeds at W = 4) and the
    # heterogeneous-link benchmark measured ≈ 0.3 nats better than 1.0 / 0.9 (docs/gasloc.md §8.6)
    proposal_lr: float = flag_field(0.7, flag="gossip-proposal-lr", low=0.0, low_open=True)
    """Proposal step η in y = θ0 − η·Δ (DiLoCo's outer lr on the complete graph)."""
    momentum: float = momentum_field(0.6)
    """Heavy-ball momentum γ on the mixed increment, in [0, 1) (0: none)."""
    mixing_weight: Optional[float] = None
    """Edge weight of the mixing matrix; None: the topology's default (ring / random2: 1/3, exponential /
    random1: 1/2); must be None for complete."""
    compress: bool = flag_field(False, flag="gossip-compress", store_true=True)
    """Send proposals SparseLoCo-compressed against CHOCO public copies (pairwise); enables the codec flags."""
    chunk: int = codec_chunk_field(requires=_COMPRESSED)
    k: int = codec_k_field(requires=_COMPRESSED)
    value_bits: int = codec_value_bits_field(VALUE_BITS, requires=_COMPRESSED)
    ef_beta: float = config_field(0.95, low=0.0, high=1.0)
    """Accepted for parity with SparseLoCo but not used: the residual y − x̂ is the error feedback (β = 1;
    module docstring)."""
    index_coding: str = codec_index_coding_field(requires=_COMPRESSED)
    gossip_step: float = flag_field(0.05, flag="gossip-step", low=0.0, high=1.0, low_open=True, requires=_COMPRESSED)
    """With --sparseloco-gossip-compress: CHOCO's consensus step ξ on the public-copy differences (1, the
    uncompressed mixing for a lossless codec, diverges at k = 64 of 4096; docs/gasloc.md)."""
    rule: str = flag_field("ours", flag="gossip-rule", choices=RULES)
    """Update rule (docs/gasloc.md §2): "ours" (momentum on the mixed increment), "laplacian-momentum"
    (θ ← (I−αΛ)y + γ(y − y_prev)) or "mixed-nesterov" (θ ← M(y + γ(y − y_prev)))."""
    gossip_rounds: int = flag_field(1, flag="gossip-rounds", low=1)
    """Mixing steps R per outer round, each with the topology's next matching (R proposals sent per
    neighbour; not with --sparseloco-gossip-compress). Exponential with R = log2 W averages exactly
    (docs/gasloc.md §2.2)."""
    max_copies: int = flag_field(4, flag="gossip-max-copies", low=1, requires=_COMPRESSED)
    """With --sparseloco-gossip-compress: most peers whose public copies a worker keeps (LRU; 2 shard-sized
    fp32 copies per peer on one-peer topologies)."""
    bandwidth_refresh: int = flag_field(8, flag="gossip-bandwidth-refresh", low=1, requires={"topology": "bandwidth"})
    """Topology bandwidth: rounds between agreements on the measured link-cost table (a W-float
    point-to-point exchange)."""

    #: the mixed increment d is applied with step 1 (θ ← θ0 + d), heavy ball: the step on Δ is proposal_lr
    implied_flags = {"outer-lr": 1.0, "outer-nesterov": False}

    def codec(self) -> CodecConfig:
        return CodecConfig(chunk=self.chunk, k=self.k, value_bits=self.value_bits, index_coding=self.index_coding,
                           chunk_mode="flat")

    @property
    def effective_bucket_numel(self) -> int:
        """Compressed mode: ``bucket_numel`` rounded down to whole chunks (at least one chunk)."""
        if not self.compress:
            return self.bucket_numel
        return max(self.chunk, self.bucket_numel - self.bucket_numel % self.chunk)

    def validate(self) -> "GASLoCConfig":
        super().validate()
        if self.anchor_on_cpu:
            raise ConfigError("gasloc updates its workers' own θ_outer on the GPU inside its gossip rounds, so it "
                              "cannot stay in host memory", "anchor_on_cpu",
                              "drop it, or use --sparseloco-algorithm sparseloco / diloco / average")
        try:
            check_topology(self.topology, 1, self.mixing_weight)
        except ValueError as exc:
            raise ConfigError(f"mixing_weight: {exc}", "mixing_weight") from None
        if not 1 <= self.k <= self.chunk:
            raise ConfigError(f"k must be an integer in [1, chunk={self.chunk}], got {self.k!r}", "k",
                              "use `k` <= `chunk`")
        if self.compress and self.gossip_rounds > 1:
            raise ConfigError(f"gossip_rounds={self.gossip_rounds} needs uncompressed proposals (public copies "
                              "are kept per outer round)", "gossip_rounds",
                              "use `gossip_rounds=1`, or drop `compress`")
        if self.compress:
            check_codec(self.codec(), "GASLoCConfig codec")
            check_bucket_holds_a_chunk(self)
            if self.topology not in STATIC_TOPOLOGIES and self.max_copies < MAX_DEGREE[self.topology]:
                raise ConfigError(f"max_copies must be >= {MAX_DEGREE[self.topology]} for topology "
                                  f"{self.topology!r} (a worker meets that many peers in one round and needs a "
                                  f"copy pair for each), got {self.max_copies}", "max_copies",
                                  f"use `max_copies={MAX_DEGREE[self.topology]}` or more")
        return self

    def static_degree(self, num_workers: int) -> int:
        """Neighbours of a static topology (ring, complete) with W workers; 0 for the others."""
        if self.topology == "ring":
            return min(2, num_workers - 1)
        if self.topology == "complete":
            return num_workers - 1
        return 0

    def check_copies(self, num_workers: int, shard_numel: Optional[int] = None) -> None:
        """Compressed static topologies keep a heard copy per neighbour, all needed every round:
        refuse when ``max_copies`` is below the degree, with the memory it would take."""
        deg = self.static_degree(num_workers)
        if not self.compress or deg <= self.max_copies:
            return
        mem = (f" = {(1 + deg) * 4 * shard_numel / 2**20:.1f} MiB for this rank's {shard_numel}-element shard"
               if shard_numel is not None else "")
        raise ConfigError(
            f"max_copies={self.max_copies} is below the {deg} neighbours of compressed topology {self.topology!r} "
            f"with {num_workers} workers: it keeps 1 + {deg} fp32 copies of the shard{mem}", "max_copies",
            f"use `max_copies={deg}` to accept that memory, or a one-peer topology (`topology=random1`, "
            "exponential, bandwidth), whose copies are capped")

    def check_workers(self, num_workers: int) -> None:
        if self.topology == "exponential" and num_workers & (num_workers - 1):
            raise ConfigError(f"topology 'exponential' needs a power-of-two number of workers, got {num_workers}",
                              "topology", "use `topology=ring` or random1/random2, or a power-of-two W")
        self.check_copies(num_workers)

@dataclass
class _Round:
    """One outer round of one worker: its neighbours and what the step adds up over the buckets."""

    #: the (neighbours with weights, peers, self weight) of each of the round's ``gossip_rounds`` mixing steps
    steps: List[Tuple[List[Tuple[int, float]], List[int], float]]
    bad: bool                              # this worker's pseudo-gradient is non-finite
    nonfinite_tensor: Optional[str]
    abort: bool
    fresh: set = field(default_factory=set)  # compressed: peers refreshed densely this round
    peers_nonfinite: set = field(default_factory=set)
    sq_delta: float = 0.0
    sq_update: float = 0.0
    sq_shift: float = 0.0
    sq_resid: float = 0.0
    payload_bytes: int = 0

    @property
    def nbrs(self) -> List[Tuple[int, float]]:
        """``[(peer, M[me, peer])]`` of the first mixing step (the only one unless gossip_rounds > 1)."""
        return self.steps[0][0]

    @property
    def peers(self) -> List[int]:
        return self.steps[0][1]

    @property
    def self_weight(self) -> float:
        return self.steps[0][2]

    def into(self, stats: OuterStepStats, copies_bytes: Optional[int]) -> None:
        stats.delta_norm = math.sqrt(self.sq_delta)
        stats.update_norm = math.sqrt(self.sq_update)
        stats.skipped = self.bad
        stats.extra.update({"gossip_peers": float(len(self.peers)), "self_weight": self.self_weight,
                            "mix_shift_norm": math.sqrt(self.sq_shift),
                            "peers_nonfinite": float(len(self.peers_nonfinite))})
        if copies_bytes is not None:
            stats.error_norm = math.sqrt(self.sq_resid)  # ‖y − x̂‖ before sending, over the compressed payloads
            stats.extra.update({"dense_refresh_peers": float(len(self.fresh)),
                                "payload_bytes": float(self.payload_bytes), "copies_bytes": float(copies_bytes)})


@register_outer_strategy("gasloc")
class GASLoC(OuterStrategy[GASLoCConfig]):
    """Gossip outer step with momentum; see the module docstring. Extra state: ``momentum`` (d, rule
    "ours") or ``proposal_lag`` (v = y_prev − θ0, rules "laplacian-momentum" and "mixed-nesterov")."""

    name = "gasloc"
    config_class = GASLoCConfig
    #: workers keep their own anchor and momentum (not identical); gossip needs a neighbour; Δ_i is
    #: whatever worker i did since its last round (any H_i); the non-finite flag rides on the proposals
    capabilities = Capabilities(identical_across_workers=False, min_workers=2, per_worker_inner_steps=True,
                                agrees_nonfinite_before_step=False)

    def __init__(self, params: Sequence[torch.Tensor], group: OuterGroup,
                 config: GASLoCConfig, names: Optional[Sequence[str]] = None, slices=None):
        if not isinstance(config, GASLoCConfig):
            raise ConfigError(f"GASLoC needs a GASLoCConfig, got {type(config).__name__}")
        super().__init__(params, group, config, names, slices)
        config.check_copies(self.world_size, self.params.numel)
        self.laplacian = config.rule == "laplacian-momentum"
        self.mixed_nesterov = config.rule == "mixed-nesterov"
        # rule "ours": d (heavy ball); the lag rules: v = y_{t−1} − θ_t, v = 0 at the start
        # meaning y_{−1} := θ_0 (no momentum in round 0). The other one is None (not kept).
        lag = config.rule in LAG_RULES
        self.momentum: Optional[torch.Tensor] = None if lag else torch.zeros_like(self.anchor)
        self.proposal_lag: Optional[torch.Tensor] = torch.zeros_like(self.anchor) if lag else None
        # compressed mode: CHOCO public copies, allocated the first time a peer is met
        self.codec: Optional[CodecConfig] = config.codec() if config.compress else None
        self.static = config.topology in STATIC_TOPOLOGIES
        self.own_copy: Dict[int, torch.Tensor] = {}    # peer j → x̂_{me→j} (static: one shared tensor)
        self.heard_copy: Dict[int, torch.Tensor] = {}  # peer j → x̂_{j→me}
        #: dynamic topologies, compressed: every worker's LRU of peers (simulated for all W workers
        #: from the shared matchings, so both ends of a pair agree on whether its copies survive)
        self._lru: Optional[List["OrderedDict[int, None]"]] = None
        # bandwidth topology: the agreed link-cost table, and this worker's measurements since
        self.link_costs: Optional[List[List[float]]] = None
        self._cost_row: List[float] = [0.0] * self.world_size        # seconds per byte, 0: not measured
        self._measured: Dict[int, List[float]] = {}                   # peer → [seconds, bytes] since agreement
        #: (round, workers) → that round's edges (the workers change between rounds in elastic mode)
        self._edges_cache: Optional[Tuple[Tuple[int, int], list]] = None

    def buckets(self):
        n, b = self.params.numel, self.config.effective_bucket_numel
        for s in range(0, n, b):
            yield s, min(n, s + b)

    def _compressed_codec(self) -> CodecConfig:
        """The proposals' codec (compressed mode only)."""
        if self.codec is None:
            raise RuntimeError(f"{self.name}: the codec is used only with compressed proposals")
        return self.codec

    def copies_nbytes(self) -> int:
        """Memory held by the public copies (distinct tensors), in bytes."""
        seen = {id(t): t for t in list(self.own_copy.values()) + list(self.heard_copy.values())}
        return sum(t.numel() * t.element_size() for t in seen.values())

    # ------------------------------------------------------------------ topology
    def round_edges(self, round: Optional[int] = None) -> list:
        """All edges ``(i, j, w)`` of mixing round ``round`` (default: the next step's first), the same on
        every worker. With ``gossip_rounds`` R, outer step t mixes with rounds t·R, …, t·R + R − 1."""
        r = self.outer_steps * self.config.gossip_rounds if round is None else round
        c = self.config
        if self._edges_cache is not None and self._edges_cache[0] == (r, self.world_size):
            return self._edges_cache[1]
        out = edges(c.topology, self.world_size, r, c.seed, c.mixing_weight, self.link_costs)
        self._edges_cache = ((r, self.world_size), out)
        return out

    def round_neighbours(self, round: Optional[int] = None) -> List[Tuple[int, float]]:
        """``[(peer, M[me, peer])]`` for outer round ``round`` (default: the next step's round)."""
        return neighbours_from_edges(self.round_edges(round), self.rank)

    # ------------------------------------------------------------------ bandwidth topology
    def _record_link(self, peer: int, seconds: float, nbytes: int) -> None:
        """One timed exchange with ``peer`` (seconds for ``nbytes`` sent each way)."""
        acc = self._measured.setdefault(peer, [0.0, 0.0])
        acc[0] += seconds
        acc[1] += nbytes

    def _agree_link_costs(self) -> None:
        """Every ``bandwidth_refresh`` rounds: each worker sends its row of measured costs (seconds
        per byte, W fp64) to every other worker, point to point, and all build the same table."""
        W = self.world_size
        for p, (sec, nb) in self._measured.items():
            if nb > 0:
                self._cost_row[p] = sec / nb
        self._measured.clear()
        row = torch.tensor(self._cost_row, dtype=torch.float64)
        got = self.comm.exchange(row, [p for p in range(W) if p != self.rank], kind="p2p_costs")
        table = [self._cost_row if i == self.rank else got[i].tolist() for i in range(W)]
        self.link_costs = symmetric_costs(table, W)
        self._edges_cache = None

    def _timed_exchange(self, fn, peers: List[int], nbytes: int):
        if self.config.topology != "bandwidth" or not peers:
            return fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        for p in peers:
            self._record_link(p, dt, nbytes)
        return out

    def _begin_round(self, peers: List[int]) -> None:
        """Bandwidth topology: a 1-element handshake with this round's peer, so that the timed
        payload exchanges measure the link and not the partner's late arrival."""
        if self.config.topology == "bandwidth" and peers:
            self.comm.exchange(torch.zeros(1, dtype=torch.float32, device=self.device), peers, kind="p2p_sync")

    # ------------------------------------------------------------------ guard
    def _raise_nonfinite(self, bad_peers: List[int], nonfinite_tensor: Optional[str]) -> None:
        where = (f"tensor {nonfinite_tensor!r} on this worker (rank {self.rank})" if nonfinite_tensor is not None
                 else f"neighbour worker(s) {bad_peers}")
        raise NonFiniteError(
            f"{self.name} outer step {self.outer_steps + 1}: non-finite pseudo-gradient in {where}; θ_outer left "
            "untouched (policy 'abort'; use nonfinite_policy='skip' to let that worker discard its local progress)")

    # ------------------------------------------------------------------ the update rule
    def _apply_rule(self, s: int, e: int, y: torch.Tensor, mix: torch.Tensor) -> float:
        """θ0 ← the rule's new point from proposal ``y`` and mixed proposal ``mix`` (consumed) on one
        bucket; returns ‖θ_new − θ0‖².

        ours:                d ← γd + (m − θ0) ;  θ ← θ0 + d
        laplacian-momentum:  θ ← m + γ(y − y_prev),  y − y_prev = (y − θ0) − v,  then v ← y − θ_new
        mixed-nesterov:      θ ← m (the look-ahead z = y + γ(y − y_prev) was mixed), then v ← y − θ_new
        """
        c = self.config
        theta0 = self.anchor[s:e]
        if self.mixed_nesterov:
            assert self.proposal_lag is not None
            upd = torch.sub(mix, theta0)
            theta0.copy_(mix)
            torch.sub(y, theta0, out=self.proposal_lag[s:e])   # v ← y_t − θ_{t+1}
            return float(torch.dot(upd, upd))
        if not self.laplacian:
            assert self.momentum is not None
            d = self.momentum[s:e]
            d.mul_(c.momentum).add_(mix.sub_(theta0))  # d ← γd + (m − θ0)
            theta0.add_(d)  # θ_outer ← θ0 + d (in place on the anchor)
            return float(torch.dot(d, d))
        assert self.proposal_lag is not None
        v = self.proposal_lag[s:e]
        step = torch.sub(y, theta0).sub_(v)            # y_t − y_{t−1}
        new = mix.add_(step, alpha=c.momentum)         # θ_{t+1} = (I − αΛ)y_t + γ(y_t − y_{t−1})
        upd = torch.sub(new, theta0)
        theta0.copy_(new)
        torch.sub(y, theta0, out=v)                    # v ← y_t − θ_{t+1}
        return float(torch.dot(upd, upd))

    # ------------------------------------------------------------------ the step, in phases
    # Both steps run per bucket: propose (compress timer) → exchange with this round's peers
    # (communicate) → check the peers' non-finite flags → mix and apply the rule (apply).
    # ``_Round`` carries what a step accumulates over its buckets into the stats.

    def _outer_step(self, stats: OuterStepStats, nonfinite_tensor: Optional[str]) -> None:
        c = self.config
        if c.topology == "bandwidth" and self.outer_steps > 0 and self.outer_steps % c.bandwidth_refresh == 0:
            self._agree_link_costs()
        rnd = self._start_round(nonfinite_tensor)
        if self.codec is not None:
            self._compressed_buckets(stats, rnd)
        else:
            self._dense_buckets(stats, rnd)
        rnd.into(stats, self.copies_nbytes() if self.codec is not None else None)

    def _start_round(self, nonfinite_tensor: Optional[str]) -> "_Round":
        R = self.config.gossip_rounds
        steps = []
        for q in range(R):
            nbrs = self.round_neighbours(self.outer_steps * R + q)
            steps.append((nbrs, [p for p, _ in nbrs], 1.0 - sum(w for _, w in nbrs)))
        rnd = _Round(steps=steps, bad=nonfinite_tensor is not None, nonfinite_tensor=nonfinite_tensor,
                     abort=self.config.nonfinite_policy == "abort")
        self._begin_round(rnd.peers)   # later mixing steps: at their first bucket (_dense_buckets)
        return rnd

    def _propose(self, s: int, e: int, rnd: "_Round", out: torch.Tensor) -> torch.Tensor:
        """y = θ0 − ηΔ on bucket [s, e), into ``out``; adds ‖Δ‖² to the round.

        A worker with a non-finite Δ proposes y = θ0: under "skip" it discards its local progress
        (Δ = 0) and still mixes; under "abort" it is something finite to send, and the flag sent
        with it makes every neighbour raise at bucket 0, before anything changed."""
        if rnd.bad:
            return out.copy_(self.anchor[s:e])
        self.pseudo_gradient(s, e, out=out)
        rnd.sq_delta += float(torch.dot(out, out))
        return out.mul_(-self.config.proposal_lr).add_(self.anchor[s:e])

    def _to_mix(self, s: int, e: int, y: torch.Tensor) -> torch.Tensor:
        """What is mixed: y, or for rule mixed-nesterov the look-ahead z = y + γ((y − θ0) − v) (new tensor)."""
        if not self.mixed_nesterov:
            return y
        assert self.proposal_lag is not None
        step = torch.sub(y, self.anchor[s:e]).sub_(self.proposal_lag[s:e])   # y_t − y_{t−1}
        return torch.add(y, step, alpha=self.config.momentum)

    def _check_flags(self, rnd: "_Round", flags: Dict[int, bool]) -> None:
        """The peers' non-finite flags of one bucket (the same on every bucket): under "abort" any
        flag, ours or a neighbour's, raises here at bucket 0."""
        bad_peers = sorted(p for p, f in flags.items() if f)
        rnd.peers_nonfinite.update(bad_peers)
        if rnd.abort and (rnd.bad or bad_peers):
            self._raise_nonfinite(bad_peers, rnd.nonfinite_tensor)

    def _dense_buckets(self, stats: OuterStepStats, rnd: "_Round") -> None:
        """Proposals sent whole (fp32, plus the flag element): m = Σ_j M_ij x_j with x = y (or the
        look-ahead z), repeated over the round's ``gossip_rounds`` mixing steps (x ← m between them)."""
        for b, (s, e) in enumerate(self.buckets()):
            n = e - s
            with self._timer(stats, "time_compress_s"):
                send = torch.empty(n + 1, dtype=torch.float32, device=self.device)
                y = self._propose(s, e, rnd, torch.empty(n, dtype=torch.float32, device=self.device))
                send[:n] = self._to_mix(s, e, y)
                send[n] = 1.0 if rnd.bad else 0.0
            for q, (nbrs, peers, self_weight) in enumerate(rnd.steps):
                if q > 0 and b == 0:   # step 0's handshake was the round's (_start_round)
                    self._begin_round(peers)
                with self._timer(stats, "time_communicate_s"):
                    received = self._timed_exchange(lambda: self.comm.exchange(send, peers), peers, 4 * (n + 1))
                self._check_flags(rnd, {p: buf[n].item() != 0.0 for p, buf in received.items()})
                with self._timer(stats, "time_apply_s"):
                    terms = sorted([(self.rank, self_weight, send[:n])] + [(p, w, received[p][:n]) for p, w in nbrs],
                                   key=lambda t: t[0])
                    mix = torch.zeros(n + 1, dtype=torch.float32, device=self.device)
                    for _, w, v in terms:  # same order on every worker: identical sums on the complete graph
                        mix[:n].add_(v, alpha=w)
                    mix[n] = send[n]
                    send = mix         # the next mixing step sends what this one mixed
            mix = send[:n]
            with self._timer(stats, "time_apply_s"):
                rnd.sq_shift += float(torch.sum((mix - y) ** 2))
                rnd.sq_update += self._apply_rule(s, e, y, mix)

    # ------------------------------------------------------------------ compressed step (CHOCO copies)
    def _plan_copies(self, peers: List[int]) -> List[int]:
        """Decide which copies this round refreshes densely, evict, allocate; return the fresh peers.

        Static topologies: copies are made at the first meeting and kept (``max_copies`` ≥ degree is
        checked at construction). Dynamic ones: every worker keeps an LRU of at most ``max_copies``
        peers; the copies of pair (i, j) are valid iff j is in i's LRU and i in j's. Every worker
        simulates all W LRUs from the round's full matching (the same everywhere), so both ends of a
        pair agree. The LRUs are updated with this round's edges *before* allocating, and copies of
        peers no longer valid are freed first: at no time are more than ``max_copies`` peers' copies
        held (the round's own peers are always valid after the update: max_copies ≥ the degree).
        """
        me = self.rank
        if not self.static:
            cap = self.config.max_copies
            if self._lru is None:
                self._lru = [OrderedDict() for _ in range(self.world_size)]
            lru = self._lru
            for i, j, _ in self.round_edges():
                for a, b in ((i, j), (j, i)):
                    lru[a].pop(b, None)
                    lru[a][b] = None
                    while len(lru[a]) > cap:
                        lru[a].popitem(last=False)
            keep = {p for p in lru[me] if me in lru[p]}
            assert set(peers) <= keep, (peers, keep)
            for p in [q for q in self.heard_copy if q not in keep]:
                del self.heard_copy[p], self.own_copy[p]
        fresh = [p for p in peers if p not in self.heard_copy]
        if self.static and fresh and len(fresh) != len(peers):
            raise RuntimeError(f"{self.name}: static topology met new and known peers in one round ({peers})")
        shared = None
        for p in fresh:
            self.heard_copy[p] = torch.zeros_like(self.anchor)
            if self.static:
                shared = shared if shared is not None else torch.zeros_like(self.anchor)
                self.own_copy[p] = shared
            else:
                self.own_copy[p] = torch.zeros_like(self.anchor)
        return fresh

    def _compressed_buckets(self, stats: OuterStepStats, rnd: "_Round") -> None:
        """CHOCO copies: each peer gets the compressed residual y − x̂_{me→p} (densely y itself the
        first time a pair meets); m = y + ξ Σ_j M_ij (x̂_{j→me} − x̂_{me→j})."""
        rnd.fresh = set(self._plan_copies(rnd.peers))
        flag = torch.tensor([1 if rnd.bad else 0], dtype=torch.uint8, device=self.device)
        for s, e in self.buckets():
            n = e - s
            with self._timer(stats, "time_compress_s"):
                y = self._propose(s, e, rnd, torch.empty(n, dtype=torch.float32, device=self.device))
                x = self._to_mix(s, e, y)
                bodies = self._encode_for_peers(s, e, x, rnd)
            with self._timer(stats, "time_communicate_s"):
                received = self._exchange_bodies(n, bodies, flag, rnd)
            self._check_flags(rnd, {p: int(buf[-1].item()) != 0 for p, buf in received.items()})
            with self._timer(stats, "time_apply_s"):
                self._refresh_copies(s, e, bodies, {p: buf[:-1] for p, buf in received.items()}, rnd)
                mix = self._choco_mix(s, e, x, rnd)
                rnd.sq_update += self._apply_rule(s, e, y, mix)

    def _encode_for_peers(self, s: int, e: int, y: torch.Tensor, rnd: "_Round") -> Dict[int, torch.Tensor]:
        """peer → the bytes it gets: y (dense refresh) or encode(y − x̂_{me→p}), once per distinct copy."""
        bodies: Dict[int, torch.Tensor] = {}
        by_copy: Dict[Tuple[int, bool], torch.Tensor] = {}  # (id(own copy), fresh) → body
        for p in rnd.peers:
            key = (id(self.own_copy[p]), p in rnd.fresh)
            if key not in by_copy:
                if p in rnd.fresh:
                    by_copy[key] = y.view(torch.uint8)
                else:
                    resid = y - self.own_copy[p][s:e]
                    rnd.sq_resid += float(torch.dot(resid, resid))
                    by_copy[key] = encode(resid, self._compressed_codec(), name=f"{self.name} residual to worker {p}")
            bodies[p] = by_copy[key]
        rnd.payload_bytes += sum(int(b.numel()) for b in bodies.values())
        return bodies

    def _exchange_bodies(self, n: int, bodies: Dict[int, torch.Tensor], flag: torch.Tensor,
                         rnd: "_Round") -> Dict[int, torch.Tensor]:
        """Each body with the flag byte appended, to its peer; peer → what it sent (flag last)."""
        payloads = {p: torch.cat([b, flag]) for p, b in bodies.items()}
        recv_nbytes: Optional[Dict[int, int]] = None
        if self.config.index_coding == "packed":
            comp_n = payload_nbytes(n, self._compressed_codec()) + 1
            recv_nbytes = {p: (4 * n + 1 if p in rnd.fresh else comp_n) for p in rnd.peers}
        sent_bytes = max((int(b.numel()) for b in payloads.values()), default=0)
        return self._timed_exchange(lambda: self.comm.exchange_per_peer(payloads, recv_nbytes), rnd.peers, sent_bytes)

    def _refresh_copies(self, s: int, e: int, bodies: Dict[int, torch.Tensor], received: Dict[int, torch.Tensor],
                        rnd: "_Round") -> None:
        """x̂_{me→p} += decode(q_me) (once per distinct tensor) and x̂_{p→me} += decode(q_p)."""
        n = e - s
        done = set()
        for p in rnd.peers:
            own = self.own_copy[p]
            if id(own) not in done:
                done.add(id(own))
                self._apply_to_copy(own[s:e], bodies[p], p in rnd.fresh, n)
        for p in rnd.peers:
            self._apply_to_copy(self.heard_copy[p][s:e], received[p], p in rnd.fresh, n, peer=p)

    def _choco_mix(self, s: int, e: int, y: torch.Tensor, rnd: "_Round") -> torch.Tensor:
        """m = y + ξ Σ_j M_ij (x̂_{j→me} − x̂_{me→j}), the neighbours in peer order."""
        c = self.config
        corr = torch.zeros(e - s, dtype=torch.float32, device=self.device)
        for p, w in rnd.nbrs:  # sorted by peer
            corr.add_(self.heard_copy[p][s:e] - self.own_copy[p][s:e], alpha=w)
        rnd.sq_shift += float(torch.dot(corr, corr)) * c.gossip_step ** 2
        return torch.add(y, corr, alpha=c.gossip_step)

    def _apply_to_copy(self, copy: torch.Tensor, body: torch.Tensor, dense: bool, n: int,
                       peer: Optional[int] = None) -> None:
        if dense:
            if body.numel() != 4 * n:
                raise RuntimeError(f"{self.name}: dense refresh from worker {peer} has {body.numel()} bytes, "
                                   f"expected {4 * n}")
            copy.copy_(body.view(torch.float32))
            return
        dec = decode(body, device=copy.device)
        if dec.numel != n:
            raise RuntimeError(f"{self.name}: payload from worker {peer} covers {dec.numel} elements, bucket has {n}")
        copy[dec.indices] += dec.values

    # ------------------------------------------------------------------ state
    elementwise_buffers = ("momentum", "proposal_lag")  # one of them None, by rule

    def load_state_dict(self, sd: dict) -> None:
        """Public copies are not checkpointed: they are dropped, and every pair refreshes them densely
        at its next meeting (all workers resume from the same round, so both ends agree). Neither is
        the bandwidth topology's link-cost table: uniform matchings until the next agreement."""
        super().load_state_dict(sd)
        self.own_copy.clear()
        self.heard_copy.clear()
        self._lru = None
        self.link_costs = None
        self._cost_row = [0.0] * self.world_size
        self._measured.clear()
        self._edges_cache = None
