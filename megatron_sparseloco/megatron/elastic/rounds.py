"""The outer rounds of one rank of an elastic job: every round through the ``ElasticSession``.

In elastic mode (``--sparseloco-lighthouse``) each worker is its own Megatron job; group rank g
(this rank's ``torch.distributed`` rank in its job) of every live job forms the outer group of
shard position g, which torchft rebuilds at every quorum. The plugin hands ``OuterLoopOptimizer``
the factory ``elastic_rounds(config)``: it opens the session, builds every fragment's strategies on
``session.comm`` (``RoundsHost.build_strategies``) and returns the ``ElasticRounds`` that owns the
session and the heal state. The schedule (``megatron/schedule.py``: H, τ, P) says when a round
begins; each round syncs one fragment of the model (the whole model with P = 1) and is one round of
the elastic protocol, with its own quorum, header, verdicts and vote:

    finite = every rank of the job finite              (one in-job all-reduce MAX)
    rnd = session.begin_round(contributes, finite, samples, tokens, fingerprint(θ_outer), counters,
                              fragment p of the schedule)
          (quorum; a job behind the quorum heals: ``heal_state.HealState``; round binding; signed
          headers; decision, which also picks the round's fragment f: ``decision.round_fragment``)
    if rnd.exchange: comm.set_contributors(rnd.contributors);   (every participant: the same collectives)
                     fragment f's strategies: plan (held, snapshot), compress_all   ← "prepare"
                     exchange_all, validate_all                                      ← "exchange"
                     (payload tags, decode, codec checks, a finite aggregate: this job's verdict)
    session.agree(verdict)                             (signed verdicts: one "not ok" rolls every job back)
    committed = session.finish_round()                 (torchft's vote: the same on every rank of the job)
    committed:  every plan commits the validated data (θ_outer update) →
                ``OuterRounds.finish_committed`` (tied params, publish: in-job collectives, safe since
                the whole job got this vote)
    otherwise:  every plan cancels (state exactly as before: θ_outer, error feedback)

**Blocking** (τ = 0, ``step``): all of it after inner step t; a committed round writes θ_local ←
θ_outer,k+1; a round that did not commit keeps θ_local (``keep``: the next Δ spans both rounds) or
sets θ_local ← θ_outer (``discard``, as torchft's DiLoCo; ``--sparseloco-elastic-after-failed-round``);
a non-finite job always discards.

**Delayed** (τ ≥ 1, ``launch`` / ``complete``; Streaming DiLoCo's delayed outer step under a changing
membership): at the launch, after inner step t, the training thread only checks the job's params are
finite and copies them (θ_r,launch, the snapshot); the whole round — quorum, header, decision, the
prepare phase (Δ = θ_outer,k − θ_r,launch from the snapshot: ``OuterStrategy.local_source``), the
exchange, the verdicts and torchft's vote — runs on the comm thread while inner steps t+1 … t+τ
compute, so the quorum's wait for the slowest job is hidden too; at the completion, after inner step
t+τ, the plans commit (θ_outer,k+1) or cancel, and θ_local is merged as in single-job mode
(``outer/overlap.py``):

    committed            replay θ_local ← θ_outer,k+1 + (θ_local,now − θ_r,launch), or lerp
    not committed, keep  θ_local untouched (the next Δ covers the rounds since the last commit)
    not committed, discard   the merge on θ_outer,k (replay keeps the τ steps of the window)

A member lost between the launch and the completion fails that round only (its collectives time out
on the comm thread: rolled back, nothing applied, error feedback restored). A heal inside the comm
thread's quorum (this job the source of a joining job, or catching up itself) must not race the
training thread: it waits until the training thread is parked at the round's completion, the same
iteration on every rank of the job (``heal_state.HealGate``), so the state sent is the one at t+τ
and a catch-up rewrites θ_outer, the params and the snapshot there; a round without a heal parks
nobody. A job that is not a
contributor of the round (it just healed, its schedule is at another fragment, or its params were
not finite, reset to θ_outer,k at the launch) snapshots θ_outer,k instead of θ_r,launch, so the
replay carries all of its local progress onto θ_outer,k+1. The same fragment's schedule never has
two rounds in flight, and τ·P < H keeps one round in flight per job (``args.loop_config``). With
τ = 0 and failure-free rounds, every rank computes bitwise what single-job mode computes; with τ ≥ 1
the same holds against single-job mode with the same τ (tests/test_elastic_streaming.py).

``setup(scheduler, args)`` runs the job's first round (``startup``, blocking), before the data
iterators exist: it contributes nothing and runs the collectives of whichever fragment the others
sync; a (re)started job behind the run heals there (θ_outer of every fragment, outer momentum,
inner Adam state, iteration, consumed samples, LR schedule) and a job at the run's step takes the
run's counters from the headers, so its data slot continues where the run is; a job that arrives
while the others' delayed round is in flight waits in its quorum for their next launch. A job that
falls behind later (stopped or cut off past the timeouts, its vote failed while the others
committed, or late past the lighthouse's join window) catches up in place at its next quorum, in
the same process (``heal_state``): θ_outer and the outer state from a live peer, the error feedback
restarting at zero; it keeps its own iteration, data position, LR schedule and inner optimizer
state. Its local progress is carried onto the new θ_outer with ``--sparseloco-elastic-after-failed-round
keep``, unless its last pseudo-gradient may already be in the run's θ_outer (its last round
proceeded with it as a contributor and it did not commit: a split commit), where it is discarded
as with ``discard``. By default it takes part in that round as a non-contributor and contributes
from the next one; with ``--sparseloco-elastic-grace S`` > 0 (a run whose lighthouse forms each
quorum with the jobs that asked within S seconds of the first, so a slow job is left out instead of
waited for) its carried progress is its pseudo-gradient in that very round: a late job's inner steps
enter θ_outer one round late instead of never.

The run's end: every header says whether it is its job's last round (no later round of its schedule
fits before its ``--train-iters``) and its ``--train-iters``. A job whose round committed with only such
peers, none given fewer --train-iters than it, and ``--sparseloco-min-workers`` > 1, has nobody left to
sync with (``run_ends_here``): it ends its training after that iteration, with the run's last θ_outer,
instead of waiting for a quorum that never forms (a job that fell one round behind the others ends a
round short of its ``--train-iters``; ``_end_with_the_run``).

Consistency: every participant puts θ_outer's fingerprint (``consistency.fingerprint`` over every
fragment's strategies on this rank) in its signed header; the decision refuses a round whose
fingerprints differ, and rank 0 of the job logs the fingerprint every participant agreed on
(strategies whose workers differ by design, gossip, send none).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import collective_device
from megatron_sparseloco.elastic.config import DEFAULT_OUTER_TIMEOUT_S, ElasticConfig
from megatron_sparseloco.elastic.session import ElasticSession, Round
from megatron_sparseloco.megatron.consistency import fingerprint
from megatron_sparseloco.megatron.elastic.heal_state import (Counters, HealGate, HealState, heal_summary,
                                                                megatron_args)
from megatron_sparseloco.megatron.rounds import OuterRounds, RoundsFactory, RoundsHost
from megatron_sparseloco.outer.base import NonFiniteError, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.overlap import CommThread, OverlapConfig, merge_window
from megatron_sparseloco.outer.round import RoundPlan

if TYPE_CHECKING:
    from megatron_sparseloco.megatron.optimizer import OuterLoopOptimizer

#: one strategy's part of a round: the strategy, its plan, its stats, its byte counters before the round
Part = Tuple[OuterStrategy, RoundPlan, OuterStepStats, Tuple[int, ...]]


def run_ends_here(mine: Optional[dict], others: List[dict], min_workers: int, committed: bool) -> bool:
    """Does the run end for this job at a round with these headers (its own ``mine``, the other verified
    participants' ``others``)? Yes when this job cannot commit a round alone (``min_workers`` > 1), the
    round committed here (so this job holds the run's last θ_outer), it is not at its own last round, and
    every other participant is at its last (``last_round``) with at least this job's ``--train-iters``: nobody
    is left to sync with. A peer given fewer --train-iters that ends does not end the run: a live job left
    out of this round may still come."""
    if min_workers <= 1 or not committed or mine is None or mine["extra"].get("last_round") or not others:
        return False
    target = int(mine["extra"].get("train_iters", 0))
    return all(h["extra"].get("last_round") == 1 and int(h["extra"].get("train_iters", 0)) >= target
               for h in others)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def open_session(opt: "OuterLoopOptimizer", config: ElasticConfig, outer_timeout_s: Optional[float]
                 ) -> Tuple[HealState, ElasticSession]:
    """This rank's heal state and session: group rank = its rank in the job, the job's store (MASTER_ADDR /
    MASTER_PORT, torchrun's), every operation bounded by ``outer_timeout_s`` (``--sparseloco-outer-timeout``;
    unset: ``DEFAULT_OUTER_TIMEOUT_S``)."""
    import os
    heal = HealState(opt, megatron_args)
    world = dist.get_world_size() if dist.is_initialized() else 1
    session = ElasticSession(config, group_rank=_rank(), group_world_size=world,
                             store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                             store_port=int(os.environ.get("MASTER_PORT", "29500")), state_fn=heal.state,
                             load_fn=heal.load, template_fn=heal.template,
                             outer_timeout=outer_timeout_s or DEFAULT_OUTER_TIMEOUT_S, device=collective_device())
    return heal, session


def elastic_rounds(config: ElasticConfig) -> RoundsFactory:
    """The ``RoundsFactory`` of an elastic job: open the session, build the strategies on its comm."""

    def build(host: RoundsHost) -> "ElasticRounds":
        heal, session = open_session(host, config, host.outer_timeout_s)   # type: ignore[arg-type]
        return ElasticRounds(host.build_strategies(session.comm), host, session, config, heal)

    return build


@dataclass
class InFlight:
    """A delayed round between its launch and its completion (τ ≥ 1)."""

    scheduled: int                  # the fragment this job's schedule launched (its completion is keyed by it)
    finite: bool                    # the job's params were finite at the launch
    future: Future                  # the round on the comm thread: (round, parts, committed)
    launch_s: float                 # the launch's exposed seconds
    committed: Optional[bool] = None   # once settled (``ElasticRounds.wait``):
    rnd: Optional[Round] = None        # the round (``rnd.fragment``: the fragment it synced)
    parts: List[Part] = field(default_factory=list)   # this rank's strategies of that fragment


class ElasticRounds:
    """Every fragment's rounds over the elastic session (module docstring). A committed round ends as a
    single job's does (``OuterRounds.finish_committed`` of ``core``, which also keeps the counters)."""

    def __init__(self, fragment_strategies: List[List[OuterStrategy]], host: RoundsHost, session: ElasticSession,
                 config: ElasticConfig, heal: HealState):
        self.core = OuterRounds(fragment_strategies, host.schedule, OverlapConfig(), 0, host.identical_across_workers,
                                hooks=host)
        self.strategies = [s for ss in fragment_strategies for s in ss]
        self.hooks, self.session, self.config, self.heal = host, session, config, heal
        self.identical = host.identical_across_workers
        #: every strategy's result depends on its contributors' data alone (a refused participant's bytes are
        #: never decoded), so a round may commit with refused participants present (``begin_round``)
        self.ignores_non_contributors = all(s.capabilities.ignores_non_contributors for s in self.strategies)
        #: samples and tokens a contributing round of this job carries (``setup``, from Megatron's args)
        self.samples_per_round = 0
        self.tokens_per_round = 0
        #: the last round (for logs and tests) and whether it committed
        self.last: Optional[Round] = None
        self.last_committed = False
        # delayed rounds (τ ≥ 1): the comm thread, the launch snapshots (replay; checkpointed with the
        # strategy, as single-job mode's), the round in flight, the merges due after a resume
        self.overlap: OverlapConfig = host.overlap
        self.comm_thread = (CommThread(self.strategies[0].device) if self.overlap.steps > 0 and self.strategies
                            else None)
        #: per strategy, θ_r,launch: the compress's θ_local and replay's snapshot (one fp32 copy of this rank's
        #: params, as single-job mode's replay; checkpointed with the strategy for replay)
        self.snapshots: Dict[int, torch.Tensor] = {}
        if self.comm_thread is not None:
            heal.gate = HealGate(config.heal_timeout)
            heal.snapshots = self.snapshots
            for s in self.strategies:
                buf = self.snapshots.setdefault(id(s), torch.zeros(s.params.numel, dtype=torch.float32,
                                                                    device=s.device))
                if self.overlap.merge == "replay":
                    s.attached_state["overlap_launch"] = buf
        self.in_flight: Optional[InFlight] = None
        self.merge_due = [False] * len(fragment_strategies)

    # ------------------------------------------------------------------ the ``Rounds`` interface
    log = property(lambda self: self.core.log, doc="Counters for logging (``OuterLog``).")
    fragments = property(lambda self: self.core.fragments, doc="Every fragment's strategies.")
    fragment_syncs = property(lambda self: self.core.fragment_syncs, doc="Rounds begun, per fragment.")
    delayed = property(lambda self: [], doc="None: the delayed rounds are this object's own (``in_flight``).")

    def after_inner_step(self, calls: int, run_step: Callable[[int], None]) -> None:
        """The schedule's events after inner step ``calls`` (``OuterRounds.after_inner_step``), the delayed
        rounds through this object's ``launch`` / ``complete``."""
        self.core.after_inner_step(calls, run_step, launch=self.launch, complete=self.complete)

    def wait(self, fragment: int) -> None:
        """Settle ``fragment``'s round in flight (commit or roll back; the merge stays due): a checkpoint
        then holds θ_outer,k+1 and the launch snapshot, as in single-job mode."""
        fl = self.in_flight
        if fl is not None and fl.scheduled == fragment:
            self._settle(fl)

    def wait_all(self) -> None:
        if self.in_flight is not None:
            self._settle(self.in_flight)

    def restore_counters(self, outer_steps: int, fragment_syncs: List[int], inner_calls: int) -> None:
        """After a checkpoint load or a heal: the counters (``OuterRounds.restore_counters``) and, with τ ≥ 1,
        whether a merge is due (a checkpoint saved inside a window; ``startup`` clears it when its round
        sets θ_local)."""
        self.core.restore_counters(outer_steps, fragment_syncs, inner_calls)
        self.merge_due = [self.comm_thread is not None and self.core.schedule.merge_due(inner_calls, p)
                          for p in range(len(self.core.fragments))]

    def state_dict(self) -> Dict[str, Any]:
        """The run's committed step as this job knows it (torchft's), kept in the checkpoint's facts."""
        return {"elastic": self.session.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if isinstance(state.get("elastic"), dict):
            self.session.load_state_dict(state["elastic"])

    def setup(self, scheduler: Any, args: Any) -> None:
        """After Megatron built the model, the optimizer and the LR scheduler (and loaded a checkpoint),
        before the data iterators: the job's first round (``startup``), which heals a (re)started job and
        sets ``args.iteration`` / consumed samples / the LR schedule."""
        self.heal.scheduler = scheduler
        self.samples_per_round = self.core.schedule.inner_steps * int(args.global_batch_size)
        self.tokens_per_round = self.samples_per_round * int(getattr(args, "seq_length", 0) or 0)
        self.startup()

    # ------------------------------------------------------------------ blocking rounds
    @torch.no_grad()
    def startup(self) -> None:
        """The job's first round (module docstring); before the data iterators are built."""
        self.heal.in_iteration = False
        t0 = self.core.start_timer()
        step, start = self.session.step, self.heal.counters()
        committed, stats, rnd = self._round(contributes=False, scheduled=-1)
        if rnd.healed:
            self._say(f"worker {self.config.worker_index} started at step {step} (iteration {start.iteration}"
                      f"{', from its checkpoint' if start.iteration else ''}) but the run is at step {rnd.step}: "
                      "the run continues from the newest step a live job holds; this job healed from a live peer")
        if rnd.healed or committed:   # θ_local set by this round: no window of a checkpoint left to merge
            self.merge_due = [False] * len(self.merge_due)
        mine = self.heal.counters()
        run = max([c for c in (Counters.from_extra(h["extra"]) for h in rnd.peers if h is not None)
                   if c is not None] + [mine], key=lambda c: c.iteration)
        if run.iteration > mine.iteration:   # the run is ahead of this job's checkpoint: continue where it is
            run.apply(self.heal.opt, self.heal.args_fn(), self.heal.scheduler)
            self._say(f"worker {self.config.worker_index} joins the run at iteration {run.iteration} (its own "
                      f"counters were at iteration {mine.iteration}); its data slot continues there")
        self._end(committed, stats, rnd, t0)

    def step(self, fragment: int) -> List[OuterStepStats]:
        """The blocking round of ``fragment`` after its H inner steps; a job behind the run catches up in place."""
        self.heal.in_iteration = True
        self.heal.keep_progress = self._keeps_progress()
        t0 = self.core.start_timer()
        committed, stats, rnd = self._round(contributes=True, scheduled=fragment)
        self._end(committed, stats, rnd, t0)
        return stats

    def _keeps_progress(self) -> bool:
        """Catching up, carry the local progress onto the healed θ_outer: with ``keep``, unless this job's
        last round proceeded with it contributing and did not commit here (its Δ may be in θ_outer)."""
        last = self.last
        if self.config.after_failed_round != "keep":
            return False
        return last is None or self.last_committed or not (last.proceed and last.contributing)

    def _open(self, contributes: bool, scheduled: int, finite: bool = True,
              extra: Optional[Dict[str, int]] = None) -> Round:
        """``session.begin_round`` (quorum, heal, header, decision); ``finite``: the job's params (checked by
        the caller on the training thread), ``extra``: its counters (default: now). A job that caught up with
        its progress held in the params gets it back on the healed θ_outer when it contributes
        (``--sparseloco-elastic-grace``, blocking rounds) or trains on during a delayed round."""
        fp = (lambda: fingerprint([s.anchor for s in self.strategies])) if self.identical else None
        delayed = self.comm_thread is not None
        rnd = self.session.begin_round(contributes=contributes, finite=finite, samples=self.samples_per_round,
                                       tokens=self.tokens_per_round, fingerprint=fp,
                                       extra=self._header_extra() if extra is None else extra,
                                       ignores_non_contributors=self.ignores_non_contributors, fragment=scheduled,
                                       contributes_after_heal=self.config.grace > 0 and self.heal.keep_progress)
        if self.heal.holds_progress and (rnd.contributing or delayed):
            self.heal.finish_catch_up()
        return rnd

    def _round(self, contributes: bool, scheduled: int) -> Tuple[bool, List[OuterStepStats], Round]:
        finite = self._job_finite()
        rnd = self._open(contributes, scheduled, finite=finite)
        parts: List[Part] = []
        ok = True
        if rnd.exchange:    # every participant runs the same collectives (a non-contributor sends neutral data)
            self.session.comm.set_contributors(rnd.contributors)
            parts, ok = self._communicate(rnd)
        self.session.agree(ok)    # the signed verdicts: one "not ok" rolls the round back on every job
        committed = self.session.finish_round()
        carry = not rnd.contributing and self.heal.in_iteration and finite and not self.heal.holds_progress
        for s, plan, stats, _ in parts:
            if not committed:
                plan.cancel()
            elif carry:   # not its Δ: its own local progress goes onto θ_outer,k+1
                s.hold_local_progress()
                plan.commit(write_back=False)
                s.apply_local_progress()
            else:         # (a job catching up holds its progress in the params: not overwritten)
                plan.commit(write_back=not self.heal.holds_progress)
            s.outer_steps += int(committed)
        self.heal.finish_catch_up()
        if not finite and not committed:
            self._nonfinite()
        self.last, self.last_committed = rnd, committed
        return committed, [part[2] for part in parts], rnd

    def _communicate(self, rnd: Round) -> Tuple[List[Part], bool]:
        """Blocking: prepare and exchange (below); returns the parts and this job's verdict."""
        try:
            parts = self._prepare(rnd)
        except Exception as exc:  # any local error: the round rolls back
            self.session.report_error(exc)
            return [], False
        return parts, self._exchange(rnd, parts)

    def _prepare(self, rnd: Round) -> List[Part]:
        """Every strategy of the round's fragment: its held plan (snapshot: nothing is applied before the
        vote) and its compress phase (Δ, error feedback, payload; nothing for a non-contributor)."""
        parts: List[Part] = []
        for s in self.core.fragments[rnd.fragment].strategies:
            s.outer_steps = rnd.step   # every participant numbers the round alike (gossip draws its graph by it)
            stats = s.new_stats()
            before = tuple(s.counter_marks())
            plan = s.begin_round(stats, None, held=True, snapshot=True)
            parts.append((s, plan, stats, before))
            plan.compress_all()
        return parts

    def _exchange(self, rnd: Round, parts: List[Part]) -> bool:
        """Every prepared plan's exchange and validation; returns this job's verdict.

        Validation decodes every received payload (whose tag ``TorchFTComm`` verified), runs the codec's
        checks and checks the aggregate is finite (``RoundPlan.validate_all`` / ``aggregate_finite``);
        any failure, like any local error, makes the verdict "not ok" (``session.agree``), so the round
        rolls back on every job. The commit that follows a vote only writes data that passed these checks."""
        try:
            for s, plan, stats, before in parts:
                plan.exchange_all()
                after = s.counter_marks()
                stats.bytes_sent, stats.bytes_received, stats.collectives = (a - b for a, b in zip(after, before))
                plan.validate_all()
                if not plan.aggregate_finite():
                    raise NonFiniteError(f"elastic worker {self.config.worker_index}: the round's aggregate "
                                         f"({s.name}) holds a NaN or Inf; nothing applied")
        except Exception as exc:  # a payload that fails to decode or any local error: the round rolls back
            self.session.report_error(exc)
            return False
        return not self.session.comm.failed and self.session.comm.rejected is None

    # ------------------------------------------------------------------ delayed rounds (τ ≥ 1)
    @torch.no_grad()
    def launch(self, scheduled: int) -> None:
        """After inner step t: the job's finiteness and the launch snapshot here; the round itself (quorum,
        header, decision, compress from the snapshot, exchange, verdicts, vote) on the comm thread while
        the window's inner steps compute (module docstring)."""
        assert self.comm_thread is not None
        if self.in_flight is not None:
            raise RuntimeError("elastic: a round is still in flight at the next launch (τ·P must be < H)")
        self.heal.in_iteration = True
        self.heal.keep_progress = self._keeps_progress()
        t0 = self.core.start_timer()
        finite = self._job_finite()
        if not finite:   # its NaNs must not be trained on during the window
            for s in self.strategies:
                s.reset_to_anchor()
            self.hooks.sync_tied()
            self.hooks.publish()
        for s in self.core.fragments[scheduled].strategies:
            s.params.read(0, s.params.numel, self.snapshots[id(s)])     # θ_r,launch
        extra = self._header_extra()
        assert self.heal.gate is not None
        self.heal.gate.arm()
        future = self.comm_thread.submit(lambda: self._remote(scheduled, finite, extra))
        self.in_flight = InFlight(scheduled, finite, future, time.perf_counter() - t0)
        timer = self.hooks.megatron_timer()
        if timer is not None:
            timer.stop()

    @torch.no_grad()    # (grad mode is per thread)
    def _remote(self, scheduled: int, finite: bool, extra: Dict[str, int]) -> Tuple[Round, List[Part], bool]:
        """On the comm thread: the round after the launch; (the round, its parts, whether it committed)."""
        assert self.heal.gate is not None
        try:
            rnd = self._open(True, scheduled, finite=finite, extra=extra)
        finally:   # a heal inside the quorum ran with the training thread parked (``HealGate``)
            self.heal.gate.release()
        parts: List[Part] = []
        ok = True
        if rnd.exchange:
            self.session.comm.set_contributors(rnd.contributors)
            strategies = self.core.fragments[rnd.fragment].strategies
            for s in strategies:
                if rnd.contributing:     # Δ from θ_r,launch (training goes on in the params)
                    s.local_source = self.snapshots[id(s)]
                else:                    # not its Δ: the merge carries all its progress onto θ_outer,k+1
                    for lo, hi in s.buckets():
                        self.snapshots[id(s)][lo:hi].copy_(s.anchor_bucket(lo, hi))
            try:
                parts = self._prepare(rnd)
            except Exception as exc:  # any local error: the round rolls back
                self.session.report_error(exc)
                ok = False
            finally:
                for s in strategies:
                    s.local_source = None
            ok = ok and self._exchange(rnd, parts)
        self.session.agree(ok)
        return rnd, parts, self.session.finish_round()

    def _settle(self, fl: InFlight) -> None:
        """Wait for the round on the comm thread (parked while a heal runs); commit (θ_outer,k+1, no
        write-back) or cancel every plan."""
        if fl.committed is not None:
            return
        assert self.comm_thread is not None and self.heal.gate is not None
        self.heal.gate.serve(fl.future)
        fl.rnd, fl.parts, committed = fl.future.result()     # ElasticExit, a failed heal's exit, propagate
        self.comm_thread.join()
        fl.committed = committed
        for s, plan, _, _ in fl.parts:
            if committed:
                plan.commit(write_back=False)
                s.outer_steps += 1
            else:
                plan.cancel()
        self.last, self.last_committed = fl.rnd, committed
        if committed:
            self.core.count_committed([part[2] for part in fl.parts])
        if not fl.finite and not committed:
            self._abort_if_nonfinite_policy()   # (skip: reset to θ_outer,k at the launch already)

    @torch.no_grad()
    def complete(self, scheduled: int) -> None:
        """After inner step t+τ: settle the round launched after t, then the merge (module docstring)."""
        fl = self.in_flight
        if fl is None or fl.scheduled != scheduled:   # nothing launched here (a job that joined in the window)
            if self.merge_due[scheduled]:             # a checkpoint saved inside the window: its merge
                self.merge_due[scheduled] = False
                self._merge(scheduled)
                if scheduled == 0:
                    self.hooks.sync_tied()
                self.hooks.publish()
            return
        t0 = self.core.start_timer()
        self._settle(fl)
        self.in_flight = None
        committed, rnd = bool(fl.committed), fl.rnd
        assert rnd is not None
        if committed or self.config.after_failed_round == "discard":
            self._merge(rnd.fragment)
        stats = [part[2] for part in fl.parts]
        self._end(committed, stats, rnd, t0, launch_s=fl.launch_s)

    def _merge(self, fragment: int) -> None:
        """θ_local ← merge(θ_outer, θ_local,now) on ``fragment``'s strategies (replay from the launch snapshot,
        or lerp)."""
        for s in self.core.fragments[fragment].strategies:
            merge_window(s, self.snapshots[id(s)] if self.overlap.merge == "replay" else None, self.overlap)

    def _header_extra(self) -> Dict[str, int]:
        """The header's ``extra``: this job's counters (where its loop is) and ``last_round``, 1 when no later
        round of its schedule fits before its ``--train-iters`` (this job ends after this round)."""
        counters = self.heal.counters()
        train_iters = getattr(self.heal.args_fn(), "train_iters", None) or 0
        last = train_iters > 0 and self.core.schedule.next_launch(counters.iteration) > int(train_iters)
        return {**counters.extra(), "last_round": int(last), "train_iters": int(train_iters)}

    def _end_with_the_run(self, rnd: Round, committed: bool) -> None:
        """The run ended at this round for this job (``run_ends_here``): its training ends after this
        iteration (``args.train_iters``, which Megatron's loop reads at every iteration, is set to it)
        instead of waiting ``--sparseloco-elastic-quorum-timeout`` for a quorum and exiting with an error. A
        job that fell a round behind the others (left out of one quorum, then caught up in place with its own
        iteration kept) ends here with the run's last θ_outer; its checkpoint keeps its own counters."""
        mine = rnd.peers[rnd.rank] if 0 <= rnd.rank < len(rnd.peers) else None
        others = [h for r, h in enumerate(rnd.peers) if r != rnd.rank and h is not None]
        args = self.heal.args_fn()
        if (not self.heal.in_iteration or args is None
                or not run_ends_here(mine, others, self.config.min_workers, committed)):
            return
        iteration = self.heal.counters().iteration
        self._say(f"worker {self.config.worker_index}: the run ends at this round (workers "
                  f"[{','.join(str(h['index']) for h in others)}] ended their training with it, and a round needs "
                  f"{self.config.min_workers} jobs); this job stops at iteration {iteration} of "
                  f"--train-iters {args.train_iters} with the run's last θ_outer")
        args.train_iters = iteration

    def _job_finite(self) -> bool:
        """Every rank of the job finite (so every rank's header says the same)."""
        bad = any(s.first_nonfinite_tensor() is not None for s in self.strategies)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if bad else 0.0], device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = bool(flag.item())
        return not bad

    def _abort_if_nonfinite_policy(self) -> None:
        """A round this job's non-finite params kept from committing: ``--sparseloco-nonfinite-policy abort``
        ends the job here."""
        if any(s.config.nonfinite_policy == "abort" for s in self.strategies):
            raise NonFiniteError(f"elastic worker {self.config.worker_index}: non-finite parameters before outer "
                                 "step; θ_outer left untouched (--sparseloco-nonfinite-policy abort)")

    def _nonfinite(self) -> None:
        self._abort_if_nonfinite_policy()
        self._discard()

    def _discard(self) -> None:
        for s in self.strategies:
            s.reset_to_anchor()
        self.hooks.sync_tied()
        self.hooks.publish()

    def _end(self, committed: bool, stats: List[OuterStepStats], rnd: Round, t0: float,
             launch_s: Optional[float] = None) -> None:
        """A committed round ends in ``OuterRounds.finish_committed``; otherwise the local progress is kept
        or discarded (blocking) or was merged (delayed: ``launch_s`` given); then the round's log line."""
        if committed:
            self.core.finish_committed(rnd.fragment, stats if launch_s is None else None, t0, time.perf_counter,
                                       launch_s=launch_s)
        else:
            if rnd.healed or launch_s is not None:   # θ_local set by the heal or the merge
                self.hooks.sync_tied()
                self.hooks.publish()
            elif self.config.after_failed_round == "discard":
                self._discard()
            timer = self.hooks.megatron_timer()
            if timer is not None:
                timer.stop()
        self._log(rnd, committed, stats)
        self._end_with_the_run(rnd, committed)

    # ------------------------------------------------------------------ logs
    def _say(self, text: str) -> None:
        if _rank() == 0:
            print(f" sparseloco | elastic: {text}", flush=True)

    def _log(self, rnd: Round, committed: bool, stats: List[OuterStepStats]) -> None:
        """Rank 0 of the job: one line per round (who took part, the outcome, the fingerprint, heal)."""
        records = list(self.session.transport.records)
        self.session.transport.records.clear()
        if _rank() != 0:
            return
        index = [None if h is None else h["index"] for h in rnd.peers]
        workers = ",".join(str(i) for i in index if i is not None)
        contributors = ",".join(str(index[r]) for r in rnd.contributors)
        outcome = "committed" if committed else f"rolled back ({rnd.reason or 'the commit vote failed'})"
        if not committed and not self.heal.in_iteration and not rnd.contributors and None not in rnd.peers:
            outcome = "start-up round, nothing to commit"   # every header read, nobody contributed
        line = (f"round {self.session.step if committed else rnd.step + 1} of worker {self.config.worker_index}: "
                f"{outcome}; participants workers [{workers}], contributors [{contributors}]")
        if len(self.core.fragments) > 1:
            line += f"; fragment {rnd.fragment} of {len(self.core.fragments)}"
        if rnd.fingerprint is not None:
            line += f"; θ_outer fingerprint {rnd.fingerprint & (2**64 - 1):016x} identical on all {rnd.size}"
        lrs = [s.extra["outer_lr"] for s in stats if "outer_lr" in s.extra]
        if lrs:
            line += f"; outer lr {lrs[0]:.6g} at {len(rnd.contributors)} contributors"
        line += f"; quorum {rnd.seconds_quorum:.3f} s, header {rnd.seconds_header:.3f} s"
        if rnd.healed:
            line += f"; healed from a live peer ({rnd.behind} round(s) behind): received {heal_summary(records)}"
            if self.heal.in_iteration:
                line += (f"; caught up in place at its own iteration {self.heal.counters().iteration} (data position "
                         f"and LR schedule kept), local progress {'kept' if self.heal.keep_progress else 'discarded'}"
                         ", error feedback restarts at zero")
        sent = [r for r in records if r.role == "sent"]
        if sent:
            line += f"; sent a heal: {sum(r.nbytes for r in sent)} bytes in {sum(r.seconds for r in sent):.3f} s"
        self._say(line)

    def close(self) -> None:
        """Settle a round in flight (committed or rolled back, not merged), end the comm thread, the session."""
        try:
            if self.in_flight is not None:
                self._settle(self.in_flight)
        finally:
            self.in_flight = None
            if self.comm_thread is not None:
                self.comm_thread.shutdown()
                self.comm_thread = None
            self.core.close()
            self.session.close()


__all__ = ["ElasticRounds", "elastic_rounds", "open_session", "run_ends_here"]
