"""Malformed payloads raise PayloadError with a useful message; decode never reads out of bounds."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sparseloco.compress import CodecConfig, PayloadError, decode, encode
from megatron_sparseloco.compress.bitpack import pack_bits

SMALL_CONFIGS = [
    CodecConfig(chunk=16, k=3),
    CodecConfig(chunk=16, k=3, index_coding="entropy", quant_group_chunks=1),
    CodecConfig(chunk=9, k=2, chunk_mode="tile", tile=3, value_bits=16),
    CodecConfig(chunk=8, k=8, value_bits=4),  # dense
]


def small_payload(cfg: CodecConfig) -> torch.Tensor:
    torch.manual_seed(0)
    shape = (5, 7) if cfg.chunk_mode == "tile" else (40,)
    return encode(torch.randn(shape), cfg)


def with_bytes(payload: torch.Tensor, offset: int, raw: bytes) -> torch.Tensor:
    out = payload.clone()
    out[offset : offset + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return out


@pytest.mark.parametrize("cfg", SMALL_CONFIGS)
def test_every_truncation_and_extension_is_refused(cfg):
    payload = small_payload(cfg)
    decode(payload)
    for n in range(payload.numel()):
        with pytest.raises(PayloadError):
            decode(payload[:n])
    with pytest.raises(PayloadError, match="trailing"):
        decode(torch.cat([payload, torch.zeros(1, dtype=torch.uint8)]))


@pytest.mark.parametrize(
    "offset, raw, message",
    [
        (0, b"XXXX", "magic"),
        (4, bytes([2]), "version 2"),
        (5, bytes([3]), "value_bits"),
        (6, bytes([9]), "index coding"),
        (7, bytes([9]), "geometry"),
        (8, bytes([9]), "dtype"),
        (9, bytes([2]), "reserved"),
        (9, bytes([1]), "dense flag"),
        (16, struct.pack("<I", 17), "CodecConfig.k"),
        (32, struct.pack("<Q", 60), "bytes"),  # 4 chunks instead of 3
        (40, struct.pack("<Q", 3), "rows/cols"),
    ],
)
def test_header_defects(offset, raw, message):
    with pytest.raises(PayloadError, match=message):
        decode(with_bytes(small_payload(SMALL_CONFIGS[0]), offset, raw))


def test_tile_header_shape_must_match_numel():
    payload = small_payload(SMALL_CONFIGS[2])
    with pytest.raises(PayloadError, match="rows\\*cols"):
        decode(with_bytes(payload, 40, struct.pack("<Q", 6)))


def packed_index_payload(locals_: list[int]) -> torch.Tensor:
    """A C=100 (7-bit indices), k=3, numel=200 payload whose index section holds ``locals_``."""
    cfg = CodecConfig(chunk=100, k=3, value_bits=32)
    payload = encode(torch.randn(200), cfg)
    section = pack_bits(torch.tensor(locals_), 7)
    return torch.cat([payload[: payload.numel() - section.numel()], section])


def test_packed_indices_are_checked():
    decode(packed_index_payload([1, 5, 99, 0, 50, 99]))  # valid
    with pytest.raises(PayloadError, match="out of range"):
        decode(packed_index_payload([1, 5, 120, 0, 50, 99]))
    with pytest.raises(PayloadError, match="duplicate index 5"):
        decode(packed_index_payload([1, 5, 5, 0, 50, 99]))
    with pytest.raises(PayloadError, match="unsorted"):
        decode(packed_index_payload([1, 9, 5, 0, 50, 99]))


def test_entropy_section_defects():
    cfg = SMALL_CONFIGS[1]
    payload = small_payload(cfg)
    index_bytes = struct.unpack_from("<Q", bytes(payload[56:64].tolist()))[0]
    start = payload.numel() - index_bytes
    n_unary = struct.unpack_from("<Q", bytes(payload[start : start + 8].tolist()))[0]
    with pytest.raises(PayloadError, match="fields need"):
        decode(with_bytes(payload, start, struct.pack("<Q", n_unary + 9)))
    with pytest.raises(PayloadError, match="Rice parameter 15"):
        decode(with_bytes(payload, start + 8, bytes([0xFF])))
    # flipping the unary stream's first bit changes the number of codewords or moves indices out of range
    corrupted = payload.clone()
    corrupted[start + 8 + 2] ^= 1  # 3 chunks → 2 parameter bytes, then the unary stream
    with pytest.raises(PayloadError):
        decode(corrupted)


def test_non_finite_side_info_and_raw_values():
    payload = small_payload(SMALL_CONFIGS[0])
    with pytest.raises(PayloadError, match="side info"):
        decode(with_bytes(payload, 64, struct.pack("<f", float("nan"))))
    raw = encode(torch.randn(40), CodecConfig(chunk=16, k=3, value_bits=32))
    with pytest.raises(PayloadError, match="raw values"):
        decode(with_bytes(raw, 64, struct.pack("<f", float("inf"))))


@pytest.mark.parametrize("bad", [torch.zeros(80, dtype=torch.int8), torch.zeros(2, 40, dtype=torch.uint8), b"SLCO"])
def test_wrong_container(bad):
    with pytest.raises(PayloadError, match="1-D torch.uint8"):
        decode(bad)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=st.sampled_from(SMALL_CONFIGS),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_random_corruption_never_escapes_payload_error(cfg, flips):
    """Any corruption either raises PayloadError or decodes to valid, unique, in-range, finite data."""
    payload = small_payload(cfg).clone()
    for at, xor in flips:
        payload[at % payload.numel()] ^= xor
    try:
        dec = decode(payload)
    except PayloadError:
        return
    assert dec.indices.numel() == dec.values.numel()
    assert torch.unique(dec.indices).numel() == dec.indices.numel()
    assert bool(((dec.indices >= 0) & (dec.indices < dec.numel)).all())
    assert bool(torch.isfinite(dec.values).all())
