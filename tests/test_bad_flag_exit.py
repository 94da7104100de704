"""A bad --sparseloco-* flag ends the job with one message on rank 0 and a non-zero exit, before Megatron's checks."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args

from megatron_sparseloco.megatron.args import add_sparseloco_args
from megatron_sparseloco.megatron import plugin
from megatron_sparseloco.megatron.plugin import check_sparseloco_args_or_exit
from test_arguments import BAD, BASE

ROOT = Path(__file__).resolve().parents[1]

# Megatron options whose own (bare) assertions used to win over our message.
MEGATRON_CONFLICTS = [
    (["--sparseloco-algorithm", "sparseloco", "--use-torch-fsdp2"], 4, "--use-torch-fsdp2"),
    (["--sparseloco-algorithm", "sparseloco", "--overlap-param-gather-with-optimizer-step"], 4,
     "--overlap-param-gather-with-optimizer-step"),
]


def _args(argv, world, rank, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *argv])
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    return parse_args(add_sparseloco_args)


@pytest.mark.parametrize("argv,world,flag", BAD + MEGATRON_CONFLICTS, ids=[" ".join(c[0][-2:]) for c in BAD + MEGATRON_CONFLICTS])
def test_bad_flag_one_message_on_rank0_and_exit_2(argv, world, flag, monkeypatch, capsys):
    monkeypatch.setattr(plugin, "NONZERO_RANK_EXIT_GRACE_S", 0.0)
    for rank in (0, 1):
        args = _args(argv, world, rank, monkeypatch)
        with pytest.raises(SystemExit) as exc:
            check_sparseloco_args_or_exit(args)
        assert exc.value.code == 2
        out, err = capsys.readouterr()
        lines = [l for l in err.splitlines() if l.strip()]
        if rank == 0:
            assert len(lines) == 1 and lines[0].startswith("megatron_sparseloco: error: "), err
            assert flag in lines[0] and "Fix:" in lines[0] and "Traceback" not in err, err
        else:
            assert lines == [] and out == "", (out, err)


def test_installed_validation_runs_before_megatrons(monkeypatch, capsys):
    """Through the installed plugin, our message wins over Megatron's bare assertion for --use-torch-fsdp2."""
    import megatron.training.arguments as margs

    from megatron_sparseloco.megatron.plugin import install
    install()
    args = _args(MEGATRON_CONFLICTS[0][0], 4, 0, monkeypatch)
    with pytest.raises(SystemExit) as exc:
        margs.validate_args(args)
    assert exc.value.code == 2
    assert "--use-torch-fsdp2 cannot be combined with --sparseloco-algorithm" in capsys.readouterr().err


def test_a_nonzero_rank_waits_for_rank0_before_exiting(monkeypatch):
    """Rank 1 of a multi-rank job sleeps the grace before its exit; a single-process run does not."""
    slept = []
    monkeypatch.setattr(plugin.time, "sleep", slept.append)
    argv, world, _ = BAD[0]
    for rank, expected in ((1, [plugin.NONZERO_RANK_EXIT_GRACE_S]), (0, [])):
        slept.clear()
        with pytest.raises(SystemExit):
            check_sparseloco_args_or_exit(_args(argv, world, rank, monkeypatch))
        assert slept == expected, rank
    assert plugin.NONZERO_RANK_EXIT_GRACE_S >= 10


@pytest.mark.timeout(240)
def test_bad_flag_under_torchrun_stops_all_ranks_with_one_message(tmp_path):
    """4 ranks through torchrun: the message once, no rank traceback, non-zero exit, nothing trained.

    Rank 0 is made the slowest to start (a ``sitecustomize`` that sleeps 4 s on rank 0 only), as on
    a loaded node: the other ranks must not exit first, or torchrun kills rank 0 before it prints.
    """
    from megatron_sparseloco.testing.multirank import free_port
    slow_rank0 = tmp_path / "slow_rank0"
    slow_rank0.mkdir()
    (slow_rank0 / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0' and os.environ.get('TORCHELASTIC_RUN_ID'):\n"
        "    time.sleep(4)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ALGO", "WORKERS", "TP", "PP", "EP", "CP")}
    env.update(PRINT_ARGS="1", PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(slow_rank0), env.get("PYTHONPATH", "")]))
    argv = subprocess.run(["bash", str(ROOT / "examples/recipes/cpu_tiny_dense.sh")], capture_output=True, text=True,
                          env=env, check=True).stdout.splitlines()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           "-m", "megatron_sparseloco.run", str(ROOT / "examples/pretrain_gpt.py"), *argv, "--sparseloco-topk", "5000"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=220)
    both = p.stdout + p.stderr
    assert p.returncode != 0
    assert both.count("megatron_sparseloco: error: --sparseloco-topk") == 1, both[-3000:]
    assert "5000" in both and "Fix:" in both
    assert "SparseLoCoArgumentError" not in both and "iteration" not in p.stdout, both[-3000:]
