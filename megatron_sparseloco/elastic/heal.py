"""Heal without pickle: a live peer's state as raw tensors plus a validated JSON header.

torchft heals a job that is behind (its committed step < the quorum's largest) from a peer at the
same shard position, inside ``Manager.start_quorum``, through a ``CheckpointTransport``. torchft's
own transports unpickle what they receive (``HTTPTransport``: ``torch.load(weights_only=False)``;
``PGTransport``: ``pickle.loads`` of its metadata). ``SafeHealTransport`` replaces them: it moves
the state over the managed process group with ``send`` / ``recv`` and never unpickles anything.

A state is a tree of dicts (str keys), lists and tuples whose leaves are tensors or JSON scalars
(int, float, bool, str, None). The sender describes it in a header

    {"format": "megatron_sparseloco.heal", "version": 1, "step": s, "chunk_bytes": c,
     "total_bytes": N, "entries": [{"path": [...], "dtype": "float32", "shape": [...]} |
                                   {"path": [...], "value": v}, ...]}

and streams the tensors' bytes, in entry order, as messages of ``chunk_bytes`` (the last one
shorter). The receiver holds a *template* — the structure of its own state — and refuses, before
reading any tensor byte, a header that is not JSON, too large, of another format / version /
step, with a path the template lacks or lacks one it has, with another dtype or shape, or a
value of another JSON type (None matches any). Tensors are received into fresh buffers (the live
state is untouched until the caller loads the result); only dtypes of ``DTYPES`` are accepted.

Both sides first prove they hold the run's secret (``elastic.auth``), with fresh nonces n_r, n_s:

    receiver → sender   n_r ‖ I_r           sender → receiver   n_s ‖ I_s      (I: claimed worker index, int64)
    sender   → receiver mac("heal-src", n_r ‖ n_s ‖ step)
    receiver → sender   mac("heal-dst", n_s ‖ n_r ‖ step)
    sender   → receiver len(header) as int64, header, the data stream,
                        mac("heal-data", n_r ‖ SHA-256(header) ‖ SHA-256(data))

A sender sends nothing to a receiver whose proof fails; a receiver discards a stream whose final
MAC fails (modified in transit or not from a holder of the secret). Every transfer is recorded in
``records`` (role, peer, step, bytes, seconds).
"""
from __future__ import annotations

import hashlib
import json
import logging
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

FORMAT, VERSION = "megatron_sparseloco.heal", 1
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
#: send / recv tags of the heal (the outer exchanges use 1 and 2, ``elastic.comm``)
TAG_NONCE, TAG_PROOF, TAG_LEN, TAG_HEADER, TAG_DATA, TAG_MAC = 101, 102, 103, 104, 105, 106
_NONCE = 16

Path = Tuple[Any, ...]
#: one validated entry: (path, dtype, shape) for a tensor, (path, None, [value]) for a value
Entry = Tuple[Path, Optional[torch.dtype], list]


class HealError(RuntimeError):
    """A heal refused or failed; the message says which peer, what and why."""


