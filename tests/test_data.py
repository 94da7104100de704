"""megatron_sparseloco.data: byte tokenizer + offline indexed-dataset builder (read back with Megatron)."""
import json
import os

import numpy as np
import pytest

from megatron_sparseloco.data.build import PREFIXES, build_dataset, list_files, main, select_files, split_of
from megatron_sparseloco.data.tokenizer import EOD_ID, VOCAB_SIZE, ByteTokenizer, megatron_tokenizer_args


def _corpus(root, n=40):
    """n small text files (varied sizes, some non-ASCII), one excluded dir, one symlink, one empty file."""
    files = {}
    for i in range(n):
        rel = f"pkg{i % 3}/mod_{i:02d}.py"
        text = (f"# file {i}\n" + "x = 'é€'\n" * (i % 7) + "def f():\n    return %d\n" % i).encode("utf-8")
        files[rel] = text
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "skip.py").write_bytes(b"skipped = True\n")
    (root / "pkg0" / "__pycache__").mkdir()
    (root / "pkg0" / "__pycache__" / "c.py").write_bytes(b"cached\n")
    (root / "empty.py").write_bytes(b"")
    (root / "notes.txt").write_bytes(b"not a .py file\n")
    os.symlink(root / "pkg0" / "mod_00.py", root / "link.py")
    return files


def _read_split(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.asarray(ds[i]) for i in range(len(ds))], ds


def test_tokenizer_round_trip_and_megatron_null_tokenizer_agree():
    data = bytes(range(256)) + "héllo €".encode("utf-8")
    ids = ByteTokenizer.encode_document(data)
    assert ids[-1] == EOD_ID == 256 and ids.size == len(data) + 1
    assert ids[:-1].max() == 255 and ids.dtype == np.uint16
    assert ByteTokenizer.decode(ids) == data
    with pytest.raises(ValueError):
        ByteTokenizer.decode([1, 300])
    # Megatron's NullTokenizer built from our flags has the same EOD and vocabulary size.
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    assert megatron_tokenizer_args() == ["--tokenizer-type", "NullTokenizer", "--vocab-size", "257"]
    tok = NullTokenizer(vocab_size=VOCAB_SIZE)
    assert tok.eod == EOD_ID and tok.vocab_size == VOCAB_SIZE


def test_build_exact_tokens_round_trip_and_split(tmp_path):
    src = tmp_path / "src"
    files = _corpus(src)
    out = tmp_path / "out"
    res = build_dataset(str(out), str(src), valid_percent=25.0, log=lambda *_: None)
    assert not res.skipped
    m = json.loads((out / "manifest.json").read_text())
    listed = m["splits"]["train"]["files"] + m["splits"]["valid"]["files"]
    assert sorted(listed) == sorted(files)            # excluded dirs, symlink, empty, .txt all skipped
    for split in ("train", "valid"):
        info = m["splits"][split]
        assert info["files"] == sorted(info["files"])
        assert all(split_of(rel, 25.0) == split for rel in info["files"])
        docs, ds = _read_split(str(out / PREFIXES[split]))
        assert len(docs) == info["documents"] == len(info["files"])
        assert list(ds.document_indices) == list(range(len(docs) + 1))
        assert info["bytes"] == sum(len(files[r]) for r in info["files"])
        assert info["tokens"] == info["bytes"] + info["documents"] == sum(d.size for d in docs)
        for rel, doc in zip(info["files"], docs):
            assert doc[-1] == EOD_ID and (doc[:-1] < 256).all()
            assert ByteTokenizer.decode(doc) == files[rel]
    assert 0 < m["splits"]["valid"]["documents"] < m["splits"]["train"]["documents"]
    assert m["tokenizer"]["eod_id"] == EOD_ID and m["tokenizer"]["megatron_args"] == megatron_tokenizer_args()
    assert m["megatron_args"][:2] == ["--train-data-path", str((out / "train_text_document").resolve())]


def test_split_deterministic_and_independent_of_slice(tmp_path):
    src = tmp_path / "src"
    files = _corpus(src)
    a = build_dataset(str(tmp_path / "a"), str(src), valid_percent=25.0, log=lambda *_: None).manifest
    b = build_dataset(str(tmp_path / "b"), str(src), valid_percent=25.0, log=lambda *_: None).manifest
    assert a["splits"] == b["splits"]
    assert (tmp_path / "a" / "train_text_document.bin").read_bytes() == (tmp_path / "b" / "train_text_document.bin").read_bytes()
    # A byte budget keeps a subset; every kept file stays in the split it has in the full build.
    full_split = {r: s for s in ("train", "valid") for r in a["splits"][s]["files"]}
    budget = sum(len(d) for d in files.values()) // 2
    c = build_dataset(str(tmp_path / "c"), str(src), max_bytes=budget, valid_percent=25.0, log=lambda *_: None).manifest
    kept = c["splits"]["train"]["files"] + c["splits"]["valid"]["files"]
    assert 0 < len(kept) < len(files)
    assert sum(len(files[r]) for r in kept) <= budget
    assert all(full_split[r] == s for s in ("train", "valid") for r in c["splits"][s]["files"])
    assert [f[0] for f in select_files(list_files(str(src)), budget)] == sorted(kept)


def test_idempotent_and_rebuilds_on_change(tmp_path):
    src = tmp_path / "src"
    _corpus(src)
    out = tmp_path / "out"
    build_dataset(str(out), str(src), valid_percent=25.0, log=lambda *_: None)
    bin_path = out / "train_text_document.bin"
    stamp = bin_path.stat().st_mtime_ns
    again = build_dataset(str(out), str(src), valid_percent=25.0, log=lambda *_: None)
    assert again.skipped and bin_path.stat().st_mtime_ns == stamp
    # Other options → rebuild.
    assert not build_dataset(str(out), str(src), valid_percent=30.0, log=lambda *_: None).skipped
    # A changed source file → rebuild with the new content.
    (src / "pkg1" / "mod_01.py").write_bytes(b"changed = 1\n" * 3)
    res = build_dataset(str(out), str(src), valid_percent=30.0, log=lambda *_: None)
    assert not res.skipped
    split = split_of("pkg1/mod_01.py", 30.0)
    info = res.manifest["splits"][split]
    docs, _ = _read_split(res.prefix(split))
    assert ByteTokenizer.decode(docs[info["files"].index("pkg1/mod_01.py")]) == b"changed = 1\n" * 3
    # A truncated output file → rebuild.
    with open(bin_path, "r+b") as f:
        f.truncate(10)
    assert not build_dataset(str(out), str(src), valid_percent=30.0, log=lambda *_: None).skipped


def test_empty_split_and_bad_source_are_refused(tmp_path, capsys):
    src = tmp_path / "src"
    _corpus(src, n=3)
    with pytest.raises(ValueError, match="split is empty"):
        build_dataset(str(tmp_path / "o"), str(src), valid_percent=0.01, log=lambda *_: None)
    assert main(["--out", str(tmp_path / "o"), "--source", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_default_source_is_the_stdlib():
    import sysconfig

    from megatron_sparseloco.data.build import default_source

    assert default_source() == sysconfig.get_paths()["stdlib"]
    names = {f[0] for f in list_files(default_source())}
    assert "os.py" in names and "json/decoder.py" in names
    assert not any("site-packages" in n for n in names)
