"""Model averaging: θ ← mean over workers of θ_local.

Computed through the pseudo-gradient, bucket by bucket:

    Δ_r = θ_outer − θ_r ;   Δ̄ = (1/W)·Σ_r Δ_r   (one all-reduce SUM, then ÷W) ;   θ_outer ← θ_outer − Δ̄

which equals mean_r θ_r mathematically (θ_outer − (1/W)Σ(θ_outer − θ_r) = (1/W)Σ θ_r) and differs
from all-reducing θ itself only by fp32 rounding. We pick the Δ form because (a) it is exactly
DiLoCo with lr = 1 and no momentum, so both run ``DensePlan`` (``outer/dense_allreduce.py``),
and (b) Δ is small compared with θ, so a bf16 wire format (``comm_dtype="bf16"``) loses far less
than sending θ in bf16 would. No state besides the anchor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from megatron_sparseloco.outer.base import OuterGroup
from megatron_sparseloco.outer.dense_allreduce import DenseAllReduceStrategy, DenseConfig
from megatron_sparseloco.outer.registry import register_outer_strategy


@dataclass
class AveragingConfig(DenseConfig):
    """Model averaging has no optimiser settings: it is DiLoCo's step with lr 1 and no momentum."""

    implied_flags = {"outer-lr": 1.0, "outer-momentum": 0.0, "outer-nesterov": False}


@register_outer_strategy("average")
class ModelAveraging(DenseAllReduceStrategy[AveragingConfig]):
    """θ_outer ← θ_outer − mean_r Δ_r = mean_r θ_r, written back to every worker."""

    name = "average"
    config_class = AveragingConfig

    def __init__(self, params: Sequence[torch.Tensor], group: OuterGroup,
                 config: Optional[AveragingConfig] = None, names: Optional[Sequence[str]] = None, slices=None):
        super().__init__(params, group, config if config is not None else AveragingConfig(), names, slices)
        self.check_group_layout()

    def sgd_settings(self) -> Tuple[float, float, bool]:
        return 1.0, 0.0, False  # θ_outer − Δ̄
