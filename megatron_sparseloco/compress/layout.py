"""Chunk geometry: how a tensor is cut into chunks, how many values each chunk keeps, index mapping.

Three geometries, all expressed as ``n_chunks`` rows of a padded ``[n_chunks, space]`` matrix:

* ``flat``   (chunk_mode="flat"): ``x.reshape(-1)`` in chunks of ``space = C``; the last chunk may be
  ragged (``tail = numel mod C`` elements).
* ``tile2d`` (chunk_mode="tile", ``x.dim() >= 2``): ``x`` viewed as ``rows x cols`` with
  ``rows = prod(shape[:-1])``, ``cols = shape[-1]``, cut into ``tile x tile`` tiles (``space = tile**2``),
  row-major over the tile grid; edge tiles are ``h x w`` with ``h, w <= tile``.
* ``tile1d`` (chunk_mode="tile", ``x.dim() <= 1``): flat chunks of ``space = tile`` elements.

A chunk with ``n`` real elements keeps ``k_c(n) = clamp(round_half_up(k_full * n / space), 1, n)``
values, where ``k_full = k`` for flat/tile2d and ``k_full = max(1, round_half_up(tile * k / C))`` for tile1d.
Full chunks therefore keep exactly ``k_full``.

Inside a chunk an element has a *compact local index* ``li`` in ``[0, n)``: its offset in a flat chunk,
or ``r * w + c`` for row ``r`` and column ``c`` of an ``h x w`` tile.  That is what goes on the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_sparseloco.compress.config import CodecConfig


def round_half_up_div(numerator: int, denominator: int) -> int:
    """``round(numerator / denominator)`` with halves rounded up, in exact integer arithmetic."""
    return (2 * numerator + denominator) // (2 * denominator)


def kept_per_chunk(k_full: int, n_valid: int, space: int) -> int:
    """``k_c = clamp(round_half_up(k_full * n_valid / space), 1, n_valid)`` (0 for an empty chunk)."""
    if n_valid <= 0:
        return 0
    return min(n_valid, max(1, round_half_up_div(k_full * n_valid, space)))


@dataclass(frozen=True)
class ChunkClass:
    """``count`` chunks that all hold ``n_valid`` real elements and keep ``k`` of them."""

    count: int
    n_valid: int
    k: int


@dataclass(frozen=True)
class ChunkLayout:
    kind: str  # "flat" | "tile2d" | "tile1d"
    numel: int
    space: int  # padded chunk size
    k_full: int  # values kept by a full chunk
    rows: int = 0  # tile2d only
    cols: int = 0  # tile2d only
    tile: int = 0  # tile2d only

    # ------------------------------------------------------------------ construction
    @staticmethod
    def for_tensor(numel: int, cfg: CodecConfig, shape: tuple[int, ...] | None = None) -> "ChunkLayout":
        """Geometry of a tensor with ``numel`` elements (and ``shape``, which only tile mode reads)."""
        if cfg.chunk_mode == "flat":
            return ChunkLayout("flat", numel, cfg.chunk, cfg.k)
        if shape is None or len(shape) <= 1:
            k_full = max(1, round_half_up_div(cfg.tile * cfg.k, cfg.chunk))
            return ChunkLayout("tile1d", numel, cfg.tile, min(k_full, cfg.tile))
        cols = int(shape[-1])
        rows = int(math.prod(shape[:-1]))
        if rows * cols != numel:
            raise ValueError(f"shape {tuple(shape)} holds {rows * cols} elements, not numel={numel}")
        return ChunkLayout("tile2d", numel, cfg.tile * cfg.tile, cfg.k, rows, cols, cfg.tile)

    @staticmethod
    def for_tile2d(rows: int, cols: int, cfg: CodecConfig) -> "ChunkLayout":
        return ChunkLayout("tile2d", rows * cols, cfg.tile * cfg.tile, cfg.k, rows, cols, cfg.tile)

    # ------------------------------------------------------------------ counts (python ints, no tensors)
    @property
    def _grid(self) -> tuple[int, int]:
        """Tile grid (tile rows, tile cols) for tile2d."""
        t = self.tile
        return -(-self.rows // t), -(-self.cols // t)

    @property
    def n_chunks(self) -> int:
        if self.kind == "tile2d":
            tr, tc = self._grid
            return tr * tc
        return -(-self.numel // self.space)

    def chunk_classes(self) -> list[ChunkClass]:
        """The (at most four) kinds of chunk, with counts: full, ragged tail / right, bottom, corner tiles."""
        k_of = lambda n: kept_per_chunk(self.k_full, n, self.space)  # noqa: E731
        if self.kind != "tile2d":
            n_full, tail = divmod(self.numel, self.space)
            classes = [ChunkClass(n_full, self.space, k_of(self.space))] if n_full else []
            if tail:
                classes.append(ChunkClass(1, tail, k_of(tail)))
            return classes
        t = self.tile
        heights = _edge_counts(self.rows, t)
        widths = _edge_counts(self.cols, t)
        return [ChunkClass(nh * nw, h * w, k_of(h * w)) for h, nh in heights for w, nw in widths]

    @property
    def total_kept(self) -> int:
        return sum(c.count * c.k for c in self.chunk_classes())

    @property
    def tail(self) -> int:
        """Real elements in the last chunk (flat / tile1d: ``numel − (n_chunks − 1)·space``)."""
        return self.numel - (self.n_chunks - 1) * self.space

    @property
    def k_last(self) -> int:
        """Values the last chunk keeps (flat / tile1d)."""
        return kept_per_chunk(self.k_full, self.tail, self.space)

    # ------------------------------------------------------------------ per-chunk tensors
    def chunk_valid_and_width(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chunk: number of real elements ``n`` and tile width ``w`` (``w = n`` for flat chunks), int64."""
        if self.kind != "tile2d":
            n_chunks = self.n_chunks
            n_valid = torch.full((n_chunks,), self.space, dtype=torch.int64, device=device)
            tail = self.numel - (n_chunks - 1) * self.space if n_chunks else 0
            if n_chunks:
                n_valid[-1] = tail
            return n_valid, n_valid
        t = self.tile
        tr, tc = self._grid
        if tr == 0 or tc == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return empty, empty
        h = torch.full((tr,), t, dtype=torch.int64, device=device)
        w = torch.full((tc,), t, dtype=torch.int64, device=device)
        h[-1] = self.rows - (tr - 1) * t
        w[-1] = self.cols - (tc - 1) * t
        width = w.repeat(tr)
        return torch.outer(h, w).reshape(-1), width

    def kept_counts(self, n_valid: torch.Tensor) -> torch.Tensor:
        """Vectorised ``k_c`` for a tensor of per-chunk sizes."""
        k = torch.div(2 * self.k_full * n_valid + self.space, 2 * self.space, rounding_mode="floor")
        return torch.minimum(n_valid, k.clamp_min(1))

    # ------------------------------------------------------------------ index mapping
    def padded_to_compact(self, chunk_ids: torch.Tensor, padded: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
        """Position ``p = r * tile + c`` in the padded chunk → compact ``r * w + c`` (identity for flat)."""
        if self.kind != "tile2d":
            return padded
        r, c = padded // self.tile, padded % self.tile
        return r * width[chunk_ids] + c

    def compact_to_global(self, chunk_ids: torch.Tensor, local: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
        """Compact local index in chunk ``chunk_ids`` → position in ``x.reshape(-1)``."""
        if self.kind != "tile2d":
            return chunk_ids * self.space + local
        t = self.tile
        _, tc = self._grid
        w = width[chunk_ids]
        r, c = local // w, local % w
        tile_r, tile_c = chunk_ids // tc, chunk_ids % tc
        return (tile_r * t + r) * self.cols + tile_c * t + c

    # ------------------------------------------------------------------ magnitudes
    def magnitudes(self, x_flat: torch.Tensor) -> torch.Tensor:
        """``[n_chunks, space]`` int32 ``bits(|x|)`` per chunk slot; padding slots hold -1.

        ``bits`` is the IEEE-754 fp32 pattern with the sign bit cleared.  For non-negative floats it is
        monotonic in the value, so comparing these integers compares ``|x|``; Inf (0x7F800000) and NaN
        (above it) sort above every finite value, and -1 sorts below everything.
        """
        bits = x_flat.to(torch.float32).view(torch.int32)
        space, dev = self.space, x_flat.device
        if self.kind != "tile2d":
            n_chunks, numel = self.n_chunks, self.numel
            if n_chunks * space == numel:
                return torch.bitwise_and(bits, 0x7FFFFFFF).view(n_chunks, space)
            mags = torch.empty(n_chunks * space, dtype=torch.int32, device=dev)
            torch.bitwise_and(bits, 0x7FFFFFFF, out=mags[:numel])
            mags[numel:].fill_(-1)
            return mags.view(n_chunks, space)
        t = self.tile
        tr, tc = self._grid
        grid = torch.full((tr * t, tc * t), -1, dtype=torch.int32, device=dev)
        torch.bitwise_and(bits.view(self.rows, self.cols), 0x7FFFFFFF, out=grid[: self.rows, : self.cols])
        return grid.view(tr, t, tc, t).permute(0, 2, 1, 3).reshape(tr * tc, space)

    def all_positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense case: (chunk id, compact local index, global index) of every element, in wire order."""
        n_valid, width = self.chunk_valid_and_width(device)
        chunk_ids = torch.repeat_interleave(torch.arange(self.n_chunks, device=device), n_valid)
        starts = torch.cumsum(n_valid, 0) - n_valid
        local = torch.arange(self.numel, device=device) - starts[chunk_ids]
        return chunk_ids, local, self.compact_to_global(chunk_ids, local, width)


def _edge_counts(length: int, tile: int) -> list[tuple[int, int]]:
    """[(tile, number of full tiles), (remainder, 1)] along one axis, without empty entries."""
    full, rem = divmod(length, tile)
    out = [(tile, full)] if full else []
    if rem:
        out.append((rem, 1))
    return out
