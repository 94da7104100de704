"""The elastic round protocol on top of torchft's ``Manager``: ``ElasticSession``.

One session per rank of a job (the job = one torchft replica group; group rank g of every job
forms the outer group of shard position g). The outer loop drives each round as

    rnd = session.begin_round(contributes=..., finite=..., samples=..., fingerprint=...)
    if rnd.proceed:
        strategy's communicate over session.comm          (collectives only; state untouched)
    committed = session.finish_round()                    (torchft's vote inside the job)
    commit (θ_outer update) if committed, else roll back  (state exactly as before the round)

``begin_round``:

1. **Quorum** (``Manager.start_quorum``, synchronous): the lighthouse returns the live jobs; a job
   whose committed step is behind the largest heals from a live peer at the same shard position
   (``elastic.heal``; the caller's ``load_fn`` receives the peer's state). A rank whose heal fails
   exits (``ElasticExit``): its job restarts and heals again (ranks of one job must not disagree
   on their step). ``session.comm`` takes this round's size and rank.
2. **Round header**: every participant all-gathers a fixed-size JSON header (``HEADER_BYTES``):
   worker index, committed step, whether it contributes (a job that healed in this quorum does
   not: its local progress belongs to a stale θ_outer), whether its pseudo-gradient is finite,
   samples / tokens this round, rounds it committed since it started, optionally a fingerprint of
   its θ_outer, caller-defined integers (``extra``), and an HMAC of all that under the run's
   secret (``elastic.auth``).
3. **Decision**, the same on every participant that holds the secret (``decide``):

   * refused: a header that is malformed or whose MAC fails. If the headers this job accepts
     (its own included) are not a majority of the participants — or exactly half, and this
     process has never committed a round — this job is the odd one: it exits (``ElasticExit``,
     naming its token file). Otherwise it logs each refused participant and the round does not
     proceed; the refused job exits on its side, and the next quorum goes on without it.
   * a worker index held by two participants: the one that committed more rounds since it
     started keeps it (a tie: the lower group rank); the others exit. The round does not proceed.
   * committed steps that differ, or θ_outer fingerprints that differ (same step): the round does
     not proceed; for fingerprints, the participants outside the largest agreeing set (a tie: the
     set holding the lowest rank) exit, to be restarted and healed.
   * contributors = accepted participants that are healthy (nothing failed in their quorum, e.g.
     sending a heal) and contribute; the unhealthy ones take part in the collectives, do not
     commit, and are left out of the step and fingerprint checks. A non-finite contributor, or
     fewer than ``--sparseloco-min-workers`` contributors: no proceed.

   A round that does not proceed is reported to the manager (``report_error``), so every job's
   ``should_commit`` is False: every job rolls back.

``finish_round`` calls ``should_commit`` (a vote among the job's ranks: any rank's failure, in the
collectives or above, makes the whole job roll back). Commit is not atomic across jobs: a job that
rolled back while others committed is one step behind and heals at the next quorum.
"""
from __future__ import annotations

import gc
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.elastic.auth import derive_key, mac, mac_ok, read_token
from megatron_sparseloco.elastic.comm import TorchFTComm
from megatron_sparseloco.elastic.config import ElasticConfig
from megatron_sparseloco.elastic.heal import SafeHealTransport

log = logging.getLogger(__name__)

#: bytes of one round header on the wire (JSON, space padded)
HEADER_BYTES = 2048
HEADER_VERSION = 1
_FIELDS = ("v", "index", "group_rank", "step", "ok", "contributes", "finite", "samples", "tokens", "commits",
           "fingerprint", "extra")


