"""encode / decode: chunked Top-k, quantised values, bit-packed or entropy-coded indices, one uint8 tensor.

Payload = ``header (64 B) | side info | values | indices`` (see :mod:`.header` for the header table):

* side info: ``G x (1 + B)`` fp32 — per quantiser group ``[shift, lookup[0..B-1]]`` (absent for raw values);
* values:    ``K`` codes of ``value_bits`` bits, packed LSB-first (four 2-bit codes per byte), or ``K``
             raw bf16 / fp32 words;
* indices:   the ``K`` compact local indices, chunk-major and ascending inside a chunk — packed with
             ``W = ceil(log2 space)`` bits each, or entropy-coded (:mod:`.entropy_index`); empty when dense.

The side info comes first so fp32 words sit at 4-byte offsets.  Selection (:mod:`.layout`,
:mod:`.topk_select`): per chunk the ``k_c`` elements of largest ``|x|``, ties to the lower position, so every
device picks the same set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sparseloco.compress import entropy_index
from megatron_sparseloco.compress.bitpack import pack_bits, unpack_bits
from megatron_sparseloco.compress.checks import deferring, require
from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.errors import NonFiniteInputError, PayloadError
from megatron_sparseloco.compress.header import DTYPE_IDS, HEADER_BYTES, Header
from megatron_sparseloco.compress.layout import ChunkLayout
from megatron_sparseloco.compress.quantizer import dequantise, quantise, side_words
from megatron_sparseloco.compress.sizing import PayloadGeometry, packed_index_bits, quant_groups
from megatron_sparseloco.compress.topk_select import select_top_positions


@dataclass
class Decoded:
    """What a payload carries: values at positions of ``x.reshape(-1)``.

    numel:   elements of the encoded tensor.
    indices: int64, unique positions in ``x.reshape(-1)``, in wire order (chunk-major; ascending in flat mode).
    values:  float32 dequantised values at ``indices``.
    config:  the codec configuration read from the header.
    """

    numel: int
    indices: torch.Tensor
    values: torch.Tensor
    config: CodecConfig


@dataclass(frozen=True)
class _Selection:
    chunk_ids: torch.Tensor  # int64 [K]
    local: torch.Tensor  # compact local index [K]
    global_index: torch.Tensor  # position in x.reshape(-1) [K]


def _layout_for(x: torch.Tensor, cfg: CodecConfig) -> ChunkLayout:
    return ChunkLayout.for_tensor(x.numel(), cfg, tuple(x.shape))


def _select(
    x_flat: torch.Tensor, layout: ChunkLayout, n_valid: torch.Tensor, width: torch.Tensor, dense: bool
) -> _Selection:
    """Per-chunk Top-k by |x| (ties → lower position), sorted by (chunk, local index)."""
    dev = x_flat.device
    if dense:
        chunk_ids, local, global_index = layout.all_positions(dev)
        return _Selection(chunk_ids, local, global_index)
    n_chunks, space = layout.n_chunks, layout.space
    kept = layout.kept_counts(n_valid)
    padded_pos = select_top_positions(layout.magnitudes(x_flat), layout.k_full, kept)
    chunk_ids = torch.arange(n_chunks, device=dev)[:, None].expand(n_chunks, layout.k_full)
    if layout.total_kept < n_chunks * layout.k_full:  # some chunks keep fewer: drop their `space` slots
        keep = padded_pos < space
        padded_pos, chunk_ids = padded_pos[keep], chunk_ids[keep]
    else:
        padded_pos, chunk_ids = padded_pos.reshape(-1), chunk_ids.reshape(-1)
    local = layout.padded_to_compact(chunk_ids, padded_pos, width)
    return _Selection(chunk_ids, local, layout.compact_to_global(chunk_ids, local, width))


def _group_ids(chunk_ids: torch.Tensor, cfg: CodecConfig) -> torch.Tensor:
    if cfg.quant_group_chunks == 0:
        return torch.zeros_like(chunk_ids)
    return chunk_ids // cfg.quant_group_chunks


@dataclass(frozen=True)
class Body:
    """The three data sections of one encoded tensor (everything but the header)."""

    layout: ChunkLayout
    side: torch.Tensor  # uint8
    values: torch.Tensor  # uint8
    index: torch.Tensor  # uint8

    @property
    def nbytes(self) -> int:
        return self.side.numel() + self.values.numel() + self.index.numel()

    def parts(self) -> list[torch.Tensor]:
        return [self.side, self.values, self.index]


def _check_input(x, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPE_IDS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"encode({name!r}): expected a float32/bfloat16/float16 tensor, got {got}")


def encode_body(x: torch.Tensor, cfg: CodecConfig, name: str = "tensor", layout: ChunkLayout | None = None) -> Body:
    """Select, quantise and pack ``x`` under ``cfg`` (and ``layout``, default: from ``x``'s shape)."""
    layout = _layout_for(x, cfg) if layout is None else layout
    x_flat = x.reshape(-1)
    dev = x.device
    n_valid, width = layout.chunk_valid_and_width(dev)
    sel = _select(x_flat, layout, n_valid, width, cfg.is_dense)
    values = x_flat[sel.global_index].to(torch.float32)
    require(~torch.isfinite(values).all(),
            lambda: NonFiniteInputError(f"encode: tensor {name!r} holds NaN or Inf; refusing to send it"))

    if cfg.is_quantised:
        groups = quant_groups(cfg, layout.n_chunks)
        codes, side = quantise(values, _group_ids(sel.chunk_ids, cfg), groups, cfg.n_bins)
        side_bytes = side.reshape(-1).view(torch.uint8)
        value_bytes = pack_bits(codes, cfg.value_bits)
    else:
        side_bytes = torch.zeros(0, dtype=torch.uint8, device=dev)
        raw = values.to(torch.bfloat16) if cfg.value_bits == 16 else values
        value_bytes = raw.contiguous().view(torch.uint8)

    if cfg.is_dense:
        index_bytes = torch.zeros(0, dtype=torch.uint8, device=dev)
    elif cfg.index_coding == "packed":
        index_bytes = pack_bits(sel.local, packed_index_bits(layout))
    else:
        kept = layout.kept_counts(n_valid)
        index_bytes = entropy_index.encode_indices(sel.local, sel.chunk_ids, kept, layout.space)
    return Body(layout, side_bytes, value_bytes, index_bytes)


def encode(x: torch.Tensor, cfg: CodecConfig, name: str = "tensor") -> torch.Tensor:
    """Sparsify, quantise and serialise ``x`` (any shape; fp32, bf16 or fp16) → 1-D uint8 on ``x.device``.

    Raises :class:`NonFiniteInputError` naming ``name`` if ``x`` holds NaN/Inf (detected for free: a
    non-finite |x| sorts above every finite value, so each chunk that holds one selects it).
    """
    cfg.validate()
    _check_input(x, name)
    body = encode_body(x, cfg, name)
    layout = body.layout
    header = Header(
        cfg, layout.kind, x.dtype, cfg.is_dense, layout.numel, layout.rows, layout.cols, body.index.numel()
    ).pack()
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(x.device)
    return torch.cat([head, *body.parts()])


def _as_float32(section: torch.Tensor) -> torch.Tensor:
    """Reinterpret little-endian bytes as fp32 (copies: the slice may sit at an unaligned offset)."""
    return section.clone().view(torch.float32)


def _check_payload_type(payload) -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        if isinstance(payload, torch.Tensor):
            what = f"{payload.dtype} tensor of shape {tuple(payload.shape)}"
        else:
            what = type(payload).__name__
        raise PayloadError(f"decode: payload must be a 1-D torch.uint8 tensor, got {what}")


def geometry_of(head: Header) -> PayloadGeometry:
    """The payload geometry a header describes (its declared index length checked against the coding)."""
    cfg = head.config
    layout = (
        ChunkLayout.for_tile2d(head.rows, head.cols, cfg)
        if head.geometry == "tile2d"
        else ChunkLayout.for_tensor(head.numel, cfg, (head.numel,) if head.geometry == "tile1d" else None)
    )
    check_index_bytes(layout, cfg, head.index_bytes)
    return PayloadGeometry.of(layout, cfg, head.index_bytes)


def _check_length(payload: torch.Tensor, geo: PayloadGeometry) -> None:
    if payload.numel() != geo.nbytes:
        raise PayloadError(
            f"payload has {payload.numel()} bytes but its header describes {geo.nbytes} "
            f"(header {HEADER_BYTES} + side {geo.side_bytes} + values {geo.value_bytes} + indices {geo.index_bytes})"
            + ("; truncated?" if payload.numel() < geo.nbytes else "; trailing bytes?")
        )


def decode(payload: torch.Tensor, device: torch.device | str | None = None) -> Decoded:
    """Parse and validate a payload; never reads out of bounds; raises :class:`PayloadError` on any defect.

    Phases: the tensor's type, the header, the geometry it describes (:func:`geometry_of`), the
    length against it, then the body (:func:`decode_body`: indices, then values).
    """
    _check_payload_type(payload)
    if device is not None:
        payload = payload.to(device)
    head = Header.unpack(payload[:HEADER_BYTES].cpu().numpy().tobytes())
    geo = geometry_of(head)
    _check_length(payload, geo)
    global_index, values = decode_body(payload, HEADER_BYTES, geo.layout, geo.cfg, geo.index_bytes)
    return Decoded(head.numel, global_index, values, geo.cfg)


def body_nbytes(layout: ChunkLayout, cfg: CodecConfig, index_bytes: int) -> int:
    return PayloadGeometry.of(layout, cfg, index_bytes).body_nbytes


def check_index_bytes(layout: ChunkLayout, cfg: CodecConfig, index_bytes: int) -> None:
    """The declared index length must match what packed / dense coding implies."""
    if cfg.is_dense and index_bytes:
        raise PayloadError(f"dense payload declares a {index_bytes}-byte index section; expected 0")
    if not cfg.is_dense and cfg.index_coding == "packed":
        want = PayloadGeometry.of(layout, cfg).index_bytes
        if index_bytes != want:
            raise PayloadError(
                f"packed index section is declared as {index_bytes} bytes; {layout.total_kept} indices need {want}"
            )


def decode_body(
    payload: torch.Tensor, at: int, layout: ChunkLayout, cfg: CodecConfig, index_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in the tensor, fp32 values) of the body starting at byte ``at`` of ``payload``.

    The caller has checked that ``payload`` holds the whole body (:func:`body_nbytes`).
    """
    geo = PayloadGeometry.of(layout, cfg, index_bytes)
    values_at = at + geo.side_bytes
    index_at = values_at + geo.value_bytes
    n_valid, width = layout.chunk_valid_and_width(payload.device)
    chunk_ids, global_index = _decode_indices(payload[index_at : index_at + index_bytes], layout, cfg, n_valid, width)
    values = _decode_values(payload[at:values_at], payload[values_at:index_at], chunk_ids, layout.total_kept, cfg)
    return global_index, values


def _decode_indices(
    index_section: torch.Tensor, layout: ChunkLayout, cfg: CodecConfig, n_valid: torch.Tensor, width: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk of each kept value, its position in the tensor), validated: ascending, in range."""
    dev = index_section.device
    if cfg.is_dense:
        chunk_ids, _, global_index = layout.all_positions(dev)
        return chunk_ids, global_index
    kept = layout.kept_counts(n_valid)
    chunk_ids = torch.repeat_interleave(torch.arange(layout.n_chunks, device=dev), kept)
    if cfg.index_coding == "packed":
        local = unpack_bits(index_section, packed_index_bits(layout), layout.total_kept)
        _check_strictly_increasing(local, chunk_ids)
    else:
        local = entropy_index.decode_indices(index_section, chunk_ids, kept, layout.space)
    bad = local >= n_valid[chunk_ids]
    if not bad.numel():
        return chunk_ids, layout.compact_to_global(chunk_ids, local, width)
    # the error's evidence, taken on the device (no host read): a deferred check keeps it until the round's
    # end, so it must not hold the bucket's index tensors
    at = first_true(bad)
    chunk = chunk_ids.index_select(0, at)
    evidence = torch.cat([local.index_select(0, at), chunk, n_valid.index_select(0, chunk).to(local.dtype)])

    def out_of_range() -> PayloadError:
        index, in_chunk, holds = evidence.tolist()
        return PayloadError(f"payload index {index} in chunk {in_chunk} is out of range "
                            f"(that chunk holds {holds} elements)")

    require(bad, out_of_range)
    if deferring():   # checked later: keep every position inside its chunk meanwhile
        local = torch.where(bad, torch.zeros_like(local), local)
    return chunk_ids, layout.compact_to_global(chunk_ids, local, width)


def _decode_values(
    side_section: torch.Tensor, value_section: torch.Tensor, chunk_ids: torch.Tensor, n_kept: int, cfg: CodecConfig
) -> torch.Tensor:
    """fp32 values: dequantised codes (side info checked finite) or the raw bf16 / fp32 words."""
    if cfg.is_quantised:
        side = _as_float32(side_section).view(-1, side_words(cfg.n_bins))
        require(~torch.isfinite(side).all(),
                lambda: PayloadError("payload side info (quantiser shift / centroids) holds NaN or Inf"))
        codes = unpack_bits(value_section, cfg.value_bits, n_kept)
        return dequantise(codes, _group_ids(chunk_ids, cfg), side)
    raw = value_section.clone().view(torch.bfloat16 if cfg.value_bits == 16 else torch.float32)
    values = raw.to(torch.float32)
    require(~torch.isfinite(values).all(), lambda: PayloadError("payload raw values hold NaN or Inf"))
    return values


def _check_strictly_increasing(local: torch.Tensor, chunk_ids: torch.Tensor) -> None:
    """Packed indices must ascend strictly inside each chunk (this rules out duplicates)."""
    if local.numel() < 2:
        return
    same_chunk = chunk_ids[1:] == chunk_ids[:-1]
    bad = same_chunk & (local[1:] <= local[:-1])
    at = first_true(bad) + 1      # evidence on the device, as in ``_decode_indices``
    evidence = torch.cat([at, local.index_select(0, torch.cat([at - 1, at])), chunk_ids.index_select(0, at)])

    def not_ascending() -> PayloadError:
        position, before, index, chunk = evidence.tolist()
        kind = "duplicate" if index == before else "unsorted"
        return PayloadError(f"payload indices in chunk {chunk}: {kind} index {index} at position {position}")

    require(bad, not_ascending)


def first_true(flags: torch.Tensor) -> torch.Tensor:
    """The position of ``flags``' first True as a 1-element tensor on its device (0 when none), no host read."""
    return flags.to(torch.uint8).argmax().view(1)


def decode_dense(payload: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 1-D tensor of ``numel``: the decoded values at their positions, zeros elsewhere.

    ``out`` (optional): fp32 1-D tensor of ``numel`` elements to fill (it is zeroed first).
    """
    dec = decode(payload, device=out.device if out is not None else None)
    if out is None:
        out = torch.zeros(dec.numel, dtype=torch.float32, device=dec.values.device)
    else:
        if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != dec.numel:
            raise ValueError(
                f"decode_dense: out must be a 1-D float32 tensor of {dec.numel} elements, "
                f"got {out.dtype} of shape {tuple(out.shape)}"
            )
        out.zero_()
    out[dec.indices] = dec.values
    return out
