"""The SparseLoCo codec's settings as config fields, shared by every strategy that compresses.

SparseLoCo and compressed GASLoC declare ``chunk`` / ``k`` / ``value_bits`` / ``index_coding`` with
these helpers, so both take the same flags (``--sparseloco-chunk-size``, ``--sparseloco-topk``,
``--sparseloco-value-bits``, ``--sparseloco-index-coding``) with the same ranges; each passes the
value widths it supports and, where the codec is optional, the mode it needs (``requires``).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

from megatron_sparseloco.compress import CodecConfig, CodecConfigError
from megatron_sparseloco.compress.config import INDEX_CODINGS, MAX_CHUNK
from megatron_sparseloco.outer.config_fields import ConfigError, flag_field


def codec_chunk_field(requires: Optional[Mapping[str, Any]] = None):
    return flag_field(4096, flag="chunk-size", low=1, high=MAX_CHUNK, requires=requires,
                      doc="Chunk size C: Top-k is taken per chunk of C elements (SparseLoCo's tensor chunking: "
                          "2-D weights in √C×√C tiles).")


def codec_k_field(requires: Optional[Mapping[str, Any]] = None):
    return flag_field(64, flag="topk", low=1, requires=requires,
                      doc="Values k kept per chunk (density k/C; the reference's 64 of 4096 = 1.56 %).")


def codec_value_bits_field(choices: Sequence[int], requires: Optional[Mapping[str, Any]] = None):
    return flag_field(2, flag="value-bits", choices=choices, requires=requires,
                      doc="Bits per kept value: 2/4/8 quantised to 2**bits bins, 16 raw bf16, 32 raw fp32.")


def codec_index_coding_field(requires: Optional[Mapping[str, Any]] = None):
    return flag_field("packed", flag="index-coding", choices=INDEX_CODINGS, requires=requires,
                      doc='Index wire format: "packed" (ceil(log2 C) bits, fixed payload sizes, no size exchange) '
                          'or "entropy" (Rice-coded gaps).')


def check_codec(codec: CodecConfig, owner: str) -> None:
    """``codec.validate()``, its error as a ConfigError naming the config field (same names as the codec's)."""
    try:
        codec.validate()
    except CodecConfigError as exc:
        m = re.search(r"CodecConfig\.(\w+)", str(exc))
        fix = "use `k` <= `chunk` (k == chunk is dense)" if m and m.group(1) == "k" else None
        text = str(exc).split("; use ")[0] if fix else str(exc)   # our fix replaces the codec's hint
        raise ConfigError(f"{owner}: {text}", m.group(1) if m else None, fix) from exc


def check_bucket_holds_a_chunk(config) -> None:
    """A bucket must hold at least one chunk (buckets are whole chunks)."""
    if config.bucket_numel < config.chunk:
        raise ConfigError(f"bucket_numel {config.bucket_numel} is smaller than one chunk (chunk={config.chunk})",
                          "bucket_numel", "use a multiple of `chunk`, e.g. `bucket_numel=16777216`")
