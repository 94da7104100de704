"""patches/: the Megatron-LM ``pretrain_gpt.py`` hook ("way (b)") and ``patches/apply.sh``.

Megatron-LM's own file is never committed here, so the tests come in two tiers:

* always (no Megatron-LM source): the patch is a well-formed unified diff of ``pretrain_gpt.py``
  that only *adds* lines; the added lines are Python that imports and calls only our public
  ``megatron_sparseloco.megatron.plugin.install``; the metadata JSON agrees with the patch; and
  ``git apply`` / ``apply.sh`` accept the patch on the hunk's own pre-image (apply, idempotent
  re-apply, ``--check``, ``--reverse``, a clear error on a conflicting file).
* where a Megatron-LM source is at hand (``MEGATRON_LM_DIR`` = a checkout, or a git directory with
  the named commit in ``MEGATRON_LM_GIT_DIR``): the named commit's real
  ``pretrain_gpt.py`` has the recorded SHA-256, the patch applies cleanly and gives the recorded
  patched SHA-256, and the patched script accepts ``--sparseloco-*`` flags. Skipped otherwise.
"""
import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
PATCH = PATCHES / "megatron_lm_pretrain_gpt.patch"
META = json.loads((PATCHES / "megatron_lm_pretrain_gpt.json").read_text())
APPLY = PATCHES / "apply.sh"

HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
needs_git = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None,
                               reason="git and bash needed")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _parse_patch(text: str):
    """(header lines, [(file, [hunk dicts])]); asserts the diff's line counts are consistent."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("diff --git "))
    header, files, i = lines[:start], [], start
    while i < len(lines):
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", lines[i])
        assert m and m.group(1) == m.group(2), f"bad diff line: {lines[i]!r}"
        name, i, hunks = m.group(1), i + 1, []
        while i < len(lines) and not lines[i].startswith("--- "):
            assert lines[i].startswith(("index ", "old mode", "new mode")), f"unexpected: {lines[i]!r}"
            i += 1
        assert lines[i] == f"--- a/{name}" and lines[i + 1] == f"+++ b/{name}"
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK_RE.match(lines[i])
            assert m, f"bad hunk header {lines[i]!r}"
            old_start, old_n, new_start, new_n = (int(g) if g is not None else 1 for g in m.groups())
            i += 1
            body = []
            while i < len(lines) and lines[i][:1] in (" ", "+", "-", "\\") and not lines[i].startswith("diff --git"):
                body.append(lines[i])
                i += 1
            old = [b[1:] for b in body if b[:1] in (" ", "-")]
            new = [b[1:] for b in body if b[:1] in (" ", "+")]
            assert (len(old), len(new)) == (old_n, new_n), f"hunk counts do not match its body at {old_start}"
            hunks.append({"old_start": old_start, "new_start": new_start, "body": body, "old": old, "new": new,
                          "added": [b[1:] for b in body if b[:1] == "+"],
                          "removed": [b[1:] for b in body if b[:1] == "-"]})
        files.append((name, hunks))
    return header, files


PATCH_TEXT = PATCH.read_text()
HEADER, FILES = _parse_patch(PATCH_TEXT)


# ---- always: structure -------------------------------------------------------------------------
def test_patch_touches_only_pretrain_gpt_and_only_adds_lines():
    assert [name for name, _ in FILES] == [META["file"]] == ["pretrain_gpt.py"]
    hunks = FILES[0][1]
    assert len(hunks) == 1, "one hook, one hunk"
    h = hunks[0]
    assert h["removed"] == [], "the patch must not delete or change Megatron-LM lines"
    assert 0 < len(h["added"]) <= 15, "keep the hook minimal"
    # unified context: at most 3 lines each side, so little Megatron-LM text is in this repository
    first_add = next(k for k, b in enumerate(h["body"]) if b.startswith("+"))
    last_add = max(k for k, b in enumerate(h["body"]) if b.startswith("+"))
    assert first_add <= 3 and len(h["body"]) - 1 - last_add <= 3


def test_added_lines_are_python_that_only_installs_our_plugin():
    h = FILES[0][1][0]
    added = "\n".join(h["added"])
    tree = ast.parse(textwrap.dedent(added))          # valid Python on its own
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [(n.module, [(a.name, a.asname) for a in n.names]) for n in imports] == [
        ("megatron_sparseloco.megatron.plugin", [("install", "install_sparseloco")])]
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert calls == {"install_sparseloco", "ImportError"}
    # a statement-level call, placed before Megatron parses its arguments
    assert any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and s.value.func.id == "install_sparseloco"
               for s in tree.body)
    after = [b[1:] for b in h["body"][h["body"].index("+" + h["added"][-1]) + 1:] if b[:1] == " "]
    assert any("parse_and_validate_args(" in ln for ln in after), "install() must precede argument parsing"
    # the hook sits inside `if __name__ == "__main__":` (indented), not at import time
    assert all(ln.startswith("    ") or not ln.strip() for ln in h["added"])


def test_hooked_api_exists_and_is_inert_without_the_flag():
    from megatron_sparseloco.megatron import plugin

    assert callable(plugin.install)
    assert plugin.wrap_optimizer_from_args("OPT", [], type("A", (), {"sparseloco_algorithm": None})()) == "OPT"


def test_metadata_names_the_commit_and_agrees_with_the_patch():
    assert re.fullmatch(r"[0-9a-f]{40}", META["commit"])
    assert META["tag"] == "core_v0.19.0"
    for key in ("sha256_original", "sha256_patched"):
        assert re.fullmatch(r"[0-9a-f]{64}", META[key])
    assert META["sha256_original"] != META["sha256_patched"]
    assert META["patch"] == PATCH.name
    assert META["commit"] in "\n".join(HEADER), "the patch header names the commit"
    assert os.access(APPLY, os.X_OK), "patches/apply.sh must be executable"


# ---- always: git apply / apply.sh on the hunk's own pre-image -----------------------------------
def _preimage_dir(tmp_path: Path) -> Path:
    """A stand-in checkout whose pretrain_gpt.py is just the hunk's pre-image (the context lines)."""
    d = tmp_path / "mlm"
    d.mkdir()
    (d / "pretrain_gpt.py").write_text("\n".join(FILES[0][1][0]["old"]) + "\n")
    return d


