"""The benchmarks' and the recipes' defaults are the plugin's: a run or a recipe that sets no outer setting
gets exactly what the plugin's config dataclasses (DiLoCoConfig, SparseLoCoConfig, GASLoCConfig) give, with
SparseLoCo's outer lr resolved for the job's W and k by the plugin's own rule, as the Megatron flags resolve it."""
from __future__ import annotations

import os
import sys
from dataclasses import asdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import common  # noqa: E402
import network  # noqa: E402
import quality  # noqa: E402

from megatron_sparseloco.outer.diloco import DiLoCoConfig  # noqa: E402
from megatron_sparseloco.outer.gasloc import GASLoCConfig  # noqa: E402
from megatron_sparseloco.outer.registry import outer_strategy_class  # noqa: E402
from megatron_sparseloco.outer.sparseloco import SparseLoCoConfig, default_outer_lr  # noqa: E402


def plugin_default(algo: str, workers: int, **set_fields):
    """The config the plugin builds for ``algo`` at W = ``workers`` when only ``set_fields`` are given."""
    config = outer_strategy_class(algo).config_class(**set_fields)
    config.resolve_for_workers(workers, set(set_fields))
    return config


def built_config(algo: str, fields_: dict):
    return outer_strategy_class(algo).config_class(**fields_).validate()


