"""Every recipe's arguments must pass Megatron's real parser plus our flag validation, at its world size."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sparseloco.megatron.args import resolved_flag_values

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
MODELS = ["llama_1b", "llama_8b", "mixtral_8x7b", "cpu_tiny_dense", "cpu_tiny_moe"]
ALGOS = ["sparseloco", "diloco"]


def _recipe(name, mode, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("NNODES", "WORKERS", "TP", "PP", "EP", "CP", "ALGO",
                                                           "GPUS_PER_NODE", "DATA_PATH", "CHECKPOINT_DIR", "ELASTIC",
                                                           "LIGHTHOUSE", "WORKER_INDEX", "TOKEN_FILE", "MIN_WORKERS")}
    e.update(PRINT_ARGS=mode, PYTHON=sys.executable, **env)
    p = subprocess.run(["bash", str(RECIPES / f"{name}.sh")], capture_output=True, text=True, env=e, timeout=60)
    return p


def _world_size(name, **env):
    """The world size the recipe launches with: torchrun --nnodes x --nproc-per-node of its command."""
    p = _recipe(name, "cmd", **env)
    assert p.returncode == 0, p.stderr
    cmd = shlex.split(p.stdout)
    assert cmd[0] == "torchrun" and "megatron_sparseloco.run" in cmd and cmd[cmd.index("-m") + 2].endswith("pretrain_gpt.py")
    return int(cmd[cmd.index("--nnodes") + 1]) * int(cmd[cmd.index("--nproc-per-node") + 1]), cmd


def _megatron_parse(argv, world_size, monkeypatch):
    from megatron.training.arguments import parse_args
    from megatron_sparseloco.megatron.args import add_sparseloco_args, validate_sparseloco_args
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + argv)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    args = parse_args(extra_args_provider=add_sparseloco_args, ignore_unknown_args=False)
    return validate_sparseloco_args(args, world_size=world_size)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("name", MODELS)
def test_recipe_args_parse_and_validate(name, algo, monkeypatch):
    from megatron_sparseloco.megatron.placement.rank_layout import compute_layout
    from megatron_sparseloco.worker_layout import sizes_from_megatron_args
    p = _recipe(name, "1", ALGO=algo)
    assert p.returncode == 0, p.stderr
    argv = p.stdout.splitlines()
    assert argv and all(a != "" for a in argv)
    world, cmd = _world_size(name, ALGO=algo)
    args = _megatron_parse(argv, world, monkeypatch)  # argparse exits (SystemExit) on an unknown flag
    assert args.sparseloco_algorithm == algo
    W = args.sparseloco_workers
    assert W >= 2 and args.num_distributed_optimizer_instances == W
    assert args.use_distributed_optimizer
    # Global batch = per-worker batch x W, divisible by micro-batch x data-parallel size (Megatron's rule).
    dp = world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size)
    assert args.global_batch_size % (args.micro_batch_size * dp) == 0
    # The intended layout is accepted by the layout helper, with whole nodes per worker on real recipes.
    gpn = int(cmd[cmd.index("--nproc-per-node") + 1])
    lay = compute_layout(world // gpn, gpn, **sizes_from_megatron_args(argv))
    assert lay.workers == W
    if not name.startswith("cpu_"):
        assert all(len(set(n)) * gpn == lay.ranks_per_worker for n in lay.worker_nodes), lay.worker_nodes
    if args.num_experts:
        assert world // W % (args.expert_model_parallel_size * (args.expert_tensor_parallel_size or 1)) == 0
    # Paper defaults (docs/design.md §1.2).
    assert args.clip_grad == 1.0 and args.weight_decay == 0.1 and args.lr_decay_style == "cosine"
    flags = resolved_flag_values(args)   # what the run uses, from the configs the validation built
    assert flags['inner-steps'] in (5, 15)
    if algo == "sparseloco":
        assert (flags['topk'], flags['chunk-size'], flags['value-bits']) == (64, 4096, 2)
        assert flags['ef-decay'] == 0.95 and "--sparseloco-outer-lr" not in argv   # the plugin's rule
        assert flags['outer-momentum'] == 0.0
        if not name.startswith("cpu_"):
            assert args.lr == 1e-3 and flags['inner-steps'] == 15
    else:
        assert flags['outer-nesterov'] and flags['outer-momentum'] == 0.9
        assert flags['outer-lr'] == 0.7
        if not name.startswith("cpu_"):
            assert args.lr == 8e-4


def test_cpu_recipes_are_cpu_sized():
    for name in ("cpu_tiny_dense", "cpu_tiny_moe"):
        argv = _recipe(name, "1").stdout.splitlines()
        world, _ = _world_size(name)
        assert world == 4
        assert argv[argv.index("--distributed-backend") + 1] == "gloo"
        assert "--mock-data" in argv and argv[argv.index("--num-layers") + 1] == "2"
        assert argv[argv.index("--hidden-size") + 1] == "64"
    assert "--num-experts" in _recipe("cpu_tiny_moe", "1").stdout.splitlines()


def test_recipe_overrides_and_errors(monkeypatch):
    # Extra arguments come last and win; env overrides reach the flags.
    p = _recipe("llama_1b", "1", WORKERS="4", INNER_STEPS="30")
    argv = p.stdout.splitlines()
    assert argv[argv.index("--sparseloco-workers") + 1] == "4"
    assert argv[argv.index("--sparseloco-inner-steps") + 1] == "30"
    assert argv[argv.index("--global-batch-size") + 1] == str(256 * 4)
    p = _recipe("llama_1b", "1", CHECKPOINT_DIR="/shared/ck/run1")
    argv = p.stdout.splitlines()
    assert argv[argv.index("--save") + 1] == "/shared/ck/run1" == argv[argv.index("--load") + 1]
    p = _recipe("llama_1b", "1", ALGO="bogus")
    assert p.returncode != 0 and "ALGO=sparseloco" in p.stderr
    # A recipe asked for a worker count the data-parallel size cannot hold is refused by our validation.
    from megatron_sparseloco.megatron.args import SparseLoCoArgumentError
    argv = _recipe("llama_8b", "1", WORKERS="3").stdout.splitlines()
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-workers"):
        _megatron_parse(argv, 64, monkeypatch)


@pytest.mark.parametrize("algo", ["gasloc", "average"])
def test_every_algorithm_is_accepted(algo, monkeypatch):
    p = _recipe("llama_1b", "1", ALGO=algo)
    assert p.returncode == 0, p.stderr
    world, _ = _world_size("llama_1b", ALGO=algo)
    assert _megatron_parse(p.stdout.splitlines(), world, monkeypatch).sparseloco_algorithm == algo


def _fake_launch(tmp_path, name, **env):
    """Run a recipe for real up to torchrun, with a stand-in torchrun that records its environment and argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "torchrun"
    fake.write_text('#!/bin/bash\necho "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"\n'
                    'printf "ARG %s\\n" "$@"\n')
    fake.chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM", "PRETRAIN_SCRIPT", "PRINT_ARGS",
                                                           "CUDA_DEVICE_MAX_CONNECTIONS", "TP", "WORKERS", "ALGO")}
    e.update(PATH=f"{bindir}{os.pathsep}{e['PATH']}", PYTHON=sys.executable, **env)
    p = subprocess.run(["bash", str(RECIPES / f"{name}.sh")], capture_output=True, text=True, env=e, timeout=60)
    args = [l[4:] for l in p.stdout.splitlines() if l.startswith("ARG ")]
    script = args[args.index("megatron_sparseloco.run") + 1] if "megatron_sparseloco.run" in args else None
    return p, script


