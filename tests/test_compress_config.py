"""CodecConfig.validate names the bad field."""

from __future__ import annotations

import pytest

from megatron_sparseloco.compress import CodecConfig, CodecConfigError, encode, payload_nbytes
import torch


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(k=0), "k"),
        (dict(k=4097), "k"),
        (dict(chunk=0, k=1), "chunk"),
        (dict(chunk=2**31 + 1), "chunk"),
        (dict(value_bits=3), "value_bits"),
        (dict(value_bits=1), "value_bits"),
        (dict(index_coding="huffman"), "index_coding"),
        (dict(chunk_mode="rows"), "chunk_mode"),
        (dict(chunk_mode="tile", tile=32), "chunk"),
        (dict(tile=0), "tile"),
        (dict(quant_group_chunks=-1), "quant_group_chunks"),
        (dict(k=64.0), "k"),
        (dict(value_bits=True), "value_bits"),
    ],
)
def test_validate_names_the_field(kwargs, field):
    cfg = CodecConfig(**kwargs)
    with pytest.raises(CodecConfigError, match=rf"CodecConfig\.{field}\b"):
        cfg.validate()
    with pytest.raises(CodecConfigError):
        encode(torch.ones(8), cfg)
    with pytest.raises(CodecConfigError):
        payload_nbytes(8, cfg)


def test_valid_configs_pass_and_return_self():
    for cfg in (CodecConfig(), CodecConfig(chunk=1, k=1), CodecConfig(chunk_mode="tile", tile=8, chunk=64, k=64),
                CodecConfig(value_bits=32, index_coding="entropy", quant_group_chunks=4)):  # fmt: skip
        assert cfg.validate() is cfg
    assert CodecConfig(k=4096).is_dense and not CodecConfig().is_dense
    assert issubclass(CodecConfigError, ValueError)