def _apply_sh(*args, cwd=None):
    return subprocess.run(["bash", str(APPLY), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


@needs_git
def test_git_apply_accepts_the_patch_on_its_preimage(tmp_path):
    d = _preimage_dir(tmp_path)
    subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=d, check=True, capture_output=True)
    subprocess.run(["git", "apply", str(PATCH)], cwd=d, check=True, capture_output=True)
    assert (d / "pretrain_gpt.py").read_text() == "\n".join(FILES[0][1][0]["new"]) + "\n"


@needs_git
def test_apply_sh_applies_idempotently_checks_and_reverts(tmp_path):
    d = _preimage_dir(tmp_path)
    target = d / "pretrain_gpt.py"
    before = target.read_text()

    r = _apply_sh("--check", d)
    assert r.returncode == 0 and "applies cleanly" in r.stdout, r.stdout + r.stderr
    assert target.read_text() == before
    assert "not the root of a git checkout" in r.stdout and "differs from core_v0.19.0" in r.stderr

    r = _apply_sh(d)
    assert r.returncode == 0 and "patched" in r.stdout, r.stdout + r.stderr
    patched = target.read_text()
    assert "install_sparseloco()" in patched

    r = _apply_sh(d)                                   # idempotent
    assert r.returncode == 0 and "already applied" in r.stdout
    assert target.read_text() == patched
    assert "already applied" in _apply_sh("--check", d).stdout

    r = _apply_sh("--reverse", d)
    assert r.returncode == 0 and "reverted" in r.stdout
    assert target.read_text() == before
    r = _apply_sh("--reverse", d)
    assert r.returncode == 0 and "nothing to revert" in r.stdout


@needs_git
def test_apply_sh_in_a_git_checkout_warns_about_another_commit(tmp_path):
    d = _preimage_dir(tmp_path)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=d, check=True, capture_output=True, env=env)
    r = _apply_sh(d)
    assert r.returncode == 0, r.stderr
    assert f"the patch was made against core_v0.19.0 ({META['commit']})" in r.stderr


