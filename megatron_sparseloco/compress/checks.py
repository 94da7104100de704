"""Payload and input checks that can be read once per outer round instead of once per check.

Every validity check of the codec (a received header that does not match the plan, indices out of
range or not ascending, side info or values that are not finite, a non-finite tensor to encode)
is a boolean the device computes; reading it on the host is a synchronisation. The codec calls

    require(bad, make_error)          bad: a bool tensor, True where the check fails

and, by default, raises ``make_error()`` at once when any element is True (one host read). Inside
``checks.active()`` of a ``DeferredChecks`` (this thread only) the flag is recorded instead and the
codec continues on data made safe to process (out-of-range indices replaced, see ``deferring``);
the owner reads every recorded flag with one host read (``raise_first``) and raises the first
failure's error, built only then. ``bad_since(mark)`` is the OR of the flags recorded after
``mark`` as a device tensor (no host read), so a caller can drop the work that depended on them.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, List, Optional, Tuple

import torch

_LOCAL = threading.local()


class DeferredChecks:
    """The checks of one round (module docstring)."""

    def __init__(self) -> None:
        self._flags: List[Tuple[torch.Tensor, Callable[[], Exception]]] = []
        self._prefixes: List[str] = []

    @contextlib.contextmanager
    def active(self) -> Iterator["DeferredChecks"]:
        """Record the codec's checks on this thread inside the block (nested blocks: the innermost)."""
        outer = getattr(_LOCAL, "checks", None)
        _LOCAL.checks = self
        try:
            yield self
        finally:
            _LOCAL.checks = outer

    @contextlib.contextmanager
    def prefix(self, text: str) -> Iterator[None]:
        """Errors recorded inside the block read ``"{text}: {error}"`` (what an immediate check's caller
        adds when it re-raises: the bucket, the worker)."""
        self._prefixes.append(text)
        try:
            yield
        finally:
            self._prefixes.pop()

    def add(self, bad: torch.Tensor, make_error: Callable[[], Exception]) -> None:
        prefixes = list(self._prefixes)

        def error() -> Exception:
            exc = make_error()
            for text in reversed(prefixes):
                exc = type(exc)(f"{text}: {exc}")
            return exc

        self._flags.append((bad.any(), error if prefixes else make_error))

    def mark(self) -> int:
        """A position in the record (for ``bad_since``)."""
        return len(self._flags)

    def bad_since(self, mark: int) -> Optional[torch.Tensor]:
        """The OR of the flags recorded after ``mark`` (a 0-dim bool tensor), or None when there are none."""
        flags = [f for f, _ in self._flags[mark:]]
        return torch.stack(flags).any() if flags else None

    def raise_first(self) -> None:
        """One host read of every flag; raise the first failure's error (its message built now)."""
        if not self._flags:
            return
        flags, self._flags = self._flags, []
        if not bool(torch.stack([f.to(flags[0][0].device) for f, _ in flags]).any()):
            return
        for bad, make_error in flags:
            if bool(bad):
                raise make_error()


def deferring() -> bool:
    """True inside ``DeferredChecks.active()``: the codec must keep going on bad data, safely."""
    return getattr(_LOCAL, "checks", None) is not None


def prefixed(text: str) -> contextlib.AbstractContextManager:
    """While deferring, errors recorded inside the block read ``"{text}: {error}"``; otherwise nothing
    (an immediate check's caller adds the same text when it re-raises)."""
    checks: Optional[DeferredChecks] = getattr(_LOCAL, "checks", None)
    return checks.prefix(text) if checks is not None else contextlib.nullcontext()


def require(bad: torch.Tensor, make_error: Callable[[], Exception]) -> None:
    """Fail when any element of ``bad`` is True: at once (one host read), or recorded when deferring."""
    checks: Optional[DeferredChecks] = getattr(_LOCAL, "checks", None)
    if checks is not None:
        checks.add(bad, make_error)
    elif bool(bad.any()):
        raise make_error()


__all__ = ["DeferredChecks", "deferring", "prefixed", "require"]
