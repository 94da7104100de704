"""SparseLoCo aggregation by reduce-scatter (``--sparseloco-aggregation reduce-scatter``).

All-gather makes every worker receive the W − 1 other payloads (``(W−1)·P`` bytes). Here every
bucket is owned piecewise by the W workers, and each worker receives about ``2·(W−1)/W·P``:

Ownership. A bucket's segments are cut into *units* that keep their chunks whole — a tile row
(``t·cols`` elements) of a ``tile2d`` segment, ``C`` elements of a ``flat`` or ``dense`` one — and
owner ``j`` holds the units whose first element lies in ``[j·n/W, (j+1)·n/W)`` (n = bucket size):
a contiguous range ``R_j = [a_j, b_j)`` of the bucket, balanced in elements, empty when the bucket
has fewer units than workers. A unit range of a segment is a *sub-segment*: the same geometry and
exactly the parent's chunks (so the same kept counts and compact indices).

Per outer step and bucket, on worker w (after the EF step that produced its payload ``P_w``)::

    1. piece_{w→j} = the part of P_w inside R_j: for each sub-segment, the parent segment's side
       info (copied) and its kept values [K_lo, K_hi) in chunk-major order — codes and compact
       indices repacked at the same widths.  Sizes depend only on the plan, so no size exchange.
    2. exchange: piece_{w→j} to owner j for every j ≠ w (batched isend/irecv, ``comm/p2p.py``)
    3. owner j decodes its W pieces (validated, a bad one rejected naming the worker) and computes
       the same aggregate as all-gather on R_j, summing in worker order:
           S[i] = Σ_w v_w[i],  c[i] = #{w : i ∈ idx_w},  A = S / max(c, 1)   (contributors)  or S / W
    4. owner error feedback f_j (shard-sized, non-zero on R_j only):
           f ← f + A ;  Q_j = encode(f) with the owner codec ;  f ← f − decode(Q_j)
       the owner codec is the worker codec with ``owner_k`` / ``owner_value_bits`` (default: the
       same density and bits: Top-k per chunk of the aggregate, one quantiser per sub-segment).
       Mass is conserved exactly: decode(Q_j) + f_new = f_old + A (the EF identity of the codec).
       ``owner_residual="workers"`` (Ok-Topk's choice, arXiv 2201.07598): what the owner does not
       send goes back to the workers instead of waiting in f. With g = f + A, Q_j = encode(g),
       U = the positions Q_j sends:
           f[i] ← g[i] − decode(Q_j)[i]  for i ∈ U ;   f[i] unchanged elsewhere (only quantisation error)
       and after step 5 every worker w restores what it sent outside U:  e_w[i] ← e_w[i] + v_w[i]
       for i ∈ idx_w outside U. Position by position, u + Δf + (the values put back, averaged as A is)
       = A, so nothing is lost; it waits in the workers' e (decayed by β with the rest of e) and
       competes again in their next Top-k, instead of in an undecayed owner buffer.
    5. all-gather of the W payloads Q_j (padded to the largest, the sizes being known), and on every
       worker u[R_j] = decode(Q_j): the same bytes everywhere, so θ_outer stays bitwise identical.

With a lossless owner codec (``owner_k = chunk``, ``owner_value_bits = 32``) ``f`` stays 0 and ``u``
equals all-gather's aggregate bit for bit. Bytes per worker and bucket: sent ``Σ_{j≠w} |piece_j| +
max_j |Q_j|``, received ``Σ_{w'≠w} |piece_w| + (W−1)·max_j |Q_j|``, both ≈ 2·(W−1)/W·P plus the
16-byte piece header and copied side info per sub-segment (docs/scaling.md).
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_sparseloco.comm.interface import OuterComm
from megatron_sparseloco.compress.bitpack import pack_bits, packed_nbytes, unpack_bits
from megatron_sparseloco.compress.codec import _check_strictly_increasing
from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.errors import PayloadError
from megatron_sparseloco.compress.quantizer import dequantise, side_words
from megatron_sparseloco.compress.segments import (
    BUCKET_HEADER_BYTES,
    SEGMENT_ENTRY_BYTES,
    BucketPlan,
    FlatRange,
    Segment,
    bucket_payload_nbytes,
    decode_bucket,
    encode_bucket,
    segment_config,
    segment_layout,
    tile_edge,
)
from megatron_sparseloco.compress.sizing import PayloadGeometry, fixed_sections_nbytes, packed_index_bits

PIECE_MAGIC = b"SLCP"
PIECE_VERSION = 1
PIECE_HEADER = struct.Struct("<4sBBHII")  # magic | version | value_bits | reserved | owner | n_subs
PIECE_HEADER_BYTES = PIECE_HEADER.size    # 16


@dataclass(frozen=True)
class SubSegment:
    """Chunks [chunk_lo, chunk_hi) of parent segment ``parent`` = its kept values [k_lo, k_hi)."""

    parent: int
    segment: Segment  # offset relative to the bucket
    k_lo: int
    k_hi: int

    @property
    def kept(self) -> int:
        return self.k_hi - self.k_lo


@dataclass(frozen=True)
class OwnerRange(FlatRange):
    """The elements ``[start, end)`` of a bucket (bucket-relative) that worker ``owner`` aggregates."""

    owner: int
    start: int
    end: int
    subs: Tuple[SubSegment, ...]
    """The pieces of the bucket's segments that fall in the range."""
    plan: Optional[BucketPlan]
    """The owner codec's plan of the range (None when it is empty)."""
    piece_nbytes: int
    """Size of every worker's piece for this owner (0 when empty)."""
    aggregate_nbytes: int
    """Size of the owner's re-encoded aggregate Q_j (0 when empty)."""


