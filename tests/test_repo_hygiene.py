"""The design record the code cites lives in the repo: no source or doc points outside it."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCAN = ("megatron_sparseloco", "benchmarks", "examples", "docs", "tests", "tools", "patches", "README.md")


def _files():
    for top in SCAN:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield path
        for root, _, names in os.walk(path):
            for n in names:
                if n.endswith((".py", ".md", ".sh", ".sbatch")):
                    yield os.path.join(root, n)


def test_no_file_cites_a_design_record_outside_the_repo():
    bad = []
    for path in _files():
        if path == os.path.abspath(__file__):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        if re.search(r"\.\./shared/|(?<![\w/])DESIGN\.md", text):
            bad.append(os.path.relpath(path, ROOT))
    assert not bad, f"files citing a design record outside the repo (use docs/design.md): {bad}"
    assert os.path.isfile(os.path.join(ROOT, "docs", "design.md"))
