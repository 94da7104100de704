"""decode(encode(x)) against an independent, loop-based reference of selection and quantisation."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sparseloco.compress import CodecConfig, NonFiniteInputError, decode, decode_dense, encode

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- reference (plain python loops)
def ref_round_half_up(fr: Fraction) -> int:
    return math.floor(fr + Fraction(1, 2))


def ref_chunks(shape: tuple[int, ...], cfg: CodecConfig) -> tuple[list[list[int]], int, int]:
    """Chunks as lists of flat positions in compact local order, plus (space, k_full)."""
    numel = math.prod(shape)
    if cfg.chunk_mode == "tile" and len(shape) >= 2:
        rows, cols, t = math.prod(shape[:-1]), shape[-1], cfg.tile
        chunks = []
        for tr in range(0, rows, t):
            for tc in range(0, cols, t):
                chunks.append([r * cols + c for r in range(tr, min(tr + t, rows)) for c in range(tc, min(tc + t, cols))])
        return chunks, t * t, cfg.k
    if cfg.chunk_mode == "tile":
        space, k_full = cfg.tile, max(1, ref_round_half_up(Fraction(cfg.tile * cfg.k, cfg.chunk)))
    else:
        space, k_full = cfg.chunk, cfg.k
    return [list(range(s, min(s + space, numel))) for s in range(0, numel, space)], space, k_full


def ref_select(x: list[float], shape, cfg: CodecConfig) -> list[tuple[int, int]]:
    """[(chunk id, flat position)] of the kept elements, chunk-major, ascending local order."""
    chunks, space, k_full = ref_chunks(shape, cfg)
    out = []
    for cid, chunk in enumerate(chunks):
        n = len(chunk)
        k_c = min(n, max(1, ref_round_half_up(Fraction(k_full * n, space))))
        ranked = sorted(range(n), key=lambda li: (-abs(x[chunk[li]]), li))
        for li in sorted(ranked[:k_c]):
            out.append((cid, chunk[li]))
    return out


def ref_quantise(values: list[float], bits: int) -> tuple[list[float], bool]:
    """Dequantised values (fp32) and whether some code sits within 1e-9 of a rounding boundary."""
    B, n = 2**bits, len(values)
    shift = float(np.float32(math.fsum(values) / n))
    c = [v - shift for v in values]
    sigma = math.sqrt(math.fsum(ci * ci for ci in c) / max(n - 1, 1))
    scale = 6.0 * sigma / B
    codes, fragile = [], False
    for ci in c:
        pos = ci / scale + B / 2 if scale > 0 else B / 2
        fragile |= abs(pos - math.floor(pos) - 0.5) < 1e-9
        codes.append(min(B - 1, max(0, round(pos))))
    lookup = []
    for b in range(B):
        members = [ci for ci, q in zip(c, codes) if q == b]
        lookup.append(np.float32(math.fsum(members) / len(members)) if members else np.float32(0.0))
    return [float(lookup[q] + np.float32(shift)) for q in codes], fragile


def ref_encode_decode(x: torch.Tensor, cfg: CodecConfig) -> tuple[list[int], list[float | None]]:
    """Reference (positions, values); a value is None where the reference quantiser is fragile."""
    xs = x.float().reshape(-1).tolist()
    sel = ref_select(xs, tuple(x.shape), cfg)
    positions = [p for _, p in sel]
    raw = [xs[p] for p in positions]
    if cfg.value_bits == 32:
        return positions, raw
    if cfg.value_bits == 16:
        return positions, torch.tensor(raw, dtype=torch.float32).bfloat16().float().tolist()
    groups: dict[int, list[int]] = {}
    for i, (cid, _) in enumerate(sel):
        g = 0 if cfg.quant_group_chunks == 0 else cid // cfg.quant_group_chunks
        groups.setdefault(g, []).append(i)
    values: list[float | None] = [None] * len(sel)
    for members in groups.values():
        deq, fragile = ref_quantise([raw[i] for i in members], cfg.value_bits)
        if not fragile:
            for i, v in zip(members, deq):
                values[i] = v
    return positions, values


def assert_matches_reference(x: torch.Tensor, cfg: CodecConfig) -> None:
    payload = encode(x, cfg)
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.device == x.device
    dec = decode(payload)
    positions, values = ref_encode_decode(x.cpu(), cfg)
    assert dec.numel == x.numel()
    assert dec.config == cfg
    assert dec.indices.dtype == torch.int64 and dec.values.dtype == torch.float32
    assert dec.indices.tolist() == positions
    got = dec.values.tolist()
    checked = [(g, v) for g, v in zip(got, values) if v is not None]
    assert [g for g, _ in checked] == [v for _, v in checked]
    dense = decode_dense(payload)
    expect = torch.zeros(x.numel())
    expect[dec.indices] = dec.values
    assert torch.equal(dense, expect)


# ---------------------------------------------------------------------------- strategies
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-2.0**100, max_value=2.0**100)
tie_heavy = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-3])
element = st.one_of(finite32, tie_heavy)


@st.composite
def flat_case(draw):
    chunk = draw(st.sampled_from([1, 2, 3, 7, 16, 64]))
    k = draw(st.integers(1, chunk))
    numel = draw(st.integers(1, 3 * chunk + 5))
    bits = draw(st.sampled_from([2, 4, 8, 16, 32]))
    coding = draw(st.sampled_from(["packed", "entropy"]))
    groups = draw(st.sampled_from([0, 1, 2]))
    xs = draw(st.lists(element, min_size=numel, max_size=numel))
    cfg = CodecConfig(chunk=chunk, k=k, value_bits=bits, index_coding=coding, quant_group_chunks=groups)
    return torch.tensor(xs, dtype=torch.float32), cfg


@st.composite
def tile_case(draw):
    tile = draw(st.sampled_from([1, 2, 3, 4, 8]))
    chunk = tile * tile
    k = draw(st.integers(1, chunk))
    ndim = draw(st.sampled_from([1, 2, 3]))
    shape = tuple(draw(st.integers(1, 2 * tile + 3)) for _ in range(ndim))
    bits = draw(st.sampled_from([2, 4, 16]))
    coding = draw(st.sampled_from(["packed", "entropy"]))
    groups = draw(st.sampled_from([0, 1, 3]))
    n = math.prod(shape)
    xs = draw(st.lists(element, min_size=n, max_size=n))
    cfg = CodecConfig(chunk=chunk, k=k, value_bits=bits, index_coding=coding, chunk_mode="tile", tile=tile,
                      quant_group_chunks=groups)  # fmt: skip
    return torch.tensor(xs, dtype=torch.float32).reshape(shape), cfg


@SETTINGS
@given(flat_case())
def test_flat_matches_reference(case):
    assert_matches_reference(*case)


@SETTINGS
@given(tile_case())
def test_tile_matches_reference(case):
    assert_matches_reference(*case)


# ---------------------------------------------------------------------------- examples and edges
@pytest.mark.parametrize("coding", ["packed", "entropy"])
@pytest.mark.parametrize("numel", [1, 5, 4095, 4096, 4097, 3 * 4096 + 100])
def test_default_config_ragged_sizes(numel, coding):
    torch.manual_seed(numel)
    assert_matches_reference(torch.randn(numel), CodecConfig(index_coding=coding))


@pytest.mark.parametrize("shape", [(100, 130), (64, 64), (65, 1), (1, 200), (3, 5, 70), (4100,)])
def test_default_tile_mode_on_odd_shapes(shape):
    torch.manual_seed(0)
    assert_matches_reference(torch.randn(shape), CodecConfig(chunk_mode="tile"))


def test_tie_break_prefers_lower_position():
    cfg = CodecConfig(chunk=4, k=2, value_bits=32)
    dec = decode(encode(torch.tensor([3.0, -3.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0]), cfg))
    assert dec.indices.tolist() == [0, 1, 4, 5]
    assert dec.values.tolist() == [3.0, -3.0, 0.0, 0.0]


def test_ragged_tail_keeps_rounded_share():
    # tail of 100 elements with k=64, C=4096: round(64*100/4096) = round(1.5625) = 2
    cfg = CodecConfig(value_bits=32)
    x = torch.arange(1, 4096 + 100 + 1, dtype=torch.float32)
    dec = decode(encode(x, cfg))
    assert dec.indices.tolist() == list(range(4096 - 64, 4096)) + [4096 + 98, 4096 + 99]


def test_zeros_and_constant_do_not_produce_nan():
    for value in (0.0, 1.25):
        x = torch.full((5000,), value)
        dec = decode(encode(x, CodecConfig()))
        assert torch.isfinite(dec.values).all()
        assert torch.equal(dec.values, torch.full_like(dec.values, value))
        assert dec.indices.tolist() == list(range(64)) + list(range(4096, 4096 + 14))  # tail 904: round(64*904/4096) = 14


def test_dense_sends_everything_without_index_bytes():
    x = torch.randn(10, 7)
    for cfg in (CodecConfig(chunk=16, k=16, value_bits=32), CodecConfig(chunk=16, k=16, value_bits=32, chunk_mode="tile", tile=4)):
        payload = encode(x, cfg)
        assert payload.numel() == 64 + 70 * 4  # header + fp32 values, no index section
        assert torch.equal(decode_dense(payload), x.reshape(-1))


def test_dense_quantised_two_values_are_exact():
    # two distinct values per bin layout: each lands in its own bin, so the bin means are exact
    x = torch.tensor([1.0, -1.0] * 8)
    dec = decode(encode(x, CodecConfig(chunk=16, k=16)))
    assert torch.equal(dec.values, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input(dtype):
    torch.manual_seed(1)
    x = torch.randn(9000).to(dtype)
    assert_matches_reference(x, CodecConfig())
    assert_matches_reference(x, CodecConfig(value_bits=32, index_coding="entropy"))


def test_empty_tensor_round_trips():
    payload = encode(torch.zeros(0), CodecConfig())
    dec = decode(payload)
    assert dec.numel == 0 and dec.indices.numel() == 0 and decode_dense(payload).numel() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("cfg", [CodecConfig(), CodecConfig(chunk=8, k=8), CodecConfig(chunk_mode="tile")])
def test_non_finite_input_names_the_tensor(bad, cfg):
    x = torch.randn(70, 90)
    x[33, 71] = bad  # a position that would otherwise not be among the top values
    x[0, 0] = 100.0
    with pytest.raises(NonFiniteInputError, match="decoder.layers.3.mlp"):
        encode(x, cfg, name="decoder.layers.3.mlp")
    with pytest.raises(NonFiniteInputError, match="w"):
        encode(x.bfloat16(), cfg, name="w")


def test_rejects_non_float_input():
    with pytest.raises(TypeError, match="my_param"):
        encode(torch.ones(4, dtype=torch.int32), CodecConfig(), name="my_param")


def test_decode_to_other_device_and_dense_out():
    x = torch.randn(5000)
    payload = encode(x, CodecConfig())
    out = torch.full((5000,), 7.0)
    got = decode_dense(payload, out=out)
    dec = decode(payload, device="cpu")
    expect = torch.zeros(5000)
    expect[dec.indices] = dec.values
    assert got is out and torch.equal(out, expect)
    assert dec.indices.numel() == 64 + 14  # tail of 904 keeps round(64 * 904 / 4096) = 14
    with pytest.raises(ValueError, match="out must be"):
        decode_dense(payload, out=torch.zeros(4999))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", [CodecConfig(), CodecConfig(index_coding="entropy"), CodecConfig(chunk_mode="tile")])
def test_cuda_matches_cpu_bytes(cfg):
    torch.manual_seed(0)
    x = torch.randn(300, 200)
    x[5, :100] = 1.0  # ties
    on_cpu = encode(x, cfg)
    on_gpu = encode(x.cuda(), cfg)
    assert on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), on_cpu)
    dec = decode(on_gpu)
    assert dec.indices.is_cuda and torch.equal(dec.values.cpu(), decode(on_cpu).values)
    assert_matches_reference(x.cuda(), cfg)


def test_fast_and_exact_selection_paths_agree_with_reference():
    """Rows with and without ties across the k-th / (k+1)-th boundary, next to each other."""
    torch.manual_seed(3)
    x = torch.randn(40, 64)
    x[0:10, :12] = 5.0  # 12-way tie at the top, k = 8: tie crosses the boundary → exact path
    x[10:20, 5:13] = -5.0  # exactly 8 tied maxima: boundary unique → fast path
    x[20:30, :7] = 5.0  # 7 maxima, then a 3-way tie for the 8th slot → exact path
    x[20:30, 30:33] = -4.0
    x[30:40] = 0.0  # all zero → exact path, first 8 positions
    cfg = CodecConfig(chunk=64, k=8, value_bits=32)
    assert_matches_reference(x.reshape(-1), cfg)
    dec = decode(encode(x.reshape(-1), cfg))
    assert dec.indices.view(40, 8)[0].tolist() == list(range(8))
    assert dec.indices.view(40, 8)[25].tolist() == [25 * 64 + i for i in (0, 1, 2, 3, 4, 5, 6, 30)]


@pytest.mark.parametrize("cfg", [CodecConfig(), CodecConfig(value_bits=32, index_coding="entropy")])
def test_decode_payload_at_unaligned_offset_of_a_gather_buffer(cfg):
    """Payloads are sliced out of one gathered uint8 buffer; fp32 sections then sit at odd offsets."""
    x = torch.randn(9000)
    payload = encode(x, cfg)
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), payload, torch.zeros(5, dtype=torch.uint8)])
    sliced = decode(buffer[3 : 3 + payload.numel()])
    whole = decode(payload)
    assert torch.equal(sliced.indices, whole.indices) and torch.equal(sliced.values, whole.values)
