"""Per-worker inner steps from measured step times (``--sparseloco-inner-steps-per-worker auto``).

A round is H lockstep iterations for every worker (``OuterLoopOptimizer.is_inner_step_active``);
worker w applies its inner optimizer on the first H_w of them. With ``auto``, H_w is re-chosen at
every outer step from the step times measured in the round just finished:

    t_w   = max over the ranks of worker w of (mean wall time of its active iterations)
    H_w   = clamp(⌊H · t_min / t_w + 1e-9⌋, 1, H),     t_min = min_v t_v

so every worker's H_w steps fit in the time the fastest worker needs for H: a 2× slower worker
runs H/2 steps. Round 0 runs H on every worker (nothing measured yet); a worker with no
measurement keeps its H_w.

Agreement, point to point only: the ranks of one worker first take the max of their times (an
all-reduce *inside* the worker, never between workers), so all of them hold the same t_w; then each
rank sends its t_w (one fp64) to the rank at the same position in every other worker (one
``batch_isend_irecv`` over the cross-worker group, kind ``"p2p_steptime"``), so every rank sees the
same table (t_1 … t_W) and worker w's ranks compute the same H_w.

Inactive iterations cost no compute in megatron.training's loop: ``skip_inactive_iterations`` (installed by
the plugin over ``train_step``) hands ``train_step`` a forward/backward function that runs nothing on
the iterations ``is_inner_step_active()`` calls inactive, so a worker with H_w < H spends those
iterations' time only on ``train_step``'s bookkeeping and a slow GPU keeps pace with the fast ones.
Such an iteration (the same for fixed per-worker counts, ``--sparseloco-inner-steps-per-worker 30,15``):

* reads no batch (the worker's data iterator does not advance; Megatron's ``consumed_samples``
  still counts the global batch, so a resume skips the samples the slow worker never read: none is
  read twice);
* is reported to Megatron as a *skipped iteration* (``number of skipped iterations`` in the log
  line; the logged loss averages the active iterations only) while the learning-rate schedule
  advances as for every iteration (the schedule stays in lockstep across workers);
* is still counted in Megatron's FLOP and throughput figures (they assume every iteration computes).

Loops that drive the optimizer themselves check ``is_inner_step_active()`` before the forward/backward
(benchmarks/common.py does).
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.comm.p2p import exchange


def steps_for(H: int, times: List[Optional[float]], me: int, current: int) -> int:
    """H_me = clamp(⌊H · t_min / t_me + 1e-9⌋, 1, H) over the measured ``times`` (None: not measured)."""
    known = [t for t in times if t is not None and t > 0 and math.isfinite(t)]
    t_me = times[me]
    if not known or t_me is None or not (t_me > 0 and math.isfinite(t_me)):
        return current
    return max(1, min(H, int(math.floor(H * min(known) / t_me + 1e-9))))


class AutoInnerSteps:
    """Measures this worker's active iterations and agrees on H_w at each outer step (module docstring)."""

    def __init__(self, H: int, group: Optional[dist.ProcessGroup], intra_group: Optional[dist.ProcessGroup],
                 num_workers: int, device: torch.device):
        self.H, self.group, self.intra_group, self.num_workers = H, group, intra_group, num_workers
        self.device = device
        self.active = H
        self.counter = CommCounter()
        self._sum = 0.0
        self._n = 0
        #: the table of the last agreement (seconds per active iteration per worker; None: unknown)
        self.times: List[Optional[float]] = [None] * num_workers

    def record(self, seconds: float) -> None:
        """Wall time of one active iteration (forward, backward, inner optimizer step)."""
        self._sum += float(seconds)
        self._n += 1

    def agree(self) -> int:
        """At an outer step (every worker calls it): the new H_w of this worker."""
        mine = self._sum / self._n if self._n else 0.0
        self._sum, self._n = 0.0, 0
        if self.num_workers <= 1 or not dist.is_initialized():
            return self.active
        t = torch.tensor([mine], dtype=torch.float64, device=self.device)
        if self.intra_group is not None and dist.get_world_size(self.intra_group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.intra_group)  # inside the worker only
        me = dist.get_rank(self.group)
        got = exchange(t, [p for p in range(self.num_workers) if p != me], self.group, self.counter,
                       kind="p2p_steptime")
        vals = [float(t.item()) if w == me else float(got[w].item()) for w in range(self.num_workers)]
        self.times = [v if v > 0 else None for v in vals]
        self.active = steps_for(self.H, self.times, me, self.active)
        return self.active


def _no_forward_backward(*args, **kwargs):
    """``forward_backward_func`` of an inactive iteration: no batch read, no loss (``[]``)."""
    return []


#: megatron.training's ``train_step(forward_step_func, data_iterator, model, optimizer,
#: opt_param_scheduler, config, forward_backward_func, ...)``: positions used when a wrapper hides the names
_OPTIMIZER_AT, _FORWARD_BACKWARD_AT = 3, 6


def skip_inactive_iterations(train_step):
    """``train_step`` that runs no forward/backward on an iteration the outer loop calls inactive
    (``OuterLoopOptimizer.is_inner_step_active()`` false, see the module docstring) and reports it
    as skipped; every other call is ``train_step`` unchanged."""

    @functools.wraps(train_step)
    def train_step_skipping_inactive(*a, **kw):
        optimizer = kw["optimizer"] if "optimizer" in kw else (a[_OPTIMIZER_AT] if len(a) > _OPTIMIZER_AT else None)
        active = getattr(optimizer, "is_inner_step_active", None)
        if active is None or active():
            return train_step(*a, **kw)
        if "forward_backward_func" in kw:
            kw = dict(kw, forward_backward_func=_no_forward_backward)
        elif len(a) > _FORWARD_BACKWARD_AT:
            a = a[:_FORWARD_BACKWARD_AT] + (_no_forward_backward,) + a[_FORWARD_BACKWARD_AT + 1:]
        else:
            raise RuntimeError("sparseloco: train_step was called without forward_backward_func, so an inactive "
                               "inner iteration (--sparseloco-inner-steps-per-worker) cannot skip its compute")
        out = train_step(*a, **kw)
        # (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, ...): our optimizer
        # step "succeeded" (the LR schedule advanced); Megatron's log counts the iteration as skipped
        return (out[0], 1, *out[2:]) if isinstance(out, tuple) and len(out) > 2 else out

    return train_step_skipping_inactive
