"""Delayed application of the outer step: the collective runs while the next τ inner steps compute.

Blocking outer step (τ = 0) at the end of round k, on worker r::

    Δ_k = θ_outer,k − θ_r ;  communicate ;  θ_outer,k+1 = U(θ_outer,k, agg_k) ;  θ_r ← θ_outer,k+1

Delayed by τ inner steps (1 ≤ τ < H, ``OverlapConfig.steps``; Streaming DiLoCo, arXiv 2501.18512):

    launch (inner step H·k):    Δ_k = θ_outer,k − θ_r,launch      (SparseLoCo: also e ← βe + Δ_k,
                                                                  payload, e ← e − sent)
                                snapshot θ_r,launch (``replay`` only) ; start the collective ;
                                training continues from θ_r,launch (θ_r is NOT reset)
    complete (inner step H·k+τ): wait ; θ_outer,k+1 = U(θ_outer,k, agg_k) ; merge:
        replay (default):        θ_r ← θ_outer,k+1 + (θ_r,now − θ_r,launch)
                                 (the τ steps of progress are replayed on the new global point)
        lerp (torchft):          θ_r ← lerp(θ_outer,k+1, θ_r,now, α) = θ_outer,k+1 + α·(θ_r,now − θ_outer,k+1)
                                 (α = 0: drop the τ steps; α = 1: ignore the global point)

U is the strategy's own update (outer SGD / Nesterov for DiLoCo, the sparse mean for SparseLoCo,
the plain mean for averaging), computed from exactly the same bytes as the blocking step, so
θ_outer stays bitwise identical on every worker. The next round ends H inner steps after launch
k, at H·(k+1), and its pseudo-gradient is Δ_k+1 = θ_outer,k+1 − θ_r(H·(k+1)): with ``replay`` it
covers all H inner steps since launch k — the τ replayed ones and the H − τ after the merge — so
every inner step's progress enters exactly one pseudo-gradient; with ``lerp`` it covers the H − τ
steps after the merge plus α times the τ steps of the window (what the merge kept of them).

The round is the strategy's ``RoundPlan`` (``outer/round.py``) on the held schedule: its compress
phase at launch, its exchange phase in the background, its apply phase (``commit``) or ``cancel``
at completion; the merge replaces the blocking step's write-back.

Background execution: the exchange of a launched round runs on one host thread (``CommThread``,
shared by every strategy of the job so their collectives are issued in the same order on every
rank), on the strategy's process group, which the caller must reserve for it (a group of its own
over the same cross-worker ranks: ``build_outer_group``). Inside it every bucket's collective is
issued asynchronously (``async_op=True``) before the first is waited for. The thread is needed
because the data collectives depend on the round's first collective, the non-finite agreement
(they run only when every worker is finite; entropy coding's size exchange likewise decides the
data all-gather's shape): c10d cannot chain a collective on another's completion without a host
thread (``Future.then`` callbacks run on the backend's own thread, where issuing a collective is
not allowed). On CUDA the thread runs on its own stream that waits for the launch's kernels first;
the main stream waits for it at completion. One round per strategy is in flight at a time (τ < H).

Non-finite guard, agreed off the main thread: at launch each worker checks only its own params
(a local pass, no communication). A worker whose params are finite launches optimistically (Δ_k,
SparseLoCo's error-feedback update and payload, the snapshot) and training goes on from θ_r,launch;
a worker whose params are not finite launches nothing, and with policy ``skip`` resets
θ_r ← θ_outer,k at once (its NaNs must not be trained on). The agreement itself, the all-reduce MAX
of the 4-byte flag, is the first collective of the round on the comm thread: the data collectives
run only when every flag is 0, and the verdict is acted on at completion, on the main thread:

    all finite:      θ_outer,k+1 = U(θ_outer,k, agg_k), as above
    some not finite: nothing was exchanged; the launch's state updates are undone bit for bit
                     (``cancel``: SparseLoCo's error feedback from a copy made at launch);
                     θ_outer,k+1 = θ_outer,k, and the merge replays the window on it:
                     replay θ_r ← θ_outer,k + (θ_r,now − θ_r,launch), lerp the pull towards θ_outer,k.
                     With policy ``abort`` every worker raises ``NonFiniteError`` here instead.

So a skipped round discards, on every worker, the H inner steps before its launch and keeps the τ
steps of the window (the blocking step keeps none of the round; it has no window). The agreement
runs off the main thread because it waits for the slowest worker: on the main thread at launch it
was 0.29 s of the 0.37 s of exposed outer time per round on the 100 Mbit/s benchmark
(docs/archive/benchmarks_notebook.md, "Where the exposed time goes").

Checkpoints: ``wait()`` completes the collective and computes θ_outer,k+1 early (the payloads were
fixed at launch, so this is bitwise what completion computes); the merge stays due at H·k+τ. A
checkpoint therefore needs, besides the strategy's state (now θ_outer,k+1), only the launch
snapshot (``attached_state["overlap_launch"]``, replay) and the fact that a merge is due, which
the caller derives from its inner-step counter.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from megatron_sparseloco.outer.base import ConfigError, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.round import RoundPlan

MERGES = ("replay", "lerp")


@dataclass
class OverlapConfig:
    """``steps`` τ (0: blocking), the ``merge`` rule and lerp's ``alpha``."""

    steps: int = 0
    merge: str = "replay"
    alpha: float = 0.5

    def validate(self, inner_steps: Optional[int] = None) -> "OverlapConfig":
        """τ an integer >= 0 and < H (one round in flight at a time), a known merge rule, α in [0, 1]. The
        errors name the outer loop's fields (``megatron.args.loop_config.OuterLoopConfig``), whose checks these are."""
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigError(f"overlap steps must be an integer >= 0, got {self.steps!r}", "overlap_steps")
        if inner_steps is not None and self.steps >= inner_steps > 0 and self.steps > 0:
            raise ConfigError(f"τ={self.steps} must be < `inner_steps` H={inner_steps} (one round in flight at a time)",
                              "overlap_steps", f"use 1 <= τ <= {inner_steps - 1}, or raise `inner_steps`")
        if self.merge not in MERGES:
            raise ConfigError(f"overlap merge must be one of {MERGES}, got {self.merge!r}", "overlap_merge")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"overlap alpha must be in [0, 1], got {self.alpha!r}", "overlap_alpha")
        return self