@dataclass
class HealRecord:
    role: str            # "sent" or "received"
    peer: int            # the peer's rank in the quorum's group
    step: int
    nbytes: int          # header + tensor bytes
    seconds: float


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
    """The header (JSON bytes) and the tensors in stream order, each flat, contiguous, CPU."""
    entries, tensors = [], []
    for path, leaf in flatten(state):
        entries.append(_entry(path, leaf))
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf.detach().reshape(-1).contiguous().cpu())
    total = sum(t.numel() * t.element_size() for t in tensors)
    header = {"format": FORMAT, "version": VERSION, "step": int(step), "chunk_bytes": int(chunk_bytes),
              "total_bytes": total, "entries": entries}
    return json.dumps(header, allow_nan=False, separators=(",", ":")).encode(), tensors


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
class SafeHealTransport(CheckpointTransport):
    """torchft ``CheckpointTransport`` over the managed group: tensors + validated JSON, no pickle.

    ``template()`` returns the structure this job expects to receive (the same tree torchft sends:
    ``{"user": {key: state}, "torchft": {"step": int, "batches_committed": int}}``), leaves of the
    right dtype and shape; ``key`` is the run's MAC key (``auth.derive_key``).
    """

    def __init__(self, pg, key: bytes, template: Callable[[], Any], timeout: timedelta,
                 device: Optional[torch.device] = None, chunk_bytes: int = 64 << 20, identity: int = -1):
        self.pg, self.key, self.template, self.timeout = pg, key, template, timeout
        #: the worker index this side claims in the handshake (named in the other side's refusal)
        self.identity = int(identity)
        self.device = device if device is not None else torch.device("cpu")
        self.chunk_bytes = int(chunk_bytes)
        self.records: List[HealRecord] = []
        #: the error of the last receive that failed (cleared by the caller before a quorum)
        self.receive_error: Optional[BaseException] = None

    def metadata(self) -> str:
        return FORMAT

    # -------------------------------------------------------------- bytes over the group
    def _send(self, peer: int, data: torch.Tensor, tag: int):
        return self.pg.send([data.to(self.device)], peer, tag)

    def _recv(self, peer: int, nbytes: int, tag: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.pg.recv([buf], peer, tag).wait(self.timeout)
        return buf.cpu()

    def _swap(self, peer: int, data: bytes, tag: int) -> bytes:
        """Send ``data`` to ``peer`` and receive as many bytes from it."""
        work = self._send(peer, _as_bytes(data), tag)
        got = self._recv(peer, len(data), tag)
        work.wait(self.timeout)
        return got.numpy().tobytes()

    def _handshake(self, peer: int, step: int, sender: bool) -> bytes:
        """Both proofs (module docstring); returns the receiver's nonce n_r. Each nonce travels with
        the worker index its side claims (``identity``; not authenticated: for the logs only)."""
        mine = os.urandom(_NONCE)
        got = self._swap(peer, mine + struct.pack("<q", self.identity), TAG_NONCE)
        theirs, claimed = got[:_NONCE], struct.unpack("<q", got[_NONCE:])[0]
        n_r, n_s = (theirs, mine) if sender else (mine, theirs)
        s8 = struct.pack("<q", step)
        proof_src, proof_dst = mac(self.key, "heal-src", n_r + n_s + s8), mac(self.key, "heal-dst", n_s + n_r + s8)
        got = self._swap(peer, proof_src if sender else proof_dst, TAG_PROOF)
        if not mac_ok(self.key, "heal-dst" if sender else "heal-src", (n_s + n_r if sender else n_r + n_s) + s8, got):
            who = "the joining job" if sender else "the peer"
            raise HealError(f"heal with group rank {peer} (it claims worker index {claimed}) refused: {who} does not "
                            "hold this run's secret "
                            "(--sparseloco-elastic-token-file differs); nothing was "
                            f"{'sent' if sender else 'received'}")
        return n_r

    # -------------------------------------------------------------- send
    def send_checkpoint(self, dst_ranks: List[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        header, tensors = describe(state_dict, step, self.chunk_bytes)
        for dst in dst_ranks:
            t0 = time.perf_counter()
            n_r = self._handshake(dst, step, sender=True)
            data_hash = self._send_stream(dst, header, tensors)
            tag = mac(self.key, "heal-data", n_r + hashlib.sha256(header).digest() + data_hash)
            self._send(dst, _as_bytes(tag), TAG_MAC).wait(self.timeout)
            self._record("sent", dst, step, len(header) + sum(t.numel() * t.element_size() for t in tensors), t0)

    def _send_stream(self, dst: int, header: bytes, tensors: Sequence[torch.Tensor]) -> bytes:
        """Header length, header, then the tensors' bytes in messages of ``chunk_bytes``; SHA-256 of the data."""
        self._send(dst, _as_bytes(struct.pack("<q", len(header))), TAG_LEN).wait(self.timeout)
        self._send(dst, _as_bytes(header), TAG_HEADER).wait(self.timeout)
        digest, stage, fill = hashlib.sha256(), None, 0
        total = sum(t.numel() * t.element_size() for t in tensors)
        sizes = iter(_chunks(total, self.chunk_bytes))
        for t in tensors:
            raw = t.view(torch.uint8)
            pos = 0
            while pos < raw.numel():
                if stage is None:
                    stage, fill = torch.empty(next(sizes), dtype=torch.uint8), 0
                n = min(raw.numel() - pos, stage.numel() - fill)
                stage[fill:fill + n] = raw[pos:pos + n]
                fill, pos = fill + n, pos + n
                if fill == stage.numel():
                    digest.update(stage.numpy().data)
                    self._send(dst, stage, TAG_DATA).wait(self.timeout)
                    stage = None
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
            n_r = self._handshake(src_rank, step, sender=False)
            length = struct.unpack("<q", self._recv(src_rank, 8, TAG_LEN).numpy().tobytes())[0]
            if not 0 < length <= MAX_HEADER_BYTES:
                raise HealError(f"header of {length} bytes announced (at most {MAX_HEADER_BYTES})")
            header = self._recv(src_rank, length, TAG_HEADER).numpy().tobytes()
            template = self.template()
            plan, total, chunk = plan_receive(header, template, step)
            values, data_hash = self._recv_stream(src_rank, plan, total, chunk)
            tag = self._recv(src_rank, 32, TAG_MAC).numpy().tobytes()
            if not mac_ok(self.key, "heal-data", n_r + hashlib.sha256(header).digest() + data_hash, tag):
                raise HealError("the stream's MAC does not match (modified in transit, or not sent by a holder of "
                                "this run's secret); discarded")
        except HealError as exc:
            raise HealError(f"heal from group rank {src_rank} at step {step}: {exc}") from None
        self._record("received", src_rank, step, length + total, t0)
        return rebuild(template, values)

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
        for size in _chunks(total, chunk):
            buf = self._recv(src, size, TAG_DATA)
            digest.update(buf.numpy().data)
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

    def _record(self, role: str, peer: int, step: int, nbytes: int, t0: float) -> None:
        rec = HealRecord(role, peer, step, nbytes, time.perf_counter() - t0)
        self.records.append(rec)
        log.info("elastic heal: %s %d bytes %s group rank %d at step %d in %.3f s", rec.role, rec.nbytes,
                 "to" if role == "sent" else "from", peer, step, rec.seconds)

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass


__all__ = ["SafeHealTransport", "HealError", "HealRecord", "describe", "plan_receive", "rebuild", "flatten", "DTYPES"]
