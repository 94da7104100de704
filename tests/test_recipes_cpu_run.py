"""The CPU-sized recipes really train: a few iterations of cpu_tiny_dense.sh / cpu_tiny_moe.sh (4 gloo ranks,
2 workers), launched exactly as a user would (bash recipe → torchrun → megatron_sparseloco.run): the dense one
as documented without MEGATRON_LM (the recipe falls back to this repo's examples/pretrain_gpt.py and says so),
the MoE one with MEGATRON_LM pointing at a checkout holding a pretrain_gpt.py (here: ours, same command line)."""
import os
import re
import subprocess
import sys

import pytest

from megatron_sparseloco.testing.multirank import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("recipe,with_megatron_lm", [("cpu_tiny_dense.sh", False), ("cpu_tiny_moe.sh", True)])
def test_cpu_recipe_trains_with_outer_steps(recipe, with_megatron_lm, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM", "PRETRAIN_SCRIPT", "TORCHDYNAMO_DISABLE")}
    if with_megatron_lm:
        checkout = tmp_path / "Megatron-LM"
        checkout.mkdir()
        (checkout / "pretrain_gpt.py").symlink_to(os.path.join(REPO, "examples", "pretrain_gpt.py"))
        env["MEGATRON_LM"] = str(checkout)
    venv_bin = os.path.dirname(sys.executable)
    env.update({"PATH": venv_bin + os.pathsep + env.get("PATH", ""), "PYTHON": sys.executable, "TRAIN_ITERS": "10",
                "INNER_STEPS": "5", "LOG_INTERVAL": "5", "EVAL_INTERVAL": "10", "EVAL_ITERS": "1",
                "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "ALGO": "sparseloco"})
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "recipes", recipe)], cwd=str(tmp_path), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=380)
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:]
    assert ("MEGATRON_LM is not set" in out) != with_megatron_lm, out[:2000]
    assert re.search(r"iteration\s+10/\s+10", out), out[-3000:]
    assert "sparseloco | outer steps: 2" in out, out[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", out)]
    assert losses and all(l == l and l < 10 for l in losses)
