"""SparseLoCo (arXiv 2508.15706): Top-k + 2-bit pseudo-gradients with error feedback, all-gathered.

Per outer step, per bucket B (a flat range of this rank's shard), on worker r:

    Δ_r   = θ_outer − θ_r
    e_r   ← β·e_r + Δ_r                              error feedback (β = ``ef_beta``)
    P_r   = encode(e_r)                             Top-k per chunk of ``chunk`` elements, quantised values
    e_r   ← e_r − decode(P_r)                       remove exactly what was sent
    {P_w} = all_gather(P_r)                         packed uint8 payloads, equal sizes for "packed" indices
    S[i]  = Σ_{w : i ∈ idx_w} v_w[i] ,  c[i] = #{w : i ∈ idx_w}
    agg   = S / max(c, 1)    (reduce="contributors": mean over the workers that chose i; the
                              public reference code's scatter_reduce "mean", include_self=False)
          = S / W            (reduce="all": the (1/W)·Σ written in the paper)
    θ_outer ← θ_outer − lr·u,   u = agg, or with ``momentum`` μ > 0 the SGD momentum direction
                                 (heavy ball or Nesterov, ``outer/sgd.py``)
    θ_r   ← θ_outer

Following production Templar, Δ enters the error feedback unscaled and lr is applied once, in the
SGD step (the reference code multiplies by lr twice). Defaults: chunk 4096, k 64 (1.56 %), 2-bit
values, β 0.95, contributors mean, no momentum, per-tensor chunking, 1-D tensors dense, and an outer
lr that depends on W, k and the model's size N (the reference uses 1 at every W):

    u  = W·k / C                      the share of a chunk that the W selections can cover
    lr = s(N) / √u ,  u clamped to [1/32, 1/4]         (``default_outer_lr``)
    s(N): 0.375 at N = 446 k, 0.265 at 3.26 M, 0.06625 at 10.8 M parameters (``DEFAULT_LR_SCALES``),
          log-linear in log N between them (lr ∝ N^−α, α ≈ 0.17 then 1.16), the end values held outside

i.e. 1.5 at W = 2, 1.06 at W = 4, 0.75 at W = 8 for k = 64 of 4096 on the 3.26 M model (1.06 / 0.75 /
0.53 with k = 128), one √2 step higher on the 446 k model and four lower (a factor of 4: 0.265 at
W = 4) on the 10.8 M model. This is our quality benchmark's measurement, not a derivation
(docs/integration.md, "Outer lr and the number of workers"): each anchor is the best point of the
900-step sweep (seed 0) at every W and k measured at that size, bracketed by worse points on both
sides. The step that works shrinks as the model grows; on the two smaller sizes one step too high
costs up to ten times more than one step too low (at 10.8 M the other way round). Beyond the
measured sizes the end values are held rather than the power law extrapolated (production SparseLoCo
runs outer lr 1.0 at 72 B parameters, far above the extrapolation, with its own inner lr): set
``--sparseloco-outer-lr`` for a large model. N is every parameter of the model
(``megatron/args/model_size.py``; unknown, N = 0: the 3.26 M scale). A reading of the 1/√u: under the
contributors mean a coordinate chosen by one worker moves θ_outer by that worker's whole value, so
the update's norm grows with the union of the selections, and the step that works shrinks with it.
The rule is the default only with the contributors mean and no outer momentum; otherwise the default
is 1.5 (not measured with the rule). An explicit ``--sparseloco-outer-lr`` (``lr=``) always wins.

``peer_norm_clip``: before summing, worker w's decoded values in a bucket are scaled by
min(1, median_w' ‖v_w'‖ / ‖v_w‖) (the lower median, ``torch.median``, of the W peers' norms in
that bucket): an outlier peer cannot dominate the aggregate. Off by default. Note it is applied
per bucket, so its effect depends on ``bucket_numel``.

Chunking (``chunking``):

* ``"tensor"`` (default, as the reference code): every parameter slice of the shard is its own
  codec tensor with its own quantiser — 2-D weights in ``t x t`` tiles (64x64 for C = 4096) when
  the slice holds whole rows, flat chunks inside the tensor otherwise, 1-D tensors sent whole
  (``dense_1d``). A bucket is a run of whole slices (a slice larger than ``bucket_numel`` is split
  at tile-row / chunk boundaries) and travels as ONE payload with a segment table
  (``compress.segments``): one collective per bucket whatever the number of tensors.
* ``"flat"``: the shard's flat range is one codec tensor per bucket: chunks of C run across
  parameter boundaries and one quantiser serves the whole bucket (``quant_group_chunks`` = g > 0:
  one per g chunks). Kept for comparison; docs/codec.md "Why per tensor" says why it loses.

Buckets (flat chunking): ``bucket_numel`` is rounded down to a multiple of ``chunk`` (at least one chunk), so the
chunks of every bucket are exactly the chunks of the whole flat shard and only the shard's last
chunk is ragged. Peak extra memory of a step: one dense fp32 bucket buffer, a uint8 (int32 when
W > 255) count per bucket element, the W gathered payloads, and the decoded (index, value) lists
of one worker (of all W when ``peer_norm_clip``) — never W × shard.

Every rank decodes every payload (its own was decoded by the EF step; decoding is deterministic)
and sums them in group-rank order with the same operations, so the aggregate — and θ_outer — are
bitwise identical on all workers.

Aggregation (``aggregation``): ``"allgather"`` (default, above) or ``"reduce-scatter"``: each
worker sends each bucket's owner only its payload's part in the owner's range, owners aggregate and
re-encode their range with an owner error feedback (``owner_k`` / ``owner_value_bits``, default the
worker codec's), and an all-gather of the re-encoded ranges gives every worker the same update;
about 2·(W−1)/W payloads received instead of W − 1 (``outer/sparse_reduce_scatter.py``,
docs/scaling.md). Tensor chunking, packed indices and no peer-norm clipping only.
``"hierarchical"``: the same payloads and the same aggregate as all-gather (bitwise), moved in site
groups — each worker exchanges its payload with its counterpart in each of the other
``aggregation_groups`` − 1 sites (one WAN round per bucket instead of W − 1 ring hops), then the
site's workers gather each other's (``outer/sparse_hierarchical.py``). Packed indices.

State: the anchor, the error-feedback buffer (shard-sized fp32, different on every worker: it
must not be deduplicated as a data-parallel replica when checkpointing), and the momentum buffer
when μ > 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Collection, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from megatron_sparseloco.comm.pending import Pending
from megatron_sparseloco.compress.checks import DeferredChecks, prefixed
from megatron_sparseloco.compress import (
    CodecConfig,
    CodecConfigError,
    Decoded,
    decode,
    payload_nbytes,
)
from megatron_sparseloco.compress.config import QUANTISED_VALUE_BITS, RAW_VALUE_BITS
from megatron_sparseloco.compress.fast_segments import decode_scatter_add_bucket_fast, error_feedback_step_bucket_fast
from megatron_sparseloco.compress.fast_segments import last_dispatch as fast_segments_dispatch
# Triton kernels on CUDA for the configurations they cover; the torch codec (identical bytes) otherwise.
from megatron_sparseloco.compress.fast_path import error_feedback_step_fast as error_feedback_step
from megatron_sparseloco.compress.segments import BucketPlan, bucket_payload_nbytes, decode_bucket, plan_buckets
from megatron_sparseloco.outer.base import ConfigError, OuterConfig, OuterGroup, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.codec_fields import (check_bucket_holds_a_chunk, check_codec, codec_chunk_field,
                                                    codec_index_coding_field, codec_k_field, codec_value_bits_field)
from megatron_sparseloco.outer.config_fields import config_field, flag_field
from megatron_sparseloco.outer.registry import register_outer_strategy
from megatron_sparseloco.outer.round import BucketBuffers, Capabilities, RoundPlan
from megatron_sparseloco.outer.sparse_hierarchical import SiteGroups
from megatron_sparseloco.outer.sparse_reduce_scatter import SparseReduceScatter
from megatron_sparseloco.outer.sgd import check_outer_sgd, lr_field, momentum_field, nesterov_field, outer_sgd_

REDUCE_MODES = ("contributors", "all")
AGGREGATIONS = ("allgather", "reduce-scatter", "hierarchical")
OWNER_RESIDUALS = ("owner", "workers")
CHUNKINGS = ("tensor", "flat")
#: value widths of the SparseLoCo codec (compress.config: 2/4/8 quantised, 16 bf16, 32 fp32)
VALUE_BITS = QUANTISED_VALUE_BITS + RAW_VALUE_BITS

#: the union shares u = W·k/C over which the default lr rule was measured (W·k = 128 … 1024 at C = 4096)
DEFAULT_LR_MEASURED_U = (1 / 32, 1 / 4)
#: the rule's scale s(N) at each measured model size, (parameters, scale): lr = s / √u was the best point of
#: the quality sweep at every measured W and k there (module docstring; docs/integration.md)
DEFAULT_LR_SCALES = ((446_080, 0.375), (3_258_112, 0.265), (10_795_392, 0.06625))
#: the scale used when the model's size is unknown (N = 0): the 3.26 M model's
DEFAULT_LR_SCALE = 0.265


def default_lr_scale(numel: int = 0) -> float:
    """s(N): ``DEFAULT_LR_SCALES`` interpolated log-linearly in log N, the end values held outside the measured
    sizes; ``DEFAULT_LR_SCALE`` for N = 0 (unknown)."""
    if numel <= 0:
        return DEFAULT_LR_SCALE
    pts = DEFAULT_LR_SCALES
    if numel <= pts[0][0]:
        return pts[0][1]
    for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
        if numel == n1:                      # a measured size: its scale as written, not through exp(log)
            return s1
        if numel < n1:
            t = math.log(numel / n0) / math.log(n1 / n0)
            return math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0)))
    return pts[-1][1]


def default_outer_lr(num_workers: int, k: int, chunk: int, numel: int = 0) -> float:
    """The default outer lr, s(N) / √u with u = W·k/C held inside ``DEFAULT_LR_MEASURED_U``, to 3 significant
    digits, as the sweep grids write their √2 steps (module docstring: 1.06 at W = 4, k = 64 of 4096 on the
    3.26 M model and for an unknown size; 0.375, not 0.38, where s / √u is 0.375)."""
    low, high = DEFAULT_LR_MEASURED_U
    u = min(max(num_workers * k / chunk, low), high)
    return float(f"{default_lr_scale(numel) / math.sqrt(u):.3g}")


@dataclass
class SparseLoCoConfig(OuterConfig):
    """The SparseLoCo outer step's settings (module docstring for the math; docs/codec.md for the wire format).

    ``lr``: 1.5 when the config is built directly; from the Megatron flags, unless given, the rule of the
    number of workers ``default_outer_lr(W, k, C)`` (``resolve_for_workers``). No outer momentum by
    default: error feedback plays its role."""

    chunk: int = codec_chunk_field()
    k: int = codec_k_field()
    value_bits: int = codec_value_bits_field(VALUE_BITS)
    index_coding: str = codec_index_coding_field()
    chunking: str = flag_field("tensor", flag="chunking", choices=CHUNKINGS)
    """"tensor" (default, as the reference) compresses every parameter on its own (own quantiser, 64x64 tiles
    for 2-D weights); "flat" chunks the shard's flat range across parameters with one quantiser per bucket
    (kept for comparison)."""
    dense_1d: bool = flag_field(True, flag="dense-1d", requires={"chunking": "tensor"})
    """With tensor chunking: send 1-D tensors (norms, biases) whole, 2-bit quantised (default on,
    as the reference); off: Top-k like the rest."""
    quant_group_chunks: int = config_field(0, low=0)
    """Flat chunking: 0 = one quantiser per bucket; g > 0: one per g chunks."""
    ef_beta: float = flag_field(0.95, flag="ef-decay", low=0.0, high=1.0, high_open=True)
    """Error-feedback decay β in [0, 1): e ← β·e + Δ before compressing."""
    reduce: str = flag_field("contributors", flag="reduce", choices=REDUCE_MODES)
    """How the sparse sum S is averaged: "contributors", over the workers that sent each coordinate,
    S / max(c, 1) (the reference code); "all", over all W workers, S / W (the paper's formula)."""
    lr: float = lr_field(1.5)
    momentum: float = momentum_field(0.0)
    nesterov: bool = nesterov_field(False)
    peer_norm_clip: bool = config_field(False)
    """Scale each peer's decoded values to at most the median peer norm (module docstring)."""
    aggregation: str = flag_field("allgather", flag="aggregation", choices=AGGREGATIONS)
    """"allgather" (default) sends every worker's payload to every worker (W-1 payloads
    received); "reduce-scatter" sends each bucket range's owner only that range, owners re-encode the mean
    and all-gather it (about 2 payloads received; needs tensor chunking and packed indices;
    outer/sparse_reduce_scatter.py, docs/scaling.md); "hierarchical" moves all-gather's payloads by site
    (--sparseloco-aggregation-groups): one WAN round with the counterpart in each other site, then a gather
    inside the site, bitwise the all-gather result (needs packed indices; outer/sparse_hierarchical.py)."""
    aggregation_groups: int = flag_field(0, flag="aggregation-groups", low=0, requires={"aggregation": "hierarchical"})
    """With hierarchical aggregation (required there): the number of site groups G, W/G consecutive
    workers each (W divisible by G; list the nodes site by site)."""
    owner_k: int = config_field(0, low=0)
    """Reduce-scatter owner codec: values kept per chunk (0: k)."""
    owner_value_bits: int = config_field(0, low=0)
    """Reduce-scatter owner codec: value bits (0: value_bits)."""
    owner_residual: str = config_field("owner", choices=OWNER_RESIDUALS)
    """Reduce-scatter: where the aggregate the owner does not send waits — "owner" (the owner's error
    feedback) or "workers" (back into each contributor's e, as Ok-Topk does; module docstring)."""

    model_numel: int = config_field(0, low=0)
    """N, the model's parameters, for the size term of the default outer lr (``resolve_for_model``; the
    Megatron integration sets it from the built model); 0: unknown, the 3.26 M model's scale."""

    default_rules: ClassVar[Mapping[str, Tuple[str, str]]] = {
        "lr": ("s(N)/√(W·k/C) with W·k/C held in [1/32, 1/4] and s = "
               + " / ".join(f"{sc:g}" for _, sc in DEFAULT_LR_SCALES) + " at N = "
               + " / ".join(f"{n / 1e6:.3g}" for n, _ in DEFAULT_LR_SCALES)
               + " M parameters (log-interpolated, the end values held outside), the best outer lr measured at "
               "each size (docs/integration.md)",
               ", ".join(f"{default_outer_lr(W, 64, 4096):g} at W = {W}" for W in (2, 4, 8))
               + " (k = 64 of 4096, a 3.26 M model; lower on larger models); 1.5 with reduce 'all' or an outer "
               "momentum")}

    def check_workers(self, num_workers: int) -> None:
        if self.aggregation == "hierarchical" and num_workers % self.aggregation_groups:
            nearest = max(d for d in range(1, self.aggregation_groups + 1) if num_workers % d == 0)
            raise ConfigError(f"{self.aggregation_groups} site groups do not divide the {num_workers} workers "
                              "into equal groups", "aggregation_groups",
                              f"give a divisor of {num_workers} (e.g. {nearest}), or change the number of workers")

    def resolve_for_workers(self, num_workers: int, given: Collection[str]) -> Tuple[str, ...]:
        """Unless ``lr`` was given: the W- and k-dependent default (contributors mean, no momentum only)."""
        if "lr" not in given and self.momentum == 0.0 and self.reduce == "contributors":
            self.lr = default_outer_lr(num_workers, self.k, self.chunk, self.model_numel)
            self.rule_fields = ("lr",)
            return self.rule_fields
        return ()

    def resolve_for_model(self, num_workers: int, numel: int) -> Tuple[str, ...]:
        """Once the model is built: N = ``numel`` for the size term; the rule's lr again when it came from it."""
        self.model_numel = int(numel)
        if "lr" in self.rule_fields:
            self.lr = default_outer_lr(num_workers, self.k, self.chunk, self.model_numel)
            return ("lr",)
        return ()

    def outer_lr(self, contributors: int) -> float:
        """The outer lr of a round with ``contributors`` workers: the rule's value there when ``lr`` came
        from the rule, else ``lr`` (with every worker contributing, both are ``lr``)."""
        return (default_outer_lr(contributors, self.k, self.chunk, self.model_numel) if "lr" in self.rule_fields
                else self.lr)

    def codec(self) -> CodecConfig:
        """The flat codec (flat chunking), or the base the per-tensor segments derive theirs from."""
        return CodecConfig(chunk=self.chunk, k=self.k, value_bits=self.value_bits, index_coding=self.index_coding,
                           chunk_mode="flat", quant_group_chunks=self.quant_group_chunks)

    def owner_codec(self) -> CodecConfig:
        """The codec owners re-encode their range's aggregate with (reduce-scatter)."""
        return CodecConfig(chunk=self.chunk, k=self.owner_k or self.k,
                           value_bits=self.owner_value_bits or self.value_bits,
                           index_coding=self.index_coding, chunk_mode="flat")

    def validate(self) -> "SparseLoCoConfig":
        super().validate()
        check_codec(self.codec(), "SparseLoCoConfig")
        check_bucket_holds_a_chunk(self)
        if self.chunking == "tensor" and self.quant_group_chunks != 0:
            raise ConfigError("quant_group_chunks applies to chunking='flat' only (tensor chunking has one "
                              "quantiser per tensor)", "quant_group_chunks",
                              "set `chunking='flat'` or `quant_group_chunks=0`")
        if self.chunking == "flat" and not self.dense_1d:
            raise ConfigError("dense_1d=False applies to chunking='tensor' only (flat chunking does not see tensors)",
                              "dense_1d", "set `chunking='tensor'`, or leave `dense_1d` unset")
        check_outer_sgd(self.lr, self.momentum, self.nesterov)
        if self.aggregation == "hierarchical":
            if self.aggregation_groups < 1:
                raise ConfigError("aggregation='hierarchical' needs the number of site groups", "aggregation_groups",
                                  "give `aggregation_groups=G` (W/G consecutive workers per site)")
            if self.index_coding != "packed":
                raise ConfigError("aggregation='hierarchical' needs index_coding='packed' (exchanged payload sizes "
                                  "known "
                                  "up front)", "aggregation", "use `index_coding=packed`, or `aggregation=allgather`")
        if self.aggregation == "reduce-scatter":
            self._check_reduce_scatter()
        elif self.owner_k or self.owner_value_bits or self.owner_residual != "owner":
            bad = "owner_k" if self.owner_k else "owner_value_bits" if self.owner_value_bits else "owner_residual"
            raise ConfigError("owner_k / owner_value_bits / owner_residual apply to aggregation='reduce-scatter' only",
                              bad, "set `aggregation='reduce-scatter'`")
        return self

    def _check_reduce_scatter(self) -> None:
        for bad, why, fix in ((self.chunking != "tensor", "chunking='tensor' (per-tensor segments)",
                               "`chunking=tensor`"),
                              (self.index_coding != "packed", "index_coding='packed' (piece sizes known up front)",
                               "`index_coding=packed`"),
                              (self.peer_norm_clip, "peer_norm_clip=False", "`peer_norm_clip=False`")):
            if bad:
                raise ConfigError(f"aggregation='reduce-scatter' needs {why}", "aggregation",
                                  f"use {fix}, or `aggregation=allgather`")
        try:
            self.owner_codec().validate()
        except CodecConfigError as exc:
            raise ConfigError(f"SparseLoCoConfig owner codec (owner_k, owner_value_bits): {exc}", "owner_k") from exc

    @property
    def effective_bucket_numel(self) -> int:
        """Flat chunking: ``bucket_numel`` rounded down to a whole number of chunks (at least one chunk)."""
        return max(self.chunk, self.bucket_numel - self.bucket_numel % self.chunk)


@dataclass
class _RoundTotals:
    """What one outer step adds up over its buckets, for ``OuterStepStats`` (norms as fp64 tensors:
    no host sync per bucket)."""

    delta_sq: torch.Tensor
    error_sq: torch.Tensor
    upd_sq: torch.Tensor
    kept_local: int = 0
    kept_union: Union[int, torch.Tensor] = 0
    payload_bytes: int = 0
    applied: int = 0
    clip_min: float = 1.0

    @classmethod
    def zeros(cls, device) -> "_RoundTotals":
        def zero() -> torch.Tensor:
            return torch.zeros((), dtype=torch.float64, device=device)
        return cls(delta_sq=zero(), error_sq=zero(), upd_sq=zero())

    def into(self, stats: OuterStepStats, cfg: "SparseLoCoConfig", numel: int, reduce_scatter: bool,
             lr: float) -> None:
        stats.delta_norm = float(self.delta_sq.sqrt().item())
        stats.error_norm = float(self.error_sq.sqrt().item())
        stats.update_norm = lr * float(self.upd_sq.sqrt().item())
        stats.extra.update({
            "density": self.kept_local / numel,              # share of this rank's elements it sent
            "aggregate_density": int(self.kept_union) / numel,    # chosen by at least one worker (rs: of owned ranges)
            "payload_bytes": float(self.payload_bytes),      # this rank's encoded bytes (all buckets)
            "bits_per_param": 8.0 * self.payload_bytes / numel,
        })
        if cfg.peer_norm_clip:
            stats.extra["peer_clip_scale_min"] = self.clip_min
        if reduce_scatter:
            stats.extra["update_density"] = self.applied / numel  # elements the owners' re-encoding sent


_CODEC_PATH_SHOWN = False


def _announce_codec_path() -> None:
    """After the first round, once per process on global rank 0: which codec path each segment kind
    and the decode took (``triton``, or the reason for the torch path; ``compress.fast_segments``)."""
    global _CODEC_PATH_SHOWN
    if _CODEC_PATH_SHOWN:
        return
    _CODEC_PATH_SHOWN = True
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    paths = dict(fast_segments_dispatch)
    if paths:
        print(" sparseloco | codec path: " + "; ".join(f"{k}: {v}" for k, v in sorted(paths.items())), flush=True)


class SparseLoCoPlan(RoundPlan):
    """The SparseLoCo round (module docstring), per bucket: compress (Δ, e ← βe + Δ, payload,
    e ← e − decode(payload)), exchange (``SparseLoCo._exchange_bucket``), apply (decode, mean, outer
    SGD). Memory: one compress buffer and one apply buffer of the largest bucket, the buckets'
    payloads and this rank's decoded (index, value) lists while they wait for their apply; with
    reduce-scatter the owners' output per bucket in flight (``depth``). Cancel restores the error
    feedback from a copy made at the start of a held round (and, with ``snapshot``, the owners'
    error feedback, which the reduce-scatter exchange updates)."""

    def __init__(self, strategy: "SparseLoCo", stats: OuterStepStats, held: bool, snapshot: bool):
        plans = list(strategy._bucket_plans())
        super().__init__(strategy, stats, [(s, e) for s, e, _ in plans], held)
        self.sl, self.plans = strategy, [p for _, _, p in plans]
        largest = max(e - s for s, e in self.ranges)
        dev = strategy.device
        self.scratch = torch.empty(largest, dtype=torch.float32, device=dev)       # Δ of the bucket compressed
        #: the mean of the bucket validated: one buffer (pipelined: each bucket is applied right after), or
        #: one per bucket (held: every bucket is validated before the first is applied)
        self.means = self.buffers() if held else None
        self.work = None if held else torch.empty(largest, dtype=torch.float32, device=dev)
        self.counts = torch.empty(largest, dtype=strategy.count_dtype, device=dev)
        #: no validated mean held a NaN / Inf (a device flag, read by ``aggregate_finite``)
        self.finite = torch.ones((), dtype=torch.bool, device=dev)
        rs = strategy.reduce_scatter is not None
        self.rs_out: Optional[BucketBuffers] = self.buffers() if rs else None
        self.rs_counts: Optional[BucketBuffers] = self.buffers(strategy.count_dtype) if rs else None
        self.tot = _RoundTotals.zeros(dev)
        #: the codec's checks of this round (inputs finite, payloads well formed), read once in ``finish``
        self.checks = DeferredChecks()
        self.sent: Dict[int, Tuple[torch.Tensor, Optional[Decoded]]] = {}
        self.error_before = strategy.error_feedback.clone() if held else None
        contributors = strategy.comm.contributors
        self.contributes = strategy.comm.contributes
        if len(contributors) != strategy.world_size and (rs or strategy.site_groups is not None):
            raise ConfigError("reduce-scatter and hierarchical aggregation need every worker to contribute to every "
                              "round", "aggregation", "use `aggregation=allgather`")
        strategy.round_workers = len(contributors)
        strategy.round_lr = strategy.config.outer_lr(len(contributors))
        stats.extra["outer_lr"] = strategy.round_lr
        owner = strategy.owner_error_feedback
        self.owner_before = owner.clone() if snapshot and owner is not None else None

    def compress(self, b: int) -> None:
        (s, e), plan = self.ranges[b], self.plans[b]
        if not self.contributes:   # in the collectives, left out of the mean: a payload nobody decodes
            n = bucket_payload_nbytes(plan) if plan is not None else payload_nbytes(e - s, self.sl.codec)
            self.sent[b] = (torch.zeros(n, dtype=torch.uint8, device=self.sl.device), None)
            return
        with self.checks.active():
            self.sent[b] = self.sl._compress_bucket(s, e, plan, self.scratch[:e - s], self.tot)

    def start_exchange(self, b: int) -> Pending:
        (s, e), plan = self.ranges[b], self.plans[b]
        rs_out = None if self.rs_out is None else self.rs_out[b]
        rs_counts = None if self.rs_counts is None else self.rs_counts[b]
        return self.sl._exchange_bucket(b, s, e, plan, self.sent[b][0], rs_out, rs_counts)

    def validate(self, b: int, received: Any) -> Tuple[Any, torch.Tensor]:
        """Decode and average bucket b (θ_outer untouched): (what was received, the mean)."""
        (s, e), plan = self.ranges[b], self.plans[b]
        n = e - s
        local = self.sent[b][1]
        rs_out = None if self.rs_out is None else self.rs_out[b]
        work = self.means[b] if self.means is not None else self.work[:n]   # type: ignore[index]
        with self.checks.active():
            mean = self.sl._validate_bucket(s, e, plan, received, local, rs_out, work, self.counts[:n], self.tot,
                                            self.checks)
        if self.held:
            self.finite &= torch.isfinite(mean).all()
        return received, mean

    def check_validated(self) -> None:
        self.checks.raise_first()

    def aggregate_finite(self) -> bool:
        return bool(self.finite.item())

    def apply(self, b: int, received: Any) -> None:
        s, e = self.ranges[b]
        got, mean = received
        _, local = self.sent.pop(b)
        with self.checks.active():
            self.sl._update_bucket(s, e, got, local, mean, self.tot)
        staged, self.sl._staged = self.sl._staged, None
        if staged is not None:
            self.staged[b] = staged

    def finish(self) -> None:
        self.checks.raise_first()
        _announce_codec_path()
        self.tot.into(self.stats, self.sl.config, self.sl.params.numel, self.sl.reduce_scatter is not None,
                      self.sl.round_lr)
        self.sl._owner_time_into(self.stats)
        if self.sl.site_groups is not None:
            self.stats.extra.update(self.sl.site_groups.take_wan_bytes())

    def cancel(self) -> None:
        """The round never happened: e (and the owners' e) as before it."""
        if self.error_before is None:
            raise RuntimeError("SparseLoCo: only a held round can be cancelled (its error feedback was not copied)")
        self.sl.error_feedback.copy_(self.error_before)
        owner = self.sl.owner_error_feedback
        if self.owner_before is not None and owner is not None:
            owner.copy_(self.owner_before)


@register_outer_strategy("sparseloco")
class SparseLoCo(OuterStrategy[SparseLoCoConfig]):
    """Error-feedback Top-k compression, all-gather of packed payloads, sparse mean, outer SGD."""

    name = "sparseloco"
    config_class = SparseLoCoConfig

    def __init__(self, params: Sequence[torch.Tensor], group: OuterGroup,
                 config: Optional[SparseLoCoConfig] = None, names: Optional[Sequence[str]] = None,
                 slices=None):
        super().__init__(params, group, config if config is not None else SparseLoCoConfig(), names, slices)
        cfg = self.config
        #: the running round's contributors and outer lr (``SparseLoCoPlan``)
        self.round_workers, self.round_lr = self.world_size, cfg.lr
        #: θ_outer of the bucket ``_outer_update`` just updated, on the params' device (for its write-back)
        self._staged: Optional[torch.Tensor] = None
        self.codec = cfg.codec()
        #: tensor chunking: the buckets and their segments (None in flat chunking)
        self.plans: Optional[List[BucketPlan]] = None
        if cfg.chunking == "tensor":
            self.plans = plan_buckets(self.slices, self.codec, cfg.bucket_numel, cfg.dense_1d, self.names)
        self.error_feedback = torch.zeros(self.params.numel, dtype=torch.float32, device=self.device)
        self.momentum: Optional[torch.Tensor] = None
        if cfg.momentum != 0.0:
            self.momentum = torch.zeros(self.params.numel, dtype=torch.float32, device=self.device)
        self.reduce_scatter: Optional[SparseReduceScatter] = None
        if cfg.aggregation == "reduce-scatter":
            assert self.plans is not None, "reduce-scatter needs tensor chunking (checked by the config)"
            self.reduce_scatter = SparseReduceScatter(self.plans, cfg.owner_codec(), self.world_size, self.rank,
                                                      self.params.numel, self.device)
        self.site_groups: Optional[SiteGroups] = None
        if cfg.aggregation == "hierarchical":
            try:
                self.site_groups = SiteGroups(self.world_size, self.rank, cfg.aggregation_groups)
            except ValueError as exc:
                raise ConfigError(str(exc), "aggregation_groups",
                                  f"give a divisor of the {self.world_size} workers") from None
        self.check_group_layout()

    @property
    def count_dtype(self) -> torch.dtype:
        """The contributor counts' dtype: uint8 up to 255 workers."""
        return torch.uint8 if self.world_size <= 255 else torch.int32

    def buckets(self) -> Iterator[Tuple[int, int]]:
        if self.plans is not None:
            for plan in self.plans:
                yield plan.start, plan.end
            return
        n, b = self.params.numel, self.config.effective_bucket_numel
        for s in range(0, n, b):
            yield s, min(n, s + b)

    def _bucket_plans(self) -> Iterator[Tuple[int, int, Optional[BucketPlan]]]:
        if self.plans is not None:
            for plan in self.plans:
                yield plan.start, plan.end, plan
        else:
            for s, e in self.buckets():
                yield s, e, None

    #: the error feedback of one chunking is not the other's (other chunks, other quantisers); the
    #: reduce-scatter owners keep an error feedback of their own that all-gather has no place for
    checkpoint_fact_flags = {"chunking": "--sparseloco-chunking", "aggregation": "--sparseloco-aggregation"}

    def checkpoint_facts(self) -> Dict[str, object]:
        return {"chunking": self.config.chunking, "aggregation": self.config.aggregation}

    #: e (this worker's error feedback), the outer momentum (None when μ = 0) and, with
    #: reduce-scatter aggregation, the owner's error feedback on the ranges it owns (else None)
    elementwise_buffers = ("error_feedback", "momentum", "owner_error_feedback")
    heal_excluded_buffers = ("error_feedback", "owner_error_feedback")

    @property
    def owner_error_feedback(self) -> Optional[torch.Tensor]:
        return None if self.reduce_scatter is None else self.reduce_scatter.error

    def _bucket_name(self, s: int, e: int) -> str:
        first, last = self.params.name_of(s, self.names), self.params.name_of(e - 1, self.names)
        span = first if first == last else f"{first}..{last}"
        return f"{self.name} bucket [{s}:{e}) ({span})"

    def expected_payload_bytes(self) -> Optional[int]:
        """Exact for packed indices; for entropy coding the upper bound (payloads are padded to it at most)."""
        if self.reduce_scatter is not None:
            return self.reduce_scatter.expected_sent_bytes()
        if self.plans is not None:
            sizes = [bucket_payload_nbytes(p) for p in self.plans]
        else:
            sizes = [payload_nbytes(e - s, self.codec) for s, e in self.buckets()]
        if self.site_groups is not None:   # packed: every worker's payload of a bucket has its size
            return sum(self.site_groups.sent_nbytes(n) for n in sizes)
        return sum(sizes)

    # ------------------------------------------------------------------ the three phases
    def _compress(self, s: int, e: int, plan: Optional[BucketPlan],
                  delta: torch.Tensor) -> Tuple[torch.Tensor, Decoded]:
        """Δ into ``delta``, e ← βe + Δ, encode e, e ← e − decode(sent). Returns (payload, what was sent)."""
        cfg = self.config
        err, name = self.error_feedback[s:e], self._bucket_name(s, e)
        if plan is None:
            payload, local = error_feedback_step(err, delta, cfg.ef_beta, self.codec, name)
            expected = payload_nbytes(e - s, self.codec)
        else:
            payload, local = error_feedback_step_bucket_fast(err, delta, cfg.ef_beta, plan, name)
            expected = bucket_payload_nbytes(plan)
        if cfg.index_coding == "packed" and payload.numel() != expected:
            raise RuntimeError(f"{name}: codec produced {payload.numel()} bytes, the size formula promises {expected}")
        return payload, local

    def _aggregate(self, s: int, e: int, plan: Optional[BucketPlan], payloads: Sequence[torch.Tensor],
                   local: Optional[Decoded], agg: torch.Tensor, counts: torch.Tensor, skip: Optional[int],
                   checks: Optional[DeferredChecks] = None) -> Tuple[Union[int, torch.Tensor], float]:
        """Decode the contributors' payloads, sparse sum, then the mean into ``agg`` (θ_outer untouched).

        ``skip``: the position of this rank's own payload among them (decoded by its EF step already:
        ``local``), None when this rank does not contribute. ``checks``: the round's deferred payload
        checks; a bucket whose payloads fail one gets a zero mean (the round raises before or at its end).
        Returns (elements chosen by at least one worker, smallest peer-clip scale).
        """
        cfg = self.config
        agg.zero_()
        counts.zero_()
        clip_min, scales = 1.0, None
        mark = checks.mark() if checks is not None else 0
        if plan is not None and not cfg.peer_norm_clip:  # fused decode + scatter-add (Triton where it applies)
            try:
                with prefixed(self._bucket_name(s, e)):
                    decode_scatter_add_bucket_fast(payloads, plan, agg, counts, skip=skip, skip_decoded=local)
            except ValueError as exc:
                raise type(exc)(f"{self._bucket_name(s, e)}: {exc}") from exc
            self._drop_if_bad(agg, counts, checks, mark)
            return self._mean_(agg, counts), clip_min
        # our own payload was decoded by the EF step already (decode is deterministic)
        decoded: Iterable[Decoded] = (local if w == skip and local is not None else self._decode(p, plan, w, s, e)
                                      for w, p in enumerate(payloads))
        if cfg.peer_norm_clip:
            decoded = list(decoded)
            norms = torch.stack([torch.linalg.vector_norm(d.values) for d in decoded])
            scales = torch.clamp(norms.median() / norms.clamp_min(torch.finfo(torch.float32).tiny), max=1.0)
            clip_min = float(scales.min().item())
        for w, d in enumerate(decoded):
            values = d.values if scales is None else d.values * scales[w]
            agg.index_add_(0, d.indices, values)
            counts.index_add_(0, d.indices, torch.ones_like(d.indices, dtype=self.count_dtype))
        self._drop_if_bad(agg, counts, checks, mark)
        return self._mean_(agg, counts), clip_min

    @staticmethod
    def _drop_if_bad(agg: torch.Tensor, counts: torch.Tensor, checks: Optional[DeferredChecks], mark: int) -> None:
        """A bucket whose deferred checks failed contributes nothing (on the device: no host read)."""
        bad = checks.bad_since(mark) if checks is not None else None
        if bad is not None:
            agg.masked_fill_(bad, 0.0)
            counts.masked_fill_(bad, 0)

    def _mean_(self, agg: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The sparse sum ``agg`` into the mean in place (over the contributors that sent each element, or
        over all); returns the elements chosen by some worker (a 0-dim tensor: no host sync)."""
        kept_union = torch.count_nonzero(counts)
        if self.config.reduce == "contributors":
            agg.div_(counts.clamp_min(1))
        elif self.round_workers > 1:
            agg.div_(self.round_workers)
        return kept_union

    def _outer_update(self, s: int, e: int, agg: torch.Tensor) -> torch.Tensor:
        """Outer SGD on θ_outer's bucket [s, e) with the mean ``agg``; returns the update u."""
        cfg, lr = self.config, self.round_lr
        mom = None if self.momentum is None else self.momentum[s:e]
        anchor = self.anchor_bucket(s, e)
        update = outer_sgd_(anchor, agg, mom, lr, cfg.momentum, cfg.nesterov)
        self.store_anchor_bucket(s, e, anchor)
        self._staged = anchor
        return update

    # The round (``SparseLoCoPlan``) runs each bucket through four phases: ``_compress_bucket``
    # (Δ, EF, encode), the exchange (``_exchange_bucket``: all-gather, or reduce-scatter to owners with
    # their re-encoding, or the hierarchical relay), ``_validate_bucket`` (decode, mean) and
    # ``_update_bucket`` (outer SGD).
    # ``_RoundTotals`` adds up what the stats report.

    def _compress_bucket(self, s: int, e: int, plan: Optional[BucketPlan], work: torch.Tensor,
                         tot: "_RoundTotals") -> Tuple[torch.Tensor, Decoded]:
        delta = self.pseudo_gradient(s, e, out=work)
        tot.delta_sq += torch.linalg.vector_norm(delta, dtype=torch.float64).square()
        payload, local = self._compress(s, e, plan, delta)
        tot.error_sq += torch.linalg.vector_norm(self.error_feedback[s:e], dtype=torch.float64).square()
        tot.kept_local += int(local.indices.numel())
        tot.payload_bytes += int(payload.numel())
        return payload, local

    def _exchange_bucket(self, b: int, s: int, e: int, plan: Optional[BucketPlan], payload: torch.Tensor,
                         rs_out: Optional[torch.Tensor], rs_counts: Optional[torch.Tensor]) -> Pending:
        """All-gather: every worker's payload (asynchronous where the payload sizes are fixed).
        Reduce-scatter: (union, applied, positions), the bucket's update written into ``rs_out``
        (``rs_counts`` is the owners' scratch). Hierarchical: every worker's payload. The last two
        are several dependent exchanges with the owners' / relays' compute between them: they run
        at once (a completed ``Pending``)."""
        cfg = self.config
        if self.site_groups is not None:
            return Pending.completed(self.site_groups.all_gather(payload, self.comm))
        if self.reduce_scatter is None:
            return self.comm.start_all_gather_payloads(payload, equal_sizes=cfg.index_coding == "packed")
        assert plan is not None and rs_out is not None and rs_counts is not None
        return Pending.completed(self.reduce_scatter.aggregate(b, plan, payload, self.comm, rs_out, rs_counts,
                                                               cfg.reduce, self._bucket_name(s, e),
                                                               cfg.owner_residual))

    def _validate_bucket(self, s: int, e: int, plan: Optional[BucketPlan], got, local: Optional[Decoded],
                         rs_out: Optional[torch.Tensor], work: torch.Tensor, counts: torch.Tensor,
                         tot: "_RoundTotals", checks: Optional[DeferredChecks] = None) -> torch.Tensor:
        """The bucket's mean, θ_outer untouched. Reduce-scatter: the owners' update, already in ``rs_out``.
        All-gather: decode ``got`` (every worker's payload; the round's contributors' are kept), mean into
        ``work``. Returns the mean."""
        if self.reduce_scatter is not None:
            assert rs_out is not None
            union, applied, _ = got
            tot.applied += applied
            mean = rs_out
        else:
            contributors = self.comm.contributors
            skip = contributors.index(self.rank) if self.rank in contributors else None
            payloads = got if len(contributors) == len(got) else [got[w] for w in contributors]
            union, clip = self._aggregate(s, e, plan, payloads, local, work, counts, skip, checks)
            tot.clip_min = min(tot.clip_min, clip)
            mean = work
        tot.kept_union += union
        return mean

    def _update_bucket(self, s: int, e: int, got, local: Optional[Decoded], mean: torch.Tensor,
                       tot: "_RoundTotals") -> None:
        """Outer SGD on the bucket with its validated ``mean`` (reduce-scatter, ``owner_residual="workers"``:
        first what the owners did not send goes back into this worker's error feedback)."""
        if self.reduce_scatter is not None and self.config.owner_residual == "workers":
            assert local is not None, "reduce-scatter runs with every worker contributing"
            self._put_back(s, e, local, got[2])
        update = self._outer_update(s, e, mean)
        tot.upd_sq += torch.linalg.vector_norm(update, dtype=torch.float64).square()

    def _owner_time_into(self, stats: OuterStepStats) -> None:
        """Reduce-scatter: the part of ``time_communicate_s`` that is the owners' compute (pieces,
        decode, mean, re-encoding; all-gather decodes in ``time_apply_s`` instead), as
        ``time_owner_s``: communicate − owner = the two collectives, waits included."""
        if self.reduce_scatter is not None:
            stats.extra["time_owner_s"] = self.reduce_scatter.take_owner_seconds()

    def _put_back(self, s: int, e: int, local: Decoded, positions: torch.Tensor) -> None:
        """Reduce-scatter, ``owner_residual="workers"``: what this worker sent at a position the owners
        did not send goes back into its error feedback, e[i] ← e[i] + v[i] (the EF step removed it)."""
        applied = torch.zeros(e - s, dtype=torch.bool, device=self.device)
        applied[positions] = True
        back = ~applied[local.indices]
        err = self.error_feedback[s:e]
        idx = local.indices[back]
        err.index_put_((idx,), err[idx] + local.values[back])

    # ------------------------------------------------------------------ the round
    #: (ignores_non_contributors: the all-gather; reduce-scatter and hierarchical aggregation need every
    #: worker to contribute and are refused in elastic mode, where that matters)
    capabilities = Capabilities(has_error_feedback=True, supports_overlap=True, supports_anchor_on_cpu=True,
                                ignores_non_contributors=True)

    def begin_round(self, stats: OuterStepStats, nonfinite_tensor: Optional[str], held: bool,
                    snapshot: bool = False) -> RoundPlan:
        return SparseLoCoPlan(self, stats, held, snapshot)

    def _decode(self, payload: torch.Tensor, plan: Optional[BucketPlan], worker: int, s: int, e: int) -> Decoded:
        if plan is not None:
            try:
                return decode_bucket(payload, plan, device=self.device)
            except ValueError as exc:
                raise type(exc)(f"{self._bucket_name(s, e)}: payload of worker {worker}: {exc}") from exc
        d = decode(payload, device=self.device)
        if d.numel != e - s:
            raise RuntimeError(f"{self._bucket_name(s, e)}: worker {worker} sent a payload for {d.numel} elements, "
                               f"expected {e - s}; the outer group's shards do not line up")
        return d