def test_recipe_without_megatron_lm_uses_our_pretrain_script_and_says_so(tmp_path):
    p, script = _fake_launch(tmp_path, "cpu_tiny_dense")
    assert p.returncode == 0, p.stderr
    assert Path(script).resolve() == (ROOT / "examples" / "pretrain_gpt.py").resolve()
    assert "MEGATRON_LM is not set" in p.stderr and "examples/pretrain_gpt.py" in p.stderr


def test_recipe_with_megatron_lm_uses_its_pretrain_script(tmp_path):
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("")
    p, script = _fake_launch(tmp_path, "cpu_tiny_dense", MEGATRON_LM=str(checkout))
    assert p.returncode == 0, p.stderr
    assert script == str(checkout / "pretrain_gpt.py") and "MEGATRON_LM is not set" not in p.stderr
    p, _ = _fake_launch(tmp_path, "cpu_tiny_dense", MEGATRON_LM=str(tmp_path / "missing"))
    assert p.returncode == 2 and "not found" in p.stderr and "MEGATRON_LM" in p.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in p.stdout   # stopped before launching


@pytest.mark.parametrize("tp", ["1", "2"])
def test_recipe_exports_what_megatron_requires_for_tensor_parallelism(tp, tmp_path):
    """Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1; a single-node launch must set it too."""
    p, _ = _fake_launch(tmp_path, "llama_8b", NNODES="1", WORKERS="2", TP=tp)
    assert p.returncode == 0, p.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in p.stdout.splitlines()


