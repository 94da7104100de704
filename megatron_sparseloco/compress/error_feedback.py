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
from megatron_sparseloco.compress.segments import BucketPlan, decode_bucket, encode_bucket


def error_feedback_step(
    error: torch.Tensor, delta: torch.Tensor, beta: float, cfg: CodecConfig, name: str = "tensor"
) -> tuple[torch.Tensor, Decoded]:
    """One EF step on ``error`` (fp32, contiguous, modified in place); returns ``(payload, decoded)``.

    ``error`` may be flat or any shape with ``delta.numel()`` elements; the tensor is encoded with
    ``delta``'s shape (which tile mode reads), so pass the parameter-shaped ``delta``.
    """
    if not isinstance(error, torch.Tensor) or error.dtype != torch.float32 or not error.is_contiguous():
        raise ValueError(
            f"error_feedback_step({name!r}): error must be a contiguous float32 tensor (it is updated in place)")
    if error.numel() != delta.numel():
        raise ValueError(
            f"error_feedback_step({name!r}): error has {error.numel()} elements, delta has {delta.numel()}; "
            "they must match"
        )
    if error.device != delta.device:
        raise ValueError(f"error_feedback_step({name!r}): error is on {error.device}, delta on {delta.device}")
    flat = error.view(-1)
    flat.mul_(beta)
    flat.add_(delta.reshape(-1))
    payload = encode(error.view(delta.shape), cfg, name=name)
    return payload, _remove_sent(flat, decode(payload))


def error_feedback_step_bucket(
    error: torch.Tensor, delta: torch.Tensor, beta: float, plan: BucketPlan, name: str = "bucket"
) -> tuple[torch.Tensor, Decoded]:
    """The same EF step on a flat bucket encoded per tensor segment (:mod:`.segments`)."""
    if error.dtype != torch.float32 or error.dim() != 1 or not error.is_contiguous() or error.shape != delta.shape:
        raise ValueError(f"error_feedback_step_bucket({name!r}): error and delta must be 1-D contiguous fp32 "
                         f"tensors of {plan.numel} elements")
    error.mul_(beta)
    error.add_(delta)
    payload = encode_bucket(error, plan, name=name)
    return payload, _remove_sent(error, decode_bucket(payload, plan))


def _remove_sent(flat: torch.Tensor, decoded: Decoded) -> Decoded:
    """``e[idx] ← e[idx] − value``: the error keeps exactly what was not sent."""
    flat[decoded.indices] = flat[decoded.indices] - decoded.values
    return decoded