class ElasticExit(SystemExit):
    """This job must leave the run; the message says why and what to do (uncaught: printed on
    stderr, exit status 1)."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)


class RoundAborted(RuntimeError):
    """Reported to torchft when a round does not proceed (every job then rolls back)."""


# ---------------------------------------------------------------------- headers
def make_header(key: bytes, fields: Dict[str, Any]) -> bytes:
    """The signed, padded header bytes of ``fields`` (keys ``_FIELDS``)."""
    body = json.dumps({k: fields[k] for k in _FIELDS}, sort_keys=True, separators=(",", ":"), allow_nan=False)
    doc = json.dumps({"body": body, "mac": mac(key, "round", body.encode()).hex()}, separators=(",", ":"))
    raw = doc.encode()
    if len(raw) > HEADER_BYTES:
        raise ValueError(f"round header of {len(raw)} bytes exceeds {HEADER_BYTES} (too many extra fields?)")
    return raw + b" " * (HEADER_BYTES - len(raw))


def read_header(key: bytes, raw: bytes) -> Optional[Dict[str, Any]]:
    """The fields of a header whose MAC verifies under ``key`` and whose shape is right, else None."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        body, tag = doc["body"], bytes.fromhex(doc["mac"])
        if not isinstance(body, str) or not mac_ok(key, "round", body.encode(), tag):
            return None
        fields = json.loads(body)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        return None
    ints = ("v", "index", "group_rank", "step", "samples", "tokens", "commits")
    if not isinstance(fields, dict) or set(fields) != set(_FIELDS) or fields["v"] != HEADER_VERSION:
        return None
    if not all(isinstance(fields[k], int) and not isinstance(fields[k], bool) for k in ints):
        return None
    if not all(isinstance(fields[k], bool) for k in ("ok", "contributes", "finite")):
        return None
    fp = fields["fingerprint"]
    if not isinstance(fields["extra"], dict) or not (fp is None or (isinstance(fp, int) and not isinstance(fp, bool))):
        return None
    return fields


# ---------------------------------------------------------------------- the decision
@dataclass
class Decision:
    proceed: bool
    reason: str = ""
    exit_message: Optional[str] = None
    refused: List[int] = field(default_factory=list)
    contributors: List[int] = field(default_factory=list)
    nonfinite: List[int] = field(default_factory=list)


def _minority(n_accepted: int, n: int, commits: int) -> bool:
    return 2 * n_accepted < n or (2 * n_accepted == n and commits == 0)


def _duplicate_loser(known: Dict[int, dict], me: int) -> Optional[int]:
    """The holder that keeps this rank's worker index when another holds it too (None: this rank
    keeps it, or nobody else holds it)."""
    holders = [r for r, h in known.items() if h["index"] == known[me]["index"]]
    if len(holders) < 2:
        return None
    keeper = max(holders, key=lambda r: (known[r]["commits"], -r))
    return None if keeper == me else keeper


def _fingerprint_winners(known: Dict[int, dict], ranks: List[int]) -> Optional[List[int]]:
    """The ranks of the largest set agreeing on θ_outer's fingerprint (tie: the set of the lowest
    rank), or None when every fingerprint given agrees."""
    groups: Dict[int, List[int]] = {}
    for r in ranks:
        if known[r]["fingerprint"] is not None:
            groups.setdefault(known[r]["fingerprint"], []).append(r)
    if len(groups) <= 1:
        return None
    return max(groups.values(), key=lambda rs: (len(rs), -min(rs)))


def decide(headers: List[Optional[dict]], me: int, min_workers: int, token_file: str) -> Decision:
    """The round's decision from every participant's verified header (None: refused; this rank's
    own is never None); see the module docstring. ``me``: this rank in the group."""
    n = len(headers)
    known = {r: h for r, h in enumerate(headers) if h is not None}
    mine, refused = known[me], [r for r in range(n) if r not in known]
    if _minority(len(known), n, mine["commits"]):
        return Decision(False, "refused by the majority", refused=refused,
                        exit_message=f"this job's round header is refused by the other {len(refused)} of {n} "
                        f"workers: it does not hold the run's secret. Fix: give every job the same "
                        f"--sparseloco-elastic-token-file (this job read {token_file!r})")
    if refused:
        return Decision(False, f"refused group rank(s) {refused}: their round header does not carry this run's MAC",
                        refused=refused)
    dup = [r for r, h in known.items() if sum(q["index"] == h["index"] for q in known.values()) > 1]
    if dup:
        keeper = _duplicate_loser(known, me)
        msg = None if keeper is None else (
            f"worker index {mine['index']} is already held by a live job (group rank {keeper}). Fix: give this job "
            "a free --sparseloco-worker-index, or stop the other job")
        return Decision(False, f"worker index held twice (group ranks {dup})", exit_message=msg)
    healthy = [r for r, h in known.items() if h["ok"]]    # the others (e.g. a failed heal send) sit the round out
    if len({known[r]["step"] for r in healthy}) > 1:
        return Decision(False, f"committed steps differ: {[known[r]['step'] for r in healthy]}")
    winners = _fingerprint_winners(known, healthy)
    if winners is not None:
        msg = None if me in winners or mine["fingerprint"] is None or not mine["ok"] else (
            f"θ_outer differs from that of group ranks {winners} at step {mine['step']}. Fix: restart this job "
            "(same --sparseloco-worker-index): it heals from a live peer")
        return Decision(False, f"θ_outer fingerprints differ; agreeing group ranks {winners}", exit_message=msg)
    contributors = [r for r in healthy if known[r]["contributes"]]
    nonfinite = [r for r in contributors if not known[r]["finite"]]
    if nonfinite:
        return Decision(False, f"non-finite pseudo-gradient on group rank(s) {nonfinite}", contributors=contributors,
                        nonfinite=nonfinite)
    if len(contributors) < min_workers:
        return Decision(False, f"{len(contributors)} contributing workers, fewer than --sparseloco-min-workers "
                        f"{min_workers}", contributors=contributors)
    return Decision(True, contributors=contributors)