def test_recipes_doc_lists_every_knob():
    """Every environment variable the recipes read appears in docs/recipes.md."""
    import re
    doc = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    used = set()
    for f in RECIPES.glob("*.sh"):
        used |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::?[-=?+])", f.read_text()))
    internal = {"PRETRAIN_SCRIPT_NOTE", "PYTHONPATH", "PATH", "ARGS"}
    missing = sorted(v for v in used - internal if f"`{v}`" not in doc)
    assert not missing, f"docs/recipes.md does not list {missing}"


# ---------------------------------------------------------------------------------- elastic variant
LIGHTHOUSE = "http://lighthouse.example.org:29510"
ELASTIC_FLAGS = ("--sparseloco-lighthouse", "--sparseloco-worker-index", "--sparseloco-min-workers",
                 "--sparseloco-elastic-token-file")


def _without(argv, flags):
    """``argv`` without ``flags`` and their values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("name", MODELS)
def test_elastic_recipe_is_one_worker_per_job(name, algo, token, monkeypatch):
    from megatron_sparseloco.megatron.placement.rank_layout import compute_layout
    from megatron_sparseloco.worker_layout import sizes_from_megatron_args
    env = dict(ELASTIC="1", LIGHTHOUSE=LIGHTHOUSE, WORKER_INDEX="1", TOKEN_FILE=token, ALGO=algo)
    single = _recipe(name, "1", ALGO=algo).stdout.splitlines()
    world_all, _ = _world_size(name, ALGO=algo)
    p = _recipe(name, "1", **env)
    assert p.returncode == 0, p.stderr
    argv = p.stdout.splitlines()
    world, cmd = _world_size(name, **env)
    W = int(argv[argv.index("--sparseloco-workers") + 1])
    assert world * W == world_all, "an elastic job is one worker: its world is one worker's ranks"
    # exactly the documented flags, once each, with the environment's values
    assert all(argv.count(f) == 1 for f in ELASTIC_FLAGS + ("--sparseloco-workers",))
    # Megatron's parser and the plugin's whole validation, in the job's own world
    args = _megatron_parse(argv, world, monkeypatch)
    config = args.sparseloco_elastic
    assert (config.lighthouse, config.worker_index, config.min_workers, config.token_file) == (LIGHTHOUSE, 1, 1, token)
    assert args.sparseloco_workers == W and args.sparseloco_algorithm == algo
    # --global-batch-size is the run's; each job trains its 1/W slot of it, which Megatron's divisibility
    # rule must accept in the job's world
    gb = int(single[single.index("--global-batch-size") + 1])
    dp = world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size)
    assert args.global_batch_size * W == gb and args.global_batch_size % (args.micro_batch_size * dp) == 0
    # the layout check sees one worker over the job's nodes
    gpn = int(cmd[cmd.index("--nproc-per-node") + 1])
    assert compute_layout(world // gpn, gpn, **sizes_from_megatron_args(argv)).workers == 1
    # everything else is the single-job recipe's
    assert _without(argv, ELASTIC_FLAGS) == single


def test_elastic_recipe_options_and_errors(token):
    env = dict(ELASTIC="1", LIGHTHOUSE=LIGHTHOUSE, WORKER_INDEX="3", TOKEN_FILE=token)
    argv = _recipe("llama_1b", "1", MIN_WORKERS="2", ELASTIC_HOST="site3.example.org", MANAGER_PORT="29511",
                   OUTER_TIMEOUT="120", CHECKPOINT_DIR="/shared/ck/run1", **env).stdout.splitlines()
    opt = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert opt("--sparseloco-min-workers") == "2" and opt("--sparseloco-worker-index") == "3"
    assert opt("--sparseloco-elastic-host") == "site3.example.org"
    assert opt("--sparseloco-elastic-manager-port") == "29511" and opt("--sparseloco-outer-timeout") == "120"
    assert opt("--save") == opt("--load") == "/shared/ck/run1/worker3", "each job keeps its own checkpoint"
    for missing in ("LIGHTHOUSE", "WORKER_INDEX", "TOKEN_FILE"):
        p = _recipe("llama_1b", "1", **{k: v for k, v in env.items() if k != missing})
        assert p.returncode != 0 and f"ELASTIC=1 needs {missing}" in p.stderr and not p.stdout.strip()
    p = _recipe("llama_1b", "1", ELASTIC="yes")
    assert p.returncode != 0 and "ELASTIC=1" in p.stderr
    # not elastic: none of the elastic flags, even with the variables set
    argv = _recipe("llama_1b", "1", LIGHTHOUSE=LIGHTHOUSE, WORKER_INDEX="3", TOKEN_FILE=token).stdout.splitlines()
    assert not set(ELASTIC_FLAGS) & set(argv)
