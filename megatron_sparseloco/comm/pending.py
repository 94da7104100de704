"""``Pending``: the handle of a communication that may still be running (every ``start_*`` returns one)."""
from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    """The result of an operation that may still be running: ``wait()`` blocks and returns it (once
    computed it is kept, so ``wait`` may be called again); ``done()`` polls without blocking."""

    def __init__(self, wait: Callable[[], T], done: Optional[Callable[[], bool]] = None):
        self._wait, self._done = wait, done
        self._finished = False
        self._result: Optional[T] = None

    @classmethod
    def completed(cls, result: T) -> "Pending[T]":
        pending: Pending[T] = cls(lambda: result)
        pending._finished, pending._result = True, result
        return pending

    def done(self) -> bool:
        return self._finished or (self._done is not None and self._done())

    def wait(self) -> T:
        if not self._finished:
            self._result = self._wait()
            self._finished = True
        return self._result  # type: ignore[return-value]


__all__ = ["Pending"]
