"""Error feedback around the codec: send what the codec keeps, remember exactly what it dropped.

    s      = beta * e + delta          (in place in ``e``: ``e *= beta`` then ``e += delta``, fp32)
    P      = encode(s)
    e_new  = s - decode_dense(P)       (only sent positions change: ``e[idx] = s[idx] - value``)

So ``e_new == s - decode_dense(P)`` holds bit for bit, and positions that were not sent keep ``s``.
The subtracted values are those *decoded from the payload*, i.e. what every receiver sees.
"""

from __future__ import annotations

import torch

from megatron_sparseloco.compress.codec import Decoded, decode, encode
from megatron_sparseloco.compress.config import CodecConfig


def error_feedback_step(
    error: torch.Tensor, delta: torch.Tensor, beta: float, cfg: CodecConfig, name: str = "tensor"
) -> tuple[torch.Tensor, Decoded]:
    """One EF step on ``error`` (fp32, contiguous, modified in place); returns ``(payload, decoded)``.

    ``error`` may be flat or any shape with ``delta.numel()`` elements; the tensor is encoded with
    ``delta``'s shape (which tile mode reads), so pass the parameter-shaped ``delta``.
    """
    if not isinstance(error, torch.Tensor) or error.dtype != torch.float32 or not error.is_contiguous():
        raise ValueError(f"error_feedback_step({name!r}): error must be a contiguous float32 tensor (it is updated in place)")
    if error.numel() != delta.numel():
        raise ValueError(
            f"error_feedback_step({name!r}): error has {error.numel()} elements, delta has {delta.numel()}; they must match"
        )
    if error.device != delta.device:
        raise ValueError(f"error_feedback_step({name!r}): error is on {error.device}, delta on {delta.device}")
    flat = error.view(-1)
    flat.mul_(beta)
    flat.add_(delta.reshape(-1))
    payload = encode(error.view(delta.shape), cfg, name=name)
    decoded = decode(payload)
    flat[decoded.indices] = flat[decoded.indices] - decoded.values
    return payload, decoded
