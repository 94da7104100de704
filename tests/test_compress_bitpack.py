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
