"""The sbatch script in DRY_RUN=1 mode, driven with fake SLURM variables (no SLURM here)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "sparseloco.sbatch"


def _dry_run(nodelist, nnodes, node_id, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in
         ("NNODES", "WORKERS", "TP", "PP", "EP", "CP", "ALGO", "SITES", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE")}
    e.update(DRY_RUN="1", PYTHON=sys.executable, OMP_NUM_THREADS="1", SLURM_JOB_NODELIST=nodelist,
             SLURM_NNODES=str(nnodes), SLURM_NODEID=str(node_id), SLURM_JOB_ID="4242", REPO_DIR=str(ROOT), **env)
    return subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=e, timeout=120, cwd=str(ROOT))


def _parse(p):
    assert p.returncode == 0, p.stdout + p.stderr
    info = dict(kv.split("=", 1) for kv in re.search(r"^DRY_RUN (node=.*)$", p.stdout, re.M).group(1).split())
    cmd = shlex.split(re.search(r"^DRY_RUN command: (.*)$", p.stdout, re.M).group(1))
    return info, cmd


def _opt(cmd, flag):
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("nodelist,hosts,env", [
    ("gpu[01-02]", ["gpu01", "gpu02"], dict(RECIPE="examples/recipes/llama_1b.sh", WORKERS="2")),
    ("a,b,c", ["a", "b", "c"], dict(RECIPE="examples/recipes/llama_1b.sh", WORKERS="3", ALGO="diloco")),
    ("n[7-10]", ["n7", "n8", "n9", "n10"], dict(RECIPE="examples/recipes/llama_8b.sh", WORKERS="2",
                                                 SITES="0,0,1,1", CHECKPOINT_ROOT="/shared/ck", RUN_NAME="r8b")),
])
def test_dry_run_consistent_across_nodes(nodelist, hosts, env):
    n = len(hosts)
    seen, ports = [], set()
    for node in range(n):
        info, cmd = _parse(_dry_run(nodelist, n, node, GPUS_PER_NODE="8", **env))
        assert info["node"] == hosts[node] and int(info["node_rank"]) == node
        assert int(info["nnodes"]) == n and int(info["world_size"]) == 8 * n
        assert info["master_addr"] == hosts[0]
        ports.add(info["master_port"])
        assert cmd[0] == "torchrun"
        assert int(_opt(cmd, "--node-rank")) == node and int(_opt(cmd, "--nnodes")) == n
        assert int(_opt(cmd, "--nproc-per-node")) == 8 and _opt(cmd, "--master-addr") == hosts[0]
        assert cmd[cmd.index("-m") + 1] == "megatron_sparseloco.run" and cmd[cmd.index("-m") + 2].endswith("pretrain_gpt.py")
        assert _opt(cmd, "--sparseloco-workers") == env["WORKERS"]
        assert _opt(cmd, "--sparseloco-algorithm") == env.get("ALGO", "sparseloco")
        # Everything but the node rank is identical on every node.
        seen.append([a for i, a in enumerate(cmd) if i != cmd.index("--node-rank") + 1])
        if "CHECKPOINT_ROOT" in env:
            assert _opt(cmd, "--save") == _opt(cmd, "--load") == "/shared/ck/r8b"
        assert _opt(cmd, "--tensorboard-dir").endswith("/logs/4242/tensorboard")
    assert all(s == seen[0] for s in seen)
    assert len(ports) == 1


def test_dry_run_prints_worker_placement():
    p = _dry_run("n[1-4]", 4, 0, GPUS_PER_NODE="8", RECIPE="examples/recipes/llama_8b.sh", WORKERS="2", SITES="0,0,1,1")
    assert p.returncode == 0, p.stderr
    assert "worker 0: site 0, ranks 0-15, nodes n1, n2" in p.stdout
    assert "worker 1: site 1, ranks 16-31, nodes n3, n4" in p.stdout


@pytest.mark.parametrize("env,msg", [
    # Sites interleaved: every worker of 2 nodes would cross the slow link.
    (dict(WORKERS="2", SITES="0,1,0,1"), "spans sites"),
    # 4 nodes x 8 GPUs / TP2 = DP 16: 3 workers do not divide it.
    (dict(WORKERS="3"), "--sparseloco-workers 3 does not divide the data-parallel size 16"),
])
def test_bad_layout_fails_before_launch(env, msg):
    p = _dry_run("n[1-4]", 4, 0, GPUS_PER_NODE="8", RECIPE="examples/recipes/llama_8b.sh", **env)
    assert p.returncode != 0
    assert msg in p.stderr and "nothing was launched" in p.stderr
    assert "DRY_RUN command" not in p.stdout


def test_bad_slurm_environment():
    p = _dry_run("n[1-3]", 4, 0, RECIPE="examples/recipes/llama_1b.sh")
    assert p.returncode != 0 and "has 3 hosts but SLURM_NNODES=4" in p.stderr
    p = _dry_run("n[1-2]", 2, 5, RECIPE="examples/recipes/llama_1b.sh", WORKERS="2")
    assert p.returncode != 0 and "SLURM_NODEID=5" in p.stderr
    p = _dry_run("n[1-2]", 2, 0, RECIPE="examples/recipes/nope.sh")
    assert p.returncode != 0 and "RECIPE=examples/recipes/nope.sh not found" in p.stderr


@pytest.mark.parametrize("megatron_lm", [None, "/shared/Megatron-LM"])
def test_pretrain_script_defaults_without_megatron_lm(megatron_lm, monkeypatch):
    monkeypatch.delenv("PRETRAIN_SCRIPT", raising=False)
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    env = dict(RECIPE="examples/recipes/llama_1b.sh", WORKERS="2")
    if megatron_lm:
        env["MEGATRON_LM"] = megatron_lm
    p = _dry_run("gpu[01-02]", 2, 0, **env)
    _, cmd = _parse(p)
    script = _opt(cmd, "megatron_sparseloco.run")
    if megatron_lm:
        assert script == f"{megatron_lm}/pretrain_gpt.py" and "MEGATRON_LM is not set" not in p.stderr
    else:
        assert Path(script).resolve() == (ROOT / "examples" / "pretrain_gpt.py").resolve()
        assert "MEGATRON_LM is not set" in p.stderr


def test_log_directory_for_sbatch_output_is_documented():
    """SLURM opens #SBATCH --output before the script runs: the script header and the docs say to create it."""
    out = re.search(r"^#SBATCH --output=(\S+)/", SBATCH.read_text(), re.M)
    if out:
        assert f"mkdir -p {out.group(1)}" in SBATCH.read_text()
        assert f"mkdir -p {out.group(1)}" in (ROOT / "docs" / "recipes.md").read_text()


