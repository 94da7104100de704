"""``TorchFTComm``: the ``OuterComm`` over the process group a torchft ``Manager`` manages.

At every quorum torchft's ``Manager`` reconfigures its process group (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU) over the replica groups of the quorum: group rank g of every job,
i.e. the ranks holding the same shard position in every worker. ``size`` and ``rank`` are this
round's (``num_participants`` / ``participating_rank``: replica ids sorted, the same order on
every member). torchft groups are not registered with c10d, so every operation calls the
group's own methods (``allreduce``, ``allgather``, ``broadcast``, ``send`` / ``recv``).

Point-to-point exchanges are correct without tags and without buffering, as NCCL needs (NCCL
ignores tags and matches the operations two ranks issue to each other in issue order): this rank
walks its peers in ascending order and, with each, the lower rank sends first and the higher
receives first; every operation carries tag 0; all are waited for at the end. Every rank's order
then agrees with one global order of the pairs ((lower, higher) ascending), so no pair crosses
and no wait cycle forms (``testing/strict_p2p.py`` checks it).

Byte accounting is that of ``ProcessGroupComm`` (``comm/collectives.py``, ``comm/p2p.py``) on
the same inputs: a group of one counts nothing; variable-size all-gathers exchange the sizes
first (an int64 per rank, kind ``all_gather_sizes``) and then the payloads padded to the largest
(padding counted); point-to-point counts the bytes of the non-empty messages. Synchronous
operations count once they complete, asynchronous ones once launched.

Failures follow torchft's model. The first operation of a round that raises or times out is
reported to the manager (``Manager.report_error``: the job's ``should_commit`` is then False, so
the round rolls back) and kept in ``error``; it is never raised into the strategy. From then on
until ``sync_with_quorum`` (the next round) every operation is a no-op that touches no network
and returns a well-formed stand-in, this rank's own contribution as if it were alone:

    all_reduce_ / broadcast_      the tensor unchanged
    all_gather_payloads(p)        [p] * size
    agree_max(v)                  v
    exchange(t, peers)            {peer: copy of t}
    exchange_per_peer(payloads)   {peer: payloads[peer]}, or zeros of the announced size
    exchange_pieces(..)           {peer: zeros of recv_sizes[peer]}

The operation that failed returns the same stand-in, except ``all_reduce_``, whose tensor may
hold a partial reduction (gloo reduces in place). Stand-ins are finite and decode like real
payloads, so the strategy completes its communicate phase without raising; nothing it computed
in that round is committed.

Every work the group hands back is tracked until it completes: ``drain(seconds)`` waits (bounded)
for the ones a failed round left running (a gloo operation whose peer stopped keeps its tensors
until its own timeout), so that the session can close the group with no operation still holding
memory at interpreter teardown.

Payload authentication (``authenticate(key, context)``, set by the session every round): every
payload ``all_gather_payloads`` moves carries a tag

    tag_r = mac(key, "payload", context ‖ r ‖ payload_r)        (32 bytes, appended; counted as sent)

where ``context`` binds the round (the session's round binding) and r is the sender's position
in the gather. A contributor's payload whose tag does not verify (a bit flipped or a message cut
on the WAN, a peer without the run's secret, a payload replayed from another round or position)
is rejected: ``PayloadAuthError`` is kept in ``rejected`` and reported to the manager (this job
rolls back), and the stand-in is returned, so nothing received is decoded. Unlike a lost member
the group still works, so the round's later exchanges (the session's signed verdicts) go on and
every job learns of the rejection in the same round. Payloads of participants that do not contribute are
not checked (nobody decodes them). Dense all-reduces cannot carry a tag (the sum is formed on the
wire); their aggregate is checked for finiteness before the commit vote instead (``RoundPlan``).
"""
from __future__ import annotations

import logging
import struct
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, TypeVar

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions

from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.comm.interface import REDUCE_OPS, OuterComm
from megatron_sparseloco.comm.pending import Pending
from megatron_sparseloco.comm.p2p import check_payloads, check_peers
from megatron_sparseloco.elastic.auth import mac, mac_ok

log = logging.getLogger(__name__)
T = TypeVar("T")

#: bytes of a payload's authentication tag
PAYLOAD_TAG_BYTES = 32


class PayloadAuthError(RuntimeError):
    """A contributor's payload failed its authentication tag: the round must not decode it."""


