"""Make megatron.training's per-iteration reductions worker-local (no cross-worker traffic in inner steps).

``worker_isolation`` makes the gradients worker-local. megatron.training itself still issues, every
iteration, collectives over the whole data-parallel group or the world:

1. ``train_step`` all-reduces the reported loss (sum and token count) over the model's
   ``pg_collection.dp_cp`` group;
2. ``Timer.start/stop(barrier=True)`` (``interval-time``, and ``forward-backward`` /
   ``optimizer`` with ``--barrier-with-L1-time``, on by default) barriers the world, and
   ``Timers.log`` all-gathers every rank's times over the world;
3. the rerun state machine (``--rerun-mode``, default ``validate_results``) all-reduces its
   "rerun requested?" flags over the world in every iteration;
4. MoE models: ``training_log`` reports the MoE metrics (load-balancing / z-loss ...) every
   iteration through ``MoEMetricsTracker._sync_metrics``, whose last step averages them over the
   whole data-parallel group.

Across sites each is a WAN round trip and a lockstep barrier per inner step, and a stalled worker
would hang the others there, before ``--sparseloco-outer-timeout`` could fire. We scope each to
the worker:

1. during ``train_step`` the holder of the model's ``pg_collection`` sees a copy whose ``dp_cp``
   (and ``dp_cp_gtp_remat``) is the worker's data-parallel group, so the logged loss is the
   worker's own (Megatron prints it on the last rank, i.e. worker W-1's loss);
2. every timer barriers the worker's ranks, and ``Timers.log`` gathers the worker's times only
   (the other rows stay zero, which Megatron's min / max already skips);
3. the rerun flags are reduced over the worker's ranks (a rerun replays the worker's own
   iteration; a worker that decides to stop makes the others fail at the next outer step);
4. the MoE metrics' data-parallel average runs over the worker's data-parallel group (the logged
   MoE losses are the worker's, like the LM loss).

Nothing changes with one worker (the worker is the whole job). Evaluation and checkpoint saves
stay job-wide events (they are not per iteration).
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import collective_device
from megatron_sparseloco.megatron.placement.gradient_isolation import intra_worker_group


def worker_dp_cp_group():
    """This rank's data-parallel (with context-parallel) group restricted to its worker."""
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)


# ------------------------------------------------------------------------------ 1. train_step
def _pg_collection_holder(model_chunk):
    """The (wrapped) module whose ``pg_collection`` megatron.training's train_step reads, or None."""
    m = model_chunk
    while m is not None and not hasattr(m, "pg_collection"):
        m = getattr(m, "module", None)
    return m


def wrap_train_step(train_step, num_workers_fn):
    """``train_step`` whose loss reduction runs over the worker's data-parallel group when W > 1."""

    @functools.wraps(train_step)
    def worker_local_train_step(forward_step_func, data_iterator, model, *a, **kw):
        if num_workers_fn() <= 1:
            return train_step(forward_step_func, data_iterator, model, *a, **kw)
        holder = _pg_collection_holder(model[0])
        original = getattr(holder, "pg_collection", None) if holder is not None else None
        if original is None:
            raise RuntimeError("sparseloco: the model has no pg_collection, so megatron.training's train_step would "
                               "all-reduce the loss over every worker; build the model with megatron.training's "
                               "get_model (it sets one)")
        local = copy.copy(original)
        group = worker_dp_cp_group()
        local.dp_cp = group
        if getattr(original, "dp_cp_gtp_remat", None) is not None:
            local.dp_cp_gtp_remat = group
        holder.pg_collection = local
        try:
            return train_step(forward_step_func, data_iterator, model, *a, **kw)
        finally:
            holder.pg_collection = original

    return worker_local_train_step


# ------------------------------------------------------------------------------ 2. timers
def localize_timers(timers, group) -> None:
    """Timers barrier and gather over ``group`` (idempotent); timers created later too."""
    if timers is None:
        return
    base: type = type(timers)
    if not getattr(base, "_sparseloco_worker_local", False):
        timers.__class__ = _worker_local_timers_class(base)
    timers._sparseloco_group = group
    for timer in timers._timers.values():
        if hasattr(timer, "set_barrier_group"):
            timer.set_barrier_group(group)


