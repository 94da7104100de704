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

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, TypeVar

import torch

from megatron_sparseloco.comm.pending import Pending
from megatron_sparseloco.outer.base import OuterConfig, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.config_fields import flag_field
from megatron_sparseloco.outer.round import Capabilities, RoundPlan
from megatron_sparseloco.outer.sgd import outer_sgd_

#: wire formats of the dense all-reduce: name → torch dtype
COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def comm_dtype_field():
    """The dense all-reduce's wire format (``--sparseloco-diloco-comm-dtype``), shared by average and DiLoCo."""
    return flag_field("fp32", flag="diloco-comm-dtype", choices=tuple(COMM_DTYPES),
                      doc="Wire format of the pseudo-gradient all-reduce: fp32 (exact up to summation order) or "
                          "bf16 (half the bytes).")


@dataclass
class DenseConfig(OuterConfig):
    """Fields every dense all-reduce strategy shares."""

    comm_dtype: str = comm_dtype_field()


DenseConfigT = TypeVar("DenseConfigT", bound=DenseConfig)


class DensePlan(RoundPlan):
    """The dense round, per bucket b = [s, e):

        compress:  Δ_b = θ_outer − θ_local (fp32, into the bucket's buffer), ‖Δ‖² accumulated,
                   a ``comm_dtype`` wire copy (fp32: the buffer itself)
        exchange:  all-reduce SUM of the wire (gloo and NCCL have no portable AVG), asynchronous
        validate:  back to fp32, ÷W: Δ̄_b (into the bucket's buffer; whether it is finite is recorded)
        apply:     outer SGD θ_outer ← θ_outer − lr·u(Δ̄_b) (``outer/sgd.py``)

    W is the number of this round's contributors (``OuterComm.contributors``); a rank that takes
    part without contributing (an elastic job that just healed) sends zeros.

    Extra memory: two bucket buffers when pipelined, one shard of fp32 when held (plus the wire
    copies in bf16). Nothing to undo on cancel: compress writes only the plan's own buffers.
    """

    def __init__(self, strategy: "DenseAllReduceStrategy[Any]", stats: OuterStepStats, held: bool):
        super().__init__(strategy, stats, list(strategy.buckets()), held)
        self.dense = strategy
        self.work = self.buffers()
        self.wires: List[Optional[torch.Tensor]] = [None] * len(self.ranges)
        self.delta_sq = torch.zeros((), dtype=torch.float64, device=strategy.device)
        self.upd_sq = torch.zeros((), dtype=torch.float64, device=strategy.device)
        #: Δ̄ is the mean over this round's contributors (W over a c10d group)
        self.n_contributors = len(strategy.comm.contributors)
        self.contributes = strategy.comm.contributes
        #: no validated Δ̄ held a NaN / Inf (a device flag, read by ``aggregate_finite``)
        self.finite = torch.ones((), dtype=torch.bool, device=strategy.device)

    def compress(self, b: int) -> None:
        s, e = self.ranges[b]
        work = self.work[b]
        if self.contributes:
            self.dense.pseudo_gradient(s, e, out=work)
            self.delta_sq += torch.linalg.vector_norm(work, dtype=torch.float64).square()
        else:                # takes part in the sum with nothing (an elastic round's non-contributor)
            work.zero_()
        wire_dtype = COMM_DTYPES[self.dense.config.comm_dtype]
        self.wires[b] = work if wire_dtype == torch.float32 else work.to(wire_dtype)

    def start_exchange(self, b: int) -> Pending:
        wire = self.wires[b]
        assert wire is not None
        return self.dense.comm.start_all_reduce_(wire, op="sum")

    def validate(self, b: int, received: Any) -> torch.Tensor:
        """Δ̄_b in fp32 (the bucket's buffer); its finiteness folded into ``finite`` (no host read)."""
        work, wire = self.work[b], received
        self.wires[b] = None
        if wire.dtype != work.dtype:  # a bf16 wire copy (an fp32 wire is ``work`` itself)
            work.copy_(wire)
        if self.n_contributors > 1:
            work.div_(self.n_contributors)
        if self.held:
            self.finite &= torch.isfinite(work).all()
        return work

    def aggregate_finite(self) -> bool:
        return bool(self.finite.item())

    def apply(self, b: int, received: Any) -> None:
        s, e = self.ranges[b]
        work = received
        lr, momentum, nesterov = self.dense.sgd_settings()
        mom = None if self.dense.momentum is None else self.dense.momentum[s:e]
        anchor = self.dense.anchor_bucket(s, e)
        update = outer_sgd_(anchor, work, mom, lr, momentum, nesterov)
        self.dense.store_anchor_bucket(s, e, anchor)
        self.staged[b] = anchor
        self.upd_sq += torch.linalg.vector_norm(update, dtype=torch.float64).square()

    def finish(self) -> None:
        lr = self.dense.sgd_settings()[0]
        self.stats.delta_norm = float(self.delta_sq.sqrt().item())
        self.stats.update_norm = lr * float(self.upd_sq.sqrt().item())
        self.dense.after_update(self.stats)


class DenseAllReduceStrategy(OuterStrategy[DenseConfigT]):
    """A strategy whose round is ``DensePlan``: subclasses give ``sgd_settings`` and may keep a
    ``momentum`` buffer (None: no momentum); the config is a ``DenseConfig``."""

    capabilities = Capabilities(supports_overlap=True, supports_anchor_on_cpu=True)
    #: outer SGD momentum buffer over ``params`` (None: the algorithm keeps none)
    momentum: Optional[torch.Tensor] = None

    def sgd_settings(self) -> Tuple[float, float, bool]:
        """(lr, momentum μ, nesterov) of the outer SGD on θ_outer."""
        raise NotImplementedError

    def after_update(self, stats: OuterStepStats) -> None:
        """Extra stats once θ_outer is updated (both the blocking and the delayed step)."""

    def expected_payload_bytes(self) -> Optional[int]:
        return self.params.numel * COMM_DTYPES[self.config.comm_dtype].itemsize

    def begin_round(self, stats: OuterStepStats, nonfinite_tensor: Optional[str], held: bool,
                    snapshot: bool = False) -> RoundPlan:
        """``DensePlan``; it changes no state before ``apply``, so any cancel is exact without a snapshot."""
        return DensePlan(self, stats, held)


__all__ = ["COMM_DTYPES", "DenseConfig", "DensePlan", "DenseAllReduceStrategy", "comm_dtype_field"]
