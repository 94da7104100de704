"""Codec configuration: what is kept (Top-k per chunk), how values and indices are coded.

Density is ``k / chunk``.  With 12-bit packed indices and 2-bit values the wire cost is about
``(12 + 2) * k / chunk`` bits per parameter (0.219 at k=64, chunk=4096), plus a fixed header and the
quantiser side information (``(1 + 2**value_bits)`` fp32 words per quantiser group).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sparseloco.compress.errors import CodecConfigError

#: value widths: quantised codes (2, 4, 8 bits) or raw floats (16 = bf16, 32 = fp32)
QUANTISED_VALUE_BITS = (2, 4, 8)
RAW_VALUE_BITS = (16, 32)
INDEX_CODINGS = ("packed", "entropy")
CHUNK_MODES = ("flat", "tile")
#: chunk positions use up to 31 bits of a 64-bit sort key (the other 31 hold |x|) and a u32 header field
MAX_CHUNK = 2**31


@dataclass(frozen=True)
class CodecConfig:
    """How a tensor is sparsified and put on the wire.

    chunk:  elements per chunk ``C`` (flat mode).  In tile mode it must equal ``tile * tile``.
    k:      values kept per full chunk (density ``k / C``); ``k == chunk`` is dense (no index bits sent).
    value_bits: 2, 4 or 8 = quantised to ``2**value_bits`` bins; 16 = raw bf16; 32 = raw fp32.
    index_coding: "packed" (``ceil(log2 C)`` bits per index) or "entropy" (per-chunk Rice-coded gaps
        between sorted indices; Rice parameter 0 is a truncated bitmap, used where indices are dense).
    chunk_mode: "flat" (the flattened tensor in chunks of ``C``, ragged tail) or "tile" (2-D tensors as
        ``tile x tile`` tiles, 1-D tensors as flat chunks of ``tile`` elements with ``k`` scaled).
    tile:   tile edge for tile mode.
    quant_group_chunks: 0 = one quantiser (shift + centroids) per tensor; ``g > 0`` = one per ``g`` chunks.
    """

    chunk: int = 4096
    k: int = 64
    value_bits: int = 2
    index_coding: str = "packed"
    chunk_mode: str = "flat"
    tile: int = 64
    quant_group_chunks: int = 0

    def validate(self) -> "CodecConfig":
        """Check every field; return ``self`` so ``cfg = CodecConfig(...).validate()`` reads well."""
        for field in ("chunk", "k", "value_bits", "tile", "quant_group_chunks"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise CodecConfigError(f"CodecConfig.{field} must be an int, got {value!r}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise CodecConfigError(f"CodecConfig.chunk must be in [1, {MAX_CHUNK}], got {self.chunk}")
        if self.k < 1:
            raise CodecConfigError(f"CodecConfig.k must be >= 1, got {self.k}")
        if self.k > self.chunk:
            raise CodecConfigError(
                f"CodecConfig.k={self.k} exceeds CodecConfig.chunk={self.chunk}; use k <= chunk (k == chunk is dense)"
            )
        if self.value_bits not in QUANTISED_VALUE_BITS + RAW_VALUE_BITS:
            raise CodecConfigError(
                f"CodecConfig.value_bits must be one of {QUANTISED_VALUE_BITS + RAW_VALUE_BITS}, got {self.value_bits}"
            )
        if self.index_coding not in INDEX_CODINGS:
            raise CodecConfigError(
                f"CodecConfig.index_coding must be one of {INDEX_CODINGS}, got {self.index_coding!r}")
        if self.chunk_mode not in CHUNK_MODES:
            raise CodecConfigError(f"CodecConfig.chunk_mode must be one of {CHUNK_MODES}, got {self.chunk_mode!r}")
        if self.tile < 1:
            raise CodecConfigError(f"CodecConfig.tile must be >= 1, got {self.tile}")
        if self.chunk_mode == "tile" and self.chunk != self.tile * self.tile:
            raise CodecConfigError(
                f"CodecConfig.chunk={self.chunk} must equal tile*tile={self.tile * self.tile} in chunk_mode='tile'; "
                f"set chunk={self.tile * self.tile} or change tile"
            )
        if self.quant_group_chunks < 0:
            raise CodecConfigError(
                f"CodecConfig.quant_group_chunks must be >= 0 (0 = per tensor), got {self.quant_group_chunks}"
            )
        return self

    @property
    def is_dense(self) -> bool:
        """``k == chunk``: every element is sent and the index section is empty."""
        return self.k == self.chunk

    @property
    def is_quantised(self) -> bool:
        return self.value_bits in QUANTISED_VALUE_BITS

    @property
    def n_bins(self) -> int:
        """Quantiser bins ``2**value_bits`` (0 for raw values)."""
        return 2**self.value_bits if self.is_quantised else 0