def sign_payload(key: bytes, context: bytes, position: int, payload: torch.Tensor) -> torch.Tensor:
    """``payload`` (1-D uint8) with its tag appended (module docstring)."""
    data = payload.detach().cpu().contiguous().numpy().tobytes()
    tag = mac(key, "payload", context + struct.pack("<q", position) + data)
    return torch.cat([payload, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(payload.device)])


def open_payloads(key: bytes, context: bytes, signed: List[torch.Tensor], check: Sequence[int]) -> List[torch.Tensor]:
    """The payloads without their tags; raises ``PayloadAuthError`` naming the first position of ``check``
    whose tag does not verify (a payload shorter than a tag fails too)."""
    for r in check:
        raw = signed[r].detach().cpu().contiguous().numpy().tobytes()
        body, tag = raw[:-PAYLOAD_TAG_BYTES], raw[-PAYLOAD_TAG_BYTES:]
        if len(raw) < PAYLOAD_TAG_BYTES or not mac_ok(key, "payload", context + struct.pack("<q", r) + body, tag):
            raise PayloadAuthError(f"the payload of group rank {r} fails its authentication tag (altered or cut in "
                                   "transit, from another round or position, or not from a holder of the run's "
                                   "secret); this round decodes nothing and rolls back")
    return [t[:-PAYLOAD_TAG_BYTES] if t.numel() >= PAYLOAD_TAG_BYTES else t[:0] for t in signed]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _completed(work) -> bool:
    """Whether ``work`` finished (successfully or not); a work without ``is_completed`` counts as finished."""
    done = getattr(work, "is_completed", None)
    try:
        return bool(done()) if done is not None else True
    except Exception:  # a work whose group is gone
        return True


