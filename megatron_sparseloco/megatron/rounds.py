"""The outer rounds of one rank: per fragment, begin → communicate → commit | rollback → close.

``OuterLoopOptimizer`` builds its rounds object through a ``RoundsFactory`` (``single_job_rounds`` here;
elastic mode's in ``megatron/elastic/rounds.py``): the factory decides which comm the strategies are
built on (``RoundsHost.build_strategies``) and owns whatever else its mode needs, so the optimizer and
the checkpoint code only see the ``Rounds`` interface (the loop's events, ``state_dict`` /
``load_state_dict`` for checkpoints, ``setup`` before the data iterators, ``close``).

``OuterRounds`` is what ``OuterLoopOptimizer.step`` hands the inner-step counter to. It asks the
``RoundSchedule`` what runs after this step and drives, per fragment p, its ``FragmentRound``:
the strategies of every member optimizer holding parameters of p on this rank, each running its
``outer.round.RoundPlan``:

    blocking (τ = 0)   begin + communicate + commit in one go, buckets pipelined
                       (``OuterStrategy.step``)
    delayed (τ ≥ 1)    begin at the launch (local check, compress), communicate on the comm
                       thread, commit (apply) and merge τ inner steps later (``outer/overlap.py``)

Whatever the schedule, a round that committed ends in one place, ``OuterRounds.finish_committed``:
the round's stats are recorded (bytes, times, norms: ``OuterLog``), the tied parameters are
copied from the first pipeline stage (fragment 0 holds them), the fp32 main params are published
to the model (main → model copy and the in-worker param all-gather), Megatron's
``sparseloco-outer-sync`` timer stops, and every ``consistency_check_interval`` rounds θ_outer is
compared across workers. ``close`` waits for every round in flight and ends the comm thread.

Counting: ``fragment_syncs[p]`` counts the rounds of fragment p begun (blocking steps and
launches); ``OuterLog.outer_steps`` the rounds completed, over all fragments (with P > 1 each
fragment's round counts once; a delayed round counts when it is waited for). Both are the same on
every rank of the job; they are what checkpoints store.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence

import torch.distributed as dist

from megatron_sparseloco.comm.interface import OuterComm

from megatron_sparseloco.megatron.placement.outer_group import WorkerLostError
from megatron_sparseloco.megatron.schedule import RoundSchedule
from megatron_sparseloco.outer.base import NonFiniteError, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.overlap import CommThread, DelayedOuter, OverlapConfig


@dataclass
class OuterLog:
    """Cumulative counters for logging (per rank): rounds completed, bytes, and the last round's figures."""

    outer_steps: int = 0
    """Rounds completed, over all fragments (saved in checkpoints)."""
    bytes_sent: int = 0
    """Bytes this rank handed to the outer collectives, summed over the rounds."""
    bytes_received: int = 0
    """Bytes this rank got from them, summed over the rounds."""
    numel: float = 0
    """Dense-equivalent elements of one round on this rank (with P fragments: the whole model's / P, so
    the dense bytes it is compared with stay per round)."""
    last: Dict[str, float] = field(default_factory=dict)
    """The last round's figures (``OuterStepStats.merged`` over the strategies that took part)."""

    def record(self, stats: Sequence[OuterStepStats], numel: float) -> None:
        """Add one round's stats, of every strategy that took part; ``numel``: see the field."""
        self.last = OuterStepStats.merged(stats)
        self.bytes_sent += sum(s.bytes_sent for s in stats)
        self.bytes_received += sum(s.bytes_received for s in stats)
        self.numel = numel


class RoundHooks(Protocol):
    """What a committed round needs from the Megatron side (``OuterLoopOptimizer`` provides it)."""

    def sync_tied(self) -> None: ...
    def publish(self) -> None: ...
    def check_consistency(self) -> None: ...
    def any_reset_in_worker(self, reset: bool) -> bool: ...
    def megatron_timer(self): ...
    def lost_worker_named(self, step_no: int, begin: Optional[str] = None) -> contextlib.AbstractContextManager: ...
    def wait_all(self, step_no: int) -> None: ...


