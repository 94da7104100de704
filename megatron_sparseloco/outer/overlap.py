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

Background execution: the collectives of a launched round run on one thread (``CommThread``,
shared by every strategy of the job so their collectives are issued in the same order on every
rank), on the strategy's process group, which the caller must reserve for it (a group of its own
over the same cross-worker ranks: ``build_outer_group``). On CUDA the thread runs on its own
stream that waits for the launch's kernels first; the main stream waits for it at completion.
Payload sizes are fixed at launch (entropy coding exchanges its sizes on the thread, first).
One round per strategy is in flight at a time (τ < H).

Non-finite guard: the tiny all-reduce of the non-finite flag runs at launch, on the main thread
(its latency is exposed; nothing else of the round is). A skipped round resets θ_r ← θ_outer,k at
launch as the blocking step does; nothing is in flight, θ_outer,k+1 = θ_outer,k and the merge at
H·k+τ still runs (``replay``: θ_outer,k + (θ_now − θ_outer,k); ``lerp``: the pull towards θ_outer,k).

Checkpoints: ``wait()`` completes the collective and computes θ_outer,k+1 early (the payloads were
fixed at launch, so this is bitwise what completion computes); the merge stays due at H·k+τ. A
checkpoint therefore needs, besides the strategy's state (now θ_outer,k+1), only the launch
snapshot (``attached_state["overlap_launch"]``, replay) and the fact that a merge is due, which
the caller derives from its inner-step counter.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_sparseloco.outer.base import ConfigError, OuterStepStats, OuterStrategy

MERGES = ("replay", "lerp")


@dataclass
class OverlapConfig:
    """``steps`` τ (0: blocking), the ``merge`` rule and lerp's ``alpha``."""

    steps: int = 0
    merge: str = "replay"
    alpha: float = 0.5

    def validate(self, inner_steps: Optional[int] = None) -> "OverlapConfig":
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigError(f"overlap steps must be an integer >= 0, got {self.steps!r}")
        if inner_steps is not None and self.steps >= inner_steps > 0 and self.steps > 0:
            raise ConfigError(f"overlap steps τ={self.steps} must be < inner steps H={inner_steps}")
        if self.merge not in MERGES:
            raise ConfigError(f"overlap merge must be one of {MERGES}, got {self.merge!r}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"overlap alpha must be in [0, 1], got {self.alpha!r}")
        return self


class CommThread:
    """One background thread (and, on CUDA, one stream) running launched rounds in submission order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparseloco-outer-comm")
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def submit(self, fn: Callable[[], None]) -> Future:
        if self.stream is None:
            return self.executor.submit(fn)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the launch's kernels first

        def run():
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                fn()
            self.stream.synchronize()  # done means the data is there (blocks this thread only)

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
        if not strategy.supports_overlap:
            strategy._launch_round(OuterStepStats())  # raises the strategy's ConfigError
        self.strategy = strategy
        self.comm = comm if comm is not None else CommThread(strategy.device)
        self._own_comm = comm is None
        self.before_communicate = before_communicate
        self.launch_params: Optional[torch.Tensor] = None
        if config.merge == "replay":
            self.launch_params = torch.zeros(strategy.params.numel, dtype=torch.float32, device=strategy.device)
            strategy.attached_state["overlap_launch"] = self.launch_params
        self._future: Optional[Future] = None
        self._finish: Optional[Callable[[], None]] = None
        self._stats: Optional[OuterStepStats] = None
        #: between ``agree()`` and ``start()``: the agreed verdict (run the round?)
        self._proceed: Optional[bool] = None
        self._before = (0, 0, 0)
        #: a launched round whose θ_outer,k+1 was computed (``wait``) but not yet merged
        self.merge_due = False
        self.comm_started_at: Optional[float] = None
        self.comm_ended_at: Optional[float] = None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    # ------------------------------------------------------------------ launch
    def launch(self) -> None:
        """End of round k: non-finite agreement, Δ_k and payloads, snapshot, start the collective.

        ``agree()`` then ``start()``. Several drivers whose strategies share one process group (a
        MoE model's dense and expert shards) must run every ``agree()`` before the first
        ``start()``: the agreement is a main-thread collective on that group, and one issued while
        the comm thread already runs another driver's collective on it could be matched with that
        collective on a peer (gloo and NCCL match a group's collectives in issue order), which
        deadlocks or mixes data (``OuterLoopOptimizer.launch_outer_step`` does so)."""
        self.agree()
        self.start()

    def agree(self) -> None:
        """The launch's main-thread collective: the workers agree whether round k's Δ_k is finite
        (a skipped round resets θ_local ← θ_outer,k here). Nothing is in flight after it."""
        if self._future is not None or self.merge_due or self._proceed is not None:
            raise RuntimeError(f"{self.strategy.name}: a round is still in flight; complete() it before the next "
                               "launch (overlap steps τ must be < inner steps H)")
        s = self.strategy
        t0 = time.perf_counter()
        stats = OuterStepStats(step=s.outer_steps + 1, numel=s.params.numel)
        self._before = (s.counter.bytes_sent, s.counter.bytes_received, s.counter.collectives)
        self._stats = stats
        self._proceed, _ = s.nonfinite_verdict(stats)  # strategies with overlap agree: the step sees None
        stats.extra["time_agree_s"] = time.perf_counter() - t0   # includes waiting for the slowest worker
        stats.time_exposed_s += stats.extra["time_agree_s"]

    def start(self) -> None:
        """After ``agree()``: Δ_k and the payloads, the launch snapshot, the collective on the comm thread."""
        if self._proceed is None:
            raise RuntimeError(f"{self.strategy.name}: start() before agree()")
        s, stats, proceed = self.strategy, self._stats, self._proceed
        self._proceed = None
        t0 = time.perf_counter()
        if proceed:
            communicate, self._finish = s._launch_round(stats)
            if self.launch_params is not None:
                s.params.read(0, s.params.numel, self.launch_params)
            self._future = self.comm.submit(self._timed(communicate, stats))
        else:  # skipped: θ_local ← θ_outer,k already written back; nothing in flight
            self._finish = None
            if self.launch_params is not None:
                s.params.read(0, s.params.numel, self.launch_params)
        self.merge_due = True
        stats.time_exposed_s += time.perf_counter() - t0

    def _timed(self, communicate: Callable[[], None], stats: OuterStepStats) -> Callable[[], None]:
        def run():
            self.comm_started_at = time.perf_counter()
            if self.before_communicate is not None:
                self.before_communicate()
            communicate()
            self.comm_ended_at = time.perf_counter()
            stats.time_communicate_s += self.comm_ended_at - self.comm_started_at
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
            self._finish()
            self._finish = None
        s.outer_steps += 1
        stats.bytes_sent = s.counter.bytes_sent - self._before[0]
        stats.bytes_received = s.counter.bytes_received - self._before[1]
        stats.collectives = s.counter.collectives - self._before[2]
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
        s = self.strategy
        n, b = s.params.numel, s.config.bucket_numel
        buf = torch.empty(min(n, b), dtype=torch.float32, device=s.device)
        for lo in range(0, n, b):
            hi = min(n, lo + b)
            cur = s.params.read(lo, hi, buf[:hi - lo])
            if self.config.merge == "replay":
                cur.sub_(self.launch_params[lo:hi]).add_(s.anchor[lo:hi])   # (θ_now − θ_launch) + θ_outer,k+1
            else:
                cur.copy_(torch.lerp(s.anchor[lo:hi], cur, self.config.alpha))
            s.params.write(lo, hi, cur)
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


__all__ = ["CommThread", "DelayedOuter", "MERGES", "OverlapConfig"]
