"""DiLoCo (arXiv 2311.08105): dense mean pseudo-gradient, outer SGD with Nesterov momentum.

Per outer step, bucket by bucket:

    Δ_r = θ_outer − θ_r
    Δ̄   = (1/W)·Σ_r Δ_r                  all-reduce SUM in fp32 or bf16 (``comm_dtype``), then ÷W in fp32
    m   ← μ·m + Δ̄
    u   = Δ̄ + μ·m  (nesterov)   or   m  (heavy ball)
    θ_outer ← θ_outer − lr·u ;   θ_r ← θ_outer

exactly ``torch.optim.SGD(lr, momentum=μ, dampening=0, nesterov=...)`` applied to θ_outer with
gradient Δ̄ (see ``outer/sgd.py``). Defaults lr 0.7, μ 0.9, Nesterov (the paper's setting).
State: the anchor and one shard-sized fp32 momentum buffer (none when μ = 0).
The round is ``outer/dense_allreduce.py``'s ``DensePlan`` (shared with model averaging). Bytes per step and
rank: 4·numel (fp32) or 2·numel (bf16) sent and received, plus the 4-byte
non-finite flag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from megatron_sparseloco.outer.base import OuterGroup, OuterStepStats
from megatron_sparseloco.outer.dense_allreduce import DenseAllReduceStrategy, DenseConfig
from megatron_sparseloco.outer.registry import register_outer_strategy
from megatron_sparseloco.outer.sgd import check_outer_sgd, lr_field, momentum_field, nesterov_field


@dataclass
class DiLoCoConfig(DenseConfig):
    """The DiLoCo paper's outer optimiser: SGD, lr 0.7, Nesterov momentum 0.9."""

    lr: float = lr_field(0.7)
    momentum: float = momentum_field(0.9)
    nesterov: bool = nesterov_field(True)

    def validate(self) -> "DiLoCoConfig":
        super().validate()
        check_outer_sgd(self.lr, self.momentum, self.nesterov)
        return self


@register_outer_strategy("diloco")
class DiLoCo(DenseAllReduceStrategy[DiLoCoConfig]):
    """Dense all-reduce of Δ, then Nesterov (or heavy-ball) SGD on θ_outer."""

    name = "diloco"
    config_class = DiLoCoConfig
    elementwise_buffers = ("momentum",)  # None when μ = 0

    def __init__(self, params: Sequence[torch.Tensor], group: OuterGroup,
                 config: Optional[DiLoCoConfig] = None, names: Optional[Sequence[str]] = None, slices=None):
        super().__init__(params, group, config if config is not None else DiLoCoConfig(), names, slices)
        if self.config.momentum != 0.0:
            self.momentum = torch.zeros(self.params.numel, dtype=torch.float32, device=self.device)
        self.check_group_layout()

    def sgd_settings(self) -> Tuple[float, float, bool]:
        return self.config.lr, self.config.momentum, self.config.nesterov

    def after_update(self, stats: OuterStepStats) -> None:
        if self.momentum is not None:
            stats.extra["momentum_norm"] = float(torch.linalg.vector_norm(self.momentum).item())
