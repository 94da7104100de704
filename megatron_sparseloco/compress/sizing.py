"""Payload sizes: exact for packed indices, an upper bound for entropy-coded ones, and the bits formula.

With ``K`` values kept in total (``K = sum_c k_c``, see :mod:`.layout`), ``G`` quantiser groups,
``B = 2**value_bits`` bins and ``W = bits(space - 1)`` index bits (12 for C = 4096):

    bytes = 64 (header)
          + 4 * G * (1 + B)                 side info (quantised values only)
          + ceil(K * value_bits / 8)        values (codes, or raw bf16 / fp32)
          + index section                   packed: ceil(K * W / 8); dense (k == C): 0

For one full chunk of 4096 with k = 64 that is ``(12 + 2) * 64 / 4096 = 0.219`` bits per parameter before
the fixed costs, i.e. 146x below fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sparseloco.compress.bitpack import packed_nbytes
from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.entropy_index import max_rice_param
from megatron_sparseloco.compress.header import HEADER_BYTES
from megatron_sparseloco.compress.layout import ChunkLayout
from megatron_sparseloco.compress.quantizer import side_words


def quant_groups(cfg: CodecConfig, n_chunks: int) -> int:
    """Quantiser groups: 1 per tensor, or ``ceil(n_chunks / g)``; 0 for raw values."""
    if not cfg.is_quantised:
        return 0
    if cfg.quant_group_chunks == 0:
        return 1
    return -(-n_chunks // cfg.quant_group_chunks)


def packed_index_bits(layout: ChunkLayout) -> int:
    """``W = ceil(log2 space)`` bits per packed index."""
    return (layout.space - 1).bit_length()


def fixed_sections_nbytes(layout: ChunkLayout, cfg: CodecConfig) -> tuple[int, int]:
    """(side info bytes, value bytes) — both independent of the data."""
    side = 4 * quant_groups(cfg, layout.n_chunks) * side_words(cfg.n_bins)
    return side, packed_nbytes(layout.total_kept, cfg.value_bits)


def entropy_index_bound_bits(layout: ChunkLayout) -> int:
    """Upper bound on the Rice stream bits (unary + remainder), summed over chunks.

    For a chunk with ``n`` elements keeping ``k``: ``sum_i (d_i >> r) <= (sum_i d_i) >> r <= (n - k) >> r``,
    so the chosen cost is at most ``min_r ((n - k) >> r) + k (1 + r)`` (``<= n``, at ``r = 0``).
    """
    r_max = max_rice_param(layout.space)
    total = 0
    for cls in layout.chunk_classes():
        rice = min(((cls.n_valid - cls.k) >> r) + cls.k * (1 + r) for r in range(r_max + 1))
        total += cls.count * rice
    return total


@dataclass(frozen=True)
class PayloadGeometry:
    """Where each section of one payload sits: the chunk layout, the section sizes and their offsets.

        header [0, 64) | side [64, values_at) | values [values_at, index_at) | indices [index_at, nbytes)

    Everything but the index section follows from ``(layout, cfg)``; the index length is exact for
    packed indices (``K * W`` bits, ``W = index_width``), 0 when dense, and for entropy coding either
    what a header declares or, when sizing a payload not yet written, the bound of
    :func:`entropy_index_bound_bits` (plus the length field, parameter nibbles and padding).
    The one object the codec's ``decode``, :func:`payload_nbytes` and the Triton kernels
    (:mod:`.fast_path`) all read.
    """

    layout: ChunkLayout
    cfg: CodecConfig
    side_bytes: int
    value_bytes: int
    index_bytes: int

    @staticmethod
    def of(layout: ChunkLayout, cfg: CodecConfig, index_bytes: int | None = None) -> "PayloadGeometry":
        """The geometry of ``layout`` under ``cfg``; ``index_bytes`` None: the size ``encode`` writes
        (exact) or, for entropy coding, its upper bound."""
        side, values = fixed_sections_nbytes(layout, cfg)
        if index_bytes is None:
            if cfg.is_dense:
                index_bytes = 0
            elif cfg.index_coding == "packed":
                index_bytes = packed_nbytes(layout.total_kept, packed_index_bits(layout))
            else:
                index_bytes = 8 + (layout.n_chunks + 1) // 2 + (entropy_index_bound_bits(layout) + 7) // 8 + 1
        return PayloadGeometry(layout, cfg, side, values, index_bytes)

    @staticmethod
    def for_tensor(numel: int, cfg: CodecConfig, shape: tuple[int, ...] | None = None,
                   index_bytes: int | None = None) -> "PayloadGeometry":
        return PayloadGeometry.of(ChunkLayout.for_tensor(numel, cfg, tuple(shape) if shape is not None else None),
                                  cfg, index_bytes)

    @property
    def index_width(self) -> int:
        """``W``: bits per packed index."""
        return packed_index_bits(self.layout)

    @property
    def values_at(self) -> int:
        return HEADER_BYTES + self.side_bytes

    @property
    def index_at(self) -> int:
        return self.values_at + self.value_bytes

    @property
    def body_nbytes(self) -> int:
        """Everything but the header."""
        return self.side_bytes + self.value_bytes + self.index_bytes

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.body_nbytes


def payload_nbytes(numel: int, cfg: CodecConfig, shape: tuple[int, ...] | None = None) -> int:
    """Size in bytes of ``encode(x, cfg)`` for a tensor of ``numel`` elements (``shape`` matters in tile mode).

    * ``index_coding="packed"``: **exact** — every worker can size receive buffers before any data moves.
    * ``index_coding="entropy"``: an **upper bound** (the real size depends on the data): the per-chunk
      bound of :func:`entropy_index_bound_bits`, plus the 8-byte length field, the parameter nibbles and
      up to 1 byte of stream padding.  ``encode`` never exceeds it.
    """
    cfg.validate()
    return PayloadGeometry.for_tensor(numel, cfg, shape).nbytes


def _log2_binomial(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def analytic_bits_per_param(cfg: CodecConfig, numel: int, shape: tuple[int, ...] | None = None) -> float:
    """Bits per parameter from the formula, without byte padding.

    ``(8 * 64 + 32 * G * (1 + B) + K * value_bits + index_bits) / numel`` where ``index_bits`` is
    ``K * W`` for packed coding (0 when dense) and, for entropy coding, the information-theoretic floor
    ``sum_c log2 binom(n_c, k_c)`` — a **lower bound** that real entropy payloads exceed by the Rice
    overhead (≈ 0.2 bits/index at k/C = 64/4096) plus 4 parameter bits per chunk.
    Packed payloads equal this formula up to the byte padding of the value and index sections.
    """
    cfg.validate()
    if numel <= 0:
        raise ValueError(f"analytic_bits_per_param needs numel >= 1, got {numel}")
    layout = ChunkLayout.for_tensor(numel, cfg, tuple(shape) if shape is not None else None)
    kept = layout.total_kept
    side_bits = 32 * quant_groups(cfg, layout.n_chunks) * side_words(cfg.n_bins)
    if cfg.is_dense:
        index_bits = 0.0
    elif cfg.index_coding == "packed":
        index_bits = float(kept * packed_index_bits(layout))
    else:
        index_bits = sum(c.count * _log2_binomial(c.n_valid, c.k) for c in layout.chunk_classes())
    return (8 * HEADER_BYTES + side_bits + kept * cfg.value_bits + index_bits) / numel
