"""Build Megatron indexed datasets (.bin/.idx) offline from a local text directory.

    python -m megatron_sparseloco.data.build --out data/stdlib [--source DIR] [--max-bytes N]

* Corpus: every file matching ``--pattern`` (default ``*.py``) under ``--source`` (default: this
  interpreter's standard library, ``sysconfig.get_paths()["stdlib"]``), skipping
  ``site-packages`` / ``dist-packages`` / ``__pycache__`` and symlinks. One file = one document.
* Tokens: the file's bytes, then EOD (``tokenizer.ByteTokenizer``; train with
  ``--tokenizer-type NullTokenizer --vocab-size 257``).
* Slice: with ``--max-bytes N`` files are taken in a fixed pseudo-random order (sha256 of
  ``"select:" + relative path``) while the running total of file bytes stays ≤ N; larger files
  are skipped. Same source + same N → same slice on every machine with the same files.
* Split: by file, ``sha256(relative path) mod 10000 < valid_percent × 100`` → held-out
  (``valid``), else ``train``; independent of the slice and of file order. Inside a split the
  documents are written in sorted path order.
* Output: ``<out>/train_text_document.{bin,idx}``, ``<out>/valid_text_document.{bin,idx}``,
  ``<out>/manifest.json`` (config, files, documents/bytes/tokens per split, tokenizer, the
  Megatron flags to use). Files are written under temporary names and renamed; the manifest is
  written last.
* Idempotent: when ``manifest.json`` records the same config (source, patterns, max bytes, valid
  percent, a fingerprint of the candidate files' paths, sizes and mtimes) and the .bin/.idx files
  are present with the recorded sizes, nothing is rebuilt.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_sparseloco.data.tokenizer import EOD_ID, TOKEN_DTYPE, VOCAB_SIZE, ByteTokenizer, megatron_tokenizer_args

FORMAT_VERSION = 1
SPLITS = ("train", "valid")
PREFIXES = {"train": "train_text_document", "valid": "valid_text_document"}
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
MANIFEST = "manifest.json"


def default_source() -> str:
    """The running interpreter's standard-library directory."""
    return sysconfig.get_paths()["stdlib"]


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def split_of(relpath: str, valid_percent: float) -> str:
    """``'valid'`` or ``'train'`` for a file, from its relative path alone."""
    return "valid" if _hash_int(relpath) % 10000 < round(valid_percent * 100) else "train"


def list_files(source: str, patterns: Sequence[str] = ("*.py",)) -> List[Tuple[str, int, int]]:
    """(relative posix path, size, mtime_ns) of the corpus files under ``source``, sorted by path."""
    out = []
    for root, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not os.path.islink(os.path.join(root, d)))
        for name in files:
            if not any(fnmatch(name, p) for p in patterns):
                continue
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            st = os.stat(path)
            if st.st_size == 0:
                continue
            rel = os.path.relpath(path, source).replace(os.sep, "/")
            out.append((rel, st.st_size, st.st_mtime_ns))
    out.sort()
    return out


def select_files(files: Sequence[Tuple[str, int, int]], max_bytes: Optional[int]) -> List[Tuple[str, int, int]]:
    """The slice of ``files`` kept under ``max_bytes`` (all of them when None), sorted by path."""
    if max_bytes is None:
        return list(files)
    chosen, total = [], 0
    for f in sorted(files, key=lambda f: (_hash_int("select:" + f[0]), f[0])):
        if total + f[1] <= max_bytes:
            chosen.append(f)
            total += f[1]
    return sorted(chosen)


def _fingerprint(files: Sequence[Tuple[str, int, int]]) -> str:
    h = hashlib.sha256()
    for rel, size, mtime in files:
        h.update(f"{rel}\0{size}\0{mtime}\n".encode("utf-8"))
    return h.hexdigest()


@dataclass
class BuildResult:
    out: str
    manifest: dict
    skipped: bool                    # True: an up-to-date build was found and nothing was written

    def prefix(self, split: str) -> str:
        """The Megatron data-path prefix (no .bin/.idx) of a split."""
        return os.path.join(self.out, PREFIXES[split])

    def tokens(self, split: str) -> int:
        return int(self.manifest["splits"][split]["tokens"])


def megatron_data_args(out: str) -> List[str]:
    """Megatron flags that train on ``train`` and evaluate on ``valid`` of a build in ``out``."""
    return ["--train-data-path", os.path.join(out, PREFIXES["train"]),
            "--valid-data-path", os.path.join(out, PREFIXES["valid"])] + megatron_tokenizer_args()


