"""What an elastic job receives when it heals from a live peer, and the counters it catches up on.

A job whose committed step is behind the quorum's receives, from the peer at the same shard
position (``elastic.heal``: raw tensors and a validated JSON header, nothing unpickled)::

    outer       per strategy: θ_outer and every per-element buffer of ``elementwise_buffers``
                except ``heal_excluded_buffers`` (SparseLoCo's error feedback: zero on the joiner),
                and the strategy's round counter
    inner       per member optimizer: the inner optimizer's state of this rank's shard (Adam:
                exp_avg, exp_avg_sq, step) and the param groups' own ``step`` where one is kept
    loop        inner_calls, outer_steps, fragment_syncs (``OuterLoopOptimizer``)
    train       the run's counters (``Counters``): iteration, consumed train / valid samples
    scheduler   Megatron's LR scheduler ``state_dict`` (JSON scalars)

The fp32 main params are not sent. What a job takes from a heal depends on when it heals:

    joining     (its first round: a (re)started job; ``in_iteration`` False) everything above;
                θ_local ← θ_outer; it continues at the run's counters (iteration, data slot
                position, LR schedule, inner optimizer state from the peer)
    catching up (a later round: stopped, cut off, or its vote failed while the others committed;
                ``in_iteration`` True) only ``outer`` (θ_outer, outer momentum; error feedback
                restarts at zero). The job keeps its own iteration, data position, LR schedule and
                inner optimizer state: it reads every sample of its slot once and finishes its
                iterations later than the run, contributing as it goes. Its local progress
                θ_local − θ_outer is carried onto the new θ_outer when ``keep_progress`` (set by the
                rounds from ``--sparseloco-elastic-after-failed-round`` and whether its last
                pseudo-gradient may already be in the run's θ_outer), else θ_local ← θ_outer; while
                the round that healed it runs, the params hold that progress
                (``OuterStrategy.hold_local_progress``), which ``finish_catch_up`` puts back.

The caller publishes the params (main → model params and the in-job param all-gather: a
collective, so not done here, on torchft's quorum path).

Counters are *post-iteration* values: a sender inside ``optimizer.step()`` of iteration k (its
training loop's counters advance only after the step returns) reports iteration k + 1, consumed
samples + the job's batch B and the scheduler's steps + B (``Counters.of``): exactly what it holds
once that iteration ends, which is where the joiner starts. The same triple rides in every round
header (``extra``), so a job that joins without a heal (same committed step) takes the run's
position from its peers: its data slot then continues where the run is (a missed slot is skipped,
never read twice).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from megatron_sparseloco.megatron.checkpoint.outer_state import ensure_adam_step_state

if TYPE_CHECKING:
    from megatron_sparseloco.megatron.optimizer import OuterLoopOptimizer


@dataclass(frozen=True)
class Counters:
    """Where a job's training loop is, after the iteration it is in (module docstring)."""

    iteration: int = 0
    samples: int = 0        # consumed train samples (the job's own: the run's / W)
    valid_samples: int = 0  # consumed validation samples
    lr_steps: int = 0       # the LR scheduler's num_steps

    def extra(self) -> Dict[str, int]:
        """The round header's ``extra`` fields."""
        return {"iteration": self.iteration, "samples": self.samples, "valid_samples": self.valid_samples,
                "lr_steps": self.lr_steps}

    @classmethod
    def from_extra(cls, extra: Dict[str, Any]) -> Optional["Counters"]:
        try:
            return cls(**{k: int(extra[k]) for k in ("iteration", "samples", "valid_samples", "lr_steps")})
        except (KeyError, TypeError, ValueError):
            return None

    @classmethod
    def of(cls, args, scheduler, in_iteration: bool) -> "Counters":
        """This job's counters (``args``: Megatron's; None: all zero); ``in_iteration``: called inside
        ``optimizer.step()`` of an iteration whose counters Megatron has not advanced yet."""
        if args is None:
            return cls()
        batch = int(getattr(args, "global_batch_size", 0) or 0) if in_iteration else 0
        curr = getattr(args, "curr_iteration", None)
        iteration = curr + 1 if in_iteration and curr is not None else int(getattr(args, "iteration", 0) or 0)
        lr_steps = int(getattr(scheduler, "num_steps", 0) or 0) + batch if scheduler is not None else 0
        return cls(int(iteration), int(getattr(args, "consumed_train_samples", 0) or 0) + batch,
                   int(getattr(args, "consumed_valid_samples", 0) or 0), lr_steps)

    def apply(self, opt: "OuterLoopOptimizer", args, scheduler) -> None:
        """Put the job's loop at these counters (before its training loop starts)."""
        opt.inner_calls = self.iteration
        if args is not None:
            args.iteration = self.iteration
            args.consumed_train_samples = self.samples
            args.consumed_valid_samples = self.valid_samples
        if scheduler is not None and getattr(scheduler, "num_steps", None) is not None:
            scheduler.num_steps = 0
            scheduler.step(increment=self.lr_steps)   # sets the LR and weight decay of that step


