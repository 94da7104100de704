"""The decisions of an elastic round, as pure functions of what the participants sent.

``decide`` turns the round's headers (None: refused, ``elastic.messages``) into whether this job
may commit the round and who contributes; ``fork_check`` is the fork rule inside it;
``tally_verdicts`` turns the verdicts gathered after the communicate phase into the round's
agreement. Every participant holding the run's secret reads the same headers and verdicts, so it
takes the same decisions (except the few that concern it alone: which job exits or rewinds).

**Refusals never make a job exit.** A job cannot tell locally "I hold another secret than the run"
from "the others are intruders", so a refused participant only drops out: it is excluded from
the contributors and from every check (worker indices, steps, fingerprints, the fork rule,
verdicts). The round commits with the verified participants when the strategy's collectives stay
correct whatever the refused ones send (``ignores_non_contributors``: an all-gather whose
payloads are decoded one by one and only the contributors' kept, SparseLoCo's); a strategy that
sums every participant's data (all-reduces, gossip) does not commit a round with a refused
participant in it. A job that verifies no other participant of a round of several does not commit
(``Decision.alone``): it may be the one holding another secret, and committing alone would fork its
model from the run. It keeps taking part (as a non-contributor) and says each round which token
file it read; only ``--sparseloco-elastic-max-failed-rounds`` ends it.

The rules among verified participants, in order (the first that applies decides):

* a worker index held twice: the holder that committed more rounds since it started keeps it (a
  tie: the lower position); the others exit (``exit_message``). No commit.
* healthy participants (``ok``: nothing failed in their quorum) at different committed steps: no
  commit (torchft heals the ones behind at the next quorum).
* θ_outer fingerprints that differ among the healthy: no commit; the participants outside the
  largest agreeing set (a tie: the set holding the lowest position) **rewind** (``Decision.rewind``:
  they set their committed step back by one, so that torchft heals them in place from a
  participant at the round's step in the next quorum). Nobody exits: a restarted loser could heal
  from another loser and lose again, a restart loop.
* the fork rule (``fork_check``): the round's step (the healthy participants') is behind the newest
  step a verified participant knows the run committed: no healthy participant of this round holds
  it (torchft heals every member of a quorum to its largest step, so a job holding it would have
  brought everyone there). The round does not
  commit while the longest waiting verified participant has waited less than ``fork_timeout``
  (``--sparseloco-elastic-quorum-timeout``): more quorums come, one of which may bring a job at
  the newest step (torchft then heals everyone to it). Past it the round goes on from the older
  step (``Fork.accepted``) and the run's history forks there: the caller logs it, and the newest
  step is forgone (never waited for again). ``--sparseloco-min-workers`` > W/2 keeps two sides of a
  partition from both committing (docs/elastic.md).
* a non-finite contributor, or fewer than ``min_workers`` contributors: no commit.

Contributors = verified, healthy participants that contribute to the round's fragment.

**The round's fragment** (``round_fragment``; with ``--sparseloco-fragments`` P > 1 every round syncs
one of the model's P fragments, each header names the one its job's schedule is at, -1 for a
start-up round that has none): the fragment most healthy participants name (a tie: the lowest;
nobody names one: 0). Every participant runs that fragment's collectives; a participant whose
schedule is at another fragment (a job that caught up in place keeps its own iteration, so its
phase may differ from the run's) takes part without contributing and keeps its local progress; a
contributor that names none (-1: a caller without fragments) contributes to whichever it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from megatron_sparseloco.elastic.messages import RoundBinding, read_verdict


@dataclass(frozen=True)
class Fork:
    """A round behind the run's newest known step that no participant of it holds (``fork_check``)."""

    newest: int            # the newest committed step a verified participant knows of
    step: int              # the round's step
    waited: int            # seconds the longest waiting verified participant has waited for ``newest``
    accepted: bool         # waited >= the timeout: the round goes on from ``step``, the run forks


@dataclass
class Decision:
    """What ``decide`` concluded for one participant; positions index the round's participants."""

    proceed: bool                                        # this round may commit on this job
    reason: str = ""                                     # why not (or what to know: an accepted fork)
    exit_message: Optional[str] = None                   # this job must leave the run (a worker index it lost)
    refused: List[int] = field(default_factory=list)     # positions whose header did not verify
    contributors: List[int] = field(default_factory=list)
    nonfinite: List[int] = field(default_factory=list)
    alone: bool = False                                  # no other participant of several verified
    rewind: bool = False                                 # this job lost the fingerprint vote: heal in place
    fork: Optional[Fork] = None
    fragment: int = 0                                    # the fragment this round syncs (``round_fragment``)


