"""Heal without pickle: a live peer's state as raw tensors plus a validated JSON header.

torchft heals a job that is behind (its committed step < the quorum's largest) from a peer at the
same shard position, inside ``Manager.start_quorum``, through a ``CheckpointTransport``. torchft's
own transports unpickle what they receive (``HTTPTransport``: ``torch.load(weights_only=False)``;
``PGTransport``: ``pickle.loads`` of its metadata). ``SafeHealTransport`` replaces them: it moves
the state over the managed process group with ``send`` / ``recv`` and never unpickles anything.

A state is a tree of dicts (str keys), lists and tuples whose leaves are tensors or JSON scalars
(int, float, bool, str, None). The source describes it in a header, from shapes and dtypes only,

    {"format": "megatron_sparseloco.heal", "version": 2, "step": s, "chunk_bytes": c,
     "total_bytes": N, "entries": [{"path": [...], "dtype": "float32", "shape": [...]} |
                                   {"path": [...], "value": v}, ...]}

and streams the tensors' bytes, in entry order (row-major within a tensor), as messages of
``chunk_bytes`` (the last one shorter), each copied from the *live* tensors into one staging
buffer (device → host of a slice), hashed and sent: the source's extra memory is one chunk (plus
one on the group's device when it is not the CPU, and, for a non-contiguous tensor, one more on
its device), whatever the state's size. The live tensors must not change until ``send_checkpoint``
returns (torchft's quorum thread calls it while the caller waits in ``start_quorum``). The
receiver holds a *template* — the structure of its own state — and refuses, before reading any
tensor byte, a header that is not JSON, too large, of another format / version / step, with a path
the template lacks or lacks one it has, with another dtype or shape, or a value of another JSON
type (None matches any). Tensors are received into fresh buffers: the joiner holds the whole
received state until the final MAC verifies (the live state is untouched until the caller loads
the result); only dtypes of ``DTYPES`` are accepted.

The exchange, with fresh nonces n_r, n_s and claimed worker indices I_r, I_s (int64, not
authenticated: for the logs), one message per line, **in this order on both sides**:

    1. receiver → source   n_r ‖ I_r                                               24 bytes
    2. source → receiver   n_s ‖ I_s ‖ mac("heal-src", n_r ‖ n_s ‖ step)           56 bytes
    3. receiver → source   mac("heal-dst", n_s ‖ n_r ‖ step),
                           or 32 zero bytes when the source's proof failed            32 bytes
    4. source → receiver   L = len(header) (int64), or 0: refused, nothing follows    8 bytes
    5. source → receiver   the header                                                 L bytes
    6. receiver → source   1: accepted, or 0: refused (the header does not fit this
                           job's state), nothing follows                              8 bytes
    7. source → receiver   the data, ceil(N / c) messages of c bytes (the last shorter)
    8. source → receiver   mac("heal-data", n_r ‖ SHA-256(header) ‖ SHA-256(data))    32 bytes

Every message is posted with tag 0 and the protocol never relies on tags: each side issues its
operations with the other in this order, waiting for each before the next, so every send meets a
receive of the same size in the same position. That is what NCCL needs (it ignores tags and
matches a pair's operations in issue order; two sends posted at once on both sides deadlock
there) and what ``testing/strict_p2p.py`` checks in the tests. A refusal (steps 3, 4, 6) still
completes the messages up to it, so neither side is left waiting on the other.

The source serves each joiner of ``send_checkpoint(dst_ranks, ...)`` in turn and independently:
a joiner that is refused (it does not hold the secret; it refuses the header) or fails (it dies
mid-transfer; a message does not complete within the heal timeout) is logged with its group rank
and the worker index it claims, recorded (``HealRecord`` role "refused" / "failed", with the
reason), and the source goes on with the next one. ``send_checkpoint`` raises only for the
source's own faults (its state cannot be described or read), which fail its round in torchft.
Every message waits at most ``timeout`` (``--sparseloco-elastic-heal-timeout``), on both sides.

A source sends nothing of the state to a receiver whose proof fails; a receiver discards a stream
whose final MAC fails (modified in transit or not from a holder of the secret). Every transfer is
recorded in ``records`` (role, peer, step, bytes, seconds, claimed index, reason).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torchft.checkpointing.transport import CheckpointTransport

from megatron_sparseloco.elastic.auth import mac, mac_ok

log = logging.getLogger(__name__)

FORMAT, VERSION = "megatron_sparseloco.heal", 2
#: the largest header a receiver reads (bytes)
MAX_HEADER_BYTES = 64 << 20
#: the largest message a receiver accepts
MAX_CHUNK_BYTES = 1 << 30
#: dtypes a heal may carry, by name
DTYPES: Dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool}
_NAMES = {v: k for k, v in DTYPES.items()}
#: the tag of every heal message: messages match by their order alone (module docstring), as over NCCL.
#: The heal runs inside ``start_quorum``, when no outer exchange (``elastic.comm``) is in flight.
TAG = 0
_NONCE = 16
#: sizes of the fixed messages 1, 2, 3, 4 / 6 and 8 (module docstring)
HELLO_BYTES, PROOF_BYTES, MAC_BYTES, WORD_BYTES = _NONCE + 8, _NONCE + 8 + 32, 32, 8
#: message 6: the receiver's verdict on the header
ACCEPTED, REFUSED = 1, 0

Path = Tuple[Any, ...]
#: one validated entry: (path, dtype, shape) for a tensor, (path, None, [value]) for a value
Entry = Tuple[Path, Optional[torch.dtype], list]


class HealError(RuntimeError):
    """A heal refused or failed; the message says which peer, what and why."""


class HealRefused(HealError):
    """One side of a heal refused the other (secret, header): the messages up to the refusal completed."""


class HealPeerError(HealError):
    """A message of a heal failed or timed out (the peer died, stalled or broke the order)."""


@dataclass
class HealRecord:
    role: str            # "sent", "received"; on the source also "refused" / "failed" (nothing or part sent)
    peer: int            # the peer's rank in the quorum's group
    step: int
    nbytes: int          # header + tensor bytes (refused / failed: those that reached the peer)
    seconds: float
    claimed: int = -1    # the worker index the peer claimed in the handshake (-1: none received)
    reason: str = ""     # why a transfer was refused or failed


# ---------------------------------------------------------------------- the state as leaves
def flatten(state: Any, path: Path = ()) -> List[Tuple[Path, Any]]:
    """(path, leaf) of every leaf, depth first, dict keys in their order."""
    if isinstance(state, dict):
        out: List[Tuple[Path, Any]] = []
        for k, v in state.items():
            if not isinstance(k, str):
                raise HealError(f"state key {k!r} at {_where(path)} is not a string")
            out += flatten(v, path + (k,))
        return out
    if isinstance(state, (list, tuple)):
        return [leaf for i, v in enumerate(state) for leaf in flatten(v, path + (i,))]
    if isinstance(state, torch.Tensor) or state is None or isinstance(state, (bool, int, float, str)):
        return [(path, state)]
    raise HealError(f"state leaf at {_where(path)} is a {type(state).__name__}; a heal carries tensors and "
                    "JSON scalars (int, float, bool, str, None) in dicts and lists")


def _where(path: Path) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def _entry(path: Path, leaf: Any) -> dict:
    if isinstance(leaf, torch.Tensor):
        if leaf.dtype not in _NAMES:
            raise HealError(f"tensor {_where(path)} has dtype {leaf.dtype}, not one a heal carries ({sorted(DTYPES)})")
        return {"path": list(path), "dtype": _NAMES[leaf.dtype], "shape": list(leaf.shape)}
    return {"path": list(path), "value": leaf}


def _tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def describe(state: Any, step: int, chunk_bytes: int) -> Tuple[bytes, List[torch.Tensor]]:
    """The header (JSON bytes, built from shapes and dtypes only) and the live tensors in stream
    order (detached, not copied: ``send_checkpoint`` reads them one chunk at a time)."""
    entries, tensors = [], []
    for path, leaf in flatten(state):
        entries.append(_entry(path, leaf))
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf.detach())
    total = sum(_nbytes(t) for t in tensors)
    header = {"format": FORMAT, "version": VERSION, "step": int(step), "chunk_bytes": int(chunk_bytes),
              "total_bytes": total, "entries": entries}
    raw = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise HealError(f"the heal header of this state is {len(raw)} bytes, more than a joiner reads "
                        f"({MAX_HEADER_BYTES}): too many entries")
    return raw, tensors


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_flat(src: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
    """``out`` (1-D, contiguous, ``src``'s dtype) ← elements [start, stop) of ``src`` in row-major order,
    for any strides, without a copy of ``src``: whole sub-blocks at once, the partial ends recursively."""
    if src.dim() <= 1:
        out.copy_(src.reshape(-1)[start:stop])
        return
    inner = math.prod(src.shape[1:])
    if inner == 0 or stop <= start:
        return
    row, off = divmod(start, inner)
    pos, n = 0, stop - start
    if off:
        take = min(n, inner - off)
        _copy_flat(src[row], off, off + take, out[:take])
        pos, row = take, row + 1
    full = (n - pos) // inner
    if full:
        out[pos:pos + full * inner].view(full, *src.shape[1:]).copy_(src[row:row + full])
        pos, row = pos + full * inner, row + full
    if pos < n:
        _copy_flat(src[row], 0, n - pos, out[pos:])


def _byte_slice(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of ``t`` in row-major order, on its device: a view of a contiguous tensor,
    else a copy of just the elements they cover."""
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8)[start:stop]
    size = t.element_size()
    first, last = start // size, -(-stop // size)
    tmp = torch.empty(last - first, dtype=t.dtype, device=t.device)
    _copy_flat(t, first, last, tmp)
    return tmp.view(torch.uint8)[start - first * size:stop - first * size]