# ---------------------------------------------------------------------------------- elastic: one sbatch per site
ELASTIC_SBATCH = ROOT / "examples" / "slurm" / "elastic.sbatch"
LIGHTHOUSE_SBATCH = ROOT / "examples" / "slurm" / "lighthouse.sbatch"
LIGHTHOUSE = "http://lighthouse.example.org:29510"


def _elastic_dry_run(nodelist, nnodes, node_id, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in
         ("NNODES", "WORKERS", "TP", "PP", "EP", "CP", "ALGO", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE",
          "LIGHTHOUSE", "WORKER_INDEX", "TOKEN_FILE", "MIN_WORKERS", "ELASTIC", "ELASTIC_HOST", "MANAGER_PORT")}
    e.update(DRY_RUN="1", PYTHON=sys.executable, OMP_NUM_THREADS="1", SLURM_JOB_NODELIST=nodelist,
             SLURM_NNODES=str(nnodes), SLURM_NODEID=str(node_id), SLURM_JOB_ID="77", REPO_DIR=str(ROOT), **env)
    return subprocess.run(["bash", str(ELASTIC_SBATCH)], capture_output=True, text=True, env=e, timeout=120,
                          cwd=str(ROOT))


def _site_env(index, token):
    return dict(LIGHTHOUSE=LIGHTHOUSE, WORKER_INDEX=str(index), TOKEN_FILE=token, RECIPE="examples/recipes/llama_8b.sh",
                WORKERS="2", MIN_WORKERS="2", GPUS_PER_NODE="8", CHECKPOINT_ROOT="/shared/ck", RUN_NAME="r8b")


