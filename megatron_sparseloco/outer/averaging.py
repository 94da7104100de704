"""Model averaging: θ ← mean over workers of θ_local.

Computed through the pseudo-gradient, bucket by bucket:

    Δ_r = θ_outer − θ_r ;   Δ̄ = (1/W)·Σ_r Δ_r   (one all-reduce SUM, then ÷W) ;   θ_outer ← θ_outer − Δ̄

which equals mean_r θ_r mathematically (θ_outer − (1/W)Σ(θ_outer − θ_r) = (1/W)Σ θ_r) and differs
from all-reducing θ itself only by fp32 rounding. We pick the Δ form because (a) it is exactly
DiLoCo with lr = 1 and no momentum, so both run ``dense_outer_step_`` (shared bucket loop), and (b)
Δ is small compared with θ, so a bf16 wire format (``comm_dtype="bf16"``) loses far less than
sending θ in bf16 would. No state besides the anchor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import all_reduce_
from megatron_sparseloco.outer.base import OuterConfig, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.config_fields import flag_field
from megatron_sparseloco.outer.registry import register_outer_strategy
from megatron_sparseloco.outer.sgd import outer_sgd_

#: wire formats of the dense all-reduce: name → torch dtype
COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def comm_dtype_field():
    """The dense all-reduce's wire format (``--sparseloco-diloco-comm-dtype``), shared by average and DiLoCo."""
    return flag_field("fp32", flag="diloco-comm-dtype", choices=tuple(COMM_DTYPES),
                      help="DiLoCo / average: dtype of the pseudo-gradient all-reduce.")


def mean_pseudo_gradient_(strategy: OuterStrategy, start: int, end: int, work: torch.Tensor,
                          comm_dtype: str, stats: OuterStepStats, delta_sq: torch.Tensor) -> torch.Tensor:
    """Fill ``work`` (length end − start) with Δ̄ = (1/W)·Σ_r Δ_r for one bucket.

    Δ is computed in fp32, cast to ``comm_dtype`` for the all-reduce (SUM; gloo and NCCL have no
    portable AVG), cast back to fp32 and divided by W. ``delta_sq`` accumulates ‖Δ_local‖².
    Timings: Δ and the cast count as compress, the all-reduce as communicate.
    """
    with strategy._timer(stats, "time_compress_s"):
        strategy.pseudo_gradient(start, end, out=work)
        delta_sq += torch.linalg.vector_norm(work, dtype=torch.float64).square()
        wire = work if COMM_DTYPES[comm_dtype] == torch.float32 else work.to(COMM_DTYPES[comm_dtype])
    with strategy._timer(stats, "time_communicate_s"):
        all_reduce_(wire, strategy.group, strategy.counter, op=dist.ReduceOp.SUM)
    with strategy._timer(stats, "time_apply_s"):
        if wire is not work:
            work.copy_(wire)
        if strategy.world_size > 1:
            work.div_(strategy.world_size)
    return work


def dense_outer_step_(strategy: OuterStrategy, stats: OuterStepStats, comm_dtype: str, lr: float = 1.0,
                      momentum: float = 0.0, nesterov: bool = False,
                      momentum_buf: Optional[torch.Tensor] = None) -> None:
    """All buckets: Δ̄ by all-reduce (``mean_pseudo_gradient_``), outer SGD on θ_outer, write back.

    lr = 1 without momentum is model averaging (θ_outer ← θ_outer − Δ̄); DiLoCo passes its SGD
    settings. Sets ``stats.delta_norm`` (‖Δ_local‖) and ``stats.update_norm`` (lr·‖u‖).
    """
    bucket = strategy.config.bucket_numel
    work = torch.empty(min(bucket, strategy.params.numel), dtype=torch.float32, device=strategy.device)
    delta_sq = torch.zeros((), dtype=torch.float64, device=strategy.device)
    upd_sq = torch.zeros((), dtype=torch.float64, device=strategy.device)
    for s, e in strategy.buckets():
        mean_delta = mean_pseudo_gradient_(strategy, s, e, work[: e - s], comm_dtype, stats, delta_sq)
        with strategy._timer(stats, "time_apply_s"):
            mom = None if momentum_buf is None else momentum_buf[s:e]
            update = outer_sgd_(strategy.anchor[s:e], mean_delta, mom, lr, momentum, nesterov)
            upd_sq += torch.linalg.vector_norm(update, dtype=torch.float64).square()
            strategy.write_back(s, e)
    stats.delta_norm = float(delta_sq.sqrt().item())
    stats.update_norm = lr * float(upd_sq.sqrt().item())


