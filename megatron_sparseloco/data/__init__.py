"""Offline benchmark data: a local text corpus → byte-level tokens → Megatron indexed datasets.

``python -m megatron_sparseloco.data.build --out data/stdlib`` writes
``train_text_document.{bin,idx}``, ``valid_text_document.{bin,idx}`` and ``manifest.json``
from the Python standard-library sources (docs/design.md §4: real text nobody here wrote, present on
every machine, no downloads). Train with Megatron's own ``--tokenizer-type NullTokenizer
--vocab-size 257`` (bytes 0..255, EOD 256 = NullTokenizer's default ``vocab_size - 1``).

``build`` is imported lazily (``from megatron_sparseloco.data.build import build_dataset``) so
that ``python -m megatron_sparseloco.data.build`` runs it exactly once.
"""
from megatron_sparseloco.data.tokenizer import EOD_ID, VOCAB_SIZE, ByteTokenizer, megatron_tokenizer_args

__all__ = ["EOD_ID", "VOCAB_SIZE", "ByteTokenizer", "megatron_tokenizer_args"]
