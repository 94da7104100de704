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


def payload_nbytes(numel: int, cfg: CodecConfig, shape: tuple[int, ...] | None = None) -> int:
    """Size in bytes of ``encode(x, cfg)`` for a tensor of ``numel`` elements (``shape`` matters in tile mode).

    * ``index_coding="packed"``: **exact** — every worker can size receive buffers before any data moves.
    * ``index_coding="entropy"``: an **upper bound** (the real size depends on the data): the per-chunk
      bound of :func:`entropy_index_bound_bits`, plus the 8-byte length field, the parameter nibbles and
      up to 1 byte of stream padding.  ``encode`` never exceeds it.
    """
    cfg.validate()
    layout = ChunkLayout.for_tensor(numel, cfg, tuple(shape) if shape is not None else None)
    side, values = fixed_sections_nbytes(layout, cfg)
    if cfg.is_dense:
        index = 0
    elif cfg.index_coding == "packed":
        index = packed_nbytes(layout.total_kept, packed_index_bits(layout))
    else:
        index = 8 + (layout.n_chunks + 1) // 2 + (entropy_index_bound_bits(layout) + 7) // 8 + 1
    return HEADER_BYTES + side + values + index


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