def dense_launch_(strategy: OuterStrategy, stats: OuterStepStats, comm_dtype: str, lr: float = 1.0,
                  momentum: float = 0.0, nesterov: bool = False, momentum_buf: Optional[torch.Tensor] = None):
    """``dense_outer_step_`` split for delayed application (``OuterStrategy._launch_round``).

    Launch (here): Δ of every bucket into one shard-sized fp32 buffer (and its ``comm_dtype``
    wire copy); ``communicate``: the bucket all-reduces (SUM) in bucket order; ``finish``: per
    bucket back to fp32, ÷W, outer SGD on θ_outer — the same operations on the same bucket
    ranges as the blocking step, so θ_outer comes out bitwise equal. No write-back. Extra memory
    while the collective is in flight: one shard of fp32 (plus its wire copy in bf16).
    """
    n = strategy.params.numel
    work = torch.empty(n, dtype=torch.float32, device=strategy.device)
    delta_sq = torch.zeros((), dtype=torch.float64, device=strategy.device)
    wires = []
    with strategy._timer(stats, "time_compress_s"):
        for s, e in strategy.buckets():
            strategy.pseudo_gradient(s, e, out=work[s:e])
            delta_sq += torch.linalg.vector_norm(work[s:e], dtype=torch.float64).square()
            wires.append(work[s:e] if COMM_DTYPES[comm_dtype] == torch.float32 else work[s:e].to(COMM_DTYPES[comm_dtype]))

    def communicate() -> None:
        for wire in wires:
            all_reduce_(wire, strategy.group, strategy.counter, op=dist.ReduceOp.SUM)

    def finish() -> None:
        upd_sq = torch.zeros((), dtype=torch.float64, device=strategy.device)
        with strategy._timer(stats, "time_apply_s"):
            for (s, e), wire in zip(strategy.buckets(), wires):
                mean_delta = work[s:e]
                if wire.dtype != torch.float32:
                    mean_delta.copy_(wire)
                if strategy.world_size > 1:
                    mean_delta.div_(strategy.world_size)
                mom = None if momentum_buf is None else momentum_buf[s:e]
                update = outer_sgd_(strategy.anchor[s:e], mean_delta, mom, lr, momentum, nesterov)
                upd_sq += torch.linalg.vector_norm(update, dtype=torch.float64).square()
        stats.delta_norm = float(delta_sq.sqrt().item())
        stats.update_norm = lr * float(upd_sq.sqrt().item())

    return communicate, finish


@dataclass
class AveragingConfig(OuterConfig):
    """Model averaging has no optimiser settings: it is DiLoCo's step with lr 1 and no momentum."""

    comm_dtype: str = comm_dtype_field()
    """Wire format of Δ: "fp32" (exact up to summation order) or "bf16" (half the bytes)."""

    implied_flags = {"outer-lr": 1.0, "outer-momentum": 0.0, "outer-nesterov": False}


@register_outer_strategy("average")
class ModelAveraging(OuterStrategy):
    """θ_outer ← θ_outer − mean_r Δ_r = mean_r θ_r, written back to every worker."""

    name = "average"
    config_class = AveragingConfig

    def __init__(self, params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup],
                 config: Optional[AveragingConfig] = None, names: Optional[Sequence[str]] = None, slices=None):
        super().__init__(params, group, config if config is not None else AveragingConfig(), names, slices)
        self.check_group_layout()

    def expected_payload_bytes(self) -> Optional[int]:
        return self.params.numel * COMM_DTYPES[self.config.comm_dtype].itemsize

    def _outer_step(self, stats: OuterStepStats) -> None:
        dense_outer_step_(self, stats, self.config.comm_dtype)  # lr 1, no momentum: θ_outer − Δ̄

    supports_overlap = True

    def _launch_round(self, stats: OuterStepStats):
        return dense_launch_(self, stats, self.config.comm_dtype)