def test_elastic_one_sbatch_per_site(tmp_path):
    """Two sites, each its own job of 2 nodes (one llama_8b worker): each job's torchrun world is its own
    nodes, every node of a job runs the same command but its node rank, and the jobs differ only in their
    worker slot, their own first host (store, manager server) and their checkpoint directory."""
    token = str(tmp_path / "token")
    sites = {0: ("a[1-2]", ["a1", "a2"]), 1: ("b[7-8]", ["b7", "b8"])}
    per_site = {}
    for index, (nodelist, hosts) in sites.items():
        seen = []
        for node in range(2):
            info, cmd = _parse(_elastic_dry_run(nodelist, 2, node, **_site_env(index, token)))
            assert info["node"] == hosts[node] and int(info["node_rank"]) == node
            assert int(info["world_size"]) == 16 and info["master_addr"] == hosts[0] == info["elastic_host"]
            assert info["worker_index"] == str(index) and info["lighthouse"] == LIGHTHOUSE
            assert cmd[0] == "torchrun" and int(_opt(cmd, "--nnodes")) == 2 and int(_opt(cmd, "--node-rank")) == node
            assert _opt(cmd, "--master-addr") == hosts[0] and _opt(cmd, "--master-port") == "29500"
            assert _opt(cmd, "--sparseloco-lighthouse") == LIGHTHOUSE
            assert _opt(cmd, "--sparseloco-worker-index") == str(index)
            assert _opt(cmd, "--sparseloco-workers") == "2" and _opt(cmd, "--sparseloco-min-workers") == "2"
            assert _opt(cmd, "--sparseloco-elastic-token-file") == token
            assert _opt(cmd, "--sparseloco-elastic-host") == hosts[0]
            assert _opt(cmd, "--sparseloco-elastic-manager-port") == "29511"
            assert _opt(cmd, "--save") == _opt(cmd, "--load") == f"/shared/ck/r8b/worker{index}"
            assert _opt(cmd, "--global-batch-size") == "256"      # the run's: 2 slots x 128 (each job trains its slot)
            seen.append([a for i, a in enumerate(cmd) if i != cmd.index("--node-rank") + 1])
        assert seen[0] == seen[1]
        per_site[index] = seen[0]
    assert len(per_site[0]) == len(per_site[1])
    differ = {x for a, b in zip(per_site[0], per_site[1]) if a != b for x in (a, b)}
    assert differ == {"a1", "b7", "0", "1", "/shared/ck/r8b/worker0", "/shared/ck/r8b/worker1"}, differ


def test_elastic_sbatch_needs_the_run_settings(tmp_path):
    env = _site_env(0, str(tmp_path / "token"))
    for missing in ("LIGHTHOUSE", "WORKER_INDEX", "TOKEN_FILE"):
        p = _elastic_dry_run("a[1-2]", 2, 0, **{k: v for k, v in env.items() if k != missing})
        assert p.returncode != 0 and f"{missing} is not set" in p.stderr and "nothing was launched" in p.stderr
        assert "DRY_RUN command" not in p.stdout
    # a job's nodes must hold one worker: TP 3 does not divide 8 GPUs
    p = _elastic_dry_run("a[1-2]", 2, 0, **dict(env, TP="3"))
    assert p.returncode != 0 and "nothing was launched" in p.stderr


def test_lighthouse_sbatch_prints_the_lighthouse_and_its_url():
    e = {k: v for k, v in os.environ.items() if k not in ("MIN_WORKERS", "LIGHTHOUSE_PORT", "LIGHTHOUSE_HOST")}
    e.update(DRY_RUN="1", PYTHON=sys.executable, MIN_WORKERS="2", LIGHTHOUSE_HOST="lh.example.org")
    p = subprocess.run(["bash", str(LIGHTHOUSE_SBATCH)], capture_output=True, text=True, env=e, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "LIGHTHOUSE=http://lh.example.org:29510" in p.stdout
    cmd = shlex.split(re.search(r"^DRY_RUN command: (.*)$", p.stdout, re.M).group(1))
    assert os.path.basename(cmd[0]) == "torchft_lighthouse"
    assert _opt(cmd, "--min_replicas") == "2" and _opt(cmd, "--bind") == "[::]:29510"
    for flag in ("--join_timeout_ms", "--heartbeat_timeout_ms", "--quorum_tick_ms"):
        assert int(_opt(cmd, flag)) > 0
    help_text = subprocess.run([cmd[0] if os.path.exists(cmd[0]) else "torchft_lighthouse", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    for flag in ("--min_replicas", "--bind", "--join_timeout_ms", "--heartbeat_timeout_ms", "--quorum_tick_ms"):
        assert flag in help_text, f"torchft_lighthouse has no {flag}"
    e["MIN_WORKERS"] = "0"
    p = subprocess.run(["bash", str(LIGHTHOUSE_SBATCH)], capture_output=True, text=True, env=e, timeout=60)
    assert p.returncode != 0 and "MIN_WORKERS=0" in p.stderr
