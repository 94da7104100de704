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

from megatron_sparseloco.outer.config_fields import ConfigError, flag_field


def lr_field(default: float):
    """The outer learning rate field (``--sparseloco-outer-lr``), > 0; each config its own default."""
    return flag_field(default, flag="outer-lr", low=0.0, low_open=True,
                      doc="Outer learning rate on θ_outer (GASLoC's step on Δ is --sparseloco-gossip-proposal-lr).")


def momentum_field(default: float):
    """The outer momentum field μ (``--sparseloco-outer-momentum``), in [0, 1)."""
    return flag_field(default, flag="outer-momentum", low=0.0, high=1.0, high_open=True,
                      doc="Outer momentum μ in [0, 1); 0: none (no momentum buffer).")


def nesterov_field(default: bool):
    """The Nesterov switch (``--[no-]sparseloco-outer-nesterov``); needs μ > 0 (``check_outer_sgd``)."""
    return flag_field(default, flag="outer-nesterov",
                      doc="Nesterov outer momentum (u = Δ̄ + μ·m) or, off, heavy ball (u = m); needs a non-zero "
                          "outer momentum.")


def check_outer_sgd(lr: float, momentum: float, nesterov: bool) -> None:
    """Cross-field check of the outer SGD fields (types and ranges are the fields' own):
    Nesterov needs a momentum, as in ``torch.optim.SGD``."""
    if nesterov and momentum == 0.0:
        raise ConfigError("nesterov=True needs a non-zero momentum", "nesterov",
                          "set `momentum=0.9`, or `nesterov=False`")


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