class TorchFTComm(OuterComm):
    """``OuterComm`` over ``pg``, the process group ``manager`` reconfigures at each quorum."""

    def __init__(self, manager, pg, timeout: timedelta, counter: Optional[CommCounter] = None):
        self.manager, self.pg, self.timeout = manager, pg, timeout
        self.counter = counter if counter is not None else CommCounter()
        #: the first failure of this round (None: every operation so far succeeded)
        self.error: Optional[BaseException] = None
        self._size, self._rank = 1, 0
        #: this round's contributors (``set_contributors``; None: every participant)
        self._contributors: Optional[List[int]] = None
        #: the run's MAC key and this round's context for payload tags (``authenticate``; None: no tags)
        self._key: Optional[bytes] = None
        self._context = b""
        #: works issued and not known to be complete (``drain``)
        self._works: List = []
        #: the first payload of this round whose tag did not verify (None: none)
        self.rejected: Optional[PayloadAuthError] = None

    def authenticate(self, key: Optional[bytes], context: bytes = b"") -> None:
        """Tag every all-gathered payload of this round under ``key``, bound to ``context`` (module
        docstring); None: no tags."""
        self._key, self._context = key, bytes(context)

    # ------------------------------------------------------------------ round and identity
    def sync_with_quorum(self) -> None:
        """Take this round's size and rank from the manager (after ``start_quorum``); clear ``error``."""
        self._size = int(self.manager.num_participants())
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError("this job is not a participant of the current quorum (torchft returned no rank); "
                               "the elastic session runs quorums with use_async_quorum=False, which always gives one")
        self._rank = int(rank)
        self.error = None
        self._contributors = None
        self._works = [w for w in self._works if not _completed(w)]
        self.rejected = None

    def set_contributors(self, contributors: Sequence[int]) -> None:
        """The group ranks whose pseudo-gradient enters this round (the session's decision)."""
        self._contributors = sorted(int(r) for r in contributors)

    @property
    def contributors(self) -> List[int]:
        return list(range(self._size)) if self._contributors is None else list(self._contributors)

    def _find_device(self) -> torch.device:
        cuda = "nccl" in self.pg.getBackendName().lower() and torch.cuda.is_available()
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` as this round's failure (the first one wins) and report it to the manager:
        the round rolls back on this job and the rest of its operations are skipped."""
        if self.error is None:
            self.error = exc
            log.warning("elastic outer group: %s: %s (the round will roll back; later operations of this round "
                        "are skipped)", type(exc).__name__, exc)
            self.manager.report_error(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))

    def reject(self, exc: PayloadAuthError) -> None:
        """Record a payload that failed its tag (the first one wins) and report it: this job rolls back."""
        if self.rejected is None:
            self.rejected = exc
            log.warning("elastic outer group: %s", exc)
            self.manager.report_error(exc)

    def _guard(self, run: Callable[[], T], stand_in: Callable[[], T]) -> T:
        """``run()``; after a failure of this round, or when it fails, ``stand_in()``."""
        if self.error is not None:
            return stand_in()
        try:
            return run()
        except Exception as exc:  # torchft's model: report, never raise into the strategy
            self.fail(exc)
            return stand_in()

    def _wait(self, work) -> None:
        work.wait(self.timeout)

    def _track(self, work):
        """``work``, remembered until it completes (``drain``)."""
        self._works.append(work)
        return work

    def drain(self, seconds: float) -> int:
        """Wait at most ``seconds`` in all for the works still running (errors ignored: the round they
        belonged to failed already); returns how many did not finish."""
        deadline = time.monotonic() + seconds
        left = []
        for work in self._works:
            if _completed(work):
                continue
            try:
                work.wait(timedelta(seconds=max(0.0, deadline - time.monotonic())))
            except Exception:  # a failed or timed-out operation is finished too
                pass
            if not _completed(work) and time.monotonic() >= deadline:
                left.append(work)
        self._works = left
        return len(left)

    # ------------------------------------------------------------------ collectives
    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.start_all_reduce_(tensor, op).wait()

    def start_all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> Pending[torch.Tensor]:
        reduce_op = REDUCE_OPS[op]
        if self.size == 1 or self.error is not None:
            return Pending.completed(tensor)

        def launch() -> Pending[torch.Tensor]:
            opts = AllreduceOptions()
            opts.reduceOp = reduce_op
            work = self._track(self.pg.allreduce([tensor], opts))
            self.counter.add("all_reduce", _nbytes(tensor), _nbytes(tensor))

            def finish() -> torch.Tensor:
                self._wait(work)
                return tensor

            return Pending(lambda: self._guard(finish, lambda: tensor))

        return self._guard(launch, lambda: Pending.completed(tensor))

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.size == 1:
            return tensor

        def run() -> torch.Tensor:
            self._wait(self._track(self.pg.broadcast_one(tensor, src)))
            n = _nbytes(tensor)
            mine = self.rank == src
            self.counter.add("broadcast", n if mine else 0, 0 if mine else n)
            return tensor

        return self._guard(run, lambda: tensor)

    def all_gather_payloads(self, payload: torch.Tensor, equal_sizes: bool = False) -> List[torch.Tensor]:
        return self.start_all_gather_payloads(payload, equal_sizes).wait()

    def _gather_sizes(self, payload: torch.Tensor) -> List[int]:
        size_t = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
        outs = [torch.empty_like(size_t) for _ in range(self.size)]
        self._wait(self._track(self.pg.allgather([outs], [size_t], AllgatherOptions())))
        self.counter.add("all_gather_sizes", _nbytes(size_t), _nbytes(size_t) * (self.size - 1))
        return [int(s) for s in torch.cat(outs).tolist()]

    def start_all_gather_payloads(self, payload: torch.Tensor,
                                  equal_sizes: bool = False) -> Pending[List[torch.Tensor]]:
        """Sizes first (unless ``equal_sizes``), waited for here; then the padded payloads, launched."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError("all_gather_payloads expects a 1-D uint8 tensor, "
                             f"got {payload.dtype} {tuple(payload.shape)}")
        world = self.size
        stand_in = lambda: [payload] * world  # noqa: E731
        if world == 1 or self.error is not None:
            return Pending.completed(stand_in())

        key, context = self._key, self._context

        def launch() -> Pending[List[torch.Tensor]]:
            sent = payload if key is None else sign_payload(key, context, self.rank, payload)
            sizes = [sent.numel()] * world if equal_sizes else self._gather_sizes(sent)
            max_size = max(sizes)
            padded = sent.contiguous()
            if sent.numel() < max_size:
                padded = torch.zeros(max_size, dtype=torch.uint8, device=sent.device)
                padded[: sent.numel()] = sent
            gathered = [torch.empty(max_size, dtype=torch.uint8, device=sent.device) for _ in range(world)]
            work = self._track(self.pg.allgather([gathered], [padded], AllgatherOptions()))
            self.counter.add("all_gather", max_size, max_size * (world - 1))

            def finish() -> List[torch.Tensor]:
                self._wait(work)
                got = [g[:s] for g, s in zip(gathered, sizes)]
                if key is None:
                    return got
                try:
                    return open_payloads(key, context, got, self.contributors)
                except PayloadAuthError as exc:
                    self.reject(exc)
                    return stand_in()

            return Pending(lambda: self._guard(finish, stand_in))

        return self._guard(launch, lambda: Pending.completed(stand_in()))

    def agree_max(self, value: int) -> int:
        """The largest ``value`` of the group (one 4-byte all-reduce MAX); ``value`` itself after a failure."""
        flag = torch.tensor([float(value)], device=self.device)
        self.all_reduce_(flag, op="max")
        return int(value) if self.error is not None else int(flag.item())

    # ------------------------------------------------------------------ point to point
    def _p2p(self, out: Dict[int, torch.Tensor], into: Dict[int, torch.Tensor]) -> None:
        """Peers in ascending order; with each, the lower rank sends first (module docstring); empty
        messages skipped on both sides (both know the sizes); tag 0; wait for all."""
        works = []
        for p in sorted(set(out) | set(into)):
            send = [self.pg.send, out[p]] if p in out and out[p].numel() > 0 else None
            recv = [self.pg.recv, into[p]] if p in into and into[p].numel() > 0 else None
            for op in ((send, recv) if self.rank < p else (recv, send)):
                if op is not None:
                    works.append(self._track(op[0]([op[1]], p, 0)))
        for work in works:
            self._wait(work)

    def exchange(self, tensor: torch.Tensor, peers: Sequence[int], kind: str = "p2p") -> Dict[int, torch.Tensor]:
        peers = check_peers(peers, self.size, self.rank)
        if not peers:
            return {}
        send = tensor.contiguous()

        def run() -> Dict[int, torch.Tensor]:
            received = {p: torch.empty_like(send) for p in peers}
            self._p2p({p: send for p in peers}, received)
            n = _nbytes(send)
            self.counter.add(kind, n * len(peers), n * len(peers))
            return received

        return self._guard(run, lambda: {p: send.clone() for p in peers})

    def exchange_per_peer(self, payloads: Dict[int, torch.Tensor],
                          recv_nbytes: Optional[Dict[int, int]]) -> Dict[int, torch.Tensor]:
        peers = check_peers(sorted(payloads), self.size, self.rank)
        if not peers:
            return {}
        check_payloads(payloads, peers, recv_nbytes)
        dev = payloads[peers[0]].device

        def stand_in() -> Dict[int, torch.Tensor]:
            if recv_nbytes is None or all(int(recv_nbytes[p]) == payloads[p].numel() for p in peers):
                return {p: payloads[p] for p in peers}
            return {p: torch.zeros(int(recv_nbytes[p]), dtype=torch.uint8, device=dev) for p in peers}

        def run() -> Dict[int, torch.Tensor]:
            sizes = recv_nbytes
            if sizes is None:
                out = {p: torch.tensor([payloads[p].numel()], dtype=torch.int64, device=dev) for p in peers}
                got = {p: torch.empty(1, dtype=torch.int64, device=dev) for p in peers}
                self._p2p(out, got)
                self.counter.add("p2p_sizes", 8 * len(peers), 8 * len(peers))
                sizes = {p: int(got[p].item()) for p in peers}
            received = {p: torch.empty(int(sizes[p]), dtype=torch.uint8, device=dev) for p in peers}
            self._p2p({p: payloads[p].contiguous() for p in peers}, received)
            self.counter.add("p2p", sum(payloads[p].numel() for p in peers), sum(r.numel() for r in received.values()))
            return received

        return self._guard(run, stand_in)

    def exchange_pieces(self, pieces: Dict[int, torch.Tensor], recv_sizes: Dict[int, int],
                        kind: str = "all_to_all") -> Dict[int, torch.Tensor]:
        peers = check_peers(sorted(set(pieces) | set(recv_sizes)), self.size, self.rank)
        if not peers:
            return {}
        device = next(iter(pieces.values())).device if pieces else torch.device("cpu")
        empty = torch.zeros(0, dtype=torch.uint8, device=device)
        send = {p: pieces.get(p, empty).contiguous() for p in peers}

        def stand_in() -> Dict[int, torch.Tensor]:
            return {p: torch.zeros(int(recv_sizes.get(p, 0)), dtype=torch.uint8, device=device) for p in peers}

        def run() -> Dict[int, torch.Tensor]:
            received = {p: torch.empty(int(recv_sizes.get(p, 0)), dtype=torch.uint8, device=device) for p in peers}
            self._p2p(send, received)
            self.counter.add(kind, sum(t.numel() for t in send.values()), sum(t.numel() for t in received.values()))
            return received

        return self._guard(run, stand_in)


__all__ = ["PAYLOAD_TAG_BYTES", "PayloadAuthError", "TorchFTComm", "open_payloads", "sign_payload"]