class HealGate:
    """Where a heal may touch a training job's state during a delayed round (τ ≥ 1).

    The round's quorum runs on the comm thread while the training thread computes the window's inner
    steps, and torchft heals inside the quorum: a source reads its live state (θ_outer, the inner
    optimizer's state, the counters), a job catching up writes θ_outer and its params. Both must see the
    training thread stopped at one point that every rank of the job reaches at the same iteration: the
    round's completion. ``request`` (the heal, on the comm thread, from ``HealState.state`` / ``load``)
    blocks until the training thread is parked there (``serve``, while it waits for the round), and the
    training thread stays parked until ``release`` (the comm thread, once the quorum returned). A round
    without a heal never parks anyone. ``timeout``: how long a heal waits for the training thread
    (--sparseloco-elastic-heal-timeout)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        #: a delayed round's quorum is running on the comm thread
        self.active = False
        self._requested = threading.Event()
        self._parked = threading.Event()
        self._released = threading.Event()

    def arm(self) -> None:
        """The training thread, at the launch: the round's quorum may heal."""
        self._requested.clear()
        self._parked.clear()
        self._released.clear()
        self.active = True

    def request(self) -> None:
        """The comm thread, before a heal reads or writes this job's state: wait for the training thread to
        park (no-op outside a delayed round's quorum, or once parked)."""
        if not self.active or self._parked.is_set():
            return
        self._requested.set()
        if not self._parked.wait(self.timeout):
            raise RuntimeError(f"the training thread did not reach the delayed round's completion within "
                               f"{self.timeout:g} s (--sparseloco-elastic-heal-timeout)")

    def release(self) -> None:
        """The comm thread, once the quorum (and any heal) returned: the training thread goes on."""
        self.active = False
        self._released.set()

    def serve(self, future: Future) -> None:
        """The training thread, waiting at the completion for the round on the comm thread: park while a
        heal runs (until ``release``), then go on waiting."""
        while not future.done():
            if self._requested.is_set() and not self._parked.is_set():
                self._parked.set()
                self._released.wait()     # the comm thread releases in a ``finally``
            else:
                wait([future], timeout=0.05)


def megatron_args() -> Any:
    """megatron.training's args, or None outside its training loop (tests driving the optimizer directly)."""
    try:
        from megatron.training.global_vars import get_args
        return get_args()
    except (ImportError, AssertionError):
        return None


def _scalar(v: Any) -> Any:
    return v if v is None or isinstance(v, (bool, int, float, str)) else None


def _inner_state(opt: "OuterLoopOptimizer", member: int) -> Dict[str, Any]:
    """Member ``member``'s inner optimizer state on this rank: per shard tensor its state tensors."""
    inner = opt.shards[member].inner_optimizer()
    if inner is None:
        return {"params": [], "group_steps": []}
    params = [{k: v for k, v in sorted(inner.state.get(t, {}).items()) if torch.is_tensor(v)}
              for t in opt.shards[member].tensors]
    return {"params": params, "group_steps": [_scalar(g.get("step")) for g in inner.param_groups]}