@needs_git
def test_apply_sh_vendored_inside_a_larger_repository(tmp_path):
    outer = tmp_path / "outer"
    (outer / "third_party").mkdir(parents=True)
    d = _preimage_dir(outer / "third_party")
    subprocess.run(["git", "init", "-q"], cwd=outer, check=True)
    r = _apply_sh(d)
    assert r.returncode == 0 and "patched" in r.stdout, r.stdout + r.stderr
    assert "install_sparseloco()" in (d / "pretrain_gpt.py").read_text()


@needs_git
def test_apply_sh_errors_clearly(tmp_path):
    r = _apply_sh()
    assert r.returncode == 2 and "MEGATRON_LM_DIR" in r.stderr
    r = _apply_sh(tmp_path / "missing")
    assert r.returncode == 2 and "no such directory" in r.stderr
    r = _apply_sh(tmp_path)
    assert r.returncode == 2 and "must be the root of a Megatron-LM checkout" in r.stderr
    r = _apply_sh("--frobnicate", tmp_path)
    assert r.returncode == 2 and "unknown option" in r.stderr

    d = _preimage_dir(tmp_path)                       # the hunk's context no longer matches
    target = d / "pretrain_gpt.py"
    target.write_text(target.read_text().replace("inprocess_restart", "other_restart"))
    before = target.read_text()
    r = _apply_sh(d)
    assert r.returncode == 1
    assert "neither applies to nor is already applied" in r.stderr and "megatron_sparseloco.run" in r.stderr
    assert target.read_text() == before


# ---- where Megatron-LM's source is available -----------------------------------------------------
def _real_sources(tmp_path: Path) -> Path:
    """A tmp dir holding the named commit's pretrain_gpt.py (+ its two sibling imports), or skip."""
    out = tmp_path / "real"
    out.mkdir()
    names = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout:
        for n in names:
            if (Path(checkout) / n).exists():
                shutil.copy(Path(checkout) / n, out / n)
        if (out / "pretrain_gpt.py").exists():
            return out
    git_dir = os.environ.get("MEGATRON_LM_GIT_DIR")
    if git_dir and shutil.which("git") and os.path.isdir(git_dir):
        for n in names:
            r = subprocess.run(["git", "--git-dir", git_dir, "show", f"{META['commit']}:{n}"], capture_output=True)
            if r.returncode != 0:
                pytest.skip(f"{git_dir} lacks {META['commit']}:{n}")
            (out / n).write_bytes(r.stdout)
        return out
    pytest.skip("no Megatron-LM source (set MEGATRON_LM_DIR to a checkout or MEGATRON_LM_GIT_DIR to a git dir)")


@needs_git
def test_patch_applies_to_the_named_commit(tmp_path):
    src = _real_sources(tmp_path)
    target = src / "pretrain_gpt.py"
    if _sha256(target) != META["sha256_original"]:
        # a user checkout at another commit: the patch must still apply (or already be applied)
        r = _apply_sh("--check", src)
        assert r.returncode == 0, r.stdout + r.stderr
        pytest.skip("MEGATRON_LM_DIR's pretrain_gpt.py is not the named commit's; checked it applies only")
    r = _apply_sh(src)
    assert r.returncode == 0 and "patched" in r.stdout, r.stdout + r.stderr
    assert "differs" not in r.stderr                   # recognised by its SHA-256, no fuzzy match
    assert _sha256(target) == META["sha256_patched"]
    compile(target.read_text(), str(target), "exec")
    assert "already applied" in _apply_sh(src).stdout
    assert _apply_sh("--reverse", src).returncode == 0 and _sha256(target) == META["sha256_original"]


@pytest.mark.megatron
@pytest.mark.timeout(600)
@needs_git
def test_patched_script_accepts_sparseloco_flags(tmp_path):
    """``python pretrain_gpt.py --sparseloco-algorithm bogus``: argparse knows the flag (invalid choice).

    (``--help`` cannot be used: Megatron 0.19's own ``--moe-paged-stash-buffer-size-factor-cuda``
    help string has an unescaped ``%`` and makes argparse's help formatter raise.)
    """
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron.training is not installed")
    src = _real_sources(tmp_path)
    if _apply_sh(src).returncode != 0:
        pytest.skip("patch does not apply to this pretrain_gpt.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "pretrain_gpt.py", "--sparseloco-algorithm", "bogus"], cwd=src, env=env,
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "argument --sparseloco-algorithm: invalid choice: 'bogus'" in r.stderr, r.stderr[-2000:]
