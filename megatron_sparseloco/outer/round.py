"""One outer round of one strategy, bucket by bucket: begin → communicate → commit | rollback.

A strategy describes its outer step as a ``RoundPlan``: three phases per bucket b (a flat range
[s_b, e_b) of this rank's shard) and two for the whole round,

    compress(b)          local: Δ_b = θ_outer − θ_local, the strategy's state update that depends on
                         Δ only (SparseLoCo: e ← βe + Δ, payload, e ← e − decode(payload)), the
                         bytes to send; touches nothing another bucket's phases read
    start_exchange(b)    every collective of bucket b, issued; returns a ``comm.pending.Pending``
                         whose ``wait()`` gives what the others sent (asynchronous where the
                         communication interface allows it; multi-phase exchanges run at once)
    validate(b, recv)    decode what was received and reduce it to what ``apply`` needs (SparseLoCo:
                         the mean of the contributors' sparse values; dense: Δ̄), touching no state of
                         the strategy; the codec's checks are recorded, raised by ``check_validated``
    apply(b, valid)      θ_outer and the strategy state on bucket b from the validated data (no write
                         into the params)
    finish()             the round's totals into its ``OuterStepStats``
    cancel()             undo every compress: the state exactly as before the round

and the caller schedules them in one of two ways:

* **pipelined** (``run_pipelined``; the blocking outer step, τ = 0): compress(b + 1) runs while
  bucket b's collective is in flight, bucket b is applied and written back (θ_local ← θ_outer) as
  soon as its exchange completed. At most ``depth`` = 2 buckets' buffers exist at a time.
* **held** (delayed application τ ≥ 1, ``outer/overlap.py``; elastic rounds): ``compress_all`` at
  launch, ``exchange_all`` later (every bucket's collective started, then every one waited for),
  ``validate_all`` (every bucket validated, then ``check_validated``: a payload that fails a codec
  check raises here, before anything is applied; ``aggregate_finite`` says whether the validated
  aggregate is finite), then ``commit`` (apply every bucket, finish) or ``cancel``. Every bucket's
  buffers exist until the round ends. An elastic round validates before its commit vote, so a
  commit only writes data already checked and cannot fail on a peer's bytes.

Both run the same operations on the same bucket ranges in bucket order, and the round's
accumulators (norms, counts) are added in bucket order in both, so θ_outer and the stats come out
bitwise the same whichever way a round is scheduled.

A strategy that only knows its whole outer step as one call (``OuterStrategy._outer_step``, the
simple form of the extension contract, docs/design.md "Adding an outer algorithm") gets
``WholeStepPlan``: one "bucket" whose exchange runs that call; its rollback restores a snapshot
of the strategy's per-element state.

Timing (``PhaseClock``): wall time per phase into ``time_compress_s`` / ``time_communicate_s`` /
``time_apply_s``. On CUDA each phase records a pair of events and the clock reads them all once,
at the end of the round (one host synchronisation per round, not two per phase per bucket).
"""
from __future__ import annotations

import abc
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_sparseloco.comm.pending import Pending

if TYPE_CHECKING:
    from megatron_sparseloco.outer.base import OuterStepStats, OuterStrategy


@dataclass(frozen=True)
class Capabilities:
    """What an outer strategy can do; the loop and the flag checks read these, nothing else."""

    #: after an outer step every worker holds the same θ_outer (False for gossip: workers differ, so
    #: cross-worker consistency checks and fragments do not apply)
    identical_across_workers: bool = True
    #: the fewest workers the algorithm makes sense with (gossip needs a neighbour)
    min_workers: int = 1
    #: workers may run different numbers of inner steps per round (nothing assumes equal H_w)
    per_worker_inner_steps: bool = False
    #: keeps an error-feedback buffer (its norm is logged; elastic heals never copy it)
    has_error_feedback: bool = False
    #: the plan's phases are split so that the exchange can run while training goes on (τ ≥ 1):
    #: compress reads the params, exchange touches only the round's buffers, apply writes θ_outer
    supports_overlap: bool = False
    #: the workers agree on the non-finite verdict before the exchange (one all-reduce of a flag);
    #: False where the exchange carries it (gossip: the flag rides on the proposals)
    agrees_nonfinite_before_step: bool = True
    #: reaches θ_outer only through ``anchor_bucket`` / ``store_anchor_bucket`` / ``write_back`` /
    #: ``pseudo_gradient``, so it may live in host memory (``OuterConfig.anchor_on_cpu``)
    supports_anchor_on_cpu: bool = False
    #: the round's result depends on its contributors' data alone: what a participant that does not
    #: contribute sends is never read (SparseLoCo's all-gather decodes the contributors' payloads only;
    #: a sum reads everyone's), so an elastic round may go on with participants it refused present
    ignores_non_contributors: bool = False


