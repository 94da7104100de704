"""SparseLoCo codec: chunked Top-k + n-bit quantiser + bit-packed / entropy-coded wire format + error feedback.

Pure torch (no megatron import); works on CPU and CUDA tensors.  See docs/codec.md for the wire format.
"""

from megatron_sparseloco.compress.codec import Decoded, decode, decode_dense, encode
from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.error_feedback import error_feedback_step
from megatron_sparseloco.compress.errors import CodecConfigError, NonFiniteInputError, PayloadError
from megatron_sparseloco.compress.sizing import analytic_bits_per_param, payload_nbytes

__all__ = [
    "CodecConfig",
    "CodecConfigError",
    "Decoded",
    "NonFiniteInputError",
    "PayloadError",
    "analytic_bits_per_param",
    "decode",
    "decode_dense",
    "encode",
    "error_feedback_step",
    "payload_nbytes",
]
