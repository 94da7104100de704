"""The elastic round protocol on top of torchft's ``Manager``: ``ElasticSession``.

One session per rank of a job (the job = one torchft replica group; group rank g of every job
forms the outer group of shard position g). Every participant of a round runs the same sequence
of collectives, whatever it decides, so that a participant that decides otherwise (or one without
the run's secret) never pairs its collectives with different ones of the others:

    rnd = session.begin_round(contributes=..., finite=..., samples=..., fingerprint=...,
                              ignores_non_contributors=...)
    if rnd.exchange:                                      (the same on every participant)
        session.comm.set_contributors(rnd.contributors)
        strategy's communicate over session.comm          (collectives only; state untouched; a
                                                           non-contributor sends neutral data)
    ok = the caller's check of what it received           (e.g. finite, decodes)
    session.agree(ok)                                     (signed verdicts; False: this job rolls back)
    committed = session.finish_round()                    (torchft's vote inside the job)
    commit (θ_outer update) if committed, else roll back  (state exactly as before the round)

``begin_round``:

1. **Quorum** (``Manager.start_quorum``, synchronous): the lighthouse returns the live jobs; a job
   whose committed step is behind the largest heals from a live peer at the same shard position
   (``elastic.heal``; the caller's ``load_fn`` receives the peer's state). A rank whose heal fails
   in its job's first round exits (``ElasticExit``): its job restarts and heals again (the ranks of
   a joining job take their counters from the heal); later, it sits the round out (its job does not
   commit) and heals again at the next quorum. ``session.comm`` takes this round's size and rank.
2. **Binding**: every participant all-gathers a fresh random nonce over ``control``; the digest of
   the nonces (rank order) and torchft's quorum id bind every MAC of the round to it and to the
   signer's position (``elastic.messages``): a header or verdict replayed from another round or at
   another position is refused, across lighthouse restarts too. The round's all-gathered payloads
   are tagged under the same binding (``TorchFTComm.authenticate``).
3. **Round header**: every participant all-gathers a fixed-size signed JSON header: worker index,
   committed step, whether it contributes (a job that healed in this quorum does not, unless the
   caller carries its local progress onto the healed θ_outer: ``contributes_after_heal``), the
   fragment its schedule syncs, whether its pseudo-gradient is finite, samples / tokens,
   rounds it committed since it started, optionally a fingerprint of its θ_outer, the fork rule's
   fields (the newest step it knows the run committed, the newest it gave up on, how long it has
   waited), caller-defined integers (``extra``).
4. **Decision** (``elastic.decision.decide``), the same on every participant holding the secret.
   A refused header never makes a job exit: the refused participant is left out of the round's
   contributors and checks; a job that verifies none of the others does not commit and says each
   round which token file it read. ``rnd.proceed`` is whether this round may commit on this job;
   ``rnd.exchange`` whether to run the communicate phase: True on every participant whenever the
   header exchange completed, whatever its decision. A round that may not commit is reported to
   the manager (``report_error``), so that the job's ``should_commit`` is False.

``agree(ok)`` (after the communicate phase, on every participant, every round): all-gather a
signed verdict; True iff every verified participant said ok (a refused participant's verdict is
ignored). False is reported to the manager: the job rolls back. As every verified participant reads
the same verdicts, they all roll back together (``finish_round`` runs ``agree(True)`` for a caller
that did not call it, so the collective sequence stays the same).

``finish_round`` calls ``should_commit`` (a vote among the job's ranks: any rank's failure, in the
collectives or above, makes the whole job roll back). Commit is not atomic across jobs: a job that
rolled back while others committed is one step behind and heals at the next quorum.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.elastic.auth import derive_key, read_token
from megatron_sparseloco.elastic.comm import TorchFTComm
from megatron_sparseloco.elastic.config import ElasticConfig
from megatron_sparseloco.elastic.decision import Decision, Fork, ForkMemory, decide, tally_verdicts
from megatron_sparseloco.elastic.heal import SafeHealTransport
from megatron_sparseloco.elastic.messages import (HEADER_BYTES, HEADER_VERSION, RoundBinding, make_header,
                                                  make_verdict, new_nonce, read_header, refusal_line)

log = logging.getLogger(__name__)


class ElasticExit(SystemExit):
    """This job must leave the run; the message says why and what to do (uncaught: printed on
    stderr, exit status 1)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)