# ---------------------------------------------------------------------- the session
@dataclass
class Round:
    """What ``begin_round`` decided; group ranks index ``peers``."""

    step: int                        # rounds committed before this one (after any heal)
    size: int                        # participants of this round
    rank: int                        # this job's group rank
    peers: List[Optional[dict]]      # each participant's header (None: refused)
    contributors: List[int]
    contributes: bool                # this job contributes a pseudo-gradient
    healed: bool                     # this job healed from a peer in this quorum
    behind: int                      # committed rounds this job lacked before the heal (0: none)
    proceed: bool                    # run the communicate phase
    reason: str = ""                 # why not
    nonfinite: List[int] = field(default_factory=list)
    #: the θ_outer fingerprint every participant reported when they all agreed (else None): the
    #: consistency check of the elastic group, compared at every round that gives one
    fingerprint: Optional[int] = None
    seconds_quorum: float = 0.0
    seconds_header: float = 0.0

    @property
    def samples(self) -> int:
        """Samples of this round's contributors."""
        return sum((self.peers[r] or {}).get("samples", 0) for r in self.contributors)

    def summary(self) -> Dict[str, Any]:
        return {"step": self.step, "size": self.size, "rank": self.rank, "contributors": self.contributors,
                "contributes": self.contributes, "healed": self.healed, "behind": self.behind, "proceed": self.proceed,
                "reason": self.reason, "indices": [None if h is None else h["index"] for h in self.peers],
                "fingerprint": None if self.fingerprint is None else f"{self.fingerprint & (2**64 - 1):016x}",
                "seconds_quorum": round(self.seconds_quorum, 4), "seconds_header": round(self.seconds_header, 4)}


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
        #: the round header's own collectives (kept out of the strategy's byte counts)
        self.control = TorchFTComm(self.manager, self.pg, timeout, counter=CommCounter())
        self.commits = 0
        #: rounds in a row that did not commit (``--sparseloco-elastic-max-failed-rounds``)
        self.failed_in_a_row = 0
        self.round: Optional[Round] = None
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
                    fingerprint: Optional[Callable[[], int]] = None, extra: Optional[Dict[str, int]] = None) -> Round:
        """Quorum (and heal), header exchange, decision; raises ``ElasticExit`` when this job must leave.

        ``fingerprint()`` (optional) hashes θ_outer; it is called after the quorum, so a job that
        healed reports the state it received. ``extra``: small caller-defined integers shared with
        every participant (authenticated like the rest of the header)."""
        if self.round is not None:
            raise RuntimeError("begin_round called twice without finish_round")
        t0 = time.perf_counter()
        self._healed, self.transport.receive_error, before = False, None, self.step
        try:
            self.manager.start_quorum()
        except Exception as exc:  # no quorum: the lighthouse is gone or the wait exceeded the timeout
            self.close()
            raise ElasticExit(f"elastic worker {self.worker_index}: no quorum ({exc}). Fix: check the lighthouse "
                              f"{self.config.lighthouse} is up; raise --sparseloco-elastic-quorum-timeout "
                              f"({self.config.quorum_timeout:g} s) if the other workers' rounds take longer") from None
        if self.transport.receive_error is not None:
            self._heal_failed(self.transport.receive_error)
        self.comm.sync_with_quorum()
        self.control.sync_with_quorum()
        t1 = time.perf_counter()
        ok = self.manager.errored() is None
        fields = {"v": HEADER_VERSION, "index": self.config.worker_index, "group_rank": self.group_rank,
                  "step": self.step, "ok": ok, "contributes": bool(contributes and ok and not self._healed),
                  "finite": bool(finite), "samples": int(samples), "tokens": int(tokens), "commits": self.commits,
                  "fingerprint": None if fingerprint is None else int(fingerprint()), "extra": dict(extra or {})}
        rnd = self._decide(fields, behind=self.step - before if self._healed else 0)
        rnd.seconds_quorum, rnd.seconds_header = t1 - t0, time.perf_counter() - t1
        self.round = rnd
        return rnd

    def _heal_failed(self, exc: BaseException) -> None:
        """A heal this rank could not complete leaves it behind the rest of its job: the job leaves
        and a restart heals it again (a job whose ranks disagree on their step could not rejoin)."""
        self.close()
        raise ElasticExit(f"elastic worker {self.config.worker_index}: healing from a live peer failed: {exc}. Fix: "
                          f"check that --sparseloco-elastic-token-file ({self.config.token_file}) holds the run's "
                          "secret, then restart this job (same --sparseloco-worker-index): it heals at its first "
                          "quorum")

    def _decide(self, fields: Dict[str, Any], behind: int) -> Round:
        raws = self.control.all_gather_payloads(
            torch.frombuffer(bytearray(make_header(self.key, fields)), dtype=torch.uint8), equal_sizes=True)
        size, rank = self.control.size, self.control.rank
        base = dict(step=fields["step"], size=size, rank=rank, contributes=fields["contributes"], healed=self._healed,
                    behind=behind)
        if self.control.error is not None:
            self.comm.fail(self.control.error)
            return Round(peers=[None] * size, contributors=[], proceed=False,
                         reason=f"round header exchange failed: {self.control.error}", **base)
        headers = [read_header(self.key, r.numpy().tobytes()) for r in raws]
        headers[rank] = fields
        decision = decide(headers, rank, self.config.min_workers, self.token_file)
        for r in decision.refused if decision.exit_message is None else ():
            log.warning("elastic: refusing group rank %d (it claims worker index %s): its round header does not "
                        "carry this run's MAC (another --sparseloco-elastic-token-file?)", r, _claimed_index(raws[r]))
        if decision.exit_message is not None:
            self.close()
            raise ElasticExit(f"elastic worker {self.config.worker_index}: {decision.exit_message}")
        if not decision.proceed:
            self.manager.report_error(RoundAborted(decision.reason))
        fps = {h["fingerprint"] for h in headers if h is not None}
        agreed = next(iter(fps)) if len(fps) == 1 and decision.proceed else None
        return Round(peers=headers, contributors=decision.contributors, proceed=decision.proceed,
                     reason=decision.reason, nonfinite=decision.nonfinite, fingerprint=agreed, **base)

    def report_error(self, exc: Exception) -> None:
        """Make this round roll back on this job (e.g. the strategy's communicate raised)."""
        self.comm.fail(exc)

    def finish_round(self) -> bool:
        """torchft's vote inside the job; True: commit, False: roll back. Once per ``begin_round``.

        A vote that cannot complete (a rank of the job stalled past ``--sparseloco-outer-timeout``)
        rolls back: no rank of the job got a decision, so none commits. After
        ``--sparseloco-elastic-max-failed-rounds`` rounds in a row without a commit the job exits."""
        if self.round is None:
            raise RuntimeError("finish_round without begin_round")
        self.round = None
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
                              f"commit (--sparseloco-elastic-max-failed-rounds {limit}). Fix: check the other jobs "
                              "and the lighthouse are up and reachable, then restart this job")
        return committed

    def state_dict(self) -> Dict[str, int]:
        """What a job's own checkpoint must keep besides the model (torchft's committed step: a
        resumed job that lost it would heal from a peer at its first quorum)."""
        return {**self.manager.state_dict(), "commits": self.commits}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.manager.load_state_dict({"step": int(state["step"]), "batches_committed": int(state["batches_committed"])})
        self.commits = int(state.get("commits", 0))

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


def _claimed_index(raw: torch.Tensor) -> str:
    """The worker index an unverified header claims (for the log only)."""
    try:
        return str(json.loads(json.loads(raw.numpy().tobytes().decode())["body"])["index"])
    except Exception:  # any garbage: nothing to report
        return "?"


def _hostname() -> str:
    import socket
    return socket.gethostname()


def _default_pg(timeout: timedelta):
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    return ProcessGroupNCCL(timeout=timeout) if torch.cuda.is_available() else ProcessGroupGloo(timeout=timeout)


__all__ = ["ElasticSession", "ElasticExit", "Round", "Decision", "decide", "make_header", "read_header",
           "HEADER_BYTES"]