class RoundsHost(RoundHooks, Protocol):
    """What a ``RoundsFactory`` reads from the optimizer wrapper it builds the rounds of."""

    schedule: RoundSchedule
    overlap: OverlapConfig
    consistency_check_interval: int
    group: Optional[dist.ProcessGroup]
    outer_timeout_s: Optional[float]

    def build_strategies(self, comm: Optional[OuterComm | dist.ProcessGroup]) -> List[List[OuterStrategy]]:
        """Every fragment's strategies, built on ``comm`` (the outer group they exchange over)."""
        ...

    @property
    def identical_across_workers(self) -> bool: ...


class Rounds(Protocol):
    """What the optimizer wrapper and the checkpoint code use of a rounds object (``OuterRounds``, or
    elastic mode's, which runs each round through its session)."""

    log: OuterLog
    fragments: List[FragmentRound]
    fragment_syncs: List[int]

    @property
    def delayed(self) -> List[DelayedOuter]: ...
    def after_inner_step(self, calls: int, run_step: Callable[[int], None]) -> None: ...
    def step(self, fragment: int) -> List[OuterStepStats]: ...
    def wait(self, fragment: int) -> None: ...
    def wait_all(self) -> None: ...
    def restore_counters(self, outer_steps: int, fragment_syncs: List[int], inner_calls: int) -> None: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...
    def setup(self, scheduler: Any, args: Any) -> None: ...
    def close(self) -> None: ...


#: builds the rounds of an optimizer wrapper (and, through ``host.build_strategies``, its strategies)
RoundsFactory = Callable[[RoundsHost], Rounds]


class FragmentRound:
    """The strategies of one fragment on this rank and, with τ ≥ 1, their delayed-application drivers."""

    def __init__(self, index: int, strategies: List[OuterStrategy], overlap: OverlapConfig,
                 comm: Optional[CommThread], before_communicate: Callable[[], None]):
        self.index = index
        self.strategies = strategies
        self.delayed = ([DelayedOuter(s, overlap, comm, before_communicate=before_communicate) for s in strategies]
                        if comm is not None else [])
        #: a launched round not yet waited for (on every rank, with or without strategies)
        self.unwaited = False

    def step(self) -> List[OuterStepStats]:
        """The blocking round of every strategy."""
        return [s.step() for s in self.strategies]

    def launch(self) -> bool:
        """Begin the delayed round of every strategy (each in turn: local check, compress, start on the
        comm thread); returns whether a launch reset this rank's params (non-finite, policy skip)."""
        self.unwaited = True
        for d in self.delayed:
            d.launch()
        return any(d.reset_at_launch for d in self.delayed)

    def wait(self) -> Optional[List[OuterStepStats]]:
        """Wait for the delayed round and commit it (θ_outer,k+1; no merge). None when nothing was
        unwaited; else the stats of the strategies that took part (possibly none on this rank)."""
        if not self.unwaited:
            return None
        self.unwaited = False
        stats = [d.wait() for d in self.delayed]
        return [s for s in stats if s is not None]

    def merge(self) -> None:
        for d in self.delayed:
            d.merge()

    @property
    def in_flight(self) -> bool:
        return any(d.in_flight for d in self.delayed)

    def close(self) -> None:
        """Wait for a round in flight (committed, not merged)."""
        for d in self.delayed:
            if d.in_flight:
                d.wait()