class RoundAborted(RuntimeError):
    """Reported to torchft when a round may not commit on this job (its vote is then False)."""


# ---------------------------------------------------------------------- the session
@dataclass
class Round:
    """What ``begin_round`` decided; positions (the round's group ranks) index ``peers``."""

    step: int                        # rounds committed before this one (after any heal)
    size: int                        # participants of this round
    rank: int                        # this job's position in the round
    peers: List[Optional[dict]]      # each participant's header (None: refused)
    contributors: List[int]          # the positions whose pseudo-gradient enters the round
    contributes: bool                # this job offered a pseudo-gradient (its header's flag)
    healed: bool                     # this job healed from a peer in this quorum
    behind: int                      # committed rounds this job lacked before the heal (0: none)
    #: run the communicate phase this round (True on every participant whenever the header exchange
    #: completed): as a contributor iff ``rank in contributors``, else sending neutral data
    exchange: bool
    proceed: bool                    # this round may commit on this job
    reason: str = ""                 # why not (or what to know, e.g. a fork accepted)
    refused: List[int] = field(default_factory=list)    # positions whose header did not verify
    nonfinite: List[int] = field(default_factory=list)
    #: the θ_outer fingerprint every verified participant reported when they all agreed (else None):
    #: the consistency check of the elastic group, compared at every round that gives one
    fingerprint: Optional[int] = None
    #: the fork rule's finding (``elastic.decision.Fork``): this round is behind the run's newest step
    fork: Optional[Fork] = None
    #: the verdict agreement (``ElasticSession.agree``; None until it ran)
    agreed: Optional[bool] = None
    seconds_quorum: float = 0.0
    seconds_header: float = 0.0
    #: the fragment this round syncs (``elastic.decision.round_fragment``; 0 with one fragment)
    fragment: int = 0

    @property
    def verified(self) -> List[int]:
        """The positions whose header verified this round (this job's own included)."""
        return [r for r, h in enumerate(self.peers) if h is not None]

    @property
    def contributing(self) -> bool:
        """This job's pseudo-gradient enters the round (it offered one, for the round's fragment, and the
        decision kept it)."""
        return self.rank in self.contributors

    @property
    def samples(self) -> int:
        """Samples of this round's contributors."""
        return sum((self.peers[r] or {}).get("samples", 0) for r in self.contributors)

    def summary(self) -> Dict[str, Any]:
        return {"step": self.step, "size": self.size, "rank": self.rank, "contributors": self.contributors,
                "contributes": self.contributes, "healed": self.healed, "behind": self.behind,
                "exchange": self.exchange, "proceed": self.proceed, "reason": self.reason, "refused": self.refused,
                "agreed": self.agreed, "indices": [None if h is None else h["index"] for h in self.peers],
                "fingerprint": None if self.fingerprint is None else f"{self.fingerprint & (2**64 - 1):016x}",
                "fork": None if self.fork is None else vars(self.fork),
                "seconds_quorum": round(self.seconds_quorum, 4), "seconds_header": round(self.seconds_header, 4),
                "fragment": self.fragment}