class HealState:
    """The state ``ElasticSession`` sends and receives for ``opt`` (module docstring).

    ``args_fn()`` returns Megatron's args (None outside megatron.training); ``scheduler`` is set by
    the plugin once Megatron built it; ``in_iteration`` says whether the rounds run inside a step."""

    def __init__(self, opt: "OuterLoopOptimizer", args_fn: Callable[[], Any]):
        self.opt, self.args_fn = opt, args_fn
        self.scheduler = None
        self.in_iteration = False
        #: catching up: carry the local progress onto the healed θ_outer (module docstring)
        self.keep_progress = False
        #: a catch-up left the local progress in the params (``finish_catch_up`` puts it back)
        self.holds_progress = False
        #: delayed rounds: where a heal inside the round's quorum may touch the state (``HealGate``), and
        #: each strategy's launch snapshot θ_r,launch (by ``id``), which a catch-up moves with θ_outer
        self.gate: Optional[HealGate] = None
        self.snapshots: Dict[int, torch.Tensor] = {}
        # the inner optimizer's state exists from the start (Adam's zeros and step 0, which is what
        # its first step would create): a job that never stepped has the structure a heal fills
        ensure_adam_step_state(opt.members)

    def counters(self) -> Counters:
        return Counters.of(self.args_fn(), self.scheduler, self.in_iteration)

    def state(self) -> Dict[str, Any]:
        """References to the live state (the quorum thread sends them while the training thread waits: in a
        blocking round inside its ``optimizer.step()``, in a delayed one parked by the gate)."""
        if self.gate is not None:
            self.gate.request()
        opt = self.opt
        outer = [{"steps": s.outer_steps, **{k: v for k, v in s.elementwise_state().items()
                                              if k not in s.heal_excluded_buffers and k not in s.attached_state}}
                 for s in opt.strategies]
        sched: Dict[str, Any] = self.scheduler.state_dict() if self.scheduler is not None else {}
        return {"outer": outer, "inner": [_inner_state(opt, m) for m in range(len(opt.shards))],
                "loop": {"inner_calls": opt.inner_calls, "outer_steps": opt.outer_steps,
                         "fragment_syncs": [int(n) for n in opt.fragment_syncs]},
                "train": self.counters().extra(), "scheduler": {k: _scalar(v) for k, v in sched.items()}}

    def template(self) -> Dict[str, Any]:
        """The structure a heal must have: this job's own state, tensors as meta tensors (no memory)."""
        def meta(x: Any) -> Any:
            if isinstance(x, dict):
                return {k: meta(v) for k, v in x.items()}
            if isinstance(x, list):
                return [meta(v) for v in x]
            return torch.empty(x.shape, dtype=x.dtype, device="meta") if torch.is_tensor(x) else x
        return meta(self.state())

    @torch.no_grad()
    def load(self, state: Dict[str, Any]) -> None:
        """Apply a received state (validated against ``template``): join or catch up (module docstring).
        No collective."""
        if self.gate is not None:
            self.gate.request()
        if self.in_iteration:
            self._catch_up(state)
        else:
            self._join(state)

    def _load_outer(self, state: Dict[str, Any]) -> None:
        """θ_outer and the outer buffers from the heal; the excluded ones (error feedback) zeroed."""
        for s, got in zip(self.opt.strategies, state["outer"]):
            live = s.elementwise_state()
            for k, v in got.items():
                if k != "steps":
                    live[k].copy_(v)
            for k in s.heal_excluded_buffers:
                if live.get(k) is not None:
                    live[k].zero_()
            s.outer_steps = int(got["steps"])

    def _catch_up(self, state: Dict[str, Any]) -> None:
        """Only the outer state; the local progress held in the params when ``keep_progress``, else
        θ_local ← θ_outer."""
        opt = self.opt
        if self.keep_progress:
            for s in opt.strategies:
                s.hold_local_progress()
            self.holds_progress = True
        snaps = [(s, self.snapshots[id(s)]) for s in opt.strategies if id(s) in self.snapshots]
        for s, snap in snaps:      # a delayed round's snapshot: θ_r,launch − θ_outer,old, the progress at the launch
            snap.sub_(s.anchor.to(snap.device))
        self._load_outer(state)
        for s, snap in snaps:      # ... carried onto the healed θ_outer (its Δ from it is that progress)
            snap.add_(s.anchor.to(snap.device))
        if not self.keep_progress:
            for s in opt.strategies:
                s.reset_to_anchor()
        opt._anchor_at_first_step = False

    def finish_catch_up(self) -> None:
        """After the round that healed this job: the held progress onto the current θ_outer."""
        if self.holds_progress:
            for s in self.opt.strategies:
                s.apply_local_progress()
            self.holds_progress = False

    def _join(self, state: Dict[str, Any]) -> None:
        """Everything (module docstring); θ_local ← θ_outer."""
        opt = self.opt
        outer_steps = int(state["loop"]["outer_steps"])
        syncs = [int(n) for n in state["loop"]["fragment_syncs"]]
        opt.rounds.restore_counters(outer_steps, syncs, int(state["loop"]["inner_calls"]))
        self._load_outer(state)
        for s in opt.strategies:
            s.reset_to_anchor()
        for m, got in enumerate(state["inner"]):
            self._load_inner(m, got)
        counters = Counters.from_extra(state["train"]) or Counters()
        counters.apply(opt, self.args_fn(), self.scheduler)
        opt.inner_calls = int(state["loop"]["inner_calls"])
        opt._anchor_at_first_step = False

    def _load_inner(self, member: int, got: Dict[str, Any]) -> None:
        inner = self.opt.shards[member].inner_optimizer()
        if inner is None:
            return
        for t, values in zip(self.opt.shards[member].tensors, got["params"]):
            st = inner.state[t]
            for k, v in values.items():
                st[k].copy_(v)
        for g, step in zip(inner.param_groups, got["group_steps"]):
            if step is not None and "step" in g:
                g["step"] = step


def heal_summary(records: List[Any]) -> str:
    """``received N bytes in S s`` over a list of ``elastic.heal.HealRecord`` (empty: '')."""
    got = [r for r in records if r.role == "received"]
    if not got:
        return ""
    return f"{sum(r.nbytes for r in got)} bytes in {sum(r.seconds for r in got):.3f} s"


__all__ = ["Counters", "HealGate", "HealState", "heal_summary", "megatron_args"]