# ---------------------------------------------------------------------- the receiver's checks
def _json_kind(v: Any) -> str:
    return "null" if v is None else "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else \
        "float" if isinstance(v, float) else "str" if isinstance(v, str) else type(v).__name__


def _check_entry(entry: Any, expected: Dict[Path, Any], seen: set) -> Entry:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), list) or \
            not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in entry["path"]):
        raise HealError(f"malformed entry {str(entry)[:80]!r}")
    path = tuple(entry["path"])
    where = _where(path)
    if path not in expected:
        raise HealError(f"entry {where} is not part of this job's state")
    if path in seen:
        raise HealError(f"entry {where} appears twice")
    seen.add(path)
    mine = expected[path]
    if isinstance(mine, torch.Tensor):
        if set(entry) != {"path", "dtype", "shape"}:
            raise HealError(f"entry {where} must be a tensor (keys path, dtype, shape), got keys {sorted(entry)}")
        if entry["dtype"] != _NAMES.get(mine.dtype):
            raise HealError(f"entry {where} has dtype {entry['dtype']!r}, this job holds {_NAMES.get(mine.dtype)!r}")
        if entry["shape"] != list(mine.shape):
            raise HealError(f"entry {where} has shape {entry['shape']}, this job holds {list(mine.shape)}")
        return path, mine.dtype, list(mine.shape)
    if set(entry) != {"path", "value"}:
        raise HealError(f"entry {where} must be a value (keys path, value), got keys {sorted(entry)}")
    got, want = _json_kind(entry["value"]), _json_kind(mine)
    if got not in ("null", want) and want != "null":
        raise HealError(f"entry {where} is a {got}, this job holds a {want}")
    return path, None, [entry["value"]]