class OuterRounds:
    """Every fragment's rounds on this rank, driven by the schedule (module docstring)."""

    def __init__(self, fragment_strategies: List[List[OuterStrategy]], schedule: RoundSchedule,
                 overlap: OverlapConfig, consistency_interval: int, identical: bool, hooks: RoundHooks):
        self.schedule, self.hooks = schedule, hooks
        self.consistency_interval = consistency_interval if identical else 0
        strategies = [s for ss in fragment_strategies for s in ss]
        self.comm = CommThread(strategies[0].device) if overlap.steps > 0 and strategies else None
        #: the outer step whose delayed round was launched last (its collectives wait for every rank first)
        self._launched_step = 0
        self.fragments = [FragmentRound(p, ss, overlap, self.comm, self._wait_all)
                          for p, ss in enumerate(fragment_strategies)]
        self.fragment_syncs: List[int] = [0] * len(self.fragments)
        self.log = OuterLog()
        #: dense-equivalent elements of one round (the fragment's share with P > 1)
        self.round_numel = sum(s.params.numel for s in strategies) / len(self.fragments)
        self._exposed_at_launch = 0.0

    @property
    def delayed(self) -> List[DelayedOuter]:
        return [d for f in self.fragments for d in f.delayed]

    # ------------------------------------------------------------------ schedule
    def begin(self, fragment: int) -> None:
        """A round of ``fragment`` begins (blocking step or launch): counted here, once."""
        self.fragment_syncs[fragment] += 1

    def step(self, fragment: int) -> List[OuterStepStats]:
        """The blocking round of ``fragment``; ends in ``finish_committed``."""
        t0 = self.start_timer()
        step_no = self.log.outer_steps + 1
        with self.hooks.lost_worker_named(step_no, begin="barrier"):
            stats = self.fragments[fragment].step()
        self.finish_committed(fragment, stats, t0, time.perf_counter)
        return stats

    def launch(self, fragment: int) -> None:
        """End of a round with τ ≥ 1: every strategy's launch; publishes the params where a launch reset them."""
        t0 = self.start_timer()
        self._launched_step = self.log.outer_steps + 1
        with self.hooks.lost_worker_named(self._launched_step, begin="arrive"):
            reset = self.fragments[fragment].launch()
        if self.hooks.any_reset_in_worker(reset):   # some shard of this worker reset θ_local ← θ_outer,k
            if fragment == 0:
                self.hooks.sync_tied()
            self.hooks.publish()
        self._exposed_at_launch = time.perf_counter() - t0
        timer = self.hooks.megatron_timer()
        if timer is not None:
            timer.stop()

    def wait(self, fragment: int) -> None:
        """Wait for ``fragment``'s round in flight and commit it (no merge); records it. Idempotent."""
        frag = self.fragments[fragment]
        with self.hooks.lost_worker_named(self.log.outer_steps + 1):
            stats = frag.wait()
        if stats is None:
            return
        self.log.outer_steps += 1
        if stats:
            self.log.record(stats, self.round_numel)

    def wait_all(self) -> None:
        for p in range(len(self.fragments)):
            self.wait(p)

    def complete(self, fragment: int) -> None:
        """τ inner steps after the launch: wait, commit, merge; then ``finish_committed``."""
        t0 = self.start_timer()
        waited = self.fragments[fragment].in_flight
        self.wait(fragment)
        self.fragments[fragment].merge()
        self.finish_committed(fragment, None, t0, time.perf_counter,
                              launch_s=self._exposed_at_launch if waited else None)

    def start_timer(self) -> float:
        timer = self.hooks.megatron_timer()
        if timer is not None:
            timer.start()
        return time.perf_counter()

    def count_committed(self, stats: List[OuterStepStats]) -> None:
        """One more round completed; its stats recorded when this rank took part (with P > 1 a rank may
        hold no strategy of the fragment: then the last round's figures stay)."""
        self.log.outer_steps += 1
        if stats or len(self.fragments) == 1:
            self.log.record(stats, self.round_numel)

    def finish_committed(self, fragment: int, stats: Optional[List[OuterStepStats]], t0: float,
                   clock: Callable[[], float], launch_s: Optional[float] = None) -> None:
        """The one place a round ends (module docstring): record (blocking), tied params, publish, timer,
        exposed time, consistency check."""
        if fragment == 0:  # tied params are in fragment 0
            self.hooks.sync_tied()
        self.hooks.publish()
        timer = self.hooks.megatron_timer()
        if timer is not None:
            timer.stop()
        if stats is not None:
            self.count_committed(stats)
            self.log.last["time_exposed_s"] = clock() - t0
        elif launch_s is not None:   # the delayed round's exposed time: launch + wait + apply + merge + publish
            self.log.last["time_exposed_s"] = launch_s + clock() - t0
            self.log.last["time_launch_s"] = launch_s
        interval = self.consistency_interval
        if interval and self.log.outer_steps % interval == 0:
            self.hooks.check_consistency()

    def after_inner_step(self, calls: int, run_step: Callable[[int], None],
                         launch: Optional[Callable[[int], None]] = None,
                         complete: Optional[Callable[[int], None]] = None) -> None:
        """Run the schedule's events for inner step ``calls``; blocking rounds go through ``run_step(p)``
        (the optimizer's ``outer_step``, so that it can be observed and patched), delayed ones through
        ``launch(p)`` / ``complete(p)`` (default: this object's; elastic mode passes its own)."""
        launch, complete = launch or self.launch, complete or self.complete
        for kind, p in self.schedule.events(calls):
            if kind == "complete":
                complete(p)
                continue
            self.begin(p)
            if kind == "step":
                run_step(p)
            else:
                launch(p)

    def _wait_all(self) -> None:
        """On the comm thread, before a launched round's first collective: every rank arrived at it
        (``placement.outer_group.OuterStepWatch``: a missing worker is named before any collective is issued)."""
        self.hooks.wait_all(self._launched_step)

    def restore_counters(self, outer_steps: int, fragment_syncs: List[int], inner_calls: int) -> None:
        """After a checkpoint load or a heal: the rounds completed and begun, each strategy's round number
        (P = 1: the rounds completed; P > 1: its fragment's rounds begun), and each driver's merge due iff
        its fragment launched in the last τ of ``inner_calls`` steps."""
        self.log.outer_steps = outer_steps
        self.fragment_syncs = list(fragment_syncs)
        for p, frag in enumerate(self.fragments):
            for s in frag.strategies:
                s.outer_steps = outer_steps if len(self.fragments) == 1 else self.fragment_syncs[p]
            due = self.schedule.merge_due(inner_calls, p)
            for d in frag.delayed:
                d.merge_due = due

    def state_dict(self) -> Dict[str, Any]:
        """What this mode adds to the checkpoint's outer-loop facts (a single job: nothing)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Read back what ``state_dict`` added (``state``: the checkpoint's outer-loop facts)."""

    def setup(self, scheduler: Any, args: Any) -> None:
        """After Megatron built the model, the optimizer and the LR scheduler, before the data iterators
        (a single job: nothing to do)."""

    def close(self) -> None:
        """Wait for every round in flight and end the comm thread (idempotent)."""
        for frag in self.fragments:
            frag.close()
        if self.comm is not None:
            self.comm.shutdown()
            self.comm = None