def _up_to_date(out: str, config: dict) -> Optional[dict]:
    path = os.path.join(out, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if manifest.get("config") != config:
        return None
    for split in SPLITS:
        info = manifest["splits"][split]
        prefix = os.path.join(out, PREFIXES[split])
        try:
            if os.path.getsize(prefix + ".bin") != info["tokens"] * np.dtype(TOKEN_DTYPE).itemsize:
                return None
            if os.path.getsize(prefix + ".idx") != info["idx_bytes"]:
                return None
        except OSError:
            return None
    return manifest


def _write_split(source: str, files: Sequence[Tuple[str, int, int]], prefix: str) -> Dict[str, int]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tmp = prefix + ".partial"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=TOKEN_DTYPE)
    n_bytes = n_tokens = 0
    for rel, _, _ in files:
        with open(os.path.join(source, rel), "rb") as f:
            data = f.read()
        tokens = ByteTokenizer.encode_document(data)
        builder.add_document(tokens, [tokens.size])
        n_bytes += len(data)
        n_tokens += tokens.size
    builder.finalize(tmp + ".idx")
    idx_bytes = os.path.getsize(tmp + ".idx")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    return {"documents": len(files), "bytes": n_bytes, "tokens": n_tokens, "idx_bytes": idx_bytes}


def build_dataset(out: str, source: Optional[str] = None, max_bytes: Optional[int] = None,
                  valid_percent: float = 5.0, patterns: Sequence[str] = ("*.py",), force: bool = False,
                  log=print) -> BuildResult:
    """Build (or find up to date) the train / valid indexed datasets in ``out``; see module doc."""
    source = os.path.realpath(source or default_source())
    if not os.path.isdir(source):
        raise FileNotFoundError(f"--source {source!r} is not a directory")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"--max-bytes must be > 0, got {max_bytes}")
    if not (0.0 < valid_percent < 100.0):
        raise ValueError(f"--valid-percent must be in (0, 100), got {valid_percent}")
    candidates = list_files(source, patterns)
    if not candidates:
        raise FileNotFoundError(f"no non-empty files matching {list(patterns)} under {source}")
    config = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "patterns": list(patterns),
        "max_bytes": max_bytes,
        "valid_percent": valid_percent,
        "files_fingerprint": _fingerprint(candidates),
    }
    if not force:
        manifest = _up_to_date(out, config)
        if manifest is not None:
            log(f"[data] {out}: up to date ({manifest['splits']['train']['tokens']} train / "
                f"{manifest['splits']['valid']['tokens']} valid tokens); nothing to do")
            return BuildResult(out, manifest, skipped=True)

    chosen = select_files(candidates, max_bytes)
    by_split: Dict[str, list] = {s: [] for s in SPLITS}
    for f in chosen:
        by_split[split_of(f[0], valid_percent)].append(f)
    for split in SPLITS:
        if not by_split[split]:
            raise ValueError(f"the {split} split is empty ({len(chosen)} files selected, valid_percent="
                             f"{valid_percent}). Fix: raise --max-bytes or adjust --valid-percent")

    os.makedirs(out, exist_ok=True)
    manifest_path = os.path.join(out, MANIFEST)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)              # a crash while rebuilding must not leave a matching manifest
    t0 = time.time()
    splits = {}
    for split in SPLITS:
        info: Dict[str, object] = dict(_write_split(source, by_split[split], os.path.join(out, PREFIXES[split])))
        info["prefix"] = PREFIXES[split]
        info["files"] = [rel for rel, _, _ in by_split[split]]
        splits[split] = info
    manifest = {
        "config": config,
        "tokenizer": {"type": "byte", "vocab_size": VOCAB_SIZE, "eod_id": EOD_ID,
                      "token_dtype": np.dtype(TOKEN_DTYPE).name,
                      "megatron_args": megatron_tokenizer_args()},
        "megatron_args": megatron_data_args(os.path.abspath(out)),
        "splits": splits,
        "candidate_files": len(candidates),
        "build_seconds": round(time.time() - t0, 3),
    }
    tmp = manifest_path + ".partial"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(tmp, manifest_path)
    log(f"[data] {out}: {splits['train']['documents']} train files ({splits['train']['tokens']} tokens), "
        f"{splits['valid']['documents']} held-out files ({splits['valid']['tokens']} tokens) from {source} "
        f"in {manifest['build_seconds']:.1f} s")
    return BuildResult(out, manifest, skipped=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_sparseloco.data.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (e.g. data/stdlib)")
    p.add_argument("--source", default=None, help=f"text directory (default: the stdlib, {default_source()})")
    p.add_argument("--pattern", action="append", default=None, help="file-name glob, repeatable (default *.py)")
    p.add_argument("--max-bytes", type=int, default=None, help="keep a deterministic slice of at most N file bytes")
    p.add_argument("--valid-percent", type=float, default=5.0, help="held-out share of files, by path hash (default 5)")
    p.add_argument("--force", action="store_true", help="rebuild even if the manifest matches")
    a = p.parse_args(argv)
    try:
        res = build_dataset(a.out, a.source, a.max_bytes, a.valid_percent, tuple(a.pattern or ("*.py",)), a.force)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron_sparseloco.data.build: {e}", file=sys.stderr)
        return 2
    print("Megatron flags: " + " ".join(res.manifest["megatron_args"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
