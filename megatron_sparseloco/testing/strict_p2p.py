"""A strict point-to-point checker: messages must match by issue order alone, as NCCL matches them.

    world = StrictP2P()
    pg0, pg1 = world.group(0), world.group(1)      # fakes that move the bytes themselves
    pgx = world.group(2, inner=some_pg)            # or a wrapper: checks, then delegates to ``inner``
    ... run each rank's protocol in its own thread with its group ...
    world.check()                                  # raises StrictP2PError listing every violation

A group offers what torchft's process groups (and the tests' loopback groups) offer for
point-to-point: ``send([t], peer, tag)`` / ``recv([t], peer, tag)``, each returning a work with
``wait(timeout)``. NCCL ignores tags: it matches the operations two ranks issue to each other in
the order each issues them, and an operation completes only once its counterpart is issued (a
send does not complete into a buffer nobody posted). A protocol that is correct over gloo thanks
to tags, or thanks to gloo buffering a send, can deadlock or mismatch over NCCL. This checker
rejects exactly that, precisely:

1. **No tags.** Any non-zero ``tag`` is refused at the call.
2. **One contiguous tensor per call**, as NCCL and gloo need (sizes are compared in bytes; the
   dtypes may differ, the bytes are copied raw).
3. **Mirror order per pair.** For ranks a, b, let a's operations *with b* (sends to b and
   receives from b, in the order a issues them) be o_a[0], o_a[1], ..., and b's with a be
   o_b[0], .... For every j, o_a[j] and o_b[j] must be one send and one receive of the same
   byte size. This is the condition under which ungrouped point-to-point operations, executed
   in issue order and completing only when matched, cannot deadlock or mismatch between two
   ranks. It implies the per-direction rule (the k-th send of a to b meets the k-th receive of b
   from a, same size) and rejects the crossed pattern (both ranks' j-th operation a send — over
   NCCL both block: the deadlock — or both a receive). Opposite operations outstanding at once
   with one peer are allowed when their order mirrors the peer's (a: send then recv, b: recv
   then send completes over NCCL); grouped launches (``batch_isend_irecv``, which NCCL may
   complete in any order) are not modelled: every operation is treated as ungrouped, the
   strictest case. Operations with different peers are independent of each other.
4. **No wait cycle.** ``wait`` blocks until the counterpart is issued (the strictest completion
   NCCL and gloo allow; a fake group then copies the bytes). Ranks a0 → a1 → ... → a0, each
   waiting on an unmatched operation with the next, can never proceed: reported as a deadlock
   (this assumes one thread issues and waits per rank, as one stream orders a rank's work).

A violation raises ``StrictP2PError`` in the thread that issues (or waits on) the operation
that reveals it, fails the counterpart's wait with the same error (no hang), and is kept in
``world.violations``: code under test that catches exceptions cannot hide one from
``world.check()``, which also reports operations left unmatched (a send nobody received, a
receive nobody sent to; ``allow_unmatched=True`` when a test lets a wait time out on purpose;
those with a killed rank are never reported).

Faults for tests: ``wait(timeout)`` raises ``StrictP2PTimeout`` (a ``TimeoutError``) when the
counterpart is not issued in time; the operation stays issued, so later ones shift by one, as
over a real transport. ``world.kill(rank)`` ends a rank: its pending and later operations, and
its peers' with it, fail with ``ConnectionError``.

Wrapping a real group (``inner=``): rules 1–3 are checked when an operation is issued and the
bytes move through ``inner``; the wait is ``inner``'s (rule 4 and the fault injection apply to
fakes only); other attributes are ``inner``'s. Testing only.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

#: seconds a wait without a timeout may block before it is reported (a test must not hang)
DEFAULT_WAIT_S = 60.0


class StrictP2PError(AssertionError):
    """A point-to-point protocol violation; the message names both ranks, the operation and the rule."""


class StrictP2PTimeout(TimeoutError):
    """A wait whose counterpart was not issued in time."""


@dataclass(eq=False)
class P2POp:
    rank: int
    peer: int
    kind: str               # "send" or "recv"
    position: int           # j: its place among ``rank``'s operations with ``peer``
    number: int             # k: its place among ``rank``'s operations of this kind with ``peer``
    nbytes: int
    tensor: torch.Tensor
    matched: bool = False
    wrapped: bool = False    # issued through a wrapper: ``inner`` moves the bytes
    error: Optional[BaseException] = None
    inner_work: Any = field(default=None, repr=False)

    def describe(self) -> str:
        arrow = f"send #{self.number} to rank {self.peer}" if self.kind == "send" else \
            f"recv #{self.number} from rank {self.peer}"
        return f"rank {self.rank}'s {arrow} ({self.nbytes} bytes; its operation #{self.position} with rank {self.peer})"


Timeout = Union[None, float, timedelta]


class _Work:
    def __init__(self, world: "StrictP2P", op: P2POp):
        self.world, self.op = world, op

    def wait(self, timeout: Timeout = None) -> bool:
        return self.world._wait(self.op, timeout)

    def is_completed(self) -> bool:
        return self.op.matched or self.op.error is not None


class StrictGroup:
    """One rank's endpoint (``StrictP2P.group``)."""

    def __init__(self, world: "StrictP2P", rank: int, inner: Any = None):
        self.world, self._rank, self.inner = world, rank, inner

    def send(self, tensors: Sequence[torch.Tensor], dst_rank: int, tag: int = 0) -> _Work:
        return self.world._issue(self, "send", tensors, int(dst_rank), tag)

    def recv(self, tensors: Sequence[torch.Tensor], src_rank: int, tag: int = 0) -> _Work:
        return self.world._issue(self, "recv", tensors, int(src_rank), tag)

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(f"StrictGroup (a point-to-point fake) has no {name!r}")
        return getattr(inner, name)