class ElasticSession:
    """One rank's membership in the elastic run (module docstring).

    ``state_fn()`` returns the state a joining job receives (tensors and JSON scalars in dicts and
    lists; references, not copies, and never the error feedback); ``load_fn(state)`` applies a
    received one; ``template_fn()`` (default ``state_fn``) gives the structure to validate
    against. ``store_addr`` / ``store_port``: the job's TCPStore (torchrun's MASTER_ADDR / PORT),
    reachable from the other jobs. ``pg``: a torchft process group (default: ProcessGroupGloo, or
    ProcessGroupNCCL when CUDA is available) with ``outer_timeout`` per operation.
    """

    def __init__(self, config: ElasticConfig, *, group_rank: int, group_world_size: int, store_addr: str,
                 store_port: int, state_fn: Callable[[], Any], load_fn: Callable[[Any], None],
                 outer_timeout: float, template_fn: Optional[Callable[[], Any]] = None, pg=None,
                 device: Optional[torch.device] = None):
        from torchft.manager import Manager
        self.config, self.group_rank = config, group_rank
        if config.token_file is None or config.worker_index is None or config.lighthouse is None:
            raise ValueError("ElasticSession needs a validated ElasticConfig (lighthouse, worker index, token file)")
        self.token_file, self.worker_index = config.token_file, config.worker_index
        self.key = derive_key(read_token(self.token_file))
        timeout = timedelta(seconds=outer_timeout)
        self.pg = pg if pg is not None else _default_pg(timeout)
        self._state_fn, self._load_fn = state_fn, load_fn
        self._template_fn = template_fn or state_fn
        self.transport = SafeHealTransport(self.pg, self.key, self._heal_template,
                                           timedelta(seconds=config.heal_timeout), device,
                                           config.heal_chunk_mb << 20, identity=config.worker_index)
        self.manager = self._connect(Manager, config, timeout, group_rank, group_world_size, store_addr, store_port)
        self.manager.register_state_dict_fn("elastic", self._on_heal, self._state_fn)
        self.comm = TorchFTComm(self.manager, self.pg, timeout)
        #: the round's own collectives: nonces, headers, verdicts (kept out of the strategy's byte counts)
        self.control = TorchFTComm(self.manager, self.pg, timeout, counter=CommCounter())
        self.commits = 0
        #: rounds in a row that did not commit (``--sparseloco-elastic-max-failed-rounds``)
        self.failed_in_a_row = 0
        self.round: Optional[Round] = None
        #: the fork rule's memory between rounds (``elastic.decision.ForkMemory``)
        self.fork_memory = ForkMemory()
        self._binding: Optional[RoundBinding] = None
        self._reported: Optional[BaseException] = None
        self._healed = False
        self._closed = False

    def _connect(self, manager_class, config: ElasticConfig, timeout: timedelta, group_rank: int,
                 group_world_size: int, store_addr: str, store_port: int):
        """torchft's manager for this rank (rank 0 starts the job's manager server and connects it to
        the lighthouse); an unreachable lighthouse or store ends the job with one message."""
        try:
            return manager_class(
                pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=config.min_workers,
                use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=config.quorum_timeout),
                connect_timeout=timedelta(seconds=config.connect_timeout), rank=group_rank,
                world_size=group_world_size, store_addr=config.host or store_addr, store_port=store_port,
                lighthouse_addr=config.lighthouse, replica_id=f"worker{config.worker_index:04d}",
                port=config.manager_port or None, hostname=config.host or _hostname(),
                heartbeat_interval=timedelta(seconds=config.heartbeat_interval), checkpoint_transport=self.transport,
                init_sync=False, max_retries=None)
        except Exception as exc:  # torchft raises plain RuntimeErrors from its RPC layer
            raise ElasticExit(f"elastic worker {config.worker_index}: cannot join the run ({exc}). Fix: check that "
                              f"the lighthouse --sparseloco-lighthouse {config.lighthouse} is up and reachable from "
                              f"this node, and that this job's store {config.host or store_addr}:{store_port} "
                              f"(--sparseloco-elastic-host) is reachable (--sparseloco-elastic-connect-timeout "
                              f"{config.connect_timeout:g} s)") from None

    def _heal_template(self) -> Any:
        return {"user": {"elastic": self._template_fn()}, "torchft": {"step": 0, "batches_committed": 0}}

    def _on_heal(self, state: Any) -> None:
        self._healed = True
        self._load_fn(state)

    @property
    def step(self) -> int:
        """Rounds committed by the run as this job knows it (torchft's step)."""
        return self.manager.current_step()

    def begin_round(self, *, contributes: bool = True, finite: bool = True, samples: int = 0, tokens: int = 0,
                    fingerprint: Optional[Callable[[], int]] = None, extra: Optional[Dict[str, int]] = None,
                    ignores_non_contributors: bool = False, fragment: int = -1,
                    contributes_after_heal: bool = False) -> Round:
        """Quorum (and heal), binding, header exchange, decision; raises ``ElasticExit`` when this job
        must leave (a failed heal, a worker index held by a veteran; never a refused header).

        ``fingerprint()`` (optional) hashes θ_outer; it is called after the quorum, so a job that
        healed reports the state it received. ``extra``: small caller-defined integers shared with
        every participant (authenticated like the rest of the header). ``ignores_non_contributors``:
        the strategy's communicate result depends only on the contributors' data whatever the other
        participants send (an all-gather whose payloads are decoded one by one, only the
        contributors' kept: SparseLoCo's); then a round with refused participants may commit with the
        verified ones. False (sums, gossip): such a round does not commit. ``fragment``: the part of the
        model this job's schedule syncs now (-1: any, a start-up round); the round syncs the one most
        participants name (``Round.fragment``). ``contributes_after_heal``: a job that catches up in this
        quorum still contributes (its local progress, carried onto the healed θ_outer by the caller, is
        its pseudo-gradient: ``--sparseloco-elastic-grace``); default: it sits the round out."""
        if self.round is not None:
            raise RuntimeError("begin_round called twice without finish_round")
        t0 = time.perf_counter()
        self._healed, self.transport.receive_error, before = False, None, self.step
        self._binding, self._reported = None, None
        try:
            self.manager.start_quorum()
        except Exception as exc:  # no quorum: the lighthouse is gone or the wait exceeded the timeout
            self.close()
            raise ElasticExit(f"elastic worker {self.worker_index}: no quorum ({exc}). Fix: check the lighthouse "
                              f"{self.config.lighthouse} is up; raise --sparseloco-elastic-quorum-timeout "
                              f"({self.config.quorum_timeout:g} s) if the other workers' rounds take longer; if the "
                              "other jobs have ended their training (--train-iters), this job had nobody left to "
                              "sync with") from None
        if self.transport.receive_error is not None:
            self._heal_failed(self.transport.receive_error, joining=not contributes)
        self.comm.sync_with_quorum()
        self.control.sync_with_quorum()
        t1 = time.perf_counter()
        fields = self._header_fields(contributes, finite, samples, tokens, fingerprint, extra, fragment,
                                     contributes_after_heal)
        rnd = self._decide(fields, self.step - before if self._healed else 0, ignores_non_contributors)
        rnd.seconds_quorum, rnd.seconds_header = t1 - t0, time.perf_counter() - t1
        self.round = rnd
        return rnd

    def _header_fields(self, contributes: bool, finite: bool, samples: int, tokens: int,
                       fingerprint: Optional[Callable[[], int]], extra: Optional[Dict[str, int]], fragment: int,
                      contributes_after_heal: bool) -> Dict[str, Any]:
        """This participant's header body (``elastic.messages.FIELDS``)."""
        ok = self.manager.errored() is None
        offers = contributes and ok and (contributes_after_heal or not self._healed)
        return {"v": HEADER_VERSION, "index": self.config.worker_index, "group_rank": self.group_rank,
                "step": self.step, "ok": ok, "contributes": bool(offers), "fragment": int(fragment),
                "finite": bool(finite), "samples": int(samples), "tokens": int(tokens), "commits": self.commits,
                "fingerprint": None if fingerprint is None else int(fingerprint()), "extra": dict(extra or {}),
                **self.fork_memory.fields(self.step, time.monotonic())}

    def _heal_failed(self, exc: BaseException, joining: bool) -> None:
        """A heal this rank could not complete. Joining (its job's first round, which contributes
        nothing): the job leaves and a restart heals it again (its counters come from that heal, and
        its ranks must not start from different ones). Later (catching up): this rank stays behind for
        this round — its error is reported, so its job does not commit — and heals again at the next
        quorum, from whichever live peer torchft then picks (a dead or refused source is not kept)."""
        if not joining:
            log.warning("elastic worker %s: healing from a live peer failed (%s); this job sits the round out and "
                        "heals again at the next quorum", self.config.worker_index, exc)
            self.manager.report_error(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            return
        self.close()
        raise ElasticExit(f"elastic worker {self.config.worker_index}: healing from a live peer failed: {exc}. Fix: "
                          f"check that --sparseloco-elastic-token-file ({self.config.token_file}) holds the run's "
                          "secret, then restart this job (same --sparseloco-worker-index): it heals at its first "
                          "quorum")

    def _bind(self) -> Optional[RoundBinding]:
        """Step 2 of the protocol: this round's binding from every participant's fresh nonce (None:
        the exchange failed; ``control`` reported it)."""
        mine = new_nonce()
        got = self.control.all_gather_payloads(torch.frombuffer(bytearray(mine), dtype=torch.uint8), equal_sizes=True)
        if self.control.error is not None:
            return None
        return RoundBinding.of_nonces([g.numpy().tobytes() for g in got], _quorum_id(self.manager))

    def _decide(self, fields: Dict[str, Any], behind: int, ignores_non_contributors: bool) -> Round:
        """Steps 2-4 of the protocol: binding, signed headers, the decision and what it asks of this job."""
        size, rank = self.control.size, self.control.rank
        base = dict(step=fields["step"], size=size, rank=rank, contributes=fields["contributes"], healed=self._healed,
                    behind=behind)
        self._binding = binding = self._bind()
        if binding is not None:   # the round's payloads are tagged under the same binding (``elastic.comm``)
            self.comm.authenticate(self.key, binding.context(-1, -1))
        raws = [] if binding is None else [r.numpy().tobytes() for r in self.control.all_gather_payloads(
            torch.frombuffer(bytearray(make_header(self.key, fields, binding, rank)), dtype=torch.uint8),
            equal_sizes=True)]
        if binding is None or self.control.error is not None:
            self.comm.fail(self.control.error or RuntimeError("round nonce exchange failed"))
            return Round(peers=[None] * size, contributors=[], exchange=False, proceed=False,
                         reason=f"round header exchange failed: {self.control.error}", **base)
        headers: List[Optional[dict]] = [read_header(self.key, raw, binding, r) for r, raw in enumerate(raws)]
        headers[rank] = fields
        decision = decide(headers, rank, self.config.min_workers, self.token_file,
                          ignores_non_contributors=ignores_non_contributors, fork_timeout=self.config.quorum_timeout)
        self._log_refusals(decision, raws)
        self._learn(headers, decision)
        if decision.exit_message is not None:
            self.close()
            raise ElasticExit(f"elastic worker {self.config.worker_index}: {decision.exit_message}")
        if decision.rewind:
            self._rewind(decision.reason)
        if not decision.proceed:
            self.manager.report_error(RoundAborted(decision.reason))
        fps = {h["fingerprint"] for h in headers if h is not None}
        agreed = next(iter(fps)) if len(fps) == 1 and decision.proceed else None
        contributors = [r for r in decision.contributors if r not in decision.nonfinite]
        return Round(peers=headers, contributors=contributors, exchange=True, proceed=decision.proceed,
                     reason=decision.reason, refused=decision.refused, nonfinite=decision.nonfinite, fingerprint=agreed,
                     fork=decision.fork, fragment=decision.fragment, **base)

    def _log_refusals(self, decision: Decision, raws: List[bytes]) -> None:
        """Name every refused participant (position, claimed worker index); a job that verified nobody
        says which token file it read and the fix, every round."""
        if decision.alone:
            log.warning("elastic worker %s: %s", self.worker_index, decision.reason)
            return
        for r in decision.refused:
            log.warning(refusal_line(r, raws[r]))

    def _learn(self, headers: List[Optional[dict]], decision: Decision) -> None:
        """The fork rule's memory after a decision (``ForkMemory.learn``); a round that waits for the
        newest step, and a fork accepted, are logged."""
        self.fork_memory.learn([h for h in headers if h is not None], decision.fork, time.monotonic())
        fork = decision.fork
        if fork is not None and not fork.accepted:
            log.warning("elastic worker %s: %s", self.worker_index, decision.reason)
        elif fork is not None:
            log.warning("elastic worker %s: the run forks at step %d: it had committed up to step %d, but no job "
                        "holding that step joined within %g s (--sparseloco-elastic-quorum-timeout); the run goes "
                        "on from step %d and the %d round(s) after it are given up", self.worker_index, fork.step,
                        fork.newest, self.config.quorum_timeout, fork.step, fork.newest - fork.step)

    def _rewind(self, why: str) -> None:
        """This job lost the fingerprint vote: set its committed step back by one, so that the next
        quorum heals it in place from a participant at the round's step (no exit, no restart loop)."""
        state = self.manager.state_dict()
        self.manager.load_state_dict({"step": int(state["step"]) - 1, "batches_committed": state["batches_committed"]})
        log.warning("elastic worker %s: %s; this job's θ_outer is not the majority's: its committed step goes back "
                    "to %d so that the next quorum heals it from a peer", self.worker_index, why, self.step)

    # ------------------------------------------------------------------ after the communicate phase
    def agree(self, ok: bool) -> bool:
        """The round's verdict agreement; call it once per round on every participant after the
        communicate phase (whether or not this job exchanged) and before ``finish_round``.

        All-gathers this participant's verdict ``ok`` signed for this round and its position; returns
        True iff every participant whose header was accepted this round sent a verifiable ok (a
        refused participant's verdict is ignored: it cannot veto). False when a verified participant
        said not ok or sent an unverifiable verdict, when the exchange fails (timeout, dead peer) or
        when this round's collectives failed already on this job (then without touching the network:
        the group may be broken); every False is reported to the manager, so this job rolls back."""
        rnd = self.round
        if rnd is None:
            raise RuntimeError("agree without begin_round")
        if rnd.agreed is not None:
            raise RuntimeError("agree called twice in one round")
        rnd.agreed, why = self._agree(bool(ok), rnd)
        if not rnd.agreed and not rnd.reason:
            rnd.reason = why
        return rnd.agreed

    def _agree(self, ok: bool, rnd: Round) -> Tuple[bool, str]:
        """(the agreement, why not) of ``agree``."""
        if self._binding is None or self.control.error is not None:
            return False, "the round header exchange failed"
        if self.comm.error is not None and self.comm.error is not self._reported:
            return False, f"the communicate phase failed: {self.comm.error}"
        raw = make_verdict(self.key, ok, self._binding, rnd.rank, self.worker_index)
        got = self.control.all_gather_payloads(torch.frombuffer(bytearray(raw), dtype=torch.uint8), equal_sizes=True)
        if self.control.error is not None:    # reported to the manager by ``control``
            return False, f"the verdict exchange failed: {self.control.error}"
        verified = {r: h["index"] for r, h in enumerate(rnd.peers) if h is not None}
        tally = tally_verdicts(self.key, [g.numpy().tobytes() for g in got], self._binding, verified)
        if tally.ok:
            return True, ""
        why = "verdicts: " + "; ".join(
            part for part in (f"not ok from participant(s) {tally.against}" if tally.against else "",
                              f"unverifiable from verified participant(s) {tally.unverifiable}" if tally.unverifiable
                              else "") if part)
        log.warning("elastic worker %s: the round rolls back (%s)", self.worker_index, why)
        self.manager.report_error(RoundAborted(why))
        return False, why

    def report_error(self, exc: Exception) -> None:
        """Make this round roll back on this job (e.g. the strategy's communicate raised). The
        network is not suspected: ``agree`` still exchanges its verdict."""
        if self.comm.error is None:
            self._reported = exc
        self.comm.fail(exc)

    def finish_round(self) -> bool:
        """torchft's vote inside the job; True: commit, False: roll back. Once per ``begin_round``
        (runs ``agree(True)`` first if the caller did not call ``agree``).

        A vote that cannot complete (a rank of the job stalled past ``--sparseloco-outer-timeout``)
        rolls back: no rank of the job got a decision, so none commits. After
        ``--sparseloco-elastic-max-failed-rounds`` rounds in a row without a commit the job exits."""
        if self.round is None:
            raise RuntimeError("finish_round without begin_round")
        if self.round.agreed is None:
            self.agree(True)
        reason, self.round = self.round.reason, None
        try:
            committed = bool(self.manager.should_commit())
        except Exception as exc:  # the vote's RPC failed or timed out: no decision anywhere in the job
            log.warning("elastic: the commit vote of this job failed (%s): rolling back", exc)
            committed = False
        self.commits += int(committed)
        self.failed_in_a_row = 0 if committed else self.failed_in_a_row + 1
        limit = self.config.max_failed_rounds
        if limit and self.failed_in_a_row >= limit:
            self.close()
            raise ElasticExit(f"elastic worker {self.worker_index}: {self.failed_in_a_row} rounds in a row did not "
                              f"commit (--sparseloco-elastic-max-failed-rounds {limit}); the last one: "
                              f"{reason or 'the commit vote failed'}. Fix: check the other jobs and the lighthouse "
                              "are up and reachable, then restart this job")
        return committed

    def state_dict(self) -> Dict[str, int]:
        """What a job's own checkpoint must keep besides the model (torchft's committed step: a
        resumed job that lost it would heal from a peer at its first quorum; the fork rule's steps)."""
        memory = self.fork_memory
        return {**self.manager.state_dict(), "commits": self.commits, "newest": memory.newest,
                "forgone": memory.forgone}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.manager.load_state_dict({"step": int(state["step"]), "batches_committed": int(state["batches_committed"])})
        self.commits = int(state.get("commits", 0))
        self.fork_memory = ForkMemory(newest=int(state.get("newest", state["step"])),
                                      forgone=int(state.get("forgone", -1)))

    def close(self) -> None:
        """End the session while the interpreter is still alive (idempotent), every step bounded by the
        outer timeout: wait for the operations a failed round left running (``TorchFTComm.drain``),
        shut torchft's manager down and join its threads (quorum thread, manager server, heal
        transport), then abort the process group and collect what referenced it. A gloo worker
        thread that still held an operation begun before a stall (a SIGSTOPped rank's collective)
        would otherwise release its tensors during interpreter finalisation, where taking the GIL
        aborts the process ("terminate called without an active exception") after its work is done."""
        if self._closed:
            return
        self._closed = True
        bound = self.comm.timeout.total_seconds()
        end = time.monotonic() + bound     # the drain's share: one outer timeout for both comms
        left = self.comm.drain(bound) + self.control.drain(max(0.0, end - time.monotonic()))
        if left:
            log.warning("elastic worker %s: %d operation(s) still running %.0f s after close", self.worker_index,
                        left, bound)
        if not _within(bound, lambda: self.manager.shutdown(wait=True)):   # torchft's threads joined
            log.warning("elastic worker %s: torchft's manager did not shut down within %.0f s", self.worker_index,
                        bound)
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            try:
                abort(errored=False)
            except TypeError:  # a process group whose abort() takes no flag
                abort()
            except Exception as exc:  # the group is unusable either way; the job is ending
                log.warning("elastic worker %s: aborting the process group at close: %s", self.worker_index, exc)
        gc.collect()


def _within(seconds: float, fn: Callable[[], None]) -> bool:
    """Run ``fn`` on a helper thread; whether it returned within ``seconds`` (an error counts as returned)."""
    def run() -> None:
        try:
            fn()
        except Exception as exc:  # shutting down: report, do not raise
            log.warning("elastic: %s", exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def _quorum_id(manager) -> int:
    """torchft's id of the current quorum (the same on every member; torchft 0.2.0 keeps it in a
    private attribute), or -1 when this torchft does not expose it."""
    qid = getattr(manager, "_quorum_id", None)
    return qid if isinstance(qid, int) and not isinstance(qid, bool) else -1


def _hostname() -> str:
    import socket
    return socket.gethostname()


def _default_pg(timeout: timedelta):
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    return ProcessGroupNCCL(timeout=timeout) if torch.cuda.is_available() else ProcessGroupGloo(timeout=timeout)


__all__ = ["ElasticSession", "ElasticExit", "Round", "RoundAborted", "Decision", "decide", "make_header",
           "read_header", "HEADER_BYTES"]