def plan_receive(header: bytes, template: Any, step: int) -> Tuple[List[Entry], int, int]:
    """Validate ``header`` against ``template`` and the expected ``step``: (entries, total bytes, chunk bytes).

    Each entry is (path, dtype, shape) for a tensor or (path, None, [value]) for a value."""
    try:
        doc = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise HealError(f"header is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise HealError(f"header is not a {FORMAT} v{VERSION} header")
    if doc.get("step") != step:
        raise HealError(f"header is for step {doc.get('step')!r}, the quorum heals to step {step}")
    chunk = doc.get("chunk_bytes")
    if not isinstance(chunk, int) or not 0 < chunk <= MAX_CHUNK_BYTES or not isinstance(doc.get("entries"), list):
        raise HealError(f"header has a bad chunk size {chunk!r} or no entry list")
    expected = dict(flatten(template))
    seen: set = set()
    plan = [_check_entry(e, expected, seen) for e in doc["entries"]]
    missing = [p for p in expected if p not in seen]
    if missing:
        raise HealError(f"header lacks {len(missing)} entries of this job's state, e.g. {_where(missing[0])}")
    total = sum(_tensor_nbytes(dt, shape) for _, dt, shape in plan if dt is not None)
    if doc.get("total_bytes") != total:
        raise HealError(f"header announces {doc.get('total_bytes')!r} bytes, its tensors hold {total}")
    return plan, total, chunk


def rebuild(template: Any, values: Dict[Path, Any], path: Path = ()) -> Any:
    """``template``'s structure with each leaf replaced by ``values[path]``."""
    if isinstance(template, dict):
        return {k: rebuild(v, values, path + (k,)) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        items = [rebuild(v, values, path + (i,)) for i, v in enumerate(template)]
        return items if isinstance(template, list) else tuple(items)
    return values[path]


def _as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _chunks(total: int, chunk: int) -> List[int]:
    return [min(chunk, total - s) for s in range(0, total, chunk)]


# ---------------------------------------------------------------------- the transport
def _word(value: int) -> torch.Tensor:
    return _as_bytes(struct.pack("<q", value))


def _int(buf: torch.Tensor) -> int:
    return struct.unpack("<q", buf.numpy().tobytes())[0]


class SafeHealTransport(CheckpointTransport):
    """torchft ``CheckpointTransport`` over the managed group: tensors + validated JSON, no pickle.

    ``template()`` returns the structure this job expects to receive (the same tree torchft sends:
    ``{"user": {key: state}, "torchft": {"step": int, "batches_committed": int}}``), leaves of the
    right dtype and shape; ``key`` is the run's MAC key (``auth.derive_key``); ``timeout`` bounds
    every message of a heal on either side (``--sparseloco-elastic-heal-timeout``; torchft's own
    timeout argument, the outer timeout, is not used); ``device``: where the group's messages live
    (the CUDA device for NCCL); ``chunk_bytes``: bytes per data message and of the source's staging
    buffer; ``identity``: the worker index this side claims in the handshake (named in the other
    side's logs).
    """

    def __init__(self, pg, key: bytes, template: Callable[[], Any], timeout: timedelta,
                 device: Optional[torch.device] = None, chunk_bytes: int = 64 << 20, identity: int = -1):
        self.pg, self.key, self.template, self.timeout = pg, key, template, timeout
        self.identity = int(identity)
        self.device = device if device is not None else torch.device("cpu")
        self.chunk_bytes = int(chunk_bytes)
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes {chunk_bytes} outside (0, {MAX_CHUNK_BYTES}]")
        self.records: List[HealRecord] = []
        #: the error of the last receive that failed (cleared by the caller before a quorum)
        self.receive_error: Optional[BaseException] = None

    def metadata(self) -> str:
        return FORMAT

    # -------------------------------------------------------------- one message, bounded by the heal timeout
    def _wait(self, work, peer: int, what: str) -> None:
        t0 = time.perf_counter()
        try:
            done = work.wait(self.timeout)
        except Exception as exc:  # the group's own error type varies (gloo, NCCL, a test's fake)
            waited = time.perf_counter() - t0
            late = waited >= self.timeout.total_seconds()
            raise HealPeerError(
                f"{what} with group rank {peer} " + (
                    f"did not complete within the heal timeout ({self.timeout.total_seconds():g} s, "
                    "--sparseloco-elastic-heal-timeout)" if late else "failed") + f": {exc}") from None
        if done is False:
            raise HealPeerError(f"{what} with group rank {peer} did not complete")

    def _send(self, peer: int, data: torch.Tensor, what: str) -> None:
        """Post one message and wait for it (the next operation of the pair is issued only after)."""
        try:
            work = self.pg.send([data.to(self.device)], peer, TAG)
        except Exception as exc:  # posting failed: the group is broken towards this peer
            raise HealPeerError(f"sending {what} to group rank {peer} failed: {exc}") from None
        self._wait(work, peer, f"sending {what}")

    def _recv_into(self, peer: int, buf: torch.Tensor, what: str) -> None:
        try:
            work = self.pg.recv([buf], peer, TAG)
        except Exception as exc:
            raise HealPeerError(f"receiving {what} from group rank {peer} failed: {exc}") from None
        self._wait(work, peer, f"receiving {what}")

    def _recv(self, peer: int, nbytes: int, what: str) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._recv_into(peer, buf, what)
        return buf.cpu()

    def _staging(self, nbytes: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One host buffer (hashing) and, when the group's device is not the CPU, one there (sending)."""
        size = max(min(self.chunk_bytes, nbytes), 1)
        host = torch.empty(size, dtype=torch.uint8)
        return host, (None if self.device.type == "cpu" else torch.empty(size, dtype=torch.uint8, device=self.device))

    # -------------------------------------------------------------- send: each joiner on its own
    def send_checkpoint(self, dst_ranks: List[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Heal every joiner of ``dst_ranks`` in turn; a joiner refused or failed is logged and
        recorded, and the next one is served. Raises only for this side's own faults."""
        header, tensors = describe(state_dict, step, self.chunk_bytes)
        total = sum(_nbytes(t) for t in tensors)
        stage = self._staging(total)
        for dst in dst_ranks:
            self._serve(dst, step, header, tensors, total, stage)

    def _serve(self, dst: int, step: int, header: bytes, tensors: Sequence[torch.Tensor], total: int,
               stage: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
        t0, progress = time.perf_counter(), {"claimed": -1, "nbytes": 0}
        try:
            n_r = self._source_handshake(dst, step, progress)
            self._send(dst, _word(len(header)), "the header length (message 4)")
            self._send(dst, _as_bytes(header), "the header (message 5)")
            progress["nbytes"] = len(header)
            if _int(self._recv(dst, WORD_BYTES, "the header verdict (message 6)")) != ACCEPTED:
                raise HealRefused("it refused the header (its state's paths, dtypes or shapes, or its step, "
                                  "differ from this job's: its log says which); no tensor byte was sent")
            data_hash = self._send_stream(dst, tensors, total, stage, progress)
            tag = mac(self.key, "heal-data", n_r + hashlib.sha256(header).digest() + data_hash)
            self._send(dst, _as_bytes(tag), "the stream MAC (message 8)")
        except HealError as exc:
            role = "refused" if isinstance(exc, HealRefused) else "failed"
            self._record(role, dst, step, progress["nbytes"], t0, progress["claimed"], str(exc))
            return
        self._record("sent", dst, step, len(header) + total, t0, progress["claimed"])

    def _source_handshake(self, dst: int, step: int, progress: Dict[str, int]) -> bytes:
        """Messages 1-4 of a refusal, 1-3 of an accepted joiner; returns its nonce n_r."""
        hello = self._recv(dst, HELLO_BYTES, "the joiner's nonce (message 1)").numpy().tobytes()
        n_r, progress["claimed"] = hello[:_NONCE], struct.unpack("<q", hello[_NONCE:])[0]
        n_s, s8 = os.urandom(_NONCE), struct.pack("<q", step)
        proof = mac(self.key, "heal-src", n_r + n_s + s8)
        self._send(dst, _as_bytes(n_s + struct.pack("<q", self.identity) + proof), "this side's proof (message 2)")
        theirs = self._recv(dst, MAC_BYTES, "the joiner's proof (message 3)").numpy().tobytes()
        if not mac_ok(self.key, "heal-dst", n_s + n_r + s8, theirs):
            self._send(dst, _word(0), "the refusal (message 4)")
            raise HealRefused("it does not hold this run's secret (--sparseloco-elastic-token-file differs); "
                              "nothing was sent")
        return n_r

    def _send_stream(self, dst: int, tensors: Sequence[torch.Tensor], total: int,
                     stage: Tuple[torch.Tensor, Optional[torch.Tensor]], progress: Dict[str, int]) -> bytes:
        """The tensors' bytes in messages of ``chunk_bytes``, each copied from the live tensors into the
        staging buffer, hashed and sent; returns SHA-256 of the data."""
        host, dev = stage
        digest, sizes = hashlib.sha256(), _chunks(total, self.chunk_bytes)
        it, t, pos = iter(tensors), None, 0
        for i, n in enumerate(sizes):
            fill = 0
            while fill < n:
                while t is None or pos == _nbytes(t):
                    t, pos = next(it), 0
                k = min(n - fill, _nbytes(t) - pos)
                host[fill:fill + k].copy_(_byte_slice(t, pos, pos + k))
                fill, pos = fill + k, pos + k
            digest.update(memoryview(host[:n].numpy()))
            out = host[:n] if dev is None else dev[:n].copy_(host[:n])
            self._send(dst, out, f"data chunk {i + 1} of {len(sizes)} (message 7)")
            progress["nbytes"] += n
        return digest.digest()

    # -------------------------------------------------------------- receive
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        try:
            return self._receive(src_rank, step)
        except Exception as exc:
            self.receive_error = exc
            raise

    def _receive(self, src_rank: int, step: int) -> Any:
        t0 = time.perf_counter()
        try:
            n_r, source = self._receiver_handshake(src_rank, step)
            length = _int(self._recv(src_rank, WORD_BYTES, "the header length (message 4)"))
            if source is not None:
                raise HealRefused(f"the peer (it claims worker index {source}) does not hold this run's secret "
                                  "(--sparseloco-elastic-token-file differs); nothing was received")
            if length == 0:
                raise HealRefused("the peer refused this job's proof: this job does not hold this run's secret "
                                  "(--sparseloco-elastic-token-file differs) or the proof was altered in transit; "
                                  "nothing was received")
            if not 0 < length <= MAX_HEADER_BYTES:
                raise HealError(f"header of {length} bytes announced (at most {MAX_HEADER_BYTES})")
            header = self._recv(src_rank, length, "the header (message 5)").numpy().tobytes()
            try:
                template = self.template()
                plan, total, chunk = plan_receive(header, template, step)
            except Exception:  # refused (or this side cannot say): the source must not wait for a verdict
                self._send(src_rank, _word(REFUSED), "the header verdict (message 6)")
                raise
            self._send(src_rank, _word(ACCEPTED), "the header verdict (message 6)")
            values, data_hash = self._recv_stream(src_rank, plan, total, chunk)
            tag = self._recv(src_rank, MAC_BYTES, "the stream MAC (message 8)").numpy().tobytes()
            if not mac_ok(self.key, "heal-data", n_r + hashlib.sha256(header).digest() + data_hash, tag):
                raise HealError("the stream's MAC does not match (modified in transit, or not sent by a holder of "
                                "this run's secret); discarded")
        except HealError as exc:
            raise HealError(f"heal from group rank {src_rank} at step {step}: {exc}") from None
        self._record("received", src_rank, step, length + total, t0)
        return rebuild(template, values)

    def _receiver_handshake(self, src: int, step: int) -> Tuple[bytes, Optional[int]]:
        """Messages 1-3; returns n_r and, when the source's proof failed, the worker index it claims
        (else None). Message 3 is sent either way, so that the source's refusal (message 4) completes."""
        n_r = os.urandom(_NONCE)
        self._send(src, _as_bytes(n_r + struct.pack("<q", self.identity)), "this side's nonce (message 1)")
        got = self._recv(src, PROOF_BYTES, "the source's proof (message 2)").numpy().tobytes()
        n_s, claimed, proof = got[:_NONCE], struct.unpack("<q", got[_NONCE:_NONCE + 8])[0], got[_NONCE + 8:]
        s8 = struct.pack("<q", step)
        ok = mac_ok(self.key, "heal-src", n_r + n_s + s8, proof)
        mine = mac(self.key, "heal-dst", n_s + n_r + s8) if ok else bytes(MAC_BYTES)
        self._send(src, _as_bytes(mine), "this side's proof (message 3)")
        return n_r, (None if ok else claimed)

    def _recv_stream(self, src: int, plan, total: int, chunk: int) -> Tuple[Dict[Path, Any], bytes]:
        values: Dict[Path, Any] = {}
        outs = []
        for path, dtype, shape in plan:
            if dtype is None:
                values[path] = shape[0]
            else:
                out = torch.empty(shape, dtype=dtype)
                values[path] = out
                outs.append(out.view(-1).view(torch.uint8))
        digest, targets = hashlib.sha256(), iter(outs)
        target, pos = None, 0
        sizes = _chunks(total, chunk)
        host = torch.empty(max(min(chunk, total), 1), dtype=torch.uint8)
        dev = None if self.device.type == "cpu" else torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        for i, size in enumerate(sizes):
            what = f"data chunk {i + 1} of {len(sizes)} (message 7)"
            if dev is None:
                self._recv_into(src, host[:size], what)
            else:
                self._recv_into(src, dev[:size], what)
                host[:size].copy_(dev[:size])
            buf = host[:size]
            digest.update(memoryview(buf.numpy()))
            off = 0
            while off < size:
                while target is None or pos == target.numel():
                    target, pos = next(targets), 0
                n = min(size - off, target.numel() - pos)
                target[pos:pos + n] = buf[off:off + n]
                off, pos = off + n, pos + n
        for path, v in values.items():   # a bool is 0 or 1 whatever byte arrived
            if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
                values[path] = v.view(torch.uint8) != 0
        return values, digest.digest()

    def _record(self, role: str, peer: int, step: int, nbytes: int, t0: float, claimed: int = -1,
                reason: str = "") -> None:
        rec = HealRecord(role, peer, step, nbytes, time.perf_counter() - t0, claimed, reason)
        self.records.append(rec)
        if role in ("sent", "received"):
            log.info("elastic heal: %s %d bytes %s group rank %d at step %d in %.3f s", rec.role, rec.nbytes,
                     "to" if role == "sent" else "from", peer, step, rec.seconds)
        else:
            log.warning("elastic heal of the joiner at group rank %d (it claims worker index %s) at step %d %s after "
                        "%.3f s (%d bytes sent): %s. This job goes on with its round (and the next joiner, if any)",
                        peer, claimed if claimed >= 0 else "?", step, role, rec.seconds, nbytes, reason)

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass


__all__ = ["SafeHealTransport", "HealError", "HealRefused", "HealPeerError", "HealRecord", "describe",
           "plan_receive", "rebuild", "flatten", "DTYPES", "TAG"]
