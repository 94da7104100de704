"""Exceptions raised by the SparseLoCo codec.

All three derive from :class:`ValueError` so callers that only care about "bad input" can catch that.
"""

from __future__ import annotations


class CodecConfigError(ValueError):
    """A :class:`~megatron_sparseloco.compress.config.CodecConfig` field is invalid; the message names it."""


class PayloadError(ValueError):
    """A payload is malformed: bad magic/version, truncated, inconsistent lengths, invalid indices or side info."""


class NonFiniteInputError(ValueError):
    """The tensor handed to ``encode`` holds NaN or Inf; the message names the tensor."""
