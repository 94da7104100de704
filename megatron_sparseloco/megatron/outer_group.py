"""The cross-worker process group of the outer step, with its own timeout, and dead-worker reports.

``build_outer_group`` creates a copy of Megatron's inter-instance group (same ranks) whose
collectives time out after ``--sparseloco-outer-timeout`` seconds instead of Megatron's global
timeout, so a dead or stalled worker fails the others promptly. Every rank must call it (it
creates all such groups, in the same order, on every rank).

``OuterStepWatch`` names the missing worker: before entering an outer step each rank writes
``sparseloco/outer/<step>/<worker>/<position>`` to the job's rendezvous store (a few bytes to the
store, no collective). When the step's collective fails or times out, the rank reads which
workers never arrived and raises ``WorkerLostError`` naming them.
"""
from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist


class WorkerLostError(RuntimeError):
    """A worker did not take part in an outer step (dead, stalled or partitioned)."""


def build_outer_group(base_group: Optional[dist.ProcessGroup], timeout_s: float) -> Optional[dist.ProcessGroup]:
    if base_group is None:
        return None
    mine = tuple(dist.get_process_group_ranks(base_group))
    everyone: List[tuple] = [mine] * dist.get_world_size()  # placeholders: all_gather_object overwrites them
    dist.all_gather_object(everyone, mine)
    groups = sorted(set(everyone))
    covered = sorted(r for g in groups for r in g)
    if covered != list(range(dist.get_world_size())):
        raise RuntimeError(f"cross-worker groups {groups} do not partition the {dist.get_world_size()} ranks")
    group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], timeout=timedelta(seconds=timeout_s))
    assert isinstance(group, dist.ProcessGroup), "the groups partition the ranks, so this rank is in one"
    return group


def single_rank_group() -> Optional[dist.ProcessGroup]:
    """A process group of this rank alone: the outer group of one worker (W = 1).

    With one worker the outer step still runs (a lookahead step on θ_outer for DiLoCo, the
    compressed update with error feedback for SparseLoCo), but it must talk to no one: the
    default group (``None``) would join ranks holding *different* shards of the same worker.
    Only this rank takes part in creating it (``use_local_synchronization``), so it is cheap at
    any scale. None without torch.distributed.
    """
    if not dist.is_initialized():
        return None
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup), "a group of this rank is never NON_GROUP_MEMBER here"
    return group


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:  # no store (e.g. a group built without a rendezvous)
        return None


class OuterStepWatch:
    """Arrival markers in the rendezvous store, read back when an outer step fails."""

    def __init__(self, group: Optional[dist.ProcessGroup], position: int):
        self.group = group
        self.position = position
        self.store = _default_store() if group is not None else None
        self.worker = dist.get_rank(group) if group is not None else 0
        self.workers = dist.get_world_size(group) if group is not None else 1

    def _key(self, step: int, worker: int) -> str:
        return f"sparseloco/outer/{step}/{worker}/{self.position}"

    def arrive(self, step: int) -> None:
        if self.store is not None:
            self.store.set(self._key(step, self.worker), "1")

    def missing(self, step: int) -> List[int]:
        if self.store is None:
            return []
        try:
            return [w for w in range(self.workers) if not self.store.check([self._key(step, w)])]
        except Exception:  # the store's host died with the worker: we cannot tell who is missing
            return []

    def fail(self, step: int, exc: BaseException, timeout_s: float) -> WorkerLostError:
        missing = self.missing(step)
        ranks = [dist.get_global_rank(self.group, w) for w in missing] if self.group is not None else []
        who = (f"worker(s) {missing} (global rank(s) {ranks}) never reached outer step {step}" if missing
               else f"a worker dropped out during outer step {step}")
        return WorkerLostError(
            f"{who}; this worker ({self.worker}) gave up after at most {timeout_s:.0f} s "
            f"(--sparseloco-outer-timeout). Cause: {type(exc).__name__}: {exc}. "
            "Fix: restart the job from the last complete checkpoint (a dead worker cannot rejoin mid-run)")