@functools.lru_cache(maxsize=None)
def _worker_local_timers_class(base: Any) -> type:
    """A subclass of ``base`` (Megatron's ``Timers`` or a subclass; ``Any`` because it is subclassed here)."""
    class WorkerLocalTimers(base):
        _sparseloco_worker_local = True

        def __call__(self, name, log_level=None):
            new = name not in self._timers
            timer = super().__call__(name, log_level)
            if new and name in self._timers:
                timer.set_barrier_group(self._sparseloco_group)
            return timer

        def _get_elapsed_time_all_ranks(self, names, reset, barrier):
            # Megatron's version barriers and all-gathers over the world; the worker's ranks
            # fill their rows, the others stay 0 (skipped by Megatron's min / max).
            if len(names) == 0:
                return None
            group = self._sparseloco_group
            if barrier:
                dist.barrier(group=group)
            rank = dist.get_rank()
            table = torch.zeros((dist.get_world_size(), len(names)), dtype=torch.float, device=collective_device())
            mine = torch.zeros(len(names), dtype=torch.float, device=collective_device())
            for i, name in enumerate(names):
                if name in self._timers:
                    mine[i] = self._timers[name].elapsed(reset=reset)
            ranks = dist.get_process_group_ranks(group)
            rows = [torch.zeros_like(mine) for _ in ranks]
            dist.all_gather(rows, mine, group=group)
            for r, row in zip(ranks, rows):
                table[r] = row
            table[rank] = mine
            return table

    WorkerLocalTimers.__name__ = f"WorkerLocal{base.__name__}"
    return WorkerLocalTimers


# ------------------------------------------------------------------------------ 3. rerun machine
def localize_rerun_state_machine(group) -> None:
    """The rerun state machine's any-rank flags reduced over ``group`` instead of the world."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()

    def _reduce_any(value):
        values = value if isinstance(value, list) else [value]
        t = torch.tensor([int(bool(v)) for v in values], dtype=torch.int32, device=collective_device())
        dist.all_reduce(t, group=group)
        out = tuple(int(x) > 0 for x in t.tolist())
        return out if isinstance(value, list) else out[0]

    machine._reduce_any = _reduce_any


# ------------------------------------------------------------------------------ 4. MoE metrics
class _WorkerDataParallel:
    """A ``pg_collection`` stand-in for ``MoEMetricsTracker._sync_metrics``: its ``pp`` group, and
    ``dp_cp_gtp_remat`` = the worker's data-parallel group (the only group it averages over)."""

    def __init__(self, pg_collection):
        from megatron.core import parallel_state
        self.pp = getattr(pg_collection, "pp", None) or parallel_state.get_pipeline_model_parallel_group()
        self.dp_cp_gtp_remat = parallel_state.get_data_parallel_group(
            with_context_parallel=pg_collection is not None, partial_data_parallel=True)


def localize_moe_metrics() -> bool:
    """``MoEMetricsTracker._sync_metrics`` averages over the worker's data-parallel group (idempotent).
    False when this megatron-core has no such tracker (nothing to scope)."""
    try:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    except ImportError:
        return False
    if getattr(MoEMetricsTracker._sync_metrics, "_sparseloco_worker_local", False):
        return True
    original = MoEMetricsTracker._sync_metrics

    @functools.wraps(original)
    def _sync_metrics(self, metric_names, pg_collection=None):
        return original(self, metric_names, _WorkerDataParallel(pg_collection))

    setattr(_sync_metrics, "_sparseloco_worker_local", True)  # the mark the check above reads
    MoEMetricsTracker._sync_metrics = _sync_metrics
    return True


def make_training_reductions_worker_local(num_workers: int, timers=None) -> Optional[object]:
    """Scope megatron.training's per-iteration timers and rerun flags to this rank's worker (W > 1).

    ``train_step``'s loss reduction is handled by ``wrap_train_step`` (installed by the plugin).
    Returns the worker group used, or None with one worker.
    """
    if num_workers <= 1:
        return None
    group = intra_worker_group()
    localize_timers(timers, group)
    localize_rerun_state_machine(group)
    localize_moe_metrics()
    return group
