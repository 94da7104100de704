"""The run's shared secret and the message authentication codes made with it.

Every job of an elastic run reads the same secret from ``--sparseloco-elastic-token-file``. The
secret never crosses the network; what does is

    key      = SHA-256("megatron_sparseloco/elastic/v1" ‖ secret)
    mac(msg) = HMAC-SHA-256(key, purpose ‖ 0x00 ‖ msg)

with ``purpose`` naming what is authenticated (the round header, the round verdict, each side of
the heal handshake, the heal stream), so a MAC made for one purpose is never accepted for another.
The round's messages are also bound to their round and sender position (``elastic.messages``).
A job that does not hold the secret cannot produce a MAC the others accept (round header: it is
refused and left out of the round; heal: nothing is sent to it). The MACs authenticate
*membership*, not every byte of the outer collectives (docs/elastic.md, threat model).

Token file rules: a regular file, at least ``MIN_TOKEN_CHARS`` characters once surrounding
whitespace is stripped, not readable or writable by "other" users (``chmod o-rwx``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat

MIN_TOKEN_CHARS = 16
_KEY_CONTEXT = b"megatron_sparseloco/elastic/v1"


class TokenError(ValueError):
    """The token file cannot serve as the run's secret: ``problem`` and ``fix`` say why and what to do."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}. Fix: {fix}")


def read_token(path: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped), or ``TokenError``."""
    gen = "e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > FILE && chmod 600 FILE`"
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TokenError(f"cannot read {path!r} ({exc.strerror})", f"give the path of the run's token file, {gen}")
    if not stat.S_ISREG(st.st_mode):
        raise TokenError(f"{path!r} is not a regular file", f"give the run's token file, {gen}")
    if st.st_mode & stat.S_IRWXO:
        raise TokenError(f"{path!r} is accessible to other users (mode {stat.S_IMODE(st.st_mode):o})",
                         f"run `chmod o-rwx {path}` (e.g. `chmod 600 {path}`)")
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise TokenError(f"cannot read {path!r} ({exc.strerror})", "make it readable by the user running the job")
    if len(secret) < MIN_TOKEN_CHARS:
        raise TokenError(f"{path!r} holds {len(secret)} characters, fewer than {MIN_TOKEN_CHARS}",
                         f"put a longer random secret in it, {gen}")
    return secret


def derive_key(secret: bytes) -> bytes:
    """The MAC key of a secret (the secret itself is never used as a key or sent)."""
    return hashlib.sha256(_KEY_CONTEXT + secret).digest()


def mac(key: bytes, purpose: str, message: bytes) -> bytes:
    """HMAC-SHA-256 of ``message`` for ``purpose`` (32 bytes)."""
    return hmac.new(key, purpose.encode() + b"\x00" + message, hashlib.sha256).digest()


def mac_ok(key: bytes, purpose: str, message: bytes, tag: bytes) -> bool:
    """Constant-time check of ``tag`` against ``mac(key, purpose, message)``."""
    return hmac.compare_digest(mac(key, purpose, message), tag)
