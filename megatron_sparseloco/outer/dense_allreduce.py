"""The dense all-reduce outer step shared by model averaging and DiLoCo, bucket by bucket.

    Δ_r = θ_outer − θ_r                              (fp32)
    Δ̄   = (1/W)·Σ_r Δ_r                              all-reduce SUM in ``comm_dtype`` (fp32 or bf16), ÷W in fp32
    θ_outer ← θ_outer − lr·u(Δ̄)                      outer SGD (``outer/sgd.py``); θ_r ← θ_outer

Model averaging is lr = 1 without momentum (θ_outer − Δ̄ = mean_r θ_r); DiLoCo passes its SGD
settings and momentum buffer. ``DenseAllReduceStrategy`` is the strategy shape both share (wire
format, payload size, blocking and delayed-application steps); they differ only in
``sgd_settings`` and in what they log after the update. Bytes per step and rank:
4·numel (fp32) or 2·numel (bf16) sent and received, plus the 4-byte non-finite flag.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import all_reduce_
from megatron_sparseloco.outer.base import OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.config_fields import flag_field
from megatron_sparseloco.outer.sgd import outer_sgd_

#: wire formats of the dense all-reduce: name → torch dtype
COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def comm_dtype_field():
    """The dense all-reduce's wire format (``--sparseloco-diloco-comm-dtype``), shared by average and DiLoCo."""
    return flag_field("fp32", flag="diloco-comm-dtype", choices=tuple(COMM_DTYPES),
                      help="DiLoCo / average: dtype of the pseudo-gradient all-reduce.")


def _delta_on_wire(strategy: OuterStrategy, s: int, e: int, work: torch.Tensor, comm_dtype: str,
                   delta_sq: torch.Tensor) -> torch.Tensor:
    """Δ[s:e] into ``work`` (fp32), ‖Δ‖² added to ``delta_sq``; returns what goes on the wire
    (``work`` itself for fp32, a ``comm_dtype`` copy otherwise)."""
    strategy.pseudo_gradient(s, e, out=work)
    delta_sq += torch.linalg.vector_norm(work, dtype=torch.float64).square()
    return work if COMM_DTYPES[comm_dtype] == torch.float32 else work.to(COMM_DTYPES[comm_dtype])


def _mean_from_wire(strategy: OuterStrategy, work: torch.Tensor, wire: torch.Tensor) -> torch.Tensor:
    """``work`` ← the summed ``wire`` in fp32, ÷W: Δ̄ of one bucket."""
    if wire.dtype != work.dtype:  # a bf16 wire copy (an fp32 wire is ``work`` itself)
        work.copy_(wire)
    if strategy.world_size > 1:
        work.div_(strategy.world_size)
    return work


def mean_pseudo_gradient_(strategy: OuterStrategy, start: int, end: int, work: torch.Tensor,
                          comm_dtype: str, stats: OuterStepStats, delta_sq: torch.Tensor) -> torch.Tensor:
    """Fill ``work`` (length end − start) with Δ̄ = (1/W)·Σ_r Δ_r for one bucket.

    Δ is computed in fp32, cast to ``comm_dtype`` for the all-reduce (SUM; gloo and NCCL have no
    portable AVG), cast back to fp32 and divided by W. ``delta_sq`` accumulates ‖Δ_local‖².
    Timings: Δ and the cast count as compress, the all-reduce as communicate.
    """
    with strategy._timer(stats, "time_compress_s"):
        wire = _delta_on_wire(strategy, start, end, work, comm_dtype, delta_sq)
    with strategy._timer(stats, "time_communicate_s"):
        all_reduce_(wire, strategy.group, strategy.counter, op=dist.ReduceOp.SUM)
    with strategy._timer(stats, "time_apply_s"):
        return _mean_from_wire(strategy, work, wire)


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
            anchor = strategy.anchor_bucket(s, e)
            update = outer_sgd_(anchor, mean_delta, mom, lr, momentum, nesterov)
            strategy.store_anchor_bucket(s, e, anchor)
            upd_sq += torch.linalg.vector_norm(update, dtype=torch.float64).square()
            strategy.write_back(s, e, anchor)
            del anchor, update   # a staged bucket of θ_outer (anchor_on_cpu) is freed before the next one
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
    wires: List[torch.Tensor] = []
    with strategy._timer(stats, "time_compress_s"):
        for s, e in strategy.buckets():
            wires.append(_delta_on_wire(strategy, s, e, work[s:e], comm_dtype, delta_sq))

    def communicate() -> None:
        for wire in wires:
            all_reduce_(wire, strategy.group, strategy.counter, op=dist.ReduceOp.SUM)

    def finish() -> None:
        upd_sq = torch.zeros((), dtype=torch.float64, device=strategy.device)
        with strategy._timer(stats, "time_apply_s"):
            for (s, e), wire in zip(strategy.buckets(), wires):
                mean_delta = _mean_from_wire(strategy, work[s:e], wire)
                mom = None if momentum_buf is None else momentum_buf[s:e]
                anchor = strategy.anchor_bucket(s, e)
                update = outer_sgd_(anchor, mean_delta, mom, lr, momentum, nesterov)
                strategy.store_anchor_bucket(s, e, anchor)
                upd_sq += torch.linalg.vector_norm(update, dtype=torch.float64).square()
                del anchor, update
        stats.delta_norm = float(delta_sq.sqrt().item())
        stats.update_norm = lr * float(upd_sq.sqrt().item())

    return communicate, finish


class DenseAllReduceStrategy(OuterStrategy):
    """A strategy whose outer step is ``dense_outer_step_``: subclasses give ``sgd_settings`` and may
    keep a ``momentum`` buffer (None: no momentum); the config has a ``comm_dtype`` field."""

    supports_overlap = True
    supports_anchor_on_cpu = True
    #: outer SGD momentum buffer over ``params`` (None: the algorithm keeps none)
    momentum: Optional[torch.Tensor] = None

    def sgd_settings(self) -> Tuple[float, float, bool]:
        """(lr, momentum μ, nesterov) of the outer SGD on θ_outer."""
        raise NotImplementedError

    def after_update(self, stats: OuterStepStats) -> None:
        """Extra stats once θ_outer is updated (both the blocking and the delayed step)."""

    def expected_payload_bytes(self) -> Optional[int]:
        return self.params.numel * COMM_DTYPES[self.config.comm_dtype].itemsize

    def _outer_step(self, stats: OuterStepStats, nonfinite_tensor: Optional[str]) -> None:
        dense_outer_step_(self, stats, self.config.comm_dtype, *self.sgd_settings(), self.momentum)
        self.after_update(stats)

    def _launch_round(self, stats: OuterStepStats) -> Tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        communicate, finish_dense = dense_launch_(self, stats, self.config.comm_dtype, *self.sgd_settings(),
                                                  self.momentum)

        def finish() -> None:
            finish_dense()
            self.after_update(stats)

        def cancel() -> None:
            """Nothing to undo: the launch wrote only its own buffers (momentum moves in ``finish``)."""

        return communicate, finish, cancel
