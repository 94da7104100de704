"""The cross-worker process group of the outer step, with its own timeout, and dead-worker reports.

``build_outer_group`` creates a copy of Megatron's inter-instance group (same ranks) whose
collectives time out after ``--sparseloco-outer-timeout`` seconds instead of Megatron's global
timeout, so a dead or stalled worker fails the others promptly. Every rank must call it (it
creates all such groups, in the same order, on every rank).

``OuterStepWatch`` names a missing worker before anything can hang: before an outer step's first
collective every rank arrives in the job's rendezvous store and waits there, host-side, for all
the others (``--sparseloco-outer-timeout`` at most); a rank that times out raises
``WorkerLostError`` naming the workers (and their global ranks) that never arrived, having issued
no collective of the step. A collective that fails later in the step (a worker died inside it) is
reported through the same class.
"""
from __future__ import annotations

import sys
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
    """The arrival barrier before every outer step, and the names of the workers that never came.

    Every rank of the job (all workers, all shard positions: N ranks) arrives at each outer step in
    the job's rendezvous store, host-side:

        set   sparseloco/outer/<n>/<step>/rank<r>          (this rank arrived)
        c ← add(sparseloco/outer/<n>/<step>/arrived, 1)    (the rank with c = N sets .../<step>/all)

    and, before it issues the step's first collective, waits for ``.../<step>/all``
    (``--sparseloco-outer-timeout`` seconds at most): a blocking step on the training thread
    (``barrier``), a delayed one (``--sparseloco-overlap-steps``) on the thread that runs the round's
    collectives, so the training thread never waits for the slowest worker there (``arrive`` at
    launch, ``wait_all`` before the round). A handful of store requests per rank and step, no
    collective. When the wait times out, the rank reads which ``rank<r>`` keys are absent, names
    those ranks' workers and raises ``WorkerLostError`` having issued no collective of the step, so
    the error is raised on every waiting rank even where a failed collective would end the process
    unnamed (NCCL's watchdog with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``) or hang (a stopped peer
    keeps its sockets open); it also prints what the store held for the step and its neighbours
    (``store_state``), so a timeout can be told from a store that disagrees with the ranks. Every
    rank has finished waiting for step k − 1 before anyone arrives at step k, so arriving at k
    deletes the keys of k − 1: the store holds those of two steps at most.

    ``<n>`` numbers the watch: n counts the watches built in the process group
    (every rank builds them in the same order; the construction agrees on n): a later outer loop in
    the same job (a benchmark's next run, a test's next case) never meets an earlier loop's keys,
    whose last step stays complete (``all`` set, its count at N) and would let every rank through
    that step unchecked. The last step's keys of each finished loop stay in the store (N + 2 keys).
    """

    PREFIX = "sparseloco/outer"
    #: watches with a group built in this process so far (agreed across ranks at each construction)
    _built = 0

    def __init__(self, group: Optional[dist.ProcessGroup], position: int, timeout_s: float = 600.0):
        self.group = group
        self.position = position
        self.timeout_s = float(timeout_s)
        self.store = _default_store() if group is not None else None
        self.worker = dist.get_rank(group) if group is not None else 0
        self.workers = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank() if group is not None else 0
        self.world = dist.get_world_size() if group is not None else 1
        #: (step, None when every rank arrived / the error raised) of the last ``wait_all``
        self._outcome: Optional[tuple] = None
        #: global rank -> worker index (one object all-gather at construction)
        self.worker_of: List[int] = [0] * self.world
        #: this watch's key namespace, ``sparseloco/outer/<n>`` (class docstring)
        self.prefix = self.PREFIX
        if group is not None:
            gathered: List[tuple] = [(0, 0)] * self.world
            dist.all_gather_object(gathered, (self.worker, OuterStepWatch._built + 1))
            self.worker_of = [worker for worker, _ in gathered]
            OuterStepWatch._built = max(n for _, n in gathered)
            self.prefix = f"{self.PREFIX}/{OuterStepWatch._built}"

    def key(self, step: int, name: str) -> str:
        """The store key of ``name`` (``rank<r>``, ``arrived``, ``all``) at outer step ``step``."""
        return f"{self.prefix}/{step}/{name}"

    def barrier(self, step: int) -> None:
        """Arrive at outer step ``step`` and wait until every rank of the job has (class docstring)."""
        self.arrive(step)
        self.wait_all(step)

    def arrive(self, step: int) -> None:
        """This rank's arrival at ``step``, without waiting (a few store requests). The rank that
        completes the count marks the step complete and deletes the previous step's shared keys;
        every rank deletes its own key of the previous step."""
        if self.store is None:
            return
        try:
            self.store.set(self.key(step, f"rank{self.rank}"), str(self.worker))
            if self.store.add(self.key(step, "arrived"), 1) == self.world:
                self.store.set(self.key(step, "all"), "1")
                for name in ("arrived", "all"):
                    self.store.delete_key(self.key(step - 1, name))
            self.store.delete_key(self.key(step - 1, f"rank{self.rank}"))
        except RuntimeError as exc:  # the store went away with its host
            self._outcome = (step, self.lost(step, exc))
            raise self._outcome[1] from exc

    def wait_all(self, step: int) -> None:
        """Wait (``timeout_s`` at most) until every rank arrived at ``step``; ``WorkerLostError`` naming the
        missing ones otherwise. Once per step: a second call returns, or raises the same error, at once
        (several strategies of one round wait for it in turn)."""
        if self.store is None:
            return
        if self._outcome is not None and self._outcome[0] == step:
            if self._outcome[1] is not None:
                raise self._outcome[1]
            return
        try:
            self.store.wait([self.key(step, "all")], timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # the wait timed out, or the store went away with its host
            self._outcome = (step, self.lost(step, exc))
            raise self._outcome[1] from exc
        self._outcome = (step, None)

    def missing_ranks(self, step: int) -> List[int]:
        """Global ranks whose arrival at ``step`` is not in the store ([] when that cannot be told)."""
        if self.store is None:
            return []
        try:
            arrived = set(self._arrived_ranks(step))
        except RuntimeError:  # the store's host died with the worker: we cannot tell who is missing
            return []
        return [r for r in range(self.world) if r not in arrived]

    def _arrived_ranks(self, step: int) -> List[int]:
        """Global ranks whose ``rank<r>`` key of ``step`` is in the store (RuntimeError: no store)."""
        assert self.store is not None
        return [r for r in range(self.world) if self.store.check([self.key(step, f"rank{r}")])]

    def store_state(self, step: int) -> str:
        """What the store holds for ``step`` and its neighbours, for the error of a wait that timed out:
        ``step <s>: arrived <c> of <N>, all set|unset, ranks [...]`` (keys read, none written)."""
        if self.store is None:
            return ""
        parts = []
        try:
            for s in (step - 1, step, step + 1):
                arrived = self.key(s, "arrived")
                count = int(self.store.get(arrived)) if self.store.check([arrived]) else 0
                done = "set" if self.store.check([self.key(s, "all")]) else "unset"
                parts.append(f"step {s}: arrived {count} of {self.world}, all {done}, ranks {self._arrived_ranks(s)}")
        except (RuntimeError, ValueError):  # the store's host died, or a key changed under us
            parts.append("the store stopped answering")
        return f"{self.prefix} at the timeout: " + "; ".join(parts)

    def _who(self, step: int) -> Optional[str]:
        ranks = self.missing_ranks(step)
        if not ranks:
            return None
        workers = sorted({self.worker_of[r] for r in ranks})
        return f"worker(s) {workers} (global rank(s) {ranks}) never reached outer step {step}"

    def lost(self, step: int, exc: BaseException) -> "WorkerLostError":
        """The barrier's error: the missing workers and their ranks, printed on this rank at once."""
        who = self._who(step) or f"the rendezvous store did not answer at outer step {step}"
        err = WorkerLostError(
            f"{who}; this rank (global rank {self.rank}, worker {self.worker}) waited {self.timeout_s:g} s "
            f"(--sparseloco-outer-timeout) and stops before issuing any collective of the step "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Fix: restart the job from "
            "the last complete checkpoint (a dead worker cannot rejoin mid-run); if the worker is only slow, "
            "raise --sparseloco-outer-timeout")
        print(f"sparseloco | error: {err}", file=sys.stderr, flush=True)
        print(f"sparseloco | {self.store_state(step)}", file=sys.stderr, flush=True)
        return err

    def fail(self, step: int, exc: BaseException, timeout_s: float) -> WorkerLostError:
        """A collective of outer step ``step`` failed after the barrier (a worker died inside the step)."""
        who = self._who(step) or f"a worker dropped out during outer step {step}"
        return WorkerLostError(
            f"{who}; this worker ({self.worker}) gave up after at most {timeout_s:.0f} s "
            f"(--sparseloco-outer-timeout). Cause: {type(exc).__name__}: {exc}. "
            "Fix: restart the job from the last complete checkpoint (a dead worker cannot rejoin mid-run)")
