"""The outer rounds of one rank of an elastic job: every round through the ``ElasticSession``.

In elastic mode (``--sparseloco-lighthouse``) each worker is its own Megatron job; group rank g
(this rank's ``torch.distributed`` rank in its job) of every live job forms the outer group of
shard position g, which torchft rebuilds at every quorum. The plugin hands ``OuterLoopOptimizer``
the factory ``elastic_rounds(config)``: it opens the session, builds the strategies on ``session.comm``
(``RoundsHost.build_strategies``) and returns the ``ElasticRounds`` that owns the session and the heal
state; the optimizer's blocking rounds (τ = 0, one fragment: what ``elastic.config`` accepts) go to
``ElasticRounds.step``:

    finite = every rank of the job finite              (one in-job all-reduce MAX)
    rnd = session.begin_round(contributes, finite, samples, tokens, fingerprint(θ_outer), counters)
          (quorum; a job behind the quorum heals: ``heal_state.HealState``; round binding; signed
          headers; decision)
    if rnd.exchange: comm.set_contributors(rnd.contributors);   (every participant: the same collectives)
                     every strategy's plan (held, snapshot): compress_all, exchange_all, validate_all
                     (payload tags, decode, codec checks, a finite aggregate: this job's verdict)
    session.agree(verdict)                             (signed verdicts: one "not ok" rolls every job back)
    committed = session.finish_round()                 (torchft's vote: the same on every rank of the job)
    committed:  every plan commits the validated data (θ_outer update, θ_local ← θ_outer) →
                ``OuterRounds.finish_committed`` (tied params, publish: in-job collectives, safe since
                the whole job got this vote)
    otherwise:  every plan cancels (state exactly as before); θ_local kept (``keep``: the next Δ
                spans both rounds) or ← θ_outer (``discard``, as torchft's DiLoCo;
                ``--sparseloco-elastic-after-failed-round``); a non-finite job always discards

``setup(scheduler, args)`` runs the job's first round (``startup``), before the data iterators exist: it
contributes nothing; a (re)started job behind the run heals there (θ_outer, outer momentum, inner
Adam state, iteration, consumed samples, LR schedule) and a job at the run's step takes the run's
counters from the headers, so its data slot continues where the run is. A job that falls behind
later (stopped or cut off past the timeouts, or its vote failed while the others committed) catches
up in place at its next quorum, in the same process (``heal_state``): θ_outer and the outer state
from a live peer, the error feedback restarting at zero; it keeps its own iteration, data position,
LR schedule and inner optimizer state (megatron.training keeps them in local variables, and this
way no sample of its slot is read twice or skipped: it finishes its iterations later than the run).
Its local progress is carried onto the new θ_outer with ``--sparseloco-elastic-after-failed-round
keep``, unless its last pseudo-gradient may already be in the run's θ_outer (its last round
proceeded with it as a contributor and it did not commit: a split commit), where it is discarded
as with ``discard``. It takes part in that round as a non-contributor and contributes from the
next one.

Consistency: every participant puts θ_outer's fingerprint (``consistency.fingerprint`` over this
rank's strategies) in its signed header; the decision refuses a round whose fingerprints differ,
and rank 0 of the job logs the fingerprint every participant agreed on (strategies whose workers
differ by design, gossip, send none).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import collective_device
from megatron_sparseloco.elastic.config import DEFAULT_OUTER_TIMEOUT_S, ElasticConfig
from megatron_sparseloco.elastic.session import ElasticSession, Round
from megatron_sparseloco.megatron.consistency import fingerprint
from megatron_sparseloco.megatron.elastic.heal_state import Counters, HealState, heal_summary, megatron_args
from megatron_sparseloco.megatron.rounds import OuterRounds, RoundsFactory, RoundsHost
from megatron_sparseloco.outer.base import NonFiniteError, OuterStepStats, OuterStrategy
from megatron_sparseloco.outer.overlap import OverlapConfig
from megatron_sparseloco.outer.round import RoundPlan

if TYPE_CHECKING:
    from megatron_sparseloco.megatron.optimizer import OuterLoopOptimizer

#: one strategy's part of a round: the strategy, its plan, its stats, the byte counters before it
Part = Tuple[OuterStrategy, RoundPlan, OuterStepStats]


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
        (strategies,) = host.build_strategies(session.comm)    # one fragment (``elastic.config``)
        return ElasticRounds(strategies, host, session, config, heal)

    return build


class ElasticRounds:
    """Blocking rounds over the elastic session (module docstring). A committed round ends as a single
    job's does (``OuterRounds.finish_committed`` of ``core``, which also keeps the counters)."""

    def __init__(self, strategies: List[OuterStrategy], host: RoundsHost, session: ElasticSession,
                 config: ElasticConfig, heal: HealState):
        self.core = OuterRounds([strategies], host.schedule, OverlapConfig(), 0, host.identical_across_workers,
                                hooks=host)
        self.strategies, self.hooks, self.session, self.config, self.heal = strategies, host, session, config, heal
        self.identical = host.identical_across_workers
        #: every strategy's result depends on its contributors' data alone (a refused participant's bytes are
        #: never decoded), so a round may commit with refused participants present (``begin_round``)
        self.ignores_non_contributors = all(s.capabilities.ignores_non_contributors for s in strategies)
        #: samples and tokens a contributing round of this job carries (``setup``, from Megatron's args)
        self.samples_per_round = 0
        self.tokens_per_round = 0
        #: the last round (for logs and tests) and whether it committed
        self.last: Optional[Round] = None
        self.last_committed = False

    # ------------------------------------------------------------------ the ``Rounds`` interface
    log = property(lambda self: self.core.log, doc="Counters for logging (``OuterLog``).")
    fragments = property(lambda self: self.core.fragments, doc="The one fragment's strategies.")
    fragment_syncs = property(lambda self: self.core.fragment_syncs, doc="Rounds begun (one fragment).")
    delayed = property(lambda self: self.core.delayed, doc="None: elastic rounds are blocking.")

    def after_inner_step(self, calls: int, run_step: Callable[[int], None]) -> None:
        self.core.after_inner_step(calls, run_step)

    def wait(self, fragment: int) -> None:
        """Nothing in flight (blocking rounds)."""

    def wait_all(self) -> None:
        """Nothing in flight (blocking rounds)."""

    def restore_counters(self, outer_steps: int, fragment_syncs: List[int], inner_calls: int) -> None:
        self.core.restore_counters(outer_steps, fragment_syncs, inner_calls)

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

    # ------------------------------------------------------------------ rounds
    @torch.no_grad()
    def startup(self) -> None:
        """The job's first round (module docstring); before the data iterators are built."""
        self.heal.in_iteration = False
        t0 = self.core.start_timer()
        step, start = self.session.step, self.heal.counters()
        committed, stats, rnd = self._round(contributes=False)
        if rnd.healed:
            self._say(f"worker {self.config.worker_index} started at step {step} (iteration {start.iteration}"
                      f"{', from its checkpoint' if start.iteration else ''}) but the run is at step {rnd.step}: "
                      "the run continues from the newest step a live job holds; this job healed from a live peer")
        mine = self.heal.counters()
        run = max([c for c in (Counters.from_extra(h["extra"]) for h in rnd.peers if h is not None)
                   if c is not None] + [mine], key=lambda c: c.iteration)
        if run.iteration > mine.iteration:   # the run is ahead of this job's checkpoint: continue where it is
            run.apply(self.heal.opt, self.heal.args_fn(), self.heal.scheduler)
            self._say(f"worker {self.config.worker_index} joins the run at iteration {run.iteration} (its own "
                      f"counters were at iteration {mine.iteration}); its data slot continues there")
        self._end(committed, stats, rnd, t0)

    def step(self, fragment: int) -> List[OuterStepStats]:
        """The blocking round after H inner steps; a job behind the run catches up in place here."""
        self.heal.in_iteration = True
        self.heal.keep_progress = self._keeps_progress()
        t0 = self.core.start_timer()
        committed, stats, rnd = self._round(contributes=True)
        self._end(committed, stats, rnd, t0)
        return stats

    def _keeps_progress(self) -> bool:
        """Catching up, carry the local progress onto the healed θ_outer: with ``keep``, unless this job's
        last round proceeded with it contributing and did not commit here (its Δ may be in θ_outer)."""
        last = self.last
        if self.config.after_failed_round != "keep":
            return False
        return last is None or self.last_committed or not (last.proceed and last.contributes)

    def _round(self, contributes: bool) -> Tuple[bool, List[OuterStepStats], Round]:
        finite = self._job_finite()
        fp = (lambda: fingerprint([s.anchor for s in self.strategies])) if self.identical else None
        rnd = self.session.begin_round(contributes=contributes, finite=finite, samples=self.samples_per_round,
                                       tokens=self.tokens_per_round, fingerprint=fp,
                                       extra=self.heal.counters().extra(),
                                       ignores_non_contributors=self.ignores_non_contributors)
        parts: List[Part] = []
        ok = True
        if rnd.exchange:    # every participant runs the same collectives (a non-contributor sends neutral data)
            self.session.comm.set_contributors(rnd.contributors)
            parts, ok = self._communicate(rnd)
        self.session.agree(ok)    # the signed verdicts: one "not ok" rolls the round back on every job
        committed = self.session.finish_round()
        for s, plan, stats in parts:
            if committed:   # (a job catching up holds its progress in the params: not overwritten)
                plan.commit(write_back=not self.heal.holds_progress)
                s.outer_steps += 1
            else:
                plan.cancel()
        self.heal.finish_catch_up()
        if not finite and not committed:
            self._nonfinite()
        self.last, self.last_committed = rnd, committed
        return committed, [stats for _, _, stats in parts], rnd

    def _communicate(self, rnd: Round) -> Tuple[List[Part], bool]:
        """Every strategy's compress, exchange and validation (held: nothing is applied before the vote);
        returns the parts and this job's verdict.

        Validation decodes every received payload (whose tag ``TorchFTComm`` verified), runs the codec's
        checks and checks the aggregate is finite (``RoundPlan.validate_all`` / ``aggregate_finite``);
        any failure, like any local error, makes the verdict "not ok" (``session.agree``), so the round
        rolls back on every job. The commit that follows a vote only writes data that passed these checks."""
        parts: List[Part] = []
        try:
            for s in self.strategies:
                s.outer_steps = rnd.step   # every participant numbers the round alike (gossip draws its graph by it)
                stats = s.new_stats()
                before = s.counter_marks()
                plan = s.begin_round(stats, None, held=True, snapshot=True)
                parts.append((s, plan, stats))
                plan.compress_all()
                plan.exchange_all()
                after = s.counter_marks()
                stats.bytes_sent, stats.bytes_received, stats.collectives = (a - b for a, b in zip(after, before))
                plan.validate_all()
                if not plan.aggregate_finite():
                    raise NonFiniteError(f"elastic worker {self.config.worker_index}: the round's aggregate "
                                         f"({s.name}) holds a NaN or Inf; nothing applied")
        except Exception as exc:  # a payload that fails to decode or any local error: the round rolls back
            self.session.report_error(exc)
            return parts, False
        return parts, not self.session.comm.failed and self.session.comm.rejected is None

    def _job_finite(self) -> bool:
        """Every rank of the job finite (so every rank's header says the same)."""
        bad = any(s.first_nonfinite_tensor() is not None for s in self.strategies)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if bad else 0.0], device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = bool(flag.item())
        return not bad

    def _nonfinite(self) -> None:
        if any(s.config.nonfinite_policy == "abort" for s in self.strategies):
            raise NonFiniteError(f"elastic worker {self.config.worker_index}: non-finite parameters before outer "
                                 "step; θ_outer left untouched (--sparseloco-nonfinite-policy abort)")
        self._discard()

    def _discard(self) -> None:
        for s in self.strategies:
            s.reset_to_anchor()
        self.hooks.sync_tied()
        self.hooks.publish()

    def _end(self, committed: bool, stats: List[OuterStepStats], rnd: Round, t0: float) -> None:
        """A committed round ends in ``_committed``; otherwise the local progress is kept or discarded."""
        if committed:
            self.core.finish_committed(0, stats, t0, time.perf_counter)
        else:
            if rnd.healed:      # the heal set θ_local (joining: θ_outer; catching up: per the progress rule)
                self.hooks.sync_tied()
                self.hooks.publish()
            elif self.config.after_failed_round == "discard":
                self._discard()
            timer = self.hooks.megatron_timer()
            if timer is not None:
                timer.stop()
        self._log(rnd, committed, stats)

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
        self.core.close()
        self.session.close()


__all__ = ["ElasticRounds", "elastic_rounds", "open_session"]
