"""The outer SGD update shared by the strategies, with torch.optim.SGD's exact semantics.

With a pseudo-gradient g (already averaged over workers), learning rate lr, momentum μ
(dampening 0, no weight decay), on the anchor θ_outer:

    m ← μ·m + g
    u = g + μ·m        (nesterov)      or      u = m        (heavy ball)      or   u = g   (μ = 0)
    θ_outer ← θ_outer − lr·u

The operations are the ones ``torch.optim.SGD(foreach=False)`` issues (``mul_``/``add_`` with the
same alphas), so a single-process SGD fed with the same g gives bitwise the same anchor. One
difference that cannot matter: torch initialises m by cloning the first g, we start from m = 0,
which gives μ·0 + g = g (equal up to the sign of zeros).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_sparseloco.outer.base import ConfigError, OuterConfig


def check_outer_sgd(lr: float, momentum: float, nesterov: bool) -> None:
    """Shared validation of the outer SGD fields (lr, momentum, nesterov)."""
    OuterConfig._check_range("lr", lr, 0.0, float("inf"), lo_open=True, hi_open=True)
    OuterConfig._check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
    if not isinstance(nesterov, bool):
        raise ConfigError(f"nesterov must be True or False, got {nesterov!r}")


def outer_sgd_(anchor: torch.Tensor, grad: torch.Tensor, momentum_buf: Optional[torch.Tensor],
               lr: float, momentum: float, nesterov: bool) -> torch.Tensor:
    """Apply one outer SGD step to ``anchor`` in place; returns the direction u (before lr).

    ``grad`` may be overwritten (it is the caller's scratch buffer). ``momentum_buf`` is required
    when ``momentum > 0`` and ignored otherwise.
    """
    update = grad
    if momentum != 0.0:
        if momentum_buf is None:
            raise ValueError("outer_sgd_: momentum > 0 needs a momentum buffer")
        momentum_buf.mul_(momentum).add_(grad)
        if nesterov:
            update = grad.add_(momentum_buf, alpha=momentum)
        else:
            update = momentum_buf
    anchor.add_(update, alpha=-lr)
    return update