class PhaseClock:
    """Seconds per phase, added into ``stats`` fields; CUDA events read once in ``resolve``."""

    def __init__(self, stats: "OuterStepStats", device: torch.device):
        self.stats = stats
        self.cuda = device.type == "cuda"
        self._events: List[Tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def phase(self, attr: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((attr, start, end))
            return
        t0 = time.perf_counter()
        yield
        setattr(self.stats, attr, getattr(self.stats, attr) + time.perf_counter() - t0)

    def resolve(self) -> None:
        """Add the recorded CUDA intervals (one synchronisation, on the last event)."""
        if not self._events:
            return
        self._events[-1][2].synchronize()
        for attr, start, end in self._events:
            setattr(self.stats, attr, getattr(self.stats, attr) + start.elapsed_time(end) / 1e3)
        self._events.clear()


def clock_of(stats: "OuterStepStats", device: torch.device) -> PhaseClock:
    """The round's clock, kept on its stats object (one per round)."""
    clock = stats.__dict__.get("_clock")
    if clock is None:
        clock = stats.__dict__["_clock"] = PhaseClock(stats, device)
    return clock


class BucketBuffers:
    """Scratch tensors per bucket: ``depth`` rotating buffers of the largest bucket (pipelined), or
    one buffer per bucket carved from one flat tensor (held: ``depth`` = number of buckets)."""

    def __init__(self, ranges: Sequence[Tuple[int, int]], depth: int, dtype: torch.dtype, device: torch.device):
        self.ranges = list(ranges)
        self.held = depth >= len(self.ranges)
        if self.held:
            total = sum(e - s for s, e in self.ranges)
            self.flat = torch.empty(total, dtype=dtype, device=device)
            self.offsets = [0]
            for s, e in self.ranges:
                self.offsets.append(self.offsets[-1] + e - s)
        else:
            largest = max(e - s for s, e in self.ranges)
            self.ring = [torch.empty(largest, dtype=dtype, device=device) for _ in range(depth)]

    def __getitem__(self, b: int) -> torch.Tensor:
        s, e = self.ranges[b]
        if self.held:
            return self.flat[self.offsets[b]:self.offsets[b + 1]]
        return self.ring[b % len(self.ring)][:e - s]


class RoundPlan(abc.ABC):
    """One round of one strategy (module docstring). ``ranges``: the buckets' flat ranges."""

    #: buckets whose buffers exist at once when pipelined (compress b + 1 while b is in flight)
    PIPELINE_DEPTH = 2
    #: the schedules time the phases (False where the strategy's own step times them: ``WholeStepPlan``)
    timed_phases = True

    def __init__(self, strategy: "OuterStrategy", stats: "OuterStepStats", ranges: Sequence[Tuple[int, int]],
                 held: bool):
        self.strategy, self.stats, self.ranges = strategy, stats, list(ranges)
        self.held = held
        self.depth = len(self.ranges) if held else self.PIPELINE_DEPTH
        self.clock = clock_of(stats, strategy.device)
        self.received: Dict[int, Any] = {}
        #: the held schedule's ``validate_all`` ran (``received`` then holds validated data)
        self.validated = False
        #: bucket → θ_outer of it on the params' device as ``apply`` left it (``anchor_on_cpu``: the
        #: staged copy), for the write-back that follows, so θ_outer is staged once per apply
        self.staged: Dict[int, torch.Tensor] = {}

    def _phase(self, attr: str):
        return self.clock.phase(attr) if self.timed_phases else contextlib.nullcontext()

    def buffers(self, dtype: torch.dtype = torch.float32) -> BucketBuffers:
        return BucketBuffers(self.ranges, self.depth, dtype, self.strategy.device)

    @abc.abstractmethod
    def compress(self, b: int) -> None:
        """Δ and the local state update of bucket b; what to send."""

    @abc.abstractmethod
    def start_exchange(self, b: int) -> Pending:
        """Issue bucket b's collectives; the result is what ``apply`` takes."""

    def validate(self, b: int, received: Any) -> Any:
        """Bucket b's received data decoded and reduced to what ``apply`` takes, without changing the
        strategy's state (default: nothing to decode). Codec checks are recorded, not raised."""
        return received

    def check_validated(self) -> None:
        """Raise the first check that failed in the ``validate`` calls so far (default: none)."""

    def aggregate_finite(self) -> bool:
        """Whether every validated aggregate is finite (one host read; default: True)."""
        return True

    @abc.abstractmethod
    def apply(self, b: int, received: Any) -> None:
        """θ_outer and the strategy state on bucket b from what ``validate`` returned (no params written)."""

    def finish(self) -> None:
        """The round's totals into ``self.stats`` (after the last apply)."""

    def cancel(self) -> None:
        """Undo every ``compress`` (the round never happened): state bit for bit as before it."""

    # ------------------------------------------------------------------ schedules
    def run_pipelined(self, write_back: bool = True) -> None:
        """compress(b + 1) while bucket b's exchange is in flight; apply and write back each bucket."""
        pending: Optional[Tuple[int, Pending]] = None
        for b in range(len(self.ranges)):
            with self._phase("time_compress_s"):
                self.compress(b)
            with self._phase("time_communicate_s"):
                started = self.start_exchange(b)
            if pending is not None:
                self._apply_waited(*pending, write_back=write_back)
            pending = (b, started)
        if pending is not None:
            self._apply_waited(*pending, write_back=write_back)
        self.finish()
        self.strategy.anchor_ready()
        self.clock.resolve()

    def _apply_waited(self, b: int, started: Pending, write_back: bool) -> None:
        with self._phase("time_communicate_s"):
            received = started.wait()
        with self._phase("time_apply_s"):
            self.apply(b, self.validate(b, received))
            self._write_back(b, write_back)

    def compress_all(self) -> None:
        """Held schedule, at launch: every bucket's compress."""
        with self._phase("time_compress_s"):
            for b in range(len(self.ranges)):
                self.compress(b)

    def exchange_all(self) -> None:
        """Held schedule: every bucket's collectives started, then waited for (results kept)."""
        started = [self.start_exchange(b) for b in range(len(self.ranges))]
        for b, pending in enumerate(started):
            self.received[b] = pending.wait()

    def validate_all(self) -> None:
        """Held schedule, after ``exchange_all``: every bucket validated, then ``check_validated``
        (raises on a payload that fails a codec check, before anything is applied). Idempotent."""
        if self.validated:
            return
        with self._phase("time_apply_s"):
            for b in range(len(self.ranges)):
                self.received[b] = self.validate(b, self.received[b])
        self.validated = True
        self.check_validated()

    def commit(self, write_back: bool) -> None:
        """Held schedule, after ``exchange_all`` (and ``validate_all``, run here if it was not): apply every
        bucket (and write it back), finish."""
        self.validate_all()
        with self._phase("time_apply_s"):
            for b in range(len(self.ranges)):
                self.apply(b, self.received.pop(b))
                self._write_back(b, write_back)
        self.finish()
        self.strategy.anchor_ready()
        self.clock.resolve()

    def _write_back(self, b: int, write_back: bool) -> None:
        """θ_local ← θ_outer on bucket b (from the staged copy ``apply`` left, if any); the staged copy is freed."""
        staged = self.staged.pop(b, None)
        if write_back:
            self.strategy.write_back(*self.ranges[b], anchor=staged)


class WholeStepPlan(RoundPlan):
    """The simple form: the strategy's ``_outer_step(stats, nonfinite_tensor)`` is the round's only
    exchange (it communicates and updates θ_outer in one call, timing its own phases). Rollback
    restores a snapshot of the strategy's per-element state taken at the start (``snapshot=True``)."""

    timed_phases = False

    def __init__(self, strategy: "OuterStrategy", stats: "OuterStepStats", nonfinite_tensor: Optional[str],
                 held: bool, snapshot: bool = False):
        super().__init__(strategy, stats, [(0, strategy.params.numel)], held)
        self.nonfinite_tensor = nonfinite_tensor
        self._saved = strategy.snapshot_state() if snapshot else None

    def compress(self, b: int) -> None:
        """Nothing ahead of the exchange: the simple form computes Δ inside ``_outer_step``."""

    def start_exchange(self, b: int) -> Pending:
        self.strategy._outer_step(self.stats, self.nonfinite_tensor)
        return Pending.completed(None)

    def apply(self, b: int, received: Any) -> None:
        """θ_outer was updated by the exchange."""

    def cancel(self) -> None:
        if self._saved is not None:
            self.strategy.restore_state(self._saved)


__all__ = ["BucketBuffers", "Capabilities", "PhaseClock", "RoundPlan", "WholeStepPlan", "clock_of"]
