"""payload_nbytes / analytic_bits_per_param agree with real payloads; entropy coding rate on random data."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sparseloco.compress import CodecConfig, analytic_bits_per_param, decode, encode, payload_nbytes

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def index_section_bytes(payload: torch.Tensor) -> int:
    return struct.unpack_from("<Q", bytes(payload[56:64].tolist()))[0]


@st.composite
def sized_case(draw):
    mode = draw(st.sampled_from(["flat", "tile"]))
    tile = draw(st.sampled_from([2, 3, 8]))
    chunk = tile * tile if mode == "tile" else draw(st.sampled_from([1, 5, 64, 100, 4096]))
    k = draw(st.integers(1, min(chunk, 70)))
    if mode == "tile":
        shape = tuple(draw(st.integers(1, 30)) for _ in range(draw(st.integers(1, 3))))
    else:
        shape = (draw(st.integers(1, 9000)),)
    cfg = CodecConfig(chunk=chunk, k=k, value_bits=draw(st.sampled_from([2, 4, 8, 16, 32])), chunk_mode=mode,
                      tile=tile, quant_group_chunks=draw(st.sampled_from([0, 1, 7])))  # fmt: skip
    pattern = draw(st.sampled_from(["randn", "clustered_start", "clustered_end", "spread", "zeros"]))
    return cfg, shape, pattern


def make_input(shape, pattern: str, seed: int = 0) -> torch.Tensor:
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    if pattern == "randn":
        x = torch.randn(n, generator=g)
    elif pattern == "clustered_start":
        x = torch.linspace(1.0, 0.0, n)
    elif pattern == "clustered_end":
        x = torch.linspace(0.0, 1.0, n)
    elif pattern == "spread":
        x = torch.zeros(n)
        x[:: 37] = 1.0
    else:
        x = torch.zeros(n)
    return x.reshape(shape)


@SETTINGS
@given(sized_case())
def test_packed_size_is_exact_and_formula_matches(case):
    cfg, shape, pattern = case
    x = make_input(shape, pattern)
    payload = encode(x, cfg)
    n = x.numel()
    assert payload.numel() == payload_nbytes(n, cfg, shape)
    padding_bits = 8 * payload.numel() - analytic_bits_per_param(cfg, n, shape) * n
    assert -1e-6 <= padding_bits < 16 + 1e-6  # value and index sections each pad < 8 bits


@SETTINGS
@given(sized_case())
def test_entropy_size_never_exceeds_bound(case):
    cfg, shape, pattern = case
    cfg = CodecConfig(**{**cfg.__dict__, "index_coding": "entropy"})
    x = make_input(shape, pattern)
    payload = encode(x, cfg)
    assert payload.numel() <= payload_nbytes(x.numel(), cfg, shape)
    decode(payload)  # and it parses


def test_headline_packed_numbers():
    cfg = CodecConfig()  # k=64, C=4096, 2-bit, packed
    n = 2**24
    size = payload_nbytes(n, cfg)
    kept = n // 4096 * 64
    assert size == 64 + 4 * 5 + kept * 2 // 8 + kept * 12 // 8
    assert 146.25 < 32 * n / (8 * size) < 32 * 4096 / (14 * 64)  # 146.29 without header/side info


@pytest.mark.parametrize("k, floor", [(32, 8.32), (64, 7.36), (128, 6.38)])
def test_entropy_rate_on_random_data(k, floor):
    """Measured bits/index against log2 binom(4096, k)/k; the brief targets <= 8 at k=64."""
    torch.manual_seed(k)
    n = 2**20
    cfg = CodecConfig(k=k, index_coding="entropy")
    payload = encode(torch.randn(n), cfg)
    kept = n // 4096 * k
    bits_per_index = 8 * index_section_bytes(payload) / kept
    exact_floor = (math.lgamma(4097) - math.lgamma(k + 1) - math.lgamma(4097 - k)) / math.log(2) / k
    assert exact_floor == pytest.approx(floor, abs=0.01)
    assert exact_floor < bits_per_index < exact_floor + 0.45
    if k == 64:
        assert bits_per_index <= 8.0
    real_bits = 8 * payload.numel()
    assert analytic_bits_per_param(cfg, n) * n < real_bits < 1.06 * analytic_bits_per_param(cfg, n) * n


def test_entropy_beats_packed_only_in_size_not_content():
    x = torch.randn(50000)
    a = decode(encode(x, CodecConfig()))
    b = decode(encode(x, CodecConfig(index_coding="entropy")))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


def test_dense_chunks_cost_at_most_a_bitmap():
    # k = C/2 → the entropy coder falls back to Rice r=0 (a truncated bitmap): <= C bits per chunk
    cfg = CodecConfig(k=2048, index_coding="entropy")
    payload = encode(torch.randn(4096 * 8), cfg)
    assert 8 * index_section_bytes(payload) <= 8 * 4096 + 8 * (8 + 4 + 2)


def test_analytic_rejects_empty():
    with pytest.raises(ValueError, match="numel"):
        analytic_bits_per_param(CodecConfig(), 0)
