"""error_feedback_step: e_new == (beta * e_old + delta) - decode_dense(payload), bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sparseloco.compress import CodecConfig, decode, decode_dense, error_feedback_step

CONFIGS = [
    CodecConfig(),
    CodecConfig(index_coding="entropy", value_bits=4, quant_group_chunks=2),
    CodecConfig(chunk_mode="tile", value_bits=16),
    CodecConfig(chunk=16, k=16),  # dense
]


@settings(max_examples=30, deadline=None)
@given(
    cfg=st.sampled_from(CONFIGS),
    shape=st.sampled_from([(5000,), (70, 90), (3, 4100)]),
    beta=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    seed=st.integers(0, 2**16),
    delta_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_identity_holds_exactly(cfg, shape, beta, seed, delta_dtype):
    g = torch.Generator().manual_seed(seed)
    e_old = torch.randn(shape, generator=g)
    delta = torch.randn(shape, generator=g).to(delta_dtype)
    error = e_old.clone().reshape(-1)  # flat error buffer, parameter-shaped delta
    payload, decoded = error_feedback_step(error, delta, beta, cfg, name="w")
    s = (e_old.reshape(-1) * beta) + delta.reshape(-1)  # same two roundings as the in-place update
    sent = decode_dense(payload)
    assert torch.equal(error, s - sent)
    mask = torch.zeros(s.numel(), dtype=torch.bool)
    mask[decoded.indices] = True
    assert torch.equal(error[~mask], s[~mask])
    assert torch.equal(error[decoded.indices], s[decoded.indices] - decoded.values)  # wire order
    again = decode(payload)
    assert torch.equal(again.indices, decoded.indices) and torch.equal(again.values, decoded.values)


def test_residual_shrinks_what_was_sent():
    torch.manual_seed(0)
    error = torch.zeros(8192)
    delta = torch.randn(8192)
    _, decoded = error_feedback_step(error, delta, 0.95, CodecConfig(value_bits=32))
    # raw fp32 values: the sent coordinates are cleared exactly, the rest keep delta
    assert torch.all(error[decoded.indices] == 0)
    assert int((error != 0).sum()) == 8192 - 128


def test_repeated_steps_send_everything_eventually():
    """With beta = 1 and delta only at step 0, EF drains the tensor: sum of sent == initial, residual -> 0."""
    x = torch.randn(256)
    error = torch.zeros(256)
    cfg = CodecConfig(chunk=64, k=8, value_bits=32)
    total = torch.zeros(256)
    for step in range(8):
        _, dec = error_feedback_step(error, x if step == 0 else torch.zeros(256), 1.0, cfg)
        total[dec.indices] += dec.values
    assert torch.equal(error, torch.zeros(256))
    assert torch.equal(total, x)


def test_bad_error_buffers_are_refused():
    delta = torch.randn(10)
    with pytest.raises(ValueError, match="float32"):
        error_feedback_step(torch.zeros(10, dtype=torch.bfloat16), delta, 0.9, CodecConfig(), name="p")
    with pytest.raises(ValueError, match="elements"):
        error_feedback_step(torch.zeros(11), delta, 0.9, CodecConfig(), name="p")
    with pytest.raises(ValueError, match="contiguous"):
        error_feedback_step(torch.zeros(10, 2)[:, 0], delta, 0.9, CodecConfig(), name="p")