def single_job_rounds(host: RoundsHost) -> OuterRounds:
    """The ``RoundsFactory`` of a single job: the strategies on the placement's outer group."""
    fragment_strategies = host.build_strategies(host.group)
    return OuterRounds(fragment_strategies, host.schedule, host.overlap, host.consistency_check_interval,
                       host.identical_across_workers, hooks=host)


@contextlib.contextmanager
def lost_worker_named(num_workers: int, watch, timeout_s: float, step_no: int, begin: Optional[str]) -> Iterator[None]:
    """A collective failure inside the block (timeout, closed peer) becomes the watch's
    ``WorkerLostError`` naming the workers that never reached outer step ``step_no`` (W > 1);
    ``NonFiniteError``, the arrival barrier's own ``WorkerLostError`` and single-worker errors pass
    through unchanged. ``begin``: the block begins the round — ``"barrier"``: every rank of the job
    arrives and waits for all (a blocking round: a missing worker is named before any collective);
    ``"arrive"``: its arrival is recorded (a delayed round: the comm thread waits, ``wait_all``)."""
    if begin == "barrier":
        watch.barrier(step_no)
    elif begin == "arrive":
        watch.arrive(step_no)
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        if num_workers > 1 and not isinstance(exc, (NonFiniteError, WorkerLostError)):
            raise watch.fail(step_no, exc, timeout_s) from exc
        raise


__all__ = ["FragmentRound", "OuterLog", "OuterRounds", "RoundHooks", "Rounds", "RoundsFactory", "RoundsHost",
           "lost_worker_named", "single_job_rounds"]
