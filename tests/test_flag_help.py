"""The --sparseloco-* flag reference: CLI help, README table, and the defaults they state."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sparseloco.megatron.args import help as flag_help
from megatron_sparseloco.megatron.args import add_sparseloco_args

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv, timeout=60):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=timeout)


def _parser_actions():
    p = add_sparseloco_args(argparse.ArgumentParser(add_help=False))
    return [a for a in p._actions if a.dest.startswith("sparseloco_")]


@pytest.mark.parametrize("argv", [["-m", "megatron_sparseloco", "--help"],
                                  ["-m", "megatron_sparseloco.run", "--sparseloco-help"]])
def test_help_lists_every_flag_with_default_choices_and_meaning(argv):
    p = _run(*argv)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for title, _ in flag_help.GROUPS:
        assert f"{title}:" in out
    for a in _parser_actions():
        block = out.split(a.option_strings[0].replace("--", "--[no-]", 1) if isinstance(a, argparse.BooleanOptionalAction)
                          else a.option_strings[0] + (" " if a.nargs != 0 else "\n"), 1)
        assert len(block) == 2, f"{a.option_strings[0]} missing from the help"
        entry = block[1].split("\n  --", 1)[0]
        for c in a.choices or ():
            assert str(c) in entry.splitlines()[0], (a.dest, entry)
        assert "Default: " in entry and " ".join(a.help.split())[:30] in " ".join(entry.split()), entry


def test_both_help_commands_agree():
    assert _run("-m", "megatron_sparseloco", "--help").stdout.startswith(
        _run("-m", "megatron_sparseloco.run", "--sparseloco-help").stdout.rstrip("\n"))


def test_readme_flags_table_is_generated_from_the_flags():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = flag_help.readme_section(text)
    assert section is not None, "README lacks the generated flags-table markers"
    assert section == flag_help.markdown_table(), (
        "README's flags table is stale: run `python -m megatron_sparseloco --write-readme README.md`")
    for a in _parser_actions():
        assert f"`{flag_help.flag_syntax(a)}`" in section


def test_write_readme_regenerates_a_stale_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{flag_help.README_BEGIN}\n| old | table |\n{flag_help.README_END}\nrest\n", encoding="utf-8")
    p = _run("-m", "megatron_sparseloco", "--write-readme", str(readme))
    assert p.returncode == 0, p.stderr
    text = readme.read_text(encoding="utf-8")
    assert flag_help.readme_section(text) == flag_help.markdown_table()
    assert text.startswith("intro\n") and text.endswith("rest\n") and "| old |" not in text


@pytest.mark.parametrize("algo", ["sparseloco", "diloco", "gasloc", "average"])
def test_stated_defaults_are_what_validation_resolves(algo, monkeypatch):
    """Every default the reference states is the value an unset flag gets for an algorithm that uses it."""
    from megatron.training.arguments import parse_args
    from megatron_sparseloco.megatron.args import validate_sparseloco_args
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--use-distributed-optimizer", "--sparseloco-algorithm", algo,
                                      "--sparseloco-workers", "2"])
    args = validate_sparseloco_args(parse_args(add_sparseloco_args), world_size=4)
    for a in _parser_actions():
        value = getattr(args, a.dest)
        if a.dest in ("sparseloco_algorithm", "sparseloco_workers") or value is None:
            continue
        text = flag_help.default_text(a.dest)
        if (algo, a.dest) == ("sparseloco", "sparseloco_outer_lr"):   # a rule of W (here 2) and k
            assert f"{algo} 0.265/√(W·k/C)" in text and f"{value} at W = 2" in text, (a.dest, text)
        elif a.dest in ("sparseloco_outer_lr", "sparseloco_outer_momentum"):
            assert f"{algo} {value}" in text, (a.dest, text)
        elif a.dest == "sparseloco_outer_nesterov":
            assert (algo in text.split(",")[0]) == value, (a.dest, text)
        elif isinstance(value, bool):
            assert text.startswith("on" if value else "off"), (a.dest, text)
        elif a.dest == "sparseloco_inner_steps_per_worker":
            continue
        else:
            assert text.split(" ")[0] == str(value), (a.dest, text, value)


def test_megatron_help_through_the_launcher_works():
    """megatron-core 0.19.2's own --help raises on a stray '%'; through our launcher it prints, with our group."""
    p = _run("-m", "megatron_sparseloco.run", str(ROOT / "examples" / "pretrain_gpt.py"), "--help", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--sparseloco-algorithm" in p.stdout and "--tensor-model-parallel-size" in p.stdout
