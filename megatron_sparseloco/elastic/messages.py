"""The signed messages of an elastic round, each bound to its round and its sender's position.

A round's participants (the jobs of one torchft quorum, at one shard position) exchange three
messages over the session's control group, in this order, every one an all-gather of a fixed size:

1. **Nonces**: ``NONCE_BYTES`` fresh random bytes per participant, unsigned. Every participant
   then holds the same list n_0 … n_{W-1} (rank order of the round) and the round's binding

       digest = SHA-256("megatron_sparseloco/elastic/round" ‖ W ‖ n_0 ‖ … ‖ n_{W-1})

   together with torchft's quorum id (``RoundBinding``).
2. **Round header** (``HEADER_BYTES`` of JSON, space padded): the participant's fields (``FIELDS``)
   and ``mac("round", context(p, I) ‖ body)``.
3. **Verdict** (``VERDICT_BYTES``): whether the participant found the communicated result valid,
   one byte, and ``mac("round-verdict", context(p, I) ‖ byte)``.

with, for the participant at position p of the gather claiming worker index I,

    context(p, I) = digest ‖ quorum id ‖ p ‖ I                 (the last three as int64, little endian)

A MAC therefore verifies only in the round whose nonces it was made for, at the position it was
made for, for the worker index it names: a header or verdict captured in one round and presented
in another (a later quorum, another shard position's group, a run after a lighthouse restart whose
quorum ids start again) or at another position is refused. Every participant contributes a nonce,
so no single participant (a replayer included) can make a round's digest repeat an earlier one's.
The nonces need no secrecy and no signature: a participant that sends a forged or copied nonce
only changes the digest, which every participant computes from the same gathered list.

A message that does not verify is refused (None). Nothing here is unpickled; JSON is parsed only
from a fixed-size buffer.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

from megatron_sparseloco.elastic.auth import mac, mac_ok

#: random bytes each participant contributes to a round's binding
NONCE_BYTES = 32
#: bytes of one round header on the wire (JSON, space padded)
HEADER_BYTES = 2048
#: 2: headers bound to their round (``context``); the fork fields ``newest`` / ``forgone`` / ``waited``;
#: 3: ``fragment``, the part of the model the participant's schedule syncs (-1: any, a start-up round)
HEADER_VERSION = 3
#: every field of a header body, none optional
FIELDS = ("v", "index", "group_rank", "step", "ok", "contributes", "finite", "samples", "tokens", "commits",
          "fingerprint", "extra", "newest", "forgone", "waited", "fragment")
_INTS = ("v", "index", "group_rank", "step", "samples", "tokens", "commits", "newest", "forgone", "waited",
         "fragment")
_BOOLS = ("ok", "contributes", "finite")
#: one verdict on the wire: the byte (1: ok, 0: not ok) and its MAC
VERDICT_BYTES = 1 + 32
_DIGEST_CONTEXT = b"megatron_sparseloco/elastic/round"


# ---------------------------------------------------------------------- the round's binding
def new_nonce() -> bytes:
    """This participant's fresh nonce for one round."""
    return os.urandom(NONCE_BYTES)


@dataclass(frozen=True)
class RoundBinding:
    """What every MAC of one round is bound to: the digest of its participants' nonces and torchft's
    quorum id (-1 when torchft does not expose it; the nonces alone make the binding fresh)."""

    digest: bytes
    quorum_id: int

    @classmethod
    def of_nonces(cls, nonces: Sequence[bytes], quorum_id: int) -> "RoundBinding":
        """The binding of the round whose participants sent ``nonces`` (rank order)."""
        h = hashlib.sha256(_DIGEST_CONTEXT + struct.pack("<q", len(nonces)))
        for n in nonces:
            if len(n) != NONCE_BYTES:
                raise ValueError(f"a round nonce has {len(n)} bytes, expected {NONCE_BYTES}")
            h.update(n)
        return cls(h.digest(), int(quorum_id))

    def context(self, position: int, index: int) -> bytes:
        """The prefix of every MAC made by the participant at ``position`` claiming worker ``index``."""
        return self.digest + struct.pack("<qqq", self.quorum_id, int(position), int(index))