def round_fragment(headers: Sequence[dict]) -> int:
    """The fragment most of ``headers`` name (a tie: the lowest); 0 when none names one (all -1)."""
    named = [h["fragment"] for h in headers if h["fragment"] >= 0]
    if not named:
        return 0
    return min(set(named), key=lambda f: (-named.count(f), f))


def fork_check(known: Mapping[int, dict], step: int, timeout: float) -> Optional[Fork]:
    """The fork rule (module docstring) over the verified headers ``known`` at the round's ``step``:
    None when the round is at the newest step its verified participants know of (or that step was
    forgone by one of them)."""
    newest = max(max(h["newest"], h["step"]) for h in known.values())
    forgone = max(h["forgone"] for h in known.values())
    if newest <= step or newest <= forgone:
        return None
    waited = max(h["waited"] for h in known.values())
    return Fork(newest=newest, step=step, waited=waited, accepted=waited >= timeout)


@dataclass
class ForkMemory:
    """What one job carries from round to round for the fork rule: the newest committed step it has
    seen in a verified header (its own step included), the newest step it gave up on (forgone: never
    waited for again), and since when it waits (monotonic seconds; None: it does not). Kept in the
    job's checkpoint (``newest``, ``forgone``)."""

    newest: int = 0
    forgone: int = -1
    waiting_since: Optional[float] = None

    def fields(self, step: int, now: float) -> Dict[str, int]:
        """The fork rule's fields of this job's next header (it holds committed ``step``)."""
        waited = 0 if self.waiting_since is None else int(now - self.waiting_since)
        return {"newest": max(self.newest, step), "forgone": self.forgone, "waited": waited}

    def learn(self, verified: Sequence[dict], fork: Optional[Fork], now: float) -> None:
        """After a round's decision: the newest and forgone steps of the ``verified`` headers; the
        waiting clock runs from the first round that waits until a round that does not; an accepted
        fork forgoes its newest step."""
        self.newest = max([self.newest] + [max(h["step"], h["newest"]) for h in verified])
        self.forgone = max([self.forgone] + [h["forgone"] for h in verified])
        if fork is None:
            self.waiting_since = None
        elif not fork.accepted:
            self.waiting_since = now if self.waiting_since is None else self.waiting_since
        else:
            self.waiting_since, self.forgone = None, max(self.forgone, fork.newest)


def _duplicate_keeper(known: Mapping[int, dict], me: int) -> Optional[int]:
    """The holder that keeps this participant's worker index when another verified one holds it too
    (None: this participant keeps it, or nobody else holds it)."""
    holders = [r for r, h in known.items() if h["index"] == known[me]["index"]]
    if len(holders) < 2:
        return None
    keeper = max(holders, key=lambda r: (known[r]["commits"], -r))
    return None if keeper == me else keeper


def _fingerprint_winners(known: Mapping[int, dict], ranks: Sequence[int]) -> Optional[List[int]]:
    """The positions of the largest set agreeing on θ_outer's fingerprint (tie: the set of the lowest
    position), or None when every fingerprint given agrees."""
    groups: Dict[int, List[int]] = {}
    for r in ranks:
        if known[r]["fingerprint"] is not None:
            groups.setdefault(known[r]["fingerprint"], []).append(r)
    if len(groups) <= 1:
        return None
    return max(groups.values(), key=lambda rs: (len(rs), -min(rs)))


def alone_reason(size: int, token_file: str) -> str:
    """Why a job that verifies none of the ``size - 1`` others does not commit, with the fix."""
    return (f"none of the other {size - 1} participant(s) of this round verifies under this job's secret: this job "
            "does not commit (it may be the one holding another secret; committing alone would fork its model) and "
            "takes part as a non-contributor. Fix: give every job of the run the same "
            f"--sparseloco-elastic-token-file (this job read {token_file!r}); if this job's file is the run's, the "
            "others are not part of it (firewall the lighthouse)")