@pytest.mark.parametrize("W", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("k", [32, 64, 128])
def test_an_unset_sparseloco_run_gets_the_plugins_config_at_its_w_and_k(W, k):
    run = common.RunCfg("sparseloco", k=k)
    built = built_config("sparseloco", common.strategy_fields(run, W))
    assert asdict(built) == asdict(plugin_default("sparseloco", W, k=k))
    assert built.lr == default_outer_lr(W, k, SparseLoCoConfig().chunk)


@pytest.mark.parametrize("layers,hidden", [(2, 128), (4, 256), (6, 384), (3, 200)])
def test_a_run_gets_the_plugins_lr_for_its_models_size(layers, hidden):
    """The benchmarks resolve the rule's size term as the plugin does once the model is built
    (``resolve_for_model``), with N from ``common.model_numel`` (the benchmarks' GPT, counted before building it)."""
    numel = common.model_numel(common.ModelCfg(layers=layers, hidden=hidden))
    for W in (2, 4, 8):
        run = common.RunCfg("sparseloco", k=64)
        expected = plugin_default("sparseloco", W, k=64)
        expected.resolve_for_model(W, numel)
        built = built_config("sparseloco", common.strategy_fields(run, W, numel))
        assert asdict(built) == asdict(expected) and built.lr == default_outer_lr(W, 64, 4096, numel)
        assert common.resolved_defaults([W], numel)[str(W)]["sparseloco"]["lr"] == built.lr


def test_model_numel_counts_the_built_model():
    """``common.model_numel`` against the parameters of the GPT the runs build (one rank, 3 × 96)."""
    from megatron_sparseloco.testing.megatron_harness import tiny_gpt_parameter_counts
    from megatron_sparseloco.testing.multirank import run_ranks
    model = common.ModelCfg(layers=3, hidden=96, heads=4, seq=64, vocab=257)
    build = dict(num_layers=model.layers, hidden=model.hidden, heads=model.heads, vocab=model.vocab, seq_len=model.seq)
    assert run_ranks(tiny_gpt_parameter_counts, 1, args=(build,), timeout=300)[0][0] == common.model_numel(model)


def test_the_rules_values_are_the_ones_the_docs_quote():
    assert [common.strategy_fields(common.RunCfg("sparseloco", k=64), W)["lr"] for W in (2, 4, 8)] == [1.5, 1.06, 0.75]
    assert [common.strategy_fields(common.RunCfg("sparseloco", k=128), W)["lr"] for W in (2, 4, 8)] == [1.06, 0.75, 0.53]
    sizes = [common.model_numel(common.ModelCfg(layers=L, hidden=h)) for L, h in ((2, 128), (4, 256), (6, 384))]
    assert [common.strategy_fields(common.RunCfg("sparseloco", k=64), 4, n)["lr"] for n in sizes] == [1.5, 1.06, 0.265]


@pytest.mark.parametrize("algo", ["diloco", "gasloc"])
def test_unset_diloco_and_gasloc_runs_get_the_plugins_config(algo):
    built = built_config(algo, common.strategy_fields(common.RunCfg(algo), 4))
    assert asdict(built) == asdict(plugin_default(algo, 4))


def test_runcfgs_codec_defaults_are_the_plugins():
    run, default = common.RunCfg("sparseloco"), SparseLoCoConfig()
    for name in ("index_coding", "chunking", "aggregation", "reduce", "ef_beta", "value_bits"):
        assert getattr(run, name) == getattr(default, name), name
    assert common.strategy_fields(run, 2)["k"] == default.k and common.strategy_fields(run, 2)["chunk"] == default.chunk
    gas = common.RunCfg("gasloc")
    assert (gas.gasloc_topology, gas.gasloc_rule, gas.gasloc_rounds) == (
        GASLoCConfig().topology, GASLoCConfig().rule, GASLoCConfig().gossip_rounds)


def test_a_set_outer_setting_wins_over_the_rule():
    f = common.strategy_fields(common.RunCfg("sparseloco", k=64, outer_lr=1.0), 8)
    assert f["lr"] == 1.0
    f = common.strategy_fields(common.RunCfg("sparseloco", k=64, outer_momentum=0.5), 8)   # the rule is off with μ
    assert f["lr"] == plugin_default("sparseloco", 8, momentum=0.5, nesterov=True).lr
    f = common.strategy_fields(common.RunCfg("diloco", outer_lr=0.5, outer_momentum=0.0), 2)
    assert (f["lr"], f["momentum"], f["nesterov"]) == (0.5, 0.0, False)


def test_the_quality_and_network_benchmarks_default_specs_run_the_plugins_defaults():
    """No tuned file: quality.py's runs and network.py's runs leave every outer setting to the plugin."""
    import argparse
    args = argparse.Namespace(methods="diloco,sparseloco:64,sparseloco:128,gasloc", H=15, mbs=4, lr=1e-3,
                              eval_windows=8, overlap_steps="", overlap_merges="replay", fragments="")
    runs, _ = quality.build_runs(args, {}, [0], 30)
    runs += network.hetero_runs("diloco,sparseloco:64,sparseloco:128,gasloc", dict(H=15, steps=30))
    for run in runs:
        algo = run.method
        built = built_config(algo, common.strategy_fields(run, 4))
        assert asdict(built) == asdict(plugin_default(algo, 4, **({"k": run.k} if run.k else {}))), run.label()


def test_the_results_config_block_records_the_resolved_defaults():
    d = common.resolved_defaults([2, 8])
    assert d["2"]["sparseloco"]["lr"] == 1.5 and d["8"]["sparseloco:128"]["lr"] == 0.53
    assert d["8"]["diloco"] == {"lr": DiLoCoConfig().lr, "momentum": DiLoCoConfig().momentum, "nesterov": True}
    assert d["2"]["gasloc"]["momentum"] == GASLoCConfig().momentum


@pytest.mark.parametrize("algo", ["sparseloco", "diloco", "gasloc"])
@pytest.mark.parametrize("name", ["llama_1b", "cpu_tiny_dense"])
def test_a_recipe_without_outer_settings_resolves_to_the_plugins_defaults(name, algo, monkeypatch):
    """Every outer-config flag a recipe ends up with (after Megatron's parser and our validation) is the
    plugin's default for its W, except the inner steps H (a loop flag, not a config field)."""
    import test_recipes as tr
    from megatron_sparseloco.megatron.args import resolved_flag_values
    from megatron_sparseloco.outer.config_fields import flagged_fields

    p = tr._recipe(name, "1", ALGO=algo)
    assert p.returncode == 0, p.stderr
    argv = p.stdout.splitlines()
    assert "--sparseloco-outer-lr" not in argv and "--sparseloco-outer-momentum" not in argv
    world, _ = tr._world_size(name, ALGO=algo)
    args = tr._megatron_parse(argv, world, monkeypatch)
    W = args.sparseloco_workers
    default = plugin_default(algo, W)
    resolved = resolved_flag_values(args)
    for flag, spec in flagged_fields(default).items():
        assert resolved[flag] == getattr(default, spec.name), (name, algo, flag)


def test_a_recipes_outer_lr_override_reaches_the_flags(monkeypatch):
    import test_recipes as tr
    p = tr._recipe("llama_1b", "1", ALGO="sparseloco", OUTER_LR="1.0", OUTER_MOMENTUM="0.5")
    argv = p.stdout.splitlines()
    assert argv[argv.index("--sparseloco-outer-lr") + 1] == "1.0"
    assert argv[argv.index("--sparseloco-outer-momentum") + 1] == "0.5"
