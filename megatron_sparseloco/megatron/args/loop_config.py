"""``OuterLoopConfig``: every setting of the outer loop, declared once, validated once.

Each field is declared with ``outer.config_fields.flag_field`` (a ``--sparseloco-<flag>``) or
``config_field`` (set by the integration at run time, no flag). The command line
(``megatron/args/flags.py``), the Python API (``OuterLoopOptimizer``), the recipes and the
benchmarks are derived from these declarations; ``validate`` is the one place the loop's
cross-field rules live:

    1 <= H_w <= H                         per-worker inner steps (a slower worker steps on the first H_w)
    0 <= τ < H                            one delayed round in flight per strategy (``outer/overlap.py``)
    1 <= P <= H,  τ·P < H (τ > 0)         one fragment in flight at a time (``megatron/fragments.py``)
    H_w "auto" only with τ = 0, P = 1     re-agreed at blocking outer steps (``megatron/auto_steps.py``)

A violation raises ``ConfigError`` naming the field; other fields are written in backticks, so the
command-line layer shows them as flags and the Python layer as words.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

from megatron_sparseloco.outer.config_fields import ConfigError, check_fields, config_field, flag_field
from megatron_sparseloco.outer.overlap import MERGES, OverlapConfig

#: the per-worker inner-steps value that measures H_w at run time
AUTO = "auto"


@dataclass
class OuterLoopConfig:
    """The outer loop's settings, shared by every algorithm."""

    workers: Optional[int] = flag_field(None, type=int, flag="workers", low=1)
    """Number of workers W: a worker is one distributed-optimizer instance (sets
    --num-distributed-optimizer-instances; unset: that flag's value) and must divide the data-parallel size.
    In elastic mode (--sparseloco-lighthouse) the number of worker slots, each job being one worker."""
    inner_steps: int = flag_field(15, flag="inner-steps", low=1)
    """Inner optimizer steps H between outer steps (the reference code's 15; Covenant-72B 30)."""
    inner_steps_per_worker: Optional[Union[str, List[int]]] = flag_field(None, type=str, flag="inner-steps-per-worker")
    """Comma-separated inner steps H_w per worker (parsed into a list of W ints): a round lasts max(H_w)
    iterations, worker w steps on the first H_w (a slower worker does fewer steps instead of stalling the
    others); "auto": H_w from measured step times, re-agreed at every outer step (megatron/auto_steps.py)."""
    active_inner_steps: Optional[int] = config_field(None, type=int, low=1)
    """This worker's H_w (<= H): it steps on the first H_w iterations of each round; None: H."""
    consistency_check_interval: int = flag_field(0, flag="consistency-check-interval", low=0)
    """Every N outer steps compare a hash of θ_outer across workers (0: off)."""
    outer_timeout_s: Optional[float] = flag_field(None, type=float, flag="outer-timeout", low=0.0, low_open=True)
    """Seconds an outer step may wait for the other workers before failing: set, the outer step runs on a
    group of its own with this timeout (so does delayed application, whose collectives must not interleave
    with another group's: 600 s unless set); unset: Megatron's inter-instance group and timeout."""
    overlap_steps: int = flag_field(0, flag="overlap-steps", low=0)
    """Delayed application τ (0: blocking outer step). 1 <= τ < H: the outer collective is launched at the
    end of a round and runs while the next τ inner steps compute; its result is merged τ steps later (see
    --sparseloco-overlap-merge; outer/overlap.py)."""
    overlap_merge: str = flag_field("replay", flag="overlap-merge", choices=MERGES)
    """With --sparseloco-overlap-steps: "replay" (default) puts the τ steps of local progress on the new
    global point, θ ← θ_outer + (θ_now − θ_launch); "lerp" is torchft's Streaming DiLoCo
    θ ← lerp(θ_outer, θ_now, α)."""
    overlap_alpha: float = flag_field(0.5, flag="overlap-alpha", low=0.0, high=1.0)
    """With --sparseloco-overlap-merge lerp: the weight α in [0, 1] of the local params (0: discard the τ
    local steps, 1: keep them and ignore the global point)."""
    fragments: int = flag_field(1, flag="fragments", low=1)
    """Streaming-DiLoCo fragments P (1: the whole model syncs at once; megatron/fragments.py). The layers
    are split into P contiguous groups (embedding with the first, output layer with the last), each with
    its own outer state; fragment p syncs every H steps at offset floor(p*H/P), so each sync moves about
    1/P of the bytes. 1 <= P <= layers, P <= H; with --sparseloco-overlap-steps τ: τ < H/P."""
    check_identical_start: bool = config_field(True)
    """Assert identical params across workers when the loop is built (θ_outer is initialised from them)."""
    identical_across_workers: Optional[bool] = config_field(None, type=bool)
    """Workers hold the same θ_outer after a step (consistency checks apply); None: the strategies'
    ``Capabilities.identical_across_workers``."""

    @property
    def auto_inner_steps(self) -> bool:
        """H_w measured at run time (``inner_steps_per_worker="auto"``)."""
        return self.inner_steps_per_worker == AUTO

    def inner_steps_for(self, worker_index: int) -> int:
        """Worker ``worker_index``'s H_w: its entry of the per-worker list, else H (with "auto": H until the
        first agreement of the measured step counts)."""
        per_worker = self.inner_steps_per_worker
        return per_worker[worker_index] if isinstance(per_worker, list) else self.inner_steps

    def overlap(self) -> OverlapConfig:
        return OverlapConfig(steps=self.overlap_steps, merge=self.overlap_merge, alpha=self.overlap_alpha)

    def validate(self) -> "OuterLoopConfig":
        """The field checks (type, choices, range), then the cross-field rules of the module docstring."""
        per_worker = self.inner_steps_per_worker
        if isinstance(per_worker, list):          # parsed: the field checks see the flag's string form
            self.inner_steps_per_worker = ",".join(str(h) for h in per_worker)
        try:
            check_fields(self)
        finally:
            self.inner_steps_per_worker = per_worker
        H, tau, P = self.inner_steps, self.overlap_steps, self.fragments
        if self.active_inner_steps is not None and self.active_inner_steps > H:
            raise ConfigError(f"active_inner_steps must be in [1, `inner_steps`={H}], got {self.active_inner_steps}",
                              "active_inner_steps", f"use at most {H}")
        self.overlap().validate(H)
        self._check_fragments(H, tau, P)
        if self.auto_inner_steps and (tau > 0 or P > 1):
            raise ConfigError("'auto' re-agrees H_w at blocking outer steps only", "inner_steps_per_worker",
                              "use `overlap_steps=0` and `fragments=1`, or give fixed per-worker steps")
        return self

    @staticmethod
    def _check_fragments(H: int, tau: int, P: int) -> None:
        if P > H:
            raise ConfigError(f"P={P} is more than `inner_steps` H={H} (each fragment syncs at its own inner step of "
                              "the round)", "fragments", f"use 1 <= P <= {H}, or raise `inner_steps`")
        if P > 1 and tau > 0 and tau * P >= H:
            raise ConfigError(f"with `overlap_steps` τ={tau}, τ must be < H/P = {H}/{P} (one fragment in flight at "
                              f"a time; fragments sync every {H // P} or {-(-H // P)} steps)", "fragments",
                              f"lower `overlap_steps` to at most {(H - 1) // P}, lower `fragments` to at most "
                              f"{max(1, (H - 1) // tau)}, or raise `inner_steps`")


__all__ = ["AUTO", "OuterLoopConfig"]
