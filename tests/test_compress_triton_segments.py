"""The per-tensor bucket payload's fast path (compress/fast_segments.py) in Triton interpreter mode:
same bytes, same error feedback and the same aggregate as the torch codec, segment by segment."""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.compress import CodecConfig
from megatron_sparseloco.compress import fast_path as fp
from megatron_sparseloco.compress import fast_segments as fs
from megatron_sparseloco.compress.error_feedback import error_feedback_step_bucket
from megatron_sparseloco.compress.segments import TensorSlice, decode_bucket, encode_bucket, plan_buckets

pytestmark = pytest.mark.skipif(not fp._triton_interpreted(), reason="triton imported in compiled mode")

# chunk 64 → 8x8 tiles: an aligned weight (kernels), a weight with edge tiles and a mid-row slice
# (flat chunks: kernels), a 1-D tensor (dense: torch)
SLICES = [TensorSlice((16, 16), 0, 256), TensorSlice((10, 9), 0, 90), TensorSlice((7,), 0, 7),
          TensorSlice((12, 20), 30, 230)]
NAMES = ["aligned", "edges", "norm", "midrow"]


@pytest.fixture
def interp(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(fp.INTERPRETER_SWITCH, "1")


def _plan(**kw):
    (plan,) = plan_buckets(SLICES, CodecConfig(chunk=64, k=4, **kw), 1 << 20, True, NAMES)
    return plan


@pytest.mark.parametrize("bits", [2, 4])
def test_bucket_error_feedback_matches_torch(interp, bits):
    plan = _plan(value_bits=bits)
    assert [s.geometry for s in plan.segments] == ["tile2d", "tile2d", "dense", "flat"]
    g = torch.Generator().manual_seed(5)
    err, delta = torch.randn(plan.numel, generator=g), torch.randn(plan.numel, generator=g)
    e_fast, e_ref = err.clone(), err.clone()
    p_fast, d_fast = fs.error_feedback_step_bucket_fast(e_fast, delta, 0.95, plan)
    assert fs.last_dispatch["tile2d"].startswith("tile2d segment 10x9")  # the edge-tile weight: torch
    p_ref, d_ref = error_feedback_step_bucket(e_ref, delta, 0.95, plan)
    assert torch.equal(p_fast, p_ref)
    assert torch.equal(e_fast, e_ref)
    assert torch.equal(d_fast.indices, d_ref.indices) and torch.equal(d_fast.values, d_ref.values)


def test_kernels_ran_for_aligned_and_flat_segments(interp):
    plan = _plan()
    seg = {s.name: s for s in plan.segments}
    assert fs.segment_unsupported_reason(seg["aligned"], plan.codec, torch.device("cpu")) is None
    assert fs.segment_unsupported_reason(seg["midrow"], plan.codec, torch.device("cpu")) is None
    assert "edge tiles" in fs.segment_unsupported_reason(seg["edges"], plan.codec, torch.device("cpu"))
    assert "dense" in fs.segment_unsupported_reason(seg["norm"], plan.codec, torch.device("cpu"))


@pytest.mark.parametrize("skip", [None, 1])
def test_bucket_scatter_add_matches_torch(interp, skip):
    plan = _plan()
    g = torch.Generator().manual_seed(9)
    payloads = [encode_bucket(torch.randn(plan.numel, generator=g) * (w + 1), plan) for w in range(3)]
    decoded = [decode_bucket(p, plan) for p in payloads]
    out, counts = torch.zeros(plan.numel), torch.zeros(plan.numel, dtype=torch.uint8)
    fs.decode_scatter_add_bucket_fast(payloads, plan, out, counts, skip=skip,
                                      skip_decoded=None if skip is None else decoded[skip])
    assert fs.last_dispatch["decode_scatter_add"] == "mixed"
    want, want_c = torch.zeros(plan.numel), torch.zeros(plan.numel, dtype=torch.uint8)
    for d in decoded:
        want.index_add_(0, d.indices, d.values)
        want_c.index_add_(0, d.indices, torch.ones_like(d.indices, dtype=torch.uint8))
    assert torch.equal(out, want) and torch.equal(counts, want_c)


def test_bucket_scatter_add_rejects_a_bad_payload_before_writing(interp):
    plan = _plan()
    g = torch.Generator().manual_seed(2)
    payloads = [encode_bucket(torch.randn(plan.numel, generator=g), plan) for _ in range(2)]
    payloads[1] = payloads[1][:-3]
    out = torch.zeros(plan.numel)
    with pytest.raises(ValueError, match="payload 1"):
        fs.decode_scatter_add_bucket_fast(payloads, plan, out)
    assert torch.count_nonzero(out) == 0


def test_switch_turns_the_kernels_off(interp, monkeypatch):
    monkeypatch.setenv(fp.TRITON_SWITCH, "0")
    plan = _plan()
    seg = plan.segments[0]
    assert fs.segment_unsupported_reason(seg, plan.codec, torch.device("cpu")) == f"{fp.TRITON_SWITCH}=0"
