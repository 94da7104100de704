"""``RoundSchedule``: which fragment's round launches and which completes after each inner step.

Pure arithmetic on the inner-step counter t (the number of ``step()`` calls so far), with H inner
steps per round, τ steps of delayed application and P fragments at offsets o_p = ⌊p·H/P⌋:

    fragment p launches after inner step t  ⇔  t > 0 and t ≡ o_p (mod H)          (``syncs_at``)
    fragment p completes after inner step t ⇔  fragment p launched after t − τ

τ = 0 is the blocking outer step: a round launches and completes after the same inner step.
When both happen after one step (τ > 0), completions come first (τ < H/P: never the same
fragment). Every rank follows the counter, whether or not it holds strategies of a fragment: the
tied-parameter sync and the in-worker param all-gather after a round involve every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple


def fragment_offsets(inner_steps: int, fragments: int) -> List[int]:
    """o_p = ⌊p·H/P⌋ for p = 0 .. P−1."""
    return [p * inner_steps // fragments for p in range(fragments)]


def syncs_at(calls: int, offset: int, inner_steps: int) -> bool:
    """Does a fragment with offset ``offset`` sync (blocking step or launch) after inner step ``calls``?"""
    return calls > 0 and (calls - offset) % inner_steps == 0


def round_in_flight(calls: int, offset: int, inner_steps: int, tau: int) -> bool:
    """After inner step ``calls``: was this fragment launched in the last τ steps (merge still due)?"""
    if tau <= 0:
        return False
    phase = (calls - offset) % inner_steps
    return phase < tau and calls - phase > 0


@dataclass(frozen=True)
class RoundSchedule:
    """The outer rounds' timetable for H, τ and P (module docstring)."""

    inner_steps: int
    overlap_steps: int = 0
    fragments: int = 1

    @property
    def offsets(self) -> List[int]:
        return fragment_offsets(self.inner_steps, self.fragments)

    def completions(self, calls: int) -> List[int]:
        """Fragments whose delayed round completes after inner step ``calls`` (none when τ = 0)."""
        tau = self.overlap_steps
        if tau == 0:
            return []
        return [p for p, o in enumerate(self.offsets) if syncs_at(calls - tau, o, self.inner_steps)]

    def launches(self, calls: int) -> List[int]:
        """Fragments whose round launches (τ = 0: runs, blocking) after inner step ``calls``."""
        return [p for p, o in enumerate(self.offsets) if syncs_at(calls, o, self.inner_steps)]

    def events(self, calls: int) -> List[Tuple[str, int]]:
        """What runs after inner step ``calls``, in order: ("complete", p) first, then ("step", p) for a
        blocking round or ("launch", p) for a delayed one."""
        start = "step" if self.overlap_steps == 0 else "launch"
        return [("complete", p) for p in self.completions(calls)] + [(start, p) for p in self.launches(calls)]

    def next_launch(self, calls: int) -> int:
        """The first inner step t > ``calls`` after which some fragment's round launches (or runs, τ = 0)."""
        H = self.inner_steps
        return min(calls + ((o - calls) % H or H) for o in self.offsets)

    def merge_due(self, calls: int, fragment: int) -> bool:
        """After inner step ``calls``, a round of ``fragment`` launched and its merge still to come."""
        return round_in_flight(calls, self.offsets[fragment], self.inner_steps, self.overlap_steps)


__all__ = ["RoundSchedule", "fragment_offsets", "round_in_flight", "syncs_at"]