def decide(headers: Sequence[Optional[dict]], me: int, min_workers: int, token_file: str, *,
           ignores_non_contributors: bool = False, fork_timeout: float = math.inf) -> Decision:
    """The round's decision from every participant's verified header (None: refused; this
    participant's own is never None); see the module docstring. ``me``: this participant's position."""
    n = len(headers)
    known = {r: h for r, h in enumerate(headers) if h is not None}
    mine, refused = known[me], [r for r in range(n) if r not in known]
    if n > 1 and len(known) == 1:
        return Decision(False, alone_reason(n, token_file), refused=refused, alone=True)
    if refused and not ignores_non_contributors:
        return Decision(False, f"refused participant(s) {refused} present, and this strategy's collectives combine "
                        "every participant's data: the round cannot be kept free of what they sent", refused=refused)
    dup = [r for r, h in known.items() if sum(q["index"] == h["index"] for q in known.values()) > 1]
    if dup:
        keeper = _duplicate_keeper(known, me)
        msg = None if keeper is None else (
            f"worker index {mine['index']} is already held by a live job (participant {keeper}). Fix: give this job "
            "a free --sparseloco-worker-index, or stop the other job")
        return Decision(False, f"worker index held twice (participants {dup})", exit_message=msg, refused=refused)
    healthy = [r for r, h in known.items() if h["ok"]]    # the others (e.g. a failed heal receive) sit it out
    if len({known[r]["step"] for r in healthy}) > 1:
        return Decision(False, f"committed steps differ: {[known[r]['step'] for r in healthy]}", refused=refused)
    winners = _fingerprint_winners(known, healthy)
    if winners is not None:
        rewind = me not in winners and mine["fingerprint"] is not None and mine["ok"]
        return Decision(False, f"θ_outer fingerprints differ; agreeing participants {winners}", refused=refused,
                        rewind=rewind)
    step = known[healthy[0]]["step"] if healthy else mine["step"]
    fork = fork_check(known, step, fork_timeout)
    if fork is not None and not fork.accepted:
        return Decision(False, f"the run committed step {fork.newest} but no participant of this round holds it "
                        f"(this round is at step {step}): waiting {fork.waited} of {fork_timeout:g} s "
                        "(--sparseloco-elastic-quorum-timeout) for a quorum with a job at that step", refused=refused,
                        fork=fork)
    fragment = round_fragment([known[r] for r in healthy])
    contributors = [r for r in healthy if known[r]["contributes"] and known[r]["fragment"] in (fragment, -1)]
    nonfinite = [r for r in contributors if not known[r]["finite"]]
    if nonfinite:
        return Decision(False, f"non-finite pseudo-gradient on participant(s) {nonfinite}", contributors=contributors,
                        nonfinite=nonfinite, refused=refused, fork=fork, fragment=fragment)
    if len(contributors) < min_workers:
        return Decision(False, f"{len(contributors)} contributing workers, fewer than --sparseloco-min-workers "
                        f"{min_workers}", contributors=contributors, refused=refused, fork=fork, fragment=fragment)
    return Decision(True, contributors=contributors, refused=refused, fork=fork, fragment=fragment)


# ---------------------------------------------------------------------- verdicts
@dataclass
class Verdicts:
    """The verdict agreement of one round (``tally_verdicts``)."""

    ok: bool                                                # every verified participant reported ok
    against: List[int] = field(default_factory=list)       # verified participants that reported not ok
    unverifiable: List[int] = field(default_factory=list)  # verified participants whose verdict did not verify
    ignored: List[int] = field(default_factory=list)       # refused participants (whatever they sent)


def tally_verdicts(key: bytes, raws: Sequence[bytes], binding: RoundBinding, verified: Mapping[int, int]) -> Verdicts:
    """The agreement over the gathered verdicts ``raws`` (rank order). ``verified``: position → worker
    index of each participant whose header was accepted this round; only their verdicts count, and
    each must verify for this round, its position and that index and say ok. A refused participant's
    verdict is ignored (it cannot veto); a verified participant whose verdict does not verify counts
    as not ok (an altered verdict cannot turn an objection into a commit)."""
    out = Verdicts(ok=True)
    for position, raw in enumerate(raws):
        if position not in verified:
            out.ignored.append(position)
            continue
        said = read_verdict(key, raw, binding, position, verified[position])
        if said is None:
            out.unverifiable.append(position)
        elif not said:
            out.against.append(position)
    out.ok = not out.against and not out.unverifiable
    return out


__all__ = ["Decision", "Fork", "ForkMemory", "Verdicts", "alone_reason", "decide", "fork_check", "round_fragment",
           "tally_verdicts"]