class StrictP2P:
    """The ranks of one test and the operations they issue to each other (module docstring)."""

    def __init__(self, default_wait_s: float = DEFAULT_WAIT_S):
        self.default_wait_s = default_wait_s
        self._cond = threading.Condition()
        #: (rank, peer) → rank's operations with peer, in issue order
        self.channels: Dict[Tuple[int, int], List[P2POp]] = {}
        #: every violation found (kept even when the code under test caught the exception)
        self.violations: List[str] = []
        #: (src, dst, nbytes) of every matched message, in match order
        self.messages: List[Tuple[int, int, int]] = []
        self.dead: set = set()
        self._waiting: Dict[int, P2POp] = {}

    def group(self, rank: int, inner: Any = None) -> StrictGroup:
        return StrictGroup(self, int(rank), inner)

    # ------------------------------------------------------------------ faults
    def kill(self, rank: int) -> None:
        """``rank`` is gone: every unmatched operation it or a peer holds with it fails, and so do later ones."""
        with self._cond:
            self.dead.add(rank)
            for (a, b), ops in self.channels.items():
                if rank in (a, b):
                    for op in ops:
                        if not op.matched and op.error is None:
                            op.error = ConnectionError(f"{op.describe()}: rank {rank} is gone")
            self._cond.notify_all()

    # ------------------------------------------------------------------ issue
    def _violation(self, message: str) -> StrictP2PError:
        self.violations.append(message)
        return StrictP2PError(message)

    def _issue(self, group: StrictGroup, kind: str, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> _Work:
        rank = group._rank
        where = f"rank {rank}: {kind} {'to' if kind == 'send' else 'from'} rank {peer}"
        with self._cond:
            if tag != 0:
                raise self._violation(f"{where} with tag {tag}: NCCL ignores tags, messages match by issue order "
                                      "alone. Fix: pass tag 0 and make both sides follow one order")
            if len(tensors) != 1 or not isinstance(tensors[0], torch.Tensor) or not tensors[0].is_contiguous():
                raise self._violation(f"{where}: give exactly one contiguous tensor per operation")
            if peer == rank:
                raise self._violation(f"{where}: a rank cannot send to or receive from itself")
            t = tensors[0]
            mine = self.channels.setdefault((rank, peer), [])
            op = P2POp(rank, peer, kind, len(mine), sum(o.kind == kind for o in mine), t.numel() * t.element_size(), t,
                       wrapped=group.inner is not None)
            mine.append(op)
            if rank in self.dead or peer in self.dead:
                op.error = ConnectionError(f"{op.describe()}: rank {rank if rank in self.dead else peer} is gone")
            else:
                theirs = self.channels.get((peer, rank), [])
                if len(theirs) > op.position:
                    self._match(op, theirs[op.position])
            self._cond.notify_all()
            if op.error is not None and isinstance(op.error, StrictP2PError):
                raise op.error
        if group.inner is not None and op.error is None:
            op.inner_work = getattr(group.inner, kind)([t], peer, tag)
        return _Work(self, op)

    def _match(self, op: P2POp, other: P2POp) -> None:
        """``op`` (just issued) meets ``other``, the peer's operation at the same position."""
        if op.kind == other.kind:
            pattern = ("both send first: over NCCL each blocks until the other receives (deadlock)"
                       if op.kind == "send" else "both receive: neither message is ever sent")
            err = self._violation(f"crossed order: {other.describe()} meets {op.describe()}; {pattern}. Fix: one "
                                  "side sends while the other receives, in one order both follow")
        elif op.nbytes != other.nbytes:
            err = self._violation(f"size mismatch: {other.describe()} meets {op.describe()}. Fix: both sides must "
                                  "agree on every message's size before it is posted")
        else:
            send, recv = (op, other) if op.kind == "send" else (other, op)
            if not (op.wrapped or other.wrapped):
                recv.tensor.view(-1).view(torch.uint8).copy_(send.tensor.reshape(-1).view(torch.uint8))
            op.matched = other.matched = True
            self.messages.append((send.rank, send.peer, send.nbytes))
            return
        op.error = other.error = err

    # ------------------------------------------------------------------ wait
    def _wait(self, op: P2POp, timeout: Timeout) -> bool:
        if op.inner_work is not None:
            result = op.inner_work.wait(timeout) if timeout is not None else op.inner_work.wait()
            if op.error is not None:
                raise op.error
            return result
        seconds = self.default_wait_s if timeout is None else \
            timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        deadline = time.monotonic() + seconds
        with self._cond:
            try:
                while not op.matched and op.error is None:
                    self._waiting[op.rank] = op
                    self._find_cycle(op)
                    if op.error is not None:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StrictP2PTimeout(f"{op.describe()}: its counterpart was not issued within {seconds:g} s")
                    self._cond.wait(left)
            finally:
                self._waiting.pop(op.rank, None)
        if op.error is not None:
            raise op.error
        return True

    def _find_cycle(self, op: P2POp) -> None:
        chain, peer = [op], op.peer
        while True:
            nxt = self._waiting.get(peer)
            if nxt is None or nxt.matched or nxt.error is not None or nxt in chain:
                return
            chain.append(nxt)
            if nxt.peer == op.rank:
                break
            peer = nxt.peer
        err = self._violation("deadlock: " + "; ".join(f"{o.describe()} waits" for o in chain) +
                              ", each on a rank that waits too. Fix: order the operations so that some rank's "
                              "first unmatched one meets its peer's")
        for o in chain:
            o.error = err
        self._cond.notify_all()

    # ------------------------------------------------------------------ the verdict
    def unmatched(self) -> List[P2POp]:
        """Operations never matched, except those with a rank ``kill`` ended (they failed by design)."""
        with self._cond:
            return [op for (a, b), ops in self.channels.items() if a not in self.dead and b not in self.dead
                    for op in ops if not op.matched]

    def check(self, allow_unmatched: bool = False) -> None:
        """Raise ``StrictP2PError`` naming every violation and, unless ``allow_unmatched`` (a test that
        let a wait time out on purpose), every operation never matched (``unmatched``)."""
        problems = list(self.violations)
        if not allow_unmatched:
            problems += [f"never matched: {op.describe()}" for op in self.unmatched()]
        if problems:
            raise StrictP2PError("point-to-point protocol violations:\n  " + "\n  ".join(problems))


__all__ = ["StrictP2P", "StrictGroup", "StrictP2PError", "StrictP2PTimeout", "P2POp"]