def merge_window(strategy: OuterStrategy, launch_params: Optional[torch.Tensor], config: OverlapConfig) -> None:
    """θ_local ← merge(θ_outer, θ_local,now), bucket by bucket, with θ_outer the strategy's anchor now:
    ``replay`` (``launch_params`` = θ_r,launch) θ_local ← θ_outer + (θ_local,now − θ_r,launch), else
    ``lerp`` θ_local ← lerp(θ_outer, θ_local,now, α) (module docstring)."""
    s = strategy
    n, b = s.params.numel, s.config.bucket_numel
    buf = torch.empty(min(n, b), dtype=torch.float32, device=s.device)
    for lo in range(0, n, b):
        hi = min(n, lo + b)
        cur = s.params.read(lo, hi, buf[:hi - lo])
        anchor = s.anchor_bucket(lo, hi)
        if launch_params is not None:   # replay
            cur.sub_(launch_params[lo:hi]).add_(anchor)   # (θ_now − θ_launch) + θ_outer,k+1
        else:
            cur.copy_(torch.lerp(anchor, cur, config.alpha))
        s.params.write(lo, hi, cur)


class CommThread:
    """One background thread (and, on CUDA, one stream) running launched rounds in submission order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparseloco-outer-comm")
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the thread (after the current stream's kernels, on CUDA); the future holds its result."""
        if self.stream is None:
            return self.executor.submit(fn)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the launch's kernels first

        def run() -> Any:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                out = fn()
            stream.synchronize()  # done means the data is there (blocks this thread only)
            return out

        return self.executor.submit(run)

    def join(self) -> None:
        """Main stream waits for the comm stream (CUDA); call after a future completed."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)


class DelayedOuter:
    """Drives one strategy with delayed application: ``launch()``, then ``complete()`` τ inner steps later.

    ``before_communicate``: a hook run on the comm thread before the round's collectives (tests use
    it to make one peer slow).
    """

    def __init__(self, strategy: OuterStrategy, config: OverlapConfig, comm: Optional[CommThread] = None,
                 before_communicate: Optional[Callable[[], None]] = None):
        self.config = config.validate()
        if config.steps < 1:
            raise ConfigError("DelayedOuter needs overlap steps τ >= 1 (τ = 0 is the blocking OuterStrategy.step)")
        if not strategy.capabilities.supports_overlap:
            raise ConfigError(f"outer strategy {strategy.name!r} does not support delayed application "
                              "(--sparseloco-overlap-steps); use 0")
        self.strategy = strategy
        self.comm = comm if comm is not None else CommThread(strategy.device)
        self._own_comm = comm is None
        self.before_communicate = before_communicate
        self.launch_params: Optional[torch.Tensor] = None
        if config.merge == "replay":
            self.launch_params = torch.zeros(strategy.params.numel, dtype=torch.float32, device=strategy.device)
            strategy.attached_state["overlap_launch"] = self.launch_params
        self._future: Optional[Future] = None
        #: the launched round's plan (None: nothing in flight, or this worker's params were not finite)
        self._plan: Optional[RoundPlan] = None
        #: this worker's first non-finite tensor at launch (None: finite), and the agreed culprit
        #: (set on the comm thread; None: every worker was finite)
        self._bad_name: Optional[str] = None
        self._culprit: Optional[int] = None
        #: the last launch reset θ_local ← θ_outer,k (this worker's params were not finite, policy skip)
        self.reset_at_launch = False
        self._stats: Optional[OuterStepStats] = None
        #: between ``agree()`` and ``start()``: the agreed verdict (run the round?)
        self._proceed: Optional[bool] = None
        self._before: Tuple[int, int, int] = (0, 0, 0)
        #: a launched round whose θ_outer,k+1 was computed (``wait``) but not yet merged
        self.merge_due = False
        self.comm_started_at: Optional[float] = None
        self.comm_ended_at: Optional[float] = None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    # ------------------------------------------------------------------ launch
    def launch(self) -> None:
        """End of round k: the local non-finite check, Δ_k and payloads, snapshot, start the round.

        ``agree()`` then ``start()``; no collective runs on the main thread (the agreement is the
        round's first collective on the comm thread, so several drivers sharing one process group
        issue their collectives in the same order on every rank: the order of their ``start()``)."""
        self.agree()
        self.start()

    def agree(self) -> None:
        """The launch's local half of the non-finite guard: is *this* worker's Δ_k finite? No
        communication (the workers' agreement runs on the comm thread, ahead of the round's data
        collectives: module docstring); a worker whose params are not finite resets
        θ_local ← θ_outer,k here under policy ``skip``."""
        if self._future is not None or self.merge_due or self._proceed is not None:
            raise RuntimeError(f"{self.strategy.name}: a round is still in flight; complete() it before the next "
                               "launch (overlap steps τ must be < inner steps H)")
        s = self.strategy
        t0 = time.perf_counter()
        stats = s.new_stats()
        self._before = s.counter_marks()
        self._stats = stats
        self._bad_name = s.first_nonfinite_tensor()
        self._proceed = self._bad_name is None
        self.reset_at_launch = not self._proceed and s.config.nonfinite_policy == "skip"
        if self.reset_at_launch:
            s.reset_to_anchor()
        stats.time_exposed_s += time.perf_counter() - t0

    def start(self) -> None:
        """After ``agree()``: Δ_k and the payloads (finite workers), the launch snapshot, then the round on
        the comm thread: the workers' agreement, and the data collectives if every worker was finite."""
        if self._proceed is None:
            raise RuntimeError(f"{self.strategy.name}: start() before agree()")
        s, stats, proceed = self.strategy, self._stats, self._proceed
        assert stats is not None
        self._proceed = None
        t0 = time.perf_counter()
        communicate: Optional[Callable[[], None]] = None
        self._plan = None
        if proceed:
            self._plan = s.begin_round(stats, None, held=True)
            self._plan.compress_all()
            communicate = self._plan.exchange_all
        if self.launch_params is not None:
            s.params.read(0, s.params.numel, self.launch_params)
        self._culprit = None
        self._future = self.comm.submit(self._timed(self._agreed(communicate, stats), stats))
        self.merge_due = True
        stats.time_exposed_s += time.perf_counter() - t0

    def _agreed(self, communicate: Optional[Callable[[], None]], stats: OuterStepStats) -> Callable[[], None]:
        """The round on the comm thread: the non-finite agreement, then ``communicate`` if all were finite."""
        def run():
            t0 = time.perf_counter()
            self._culprit = self.strategy._nonfinite_culprit(self._bad_name)
            stats.extra["time_agree_s"] = time.perf_counter() - t0   # includes waiting for the slowest worker
            if self._culprit is None and communicate is not None:
                communicate()
        return run

    def _timed(self, communicate: Callable[[], None], stats: OuterStepStats) -> Callable[[], None]:
        def run():
            self.comm_started_at = time.perf_counter()
            if self.before_communicate is not None:
                self.before_communicate()
            communicate()
            self.comm_ended_at = time.perf_counter()
            # the data collectives only: the agreement before them (``_agreed``) is timed apart
            stats.time_communicate_s += (self.comm_ended_at - self.comm_started_at
                                         - stats.extra.get("time_agree_s", 0.0))
        return run

    # ------------------------------------------------------------------ wait, merge
    def wait(self) -> Optional[OuterStepStats]:
        """Wait for the collective and compute θ_outer,k+1 (no merge); returns the round's stats, once.

        None when there is nothing to wait for (no launch, already waited). Exceptions of the
        collective (timeouts, a dead peer) are raised here.
        """
        if self._stats is None:
            return None
        s, stats = self.strategy, self._stats
        t0 = time.perf_counter()
        if self._future is not None:
            future, self._future = self._future, None
            w0 = time.perf_counter()
            try:
                future.result()
            finally:
                stats.extra["time_wait_s"] = time.perf_counter() - w0
            self.comm.join()
            plan, self._plan = self._plan, None
            if self._culprit is None:
                assert plan is not None
                plan.commit(write_back=False)
            else:  # a worker's Δ_k was not finite: nothing was exchanged, θ_outer,k+1 = θ_outer,k
                if plan is not None:
                    plan.cancel()
                if s.config.nonfinite_policy == "abort":
                    self._stats = None
                    self.merge_due = False
                    raise s._nonfinite_error(self._culprit, self._bad_name)
                stats.skipped = True
        s.end_round(stats, self._before)
        stats.time_exposed_s += time.perf_counter() - t0
        self._stats = None
        return stats

    def merge(self) -> float:
        """θ_local ← merge(θ_outer,k+1, θ_local,now) (see the module docstring); returns its wall time."""
        if not self.merge_due:
            return 0.0
        if self._stats is not None:
            raise RuntimeError("merge() before wait()")
        t0 = time.perf_counter()
        merge_window(self.strategy, self.launch_params, self.config)
        self.merge_due = False
        return time.perf_counter() - t0

    def complete(self) -> Optional[OuterStepStats]:
        """τ inner steps after launch: ``wait()`` (if not done yet) then ``merge()``.

        Returns the round's stats when this call waited for it (None when a checkpoint's ``wait``
        took them already, or nothing was launched).
        """
        stats = self.wait()
        exposed = self.merge()
        if stats is not None:
            stats.time_exposed_s += exposed
        return stats

    def close(self) -> None:
        """Wait for a round in flight (its result is computed, not merged) and stop an own thread."""
        if self._future is not None:
            self.wait()
        if self._own_comm:
            self.comm.shutdown()


__all__ = ["CommThread", "DelayedOuter", "MERGES", "OverlapConfig", "merge_window"]
