"""Fixed-width bit packing is a bijection with the documented little-endian layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sparseloco.compress.bitpack import bits_to_bytes, bytes_to_bits, pack_bits, packed_nbytes, unpack_bits


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 40).flatmap(lambda w: st.tuples(st.just(w), st.lists(st.integers(0, 2**w - 1), max_size=200))))
def test_pack_unpack_round_trip(case):
    width, values = case
    v = torch.tensor(values, dtype=torch.int64)
    packed = pack_bits(v, width)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(len(values), width)
    assert torch.equal(unpack_bits(packed, width, len(values)), v)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 12]).flatmap(lambda w: st.tuples(st.just(w), st.binary(min_size=0, max_size=60))))
def test_unpack_pack_round_trip_on_whole_bytes(case):
    """Every byte string whose length is a whole number of values is the image of exactly one value list."""
    width, raw = case
    count = len(raw) * 8 // width
    raw = raw[: packed_nbytes(count, width)]
    data = torch.tensor(list(raw), dtype=torch.uint8)
    if count * width % 8:  # only zero pad bits are produced by pack_bits
        data[-1] &= (1 << (count * width % 8)) - 1
    assert torch.equal(pack_bits(unpack_bits(data, width, count), width), data)


def test_twelve_bit_layout_two_indices_in_three_bytes():
    # 0xABC in bits 0..11, 0x123 in bits 12..23 → 0x123ABC little-endian
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


def test_two_bit_codes_four_per_byte_low_bits_first():
    assert pack_bits(torch.tensor([1, 2, 3, 0, 3]), 2).tolist() == [0b00111001, 0b00000011]


def test_bits_bytes_round_trip():
    bits = torch.randint(0, 2, (77,), dtype=torch.uint8)
    assert torch.equal(bytes_to_bits(bits_to_bytes(bits), 77), bits)
    assert bits_to_bytes(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1])).tolist() == [0x81, 0x01]


def test_unpack_refuses_short_input():
    with pytest.raises(ValueError, match="needs 3 bytes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 12, 2)


def _reference_pack(values: torch.Tensor, width: int) -> bytes:
    """The documented layout, one bit at a time: value i's bit b is stream bit i·width + b."""
    out = bytearray((values.numel() * width + 7) // 8)
    for i, v in enumerate(values.tolist()):
        for b in range(width):
            if (v >> b) & 1:
                j = i * width + b
                out[j // 8] |= 1 << (j % 8)
    return bytes(out)


@pytest.mark.parametrize("width", [3, 5, 7, 9, 12, 13, 16, 23, 31, 32, 40, 48, 55, 56, 57, 63])
def test_byte_windows_and_bit_matrix_give_the_documented_bytes(width):
    """Widths outside 1/2/4/8 use byte windows up to 56 bits and the bit matrix above: both must write
    exactly the bit-by-bit layout, for counts that end mid-byte, and read it back."""
    g = torch.Generator().manual_seed(width)
    for count in (1, 2, 7, 8, 9, 33):
        v = torch.randint(0, 2 ** min(width, 62), (count,), generator=g, dtype=torch.int64)
        if width == 63:
            v[0] = 2 ** 63 - 1  # the widest value: every bit set
        packed = pack_bits(v, width)
        assert bytes(packed.tolist()) == _reference_pack(v, width), (width, count)
        assert torch.equal(unpack_bits(packed, width, count), v)


def test_pack_drops_bits_above_the_width():
    v = torch.tensor([0xFABC, 0x1123], dtype=torch.int64)  # 16-bit values packed at 12 bits
    assert pack_bits(v, 12).tolist() == [0xBC, 0x3A, 0x12]
