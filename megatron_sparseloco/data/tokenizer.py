"""Byte-level tokenizer that matches Megatron's ``NullTokenizer``.

Token ids 0..255 are the raw bytes of a file; 256 is end-of-document. Megatron's
``--tokenizer-type NullTokenizer --vocab-size 257`` (megatron/core/tokenizers/text/libraries/
null_tokenizer.py) defines ``eod = vocab_size - 1 = 256`` and no pad token (``pad_id = -1``), so
the training side needs no tokenizer files at all: the indexed dataset already holds the ids.
"""
from __future__ import annotations

from typing import Iterable, List

import numpy as np

NUM_BYTES = 256
EOD_ID = NUM_BYTES                 # NullTokenizer's default eod: vocab_size - 1
VOCAB_SIZE = NUM_BYTES + 1         # --vocab-size 257
TOKEN_DTYPE = np.uint16            # what Megatron's preprocess_data picks for a vocab < 65500


def megatron_tokenizer_args() -> List[str]:
    """The Megatron flags that make ``get_tokenizer()`` agree with these ids."""
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE)]


class ByteTokenizer:
    """bytes ↔ token ids; ``encode_document`` appends EOD like ``preprocess_data --append-eod``."""

    vocab_size = VOCAB_SIZE
    eod = EOD_ID

    @staticmethod
    def encode(data: bytes) -> np.ndarray:
        return np.frombuffer(bytes(data), dtype=np.uint8).astype(TOKEN_DTYPE)

    @classmethod
    def encode_document(cls, data: bytes) -> np.ndarray:
        out = np.empty(len(data) + 1, dtype=TOKEN_DTYPE)
        out[:-1] = np.frombuffer(bytes(data), dtype=np.uint8)
        out[-1] = EOD_ID
        return out

    @staticmethod
    def decode(ids: Iterable[int]) -> bytes:
        """Token ids → bytes; EOD is dropped, any other id ≥ 256 is an error."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        arr = arr[arr != EOD_ID]
        if arr.size and (arr.min() < 0 or arr.max() >= NUM_BYTES):
            raise ValueError(f"token ids outside 0..{NUM_BYTES - 1} (and EOD {EOD_ID}): "
                             f"{arr[(arr < 0) | (arr >= NUM_BYTES)][:5]}")
        return arr.astype(np.uint8).tobytes()