def _unit(seg: Segment, codec: CodecConfig) -> int:
    return tile_edge(codec.chunk) * seg.cols if seg.geometry == "tile2d" else codec.chunk


def _chunk_units(seg: Segment, codec: CodecConfig) -> int:
    """Chunks per unit (tiles per tile row, or 1)."""
    if seg.geometry != "tile2d":
        return 1
    t = tile_edge(codec.chunk)
    return -(-seg.cols // t)


def owner_ranges(plan: BucketPlan, world: int, owner_codec: CodecConfig) -> List[OwnerRange]:
    """The W owner ranges of one bucket (see the module docstring)."""
    units = []  # (bucket offset, numel, segment index, unit index)
    for i, seg in enumerate(plan.segments):
        u = _unit(seg, plan.codec)
        for j, lo in enumerate(range(0, seg.numel, u)):
            units.append((seg.offset + lo, min(u, seg.numel - lo), i, j))
    kept_cum = []
    for seg in plan.segments:
        lay = segment_layout(seg, plan.codec)
        n_valid, _ = lay.chunk_valid_and_width(torch.device("cpu"))
        kept_cum.append([0] + torch.cumsum(lay.kept_counts(n_valid), 0).tolist())
    n = plan.numel
    out = []
    for j in range(world):
        lo, hi = j * n // world, (j + 1) * n // world
        mine = [u for u in units if lo <= u[0] < hi]
        subs: List[SubSegment] = []
        for unit in mine:  # merge consecutive units of one segment
            off, size, i, uj = unit
            if subs and subs[-1].parent == i:
                prev = subs[-1]
                s = prev.segment
                subs[-1] = SubSegment(i, Segment(s.offset, s.numel + size, s.geometry, s.cols, s.name), prev.k_lo, 0)
            else:
                seg = plan.segments[i]
                subs.append(SubSegment(i, Segment(off, size, seg.geometry, seg.cols, seg.name), 0, 0))
        fixed = []
        for sub in subs:  # kept range from the parent's chunk range
            seg = plan.segments[sub.parent]
            u, cpu = _unit(seg, plan.codec), _chunk_units(seg, plan.codec)
            c_lo = (sub.segment.offset - seg.offset) // u * cpu
            end = sub.segment.offset + sub.segment.numel - seg.offset
            c_hi = min(-(-end // u) * cpu, len(kept_cum[sub.parent]) - 1)
            fixed.append(SubSegment(sub.parent, sub.segment, kept_cum[sub.parent][c_lo], kept_cum[sub.parent][c_hi]))
        if not fixed:
            out.append(OwnerRange(j, lo, lo, (), None, 0, 0))
            continue
        start, end = fixed[0].segment.offset, fixed[-1].segment.offset + fixed[-1].segment.numel
        rebased = tuple(Segment(s.segment.offset - start, s.segment.numel, s.segment.geometry, s.segment.cols,
                                s.segment.name) for s in fixed)
        oplan = BucketPlan(plan.start + start, plan.start + end, rebased, owner_codec)
        out.append(OwnerRange(j, start, end, tuple(fixed), oplan, piece_nbytes(plan, fixed),
                              bucket_payload_nbytes(oplan)))
    return out


def _sub_sizes(plan: BucketPlan, sub: SubSegment) -> Tuple[int, int, int]:
    """(side, values, indices) bytes of one sub-segment in a piece."""
    seg = plan.segments[sub.parent]
    cfg = segment_config(plan.codec, seg.geometry)
    lay = segment_layout(seg, plan.codec)
    side, _ = fixed_sections_nbytes(lay, cfg)
    index = 0 if cfg.is_dense else packed_nbytes(sub.kept, packed_index_bits(lay))
    return side, packed_nbytes(sub.kept, cfg.value_bits), index


def piece_nbytes(plan: BucketPlan, subs: Sequence[SubSegment]) -> int:
    return PIECE_HEADER_BYTES + sum(sum(_sub_sizes(plan, s)) for s in subs)


def _segment_sections(plan: BucketPlan) -> List[Tuple[int, int, int, int]]:
    """Byte offsets (side, values, indices, end) of each segment body in a packed bucket payload."""
    at = BUCKET_HEADER_BYTES + SEGMENT_ENTRY_BYTES * len(plan.segments)
    out = []
    for seg in plan.segments:
        geo = PayloadGeometry.of(segment_layout(seg, plan.codec), segment_config(plan.codec, seg.geometry))
        side, values, index = geo.side_bytes, geo.value_bytes, geo.index_bytes  # packed indices: exact
        out.append((at, at + side, at + side + values, at + side + values + index))
        at += geo.body_nbytes
    return out


class SparseReduceScatter:
    """The reduce-scatter machinery of one SparseLoCo strategy (tensor chunking, packed indices)."""

    def __init__(self, plans: Sequence[BucketPlan], owner_codec: CodecConfig, world: int, rank: int,
                 numel: int, device: torch.device):
        self.world, self.rank, self.device = world, rank, device
        self.ranges = [owner_ranges(p, world, owner_codec) for p in plans]
        self.sections = [_segment_sections(p) for p in plans]
        #: owner error feedback f (non-zero only on the ranges this rank owns)
        self.error = torch.zeros(numel, dtype=torch.float32, device=device)
        #: seconds of ``aggregate`` spent outside its two collectives (pieces, the owner's decode,
        #: mean, error feedback and re-encoding, the decode of the gathered aggregates), since the
        #: last ``take_owner_seconds``: compute that all-gather does in its apply phase instead
        self.owner_seconds = 0.0

    def take_owner_seconds(self) -> float:
        t, self.owner_seconds = self.owner_seconds, 0.0
        return t

    def expected_sent_bytes(self) -> int:
        total = 0
        for ranges in self.ranges:
            total += sum(r.piece_nbytes for r in ranges if r.owner != self.rank)
            total += max(r.aggregate_nbytes for r in ranges)
        return total

    # ------------------------------------------------------------------ pieces
    def _unpacked(self, b: int, plan: BucketPlan, payload: torch.Tensor, parent: int,
                  cache: Optional[Dict[int, tuple]]) -> tuple:
        """(codes or None, compact indices or None) of parent segment ``parent``, all its kept values;
        unpacked once per bucket when ``cache`` is given (a segment spans up to W owners' pieces)."""
        if cache is not None and parent in cache:
            return cache[parent]
        seg = plan.segments[parent]
        cfg = segment_config(plan.codec, seg.geometry)
        lay = segment_layout(seg, plan.codec)
        _, v_at, i_at, end = self.sections[b][parent]
        codes = unpack_bits(payload[v_at:i_at], cfg.value_bits, lay.total_kept) if cfg.is_quantised else None
        local = None if cfg.is_dense else unpack_bits(payload[i_at:end], packed_index_bits(lay), lay.total_kept)
        if cache is not None:
            cache[parent] = (codes, local)
        return codes, local

    def make_piece(self, b: int, plan: BucketPlan, payload: torch.Tensor, owner: int,
                   cache: Optional[Dict[int, tuple]] = None) -> torch.Tensor:
        """Owner ``owner``'s piece of this worker's payload (step 1). Pass the same ``cache`` dict for
        every owner of one bucket so that each segment's codes and indices are unpacked once."""
        rng = self.ranges[b][owner]
        if not rng.subs:
            return torch.zeros(0, dtype=torch.uint8, device=payload.device)
        head = PIECE_HEADER.pack(PIECE_MAGIC, PIECE_VERSION, plan.codec.value_bits, 0, owner, len(rng.subs))
        parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8).to(payload.device)]
        for sub in rng.subs:
            seg = plan.segments[sub.parent]
            cfg = segment_config(plan.codec, seg.geometry)
            lay = segment_layout(seg, plan.codec)
            s_at, v_at, _, _ = self.sections[b][sub.parent]
            parts.append(payload[s_at:v_at])
            codes, local = self._unpacked(b, plan, payload, sub.parent, cache)
            if cfg.is_quantised:
                parts.append(pack_bits(codes[sub.k_lo:sub.k_hi], cfg.value_bits))
            else:
                width = cfg.value_bits // 8
                parts.append(payload[v_at + sub.k_lo * width:v_at + sub.k_hi * width])
            if not cfg.is_dense:
                parts.append(pack_bits(local[sub.k_lo:sub.k_hi], packed_index_bits(lay)))
        piece = torch.cat(parts)
        assert piece.numel() == rng.piece_nbytes, (piece.numel(), rng.piece_nbytes)
        return piece

    def decode_piece(self, b: int, plan: BucketPlan, piece: torch.Tensor,
                     owner: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(positions relative to the owner range's start, fp32 values); PayloadError on any defect."""
        rng = self.ranges[b][owner]
        if piece.dtype != torch.uint8 or piece.dim() != 1 or piece.numel() != rng.piece_nbytes:
            raise PayloadError(f"piece has {piece.numel()} bytes ({piece.dtype}), expected {rng.piece_nbytes}")
        head = PIECE_HEADER.unpack(piece[:PIECE_HEADER_BYTES].cpu().numpy().tobytes())
        want = (PIECE_MAGIC, PIECE_VERSION, plan.codec.value_bits, 0, owner, len(rng.subs))
        if head != want:
            raise PayloadError(f"piece header (magic, version, value_bits, reserved, owner, subs) = {head}, "
                               f"expected {want}")
        at, idx_all, val_all = PIECE_HEADER_BYTES, [], []
        for sub in rng.subs:
            seg = plan.segments[sub.parent]
            cfg = segment_config(plan.codec, seg.geometry)
            lay = segment_layout(sub.segment, plan.codec)
            side_n, val_n, idx_n = _sub_sizes(plan, sub)
            side_b, val_b = piece[at:at + side_n], piece[at + side_n:at + side_n + val_n]
            idx_b = piece[at + side_n + val_n:at + side_n + val_n + idx_n]
            at += side_n + val_n + idx_n
            n_valid, width = lay.chunk_valid_and_width(piece.device)
            if lay.total_kept != sub.kept:
                raise PayloadError(f"sub-segment {sub.segment.name}: plan keeps {lay.total_kept}, piece {sub.kept}")
            if cfg.is_dense:
                chunk_ids, local, pos = lay.all_positions(piece.device)
            else:
                kept = lay.kept_counts(n_valid)
                chunk_ids = torch.repeat_interleave(torch.arange(lay.n_chunks, device=piece.device), kept)
                local = unpack_bits(idx_b, packed_index_bits(lay), sub.kept)
                try:
                    _check_strictly_increasing(local, chunk_ids)
                except PayloadError as exc:
                    raise PayloadError(f"segment {sub.segment.name}: {exc}") from exc
                if bool((local >= n_valid[chunk_ids]).any()):
                    raise PayloadError(f"segment {sub.segment.name}: an index is beyond its chunk")
                pos = lay.compact_to_global(chunk_ids, local, width)
            if cfg.is_quantised:
                side = side_b.clone().view(torch.float32).view(-1, side_words(cfg.n_bins))
                if not bool(torch.isfinite(side).all()):
                    raise PayloadError(f"segment {sub.segment.name}: side info holds NaN or Inf")
                codes = unpack_bits(val_b, cfg.value_bits, sub.kept)
                values = dequantise(codes, torch.zeros_like(codes), side)
            else:
                values = val_b.clone().view(torch.bfloat16 if cfg.value_bits == 16 else torch.float32).to(torch.float32)
                if not bool(torch.isfinite(values).all()):
                    raise PayloadError(f"segment {sub.segment.name}: raw values hold NaN or Inf")
            idx_all.append(pos + (sub.segment.offset - rng.start))
            val_all.append(values)
        return torch.cat(idx_all), torch.cat(val_all)

    # ------------------------------------------------------------------ the step of one bucket
    def aggregate(self, b: int, plan: BucketPlan, payload: torch.Tensor, comm: OuterComm,
                  out: torch.Tensor, counts: torch.Tensor, reduce: str, name: str,
                  residual: str = "owner") -> Tuple[int, int, torch.Tensor]:
        """Fill ``out`` (bucket-sized) with the update u of this bucket; returns (owned elements chosen
        by some worker, elements of u sent by the owners, their bucket positions)."""
        t_start = time.perf_counter()
        wire = 0.0
        ranges = self.ranges[b]
        unpacked: Dict[int, tuple] = {}
        pieces = {j: self.make_piece(b, plan, payload, j, unpacked) for j in range(self.world)}
        mine = ranges[self.rank]
        recv_sizes = {w: mine.piece_nbytes for w in range(self.world) if w != self.rank}
        t0 = time.perf_counter()
        got = comm.exchange_pieces({j: p for j, p in pieces.items() if j != self.rank}, recv_sizes)
        wire += time.perf_counter() - t0
        got[self.rank] = pieces[self.rank]
        chosen, q = 0, torch.zeros(0, dtype=torch.uint8, device=self.device)
        if mine.plan is not None:
            chosen, q = self._owner_encode(b, plan, got, out, counts, reduce, name, residual)
        width = max(r.aggregate_nbytes for r in ranges)
        padded = torch.zeros(width, dtype=torch.uint8, device=self.device)
        padded[:q.numel()] = q
        t0 = time.perf_counter()
        gathered = comm.all_gather_payloads(padded, equal_sizes=True)
        wire += time.perf_counter() - t0
        out.zero_()
        positions = []
        for r in ranges:
            if r.plan is None:
                continue
            try:
                dec = decode_bucket(gathered[r.owner][:r.aggregate_nbytes], r.plan, device=self.device)
            except PayloadError as exc:
                raise PayloadError(f"{name}: aggregate of owner {r.owner}: {exc}") from exc
            out[r.start + dec.indices] = dec.values
            positions.append(r.start + dec.indices)
        applied = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64, device=self.device)
        self.owner_seconds += time.perf_counter() - t_start - wire
        return chosen, int(applied.numel()), applied

    def _owner_encode(self, b: int, plan: BucketPlan, got: Dict[int, torch.Tensor], out: torch.Tensor,
                      counts: torch.Tensor, reduce: str, name: str, residual: str) -> Tuple[int, torch.Tensor]:
        """The owner's part: decode the W pieces of its range, mean A into ``out``, error feedback f and
        re-encoding; returns (elements chosen by some worker, the re-encoded aggregate q)."""
        mine = self.ranges[b][self.rank]
        assert mine.plan is not None
        n = mine.numel
        agg, cnt = out[:n], counts[:n]
        agg.zero_()
        cnt.zero_()
        for w in range(self.world):
            try:
                idx, val = self.decode_piece(b, plan, got[w], self.rank)
            except PayloadError as exc:
                raise PayloadError(f"{name}: piece of worker {w} for owner {self.rank}: {exc}") from exc
            agg.index_add_(0, idx, val)
            cnt.index_add_(0, idx, torch.ones_like(idx, dtype=cnt.dtype))
        chosen = int(torch.count_nonzero(cnt).item())
        if reduce == "contributors":
            agg.div_(cnt.clamp_min(1))
        elif self.world > 1:
            agg.div_(self.world)
        s0 = plan.start + mine.start
        f = self.error[s0:s0 + n]
        if residual == "owner":      # f ← f + A, encode f, f ← f − decode(sent)
            f.add_(agg)
            q = encode_bucket(f, mine.plan, f"{name} owner {self.rank}")
            sent = decode_bucket(q, mine.plan, device=self.device)
            f.index_put_((sent.indices,), f[sent.indices] - sent.values)
        else:                        # "workers": g = f + A is encoded; f keeps g − decode(sent) at the
            agg.add_(f)              # positions sent and its old value elsewhere (A there goes back
            q = encode_bucket(agg, mine.plan, f"{name} owner {self.rank}")  # to the workers' e)
            sent = decode_bucket(q, mine.plan, device=self.device)
            f.index_put_((sent.indices,), agg[sent.indices] - sent.values)
        return chosen, q