# ---------------------------------------------------------------------- round header
def make_header(key: bytes, fields: Dict[str, Any], binding: RoundBinding, position: int) -> bytes:
    """The signed, padded header of ``fields`` (keys ``FIELDS``) for the participant at ``position``."""
    body = json.dumps({k: fields[k] for k in FIELDS}, sort_keys=True, separators=(",", ":"), allow_nan=False)
    tag = mac(key, "round", binding.context(position, fields["index"]) + body.encode())
    raw = json.dumps({"body": body, "mac": tag.hex()}, separators=(",", ":")).encode()
    if len(raw) > HEADER_BYTES:
        raise ValueError(f"round header of {len(raw)} bytes exceeds {HEADER_BYTES} (too many extra fields?)")
    return raw + b" " * (HEADER_BYTES - len(raw))


def _body_and_tag(raw: bytes):
    """(body text, fields, MAC) of a header's JSON, unverified; raises on any malformed input."""
    doc = json.loads(raw.decode("utf-8"))
    body, tag = doc["body"], bytes.fromhex(doc["mac"])
    if not isinstance(body, str):
        raise TypeError("body is not a string")
    return body, json.loads(body), tag


def _well_formed(fields: Any) -> bool:
    """Every field present, of its type (bools are not ints here), the current version."""
    if not isinstance(fields, dict) or set(fields) != set(FIELDS) or fields["v"] != HEADER_VERSION:
        return False
    if not all(isinstance(fields[k], int) and not isinstance(fields[k], bool) for k in _INTS):
        return False
    if not all(isinstance(fields[k], bool) for k in _BOOLS):
        return False
    fp = fields["fingerprint"]
    return isinstance(fields["extra"], dict) and (fp is None or (isinstance(fp, int) and not isinstance(fp, bool)))


def read_header(key: bytes, raw: bytes, binding: RoundBinding, position: int) -> Optional[Dict[str, Any]]:
    """The fields of the header received from ``position`` when its MAC verifies for this round and
    that position (and the worker index it names) and its shape is right; else None (refused)."""
    try:
        body, fields, tag = _body_and_tag(raw)
        index = fields["index"]
        if not isinstance(index, int) or isinstance(index, bool):
            return None
        if not mac_ok(key, "round", binding.context(position, index) + body.encode(), tag):
            return None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError, struct.error, OverflowError):
        return None
    return fields if _well_formed(fields) else None


def claimed_index(raw: bytes) -> str:
    """The worker index an unverified header claims (for the log only; "?" when unreadable)."""
    try:
        return str(int(_body_and_tag(raw)[1]["index"]))
    except Exception:  # any garbage: nothing to report
        return "?"


def refusal_line(position: int, raw: bytes) -> str:
    """The log line naming a refused participant: its position in this round and the index it claims."""
    return (f"elastic: refusing participant {position} of this round (it claims worker index {claimed_index(raw)}): "
            "its round header does not verify for this round and position under this run's secret (another "
            "--sparseloco-elastic-token-file, or a header replayed from another round); it is left out of the "
            "round's contributors and checks")


# ---------------------------------------------------------------------- verdict
def make_verdict(key: bytes, ok: bool, binding: RoundBinding, position: int, index: int) -> bytes:
    """The signed verdict of the participant at ``position`` (worker ``index``)."""
    byte = b"\x01" if ok else b"\x00"
    return byte + mac(key, "round-verdict", binding.context(position, index) + byte)


def read_verdict(key: bytes, raw: bytes, binding: RoundBinding, position: int, index: int) -> Optional[bool]:
    """The verdict received from ``position`` when it verifies for this round, that position and the
    worker ``index`` its accepted header names; else None (unverifiable)."""
    if len(raw) != VERDICT_BYTES or raw[:1] not in (b"\x00", b"\x01"):
        return None
    if not mac_ok(key, "round-verdict", binding.context(position, index) + raw[:1], raw[1:]):
        return None
    return raw[:1] == b"\x01"


__all__ = ["FIELDS", "HEADER_BYTES", "HEADER_VERSION", "NONCE_BYTES", "VERDICT_BYTES", "RoundBinding", "claimed_index",
           "make_header", "make_verdict", "new_nonce", "read_header", "read_verdict", "refusal_line"]
