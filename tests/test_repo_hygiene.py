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


# ---------------------------------------------------------------------- layering
#: The package's floors, lowest first (the package docstring and docs/design.md show the same table). A module
#: may import modules of its own unit (a sub-package or top-level module) and of any lower floor; units that share
#: a floor do not import each other.
FLOORS = (
    ("compress", "data"),
    ("comm",),
    ("outer", "costmodel"),
    ("elastic",),
    ("megatron",),
    ("testing",),
    ("run", "demo", "worker_layout", "__main__"),
)
PACKAGE = "megatron_sparseloco"


def _unit(module: str) -> str:
    """``megatron_sparseloco.comm.p2p`` -> ``comm``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(unit: str) -> int:
    for level, units in enumerate(FLOORS):
        if unit in units:
            return level
    return -1   # the package's own __init__ (imports nothing of ours)


def _modules():
    """module name -> path, for every ``.py`` file of the package."""
    import glob
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _is_type_checking(test) -> bool:
    import ast
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: str, known):
    """(line, imported module) for each import of ours in ``path``, wherever it stands (function bodies too),
    except under ``if TYPE_CHECKING:``; ``from pkg import name`` names the submodule where ``name`` is one."""
    import ast
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit_stmt(sub)
                continue
            visit_stmt(child)

    def visit_stmt(node):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == PACKAGE:
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
                out.extend((node.lineno, s) for s in subs)
                if len(subs) < len(node.names):
                    out.append((node.lineno, target))
        visit(node)

    visit(tree)
    return out


def _import_graph():
    mods = _modules()
    return mods, {m: _imports(m, p, mods) for m, p in mods.items()}


def test_layer_every_import_goes_down_the_floors():
    mods, graph = _import_graph()
    assert all(_floor(_unit(m)) >= 0 for m in mods if m != PACKAGE), \
        f"modules on no floor (add their unit to FLOORS): {sorted(m for m in mods if _floor(_unit(m)) < 0 and m != PACKAGE)}"
    bad = []
    for m, edges in graph.items():
        for line, target in edges:
            src, dst = _unit(m), _unit(target)
            if dst == src or dst == "":
                continue
            if _floor(dst) >= _floor(src):
                bad.append(f"{os.path.relpath(mods[m], ROOT)}:{line} imports {target} "
                           f"({dst!r} is on floor {_floor(dst)}, {src!r} on floor {_floor(src)})")
    assert not bad, "imports from a floor not below the importer's:\n" + "\n".join(bad)


def test_layer_no_import_cycle():
    mods, graph = _import_graph()
    edges = {m: sorted({t for _, t in e if t in mods and t != m}) for m, e in graph.items()}
    lines = {(m, t): line for m, e in graph.items() for line, t in e}
    state, stack, cycles = {}, [], []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                loop = stack[stack.index(t):] + [t]
                cycles.append(" -> ".join(f"{os.path.relpath(mods[a], ROOT)}:{lines[(a, b)]}"
                                          for a, b in zip(loop, loop[1:])) + f" -> {t}")
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles (each step names the importing file and line):\n" + "\n".join(cycles)


def test_layer_checker_catches_an_upward_import_and_a_cycle(tmp_path):
    """The walker itself: an upward import and a two-module cycle in a scratch package are both found."""
    pkg = tmp_path / PACKAGE
    for sub in ("comm", "megatron"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "comm" / "a.py").write_text("from megatron_sparseloco.megatron import b\n")
    (pkg / "megatron" / "b.py").write_text("def f():\n    from megatron_sparseloco.comm import a\n")
    (pkg / "megatron" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from megatron_sparseloco.megatron import b\n")
    known = {f"{PACKAGE}.comm.a", f"{PACKAGE}.megatron.b", f"{PACKAGE}.megatron.c"}
    a = _imports(f"{PACKAGE}.comm.a", str(pkg / "comm" / "a.py"), known)
    b = _imports(f"{PACKAGE}.megatron.b", str(pkg / "megatron" / "b.py"), known)
    c = _imports(f"{PACKAGE}.megatron.c", str(pkg / "megatron" / "c.py"), known)
    assert a == [(1, f"{PACKAGE}.megatron.b")] and b == [(2, f"{PACKAGE}.comm.a")] and c == []
    assert _floor(_unit(f"{PACKAGE}.megatron.b")) > _floor(_unit(f"{PACKAGE}.comm.a"))


def test_layer_megatron_top_is_small_and_the_loop_core_names_nothing_elastic():
    """At most 12 modules directly in ``megatron/`` (the rest in its wings), and the optimizer wrapper, the
    rounds and the checkpoint code use no elastic identifier: elastic mode sits behind the rounds factory."""
    import ast
    import glob
    top = os.path.join(ROOT, PACKAGE, "megatron")
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(top, "*.py")))
    assert len(modules) <= 12, f"{len(modules)} modules directly in megatron/: {modules}"
    bad = []
    paths = [os.path.join(top, "optimizer.py"), os.path.join(top, "rounds.py")]
    paths += glob.glob(os.path.join(top, "checkpoint", "*.py"))
    for path in paths:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg)):
                names = [getattr(node, "name", None) or getattr(node, "arg", "")]
            bad += [f"{os.path.relpath(path, ROOT)}:{node.lineno} {n}" for n in names
                    if any(w in n.lower() for w in ("session", "heal", "elastic"))]
    assert not bad, "elastic identifiers outside the elastic wing:\n" + "\n".join(bad)
