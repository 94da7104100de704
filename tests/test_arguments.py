"""--sparseloco-* flags through Megatron's real argument parser: defaults, and one clear error per bad input."""
import sys

import pytest
import torch

from megatron.training.arguments import parse_args

from megatron_sparseloco.megatron.args import (
    SparseLoCoArgumentError,
    add_sparseloco_args,
    validate_sparseloco_args,
)

from megatron_sparseloco.outer.config_fields import flagged_fields
from megatron_sparseloco.outer.registry import strategy_factory

BASE = ["--use-distributed-optimizer"]


def resolved(config, flag):
    """The value ``config`` runs ``flag`` with: its field's, or the value its algorithm implies."""
    specs = flagged_fields(config)
    return getattr(config, specs[flag].name) if flag in specs else type(config).implied_flags[flag]


def strategy_from_args(args):
    """The strategy factory the plugin builds from validated args: the algorithm on its config object."""
    return strategy_factory(args.sparseloco_algorithm, args.sparseloco_outer_config)


def parse(argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return parse_args(add_sparseloco_args)


@pytest.mark.parametrize("algo,lr,mom,nesterov", [
    ("sparseloco", 1.5, 0.0, False), ("diloco", 0.7, 0.9, True), ("gasloc", 1.0, 0.6, False), ("average", 1.0, 0.0, False),
])
def test_algorithm_defaults_resolved(algo, lr, mom, nesterov, monkeypatch):
    args = parse(BASE + ["--sparseloco-algorithm", algo, "--sparseloco-workers", "2"], monkeypatch)
    validate_sparseloco_args(args, world_size=4)
    config = args.sparseloco_outer_config
    assert tuple(resolved(config, f) for f in ("outer-lr", "outer-momentum", "outer-nesterov")) == (lr, mom, nesterov)
    if algo == "gasloc":  # its step on Δ is the proposal lr η (defaults η 0.7, γ 0.6: docs/gasloc.md §8.6)
        assert config.proposal_lr == 0.7
    assert args.num_distributed_optimizer_instances == 2


@pytest.mark.parametrize("W,extra,lr", [
    (2, [], 1.5), (4, [], 1.06), (8, [], 0.75), (16, [], 0.53), (64, [], 0.53), (1, [], 1.5),
    (4, ["--sparseloco-topk", "128"], 0.75), (8, ["--sparseloco-topk", "128"], 0.53),
    (8, ["--sparseloco-topk", "128", "--sparseloco-chunk-size", "16384"], 1.06),
    (8, ["--sparseloco-outer-lr", "1.5"], 1.5), (2, ["--sparseloco-outer-lr", "0.9"], 0.9),
    (8, ["--sparseloco-reduce", "all"], 1.5), (8, ["--sparseloco-outer-momentum", "0.5"], 1.5),
])
def test_sparseloco_default_outer_lr_follows_workers_and_topk(W, extra, lr, monkeypatch):
    """Unset (the model's size not known yet: the 3.26 M scale), the outer lr is 0.265/√(W·k/C) held in the
    measured range; given, or with reduce 'all' or a
    momentum, it is the flag's value or 1.5; the resolved value is what the strategy gets."""
    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", str(W), *extra], monkeypatch)
    validate_sparseloco_args(args, world_size=W)
    assert args.sparseloco_outer_config.lr == lr
    assert args.sparseloco_outer_lr == (float(extra[1]) if "--sparseloco-outer-lr" in extra else None)  # as given
    assert strategy_from_args(args)([torch.zeros(8192)], None, ["w"]).config.lr == lr


def test_default_outer_lr_rule():
    from megatron_sparseloco.outer.sparseloco import default_outer_lr
    assert default_outer_lr(4, 64, 4096) == 1.06
    assert default_outer_lr(8, 64, 4096) == float(f"{0.265 / (8 * 64 / 4096) ** 0.5:.3g}") == 0.75
    assert default_outer_lr(2, 64, 4096) == default_outer_lr(1, 64, 4096) == 1.5   # held at W·k/C = 1/32
    assert default_outer_lr(1000, 64, 4096) == default_outer_lr(16, 64, 4096) == 0.53   # held at 1/4


def test_default_outer_lr_keeps_three_significant_digits(monkeypatch):
    """The rule's value is written as the sweep grids write their √2 steps: 0.375 stays 0.375 (two decimals
    would run 0.38, a point no grid holds), 1.0607 is 1.06."""
    from megatron_sparseloco.outer import sparseloco
    for scale, W, lr in ((0.09375, 4, 0.375), (0.375, 8, 1.06), (0.0663, 4, 0.265), (0.265, 16, 0.53)):
        monkeypatch.setattr(sparseloco, "DEFAULT_LR_SCALE", scale)
        assert sparseloco.default_outer_lr(W, 64, 4096) == lr, (scale, W)


def test_default_outer_lr_size_term():
    """s(N) at the measured sizes, log-linear in log N between them, the end values held outside; N = 0
    (unknown) is the 3.26 M model's scale."""
    import math

    from megatron_sparseloco.outer.sparseloco import DEFAULT_LR_SCALES, default_lr_scale, default_outer_lr
    (n0, s0), (n1, s1), (n2, s2) = DEFAULT_LR_SCALES
    assert [default_outer_lr(W, 64, 4096, n1) for W in (2, 4, 8)] == [default_outer_lr(W, 64, 4096) for W in (2, 4, 8)]
    assert default_lr_scale(0) == default_lr_scale(n1) == s1
    assert default_lr_scale(n0) == default_lr_scale(n0 // 100) == s0 and default_lr_scale(n2) == default_lr_scale(10**12) == s2
    mid = int(math.sqrt(n0 * n1))   # the geometric middle: the geometric mean of the two scales
    assert math.isclose(default_lr_scale(mid), math.sqrt(s0 * s1), rel_tol=1e-6)
    assert s0 > default_lr_scale(1_000_000) > s1 > default_lr_scale(5_000_000) > s2   # falls with N
    assert default_outer_lr(4, 64, 4096, n0) == float(f"{s0 / math.sqrt(4 * 64 / 4096):.3g}")
    assert default_outer_lr(4, 64, 4096, n2) == float(f"{s2 / math.sqrt(4 * 64 / 4096):.3g}")


def test_the_size_term_follows_the_built_model_and_an_explicit_lr_wins(monkeypatch):
    """``resolve_for_model`` (the plugin calls it with the built model's N) moves a rule lr, also at fewer
    contributors, and leaves an explicit --sparseloco-outer-lr alone."""
    from megatron_sparseloco.outer.sparseloco import DEFAULT_LR_SCALES, default_outer_lr
    big = DEFAULT_LR_SCALES[-1][0]
    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "4"], monkeypatch)
    validate_sparseloco_args(args, world_size=4)
    config = args.sparseloco_outer_config
    assert config.resolve_for_model(4, big) == ("lr",)
    assert config.lr == default_outer_lr(4, 64, 4096, big) < default_outer_lr(4, 64, 4096)
    assert config.outer_lr(2) == default_outer_lr(2, 64, 4096, big)
    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "4",
                         "--sparseloco-outer-lr", "0.9"], monkeypatch)
    validate_sparseloco_args(args, world_size=4)
    assert args.sparseloco_outer_config.resolve_for_model(4, big) == () and args.sparseloco_outer_config.lr == 0.9


def test_workers_default_to_megatron_instances(monkeypatch):
    args = parse(BASE + ["--sparseloco-algorithm", "diloco", "--num-distributed-optimizer-instances", "4"], monkeypatch)
    validate_sparseloco_args(args, world_size=8)
    assert args.sparseloco_workers == 4


def test_plugin_off_changes_nothing(monkeypatch):
    args = parse([], monkeypatch)
    before = vars(args).copy()
    validate_sparseloco_args(args, world_size=4)
    assert vars(args) == before


def test_per_worker_steps_parsed(monkeypatch):
    args = parse(BASE + ["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "4",
                         "--sparseloco-inner-steps-per-worker", "30,30,15,30"], monkeypatch)
    validate_sparseloco_args(args, world_size=4)
    loop = args.sparseloco_loop_config
    assert loop.inner_steps_per_worker == [30, 30, 15, 30]
    assert loop.inner_steps == 30  # the round length
    assert [loop.inner_steps_for(w) for w in range(4)] == [30, 30, 15, 30]
    assert args.sparseloco_outer_config.topology == "ring"


# (argv, world size, the flag the error must name)
BAD = [
    (["--sparseloco-topk", "64"], 4, "--sparseloco-topk"),                                       # no algorithm
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-topk", "5000"], 4, "--sparseloco-topk"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-topk", "0"], 4, "--sparseloco-topk"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-chunk-size", "0"], 4, "--sparseloco-chunk-size"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-inner-steps", "0"], 4, "--sparseloco-inner-steps"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-ef-decay", "1.0"], 4, "--sparseloco-ef-decay"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-ef-decay", "-0.1"], 4, "--sparseloco-ef-decay"),
    (["--sparseloco-algorithm", "diloco", "--sparseloco-outer-lr", "0"], 4, "--sparseloco-outer-lr"),
    (["--sparseloco-algorithm", "diloco", "--sparseloco-outer-momentum", "1.0"], 4, "--sparseloco-outer-momentum"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-outer-nesterov"], 4, "--sparseloco-outer-nesterov"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "3"], 4, "--sparseloco-workers"),  # 3 ∤ 4
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "0"], 4, "--sparseloco-workers"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "2", "--num-distributed-optimizer-instances", "4"], 8, "--sparseloco-workers"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "1"], 4, "--sparseloco-workers"),
    (["--sparseloco-algorithm", "diloco", "--sparseloco-topk", "32"], 4, "--sparseloco-topk"),        # codec flag w/o codec
    (["--sparseloco-algorithm", "diloco", "--sparseloco-gossip-topology", "ring"], 4, "--sparseloco-gossip-topology"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-diloco-comm-dtype", "bf16"], 4, "--sparseloco-diloco-comm-dtype"),
    (["--sparseloco-algorithm", "diloco", "--sparseloco-reduce", "all"], 4, "--sparseloco-reduce"),
    (["--sparseloco-algorithm", "average", "--sparseloco-outer-lr", "0.5"], 4, "--sparseloco-outer-lr"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-bucket-size", "100"], 4, "--sparseloco-bucket-size"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-consistency-check-interval", "-1"], 4, "--sparseloco-consistency-check-interval"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-consistency-check-interval", "5"], 4, "--sparseloco-consistency-check-interval"),
    (["--sparseloco-algorithm", "sparseloco", "--sparseloco-outer-timeout", "0"], 4, "--sparseloco-outer-timeout"),
    (["--sparseloco-algorithm", "diloco", "--sparseloco-inner-steps-per-worker", "1,2"], 4, "--sparseloco-inner-steps-per-worker"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-inner-steps-per-worker", "1,2,3"], 4, "--sparseloco-inner-steps-per-worker"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-inner-steps-per-worker", "4,x"], 4, "--sparseloco-inner-steps-per-worker"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-inner-steps-per-worker", "4,0"], 4, "--sparseloco-inner-steps-per-worker"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-inner-steps", "5", "--sparseloco-inner-steps-per-worker", "4,2"], 4, "--sparseloco-inner-steps"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "3", "--sparseloco-gossip-topology", "exponential"], 3, "--sparseloco-gossip-topology"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-gossip-proposal-lr", "0"], 4, "--sparseloco-gossip-proposal-lr"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-gossip-step", "0.1"], 4, "--sparseloco-gossip-step"),
    (["--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2", "--sparseloco-gossip-compress", "--sparseloco-ef-decay", "0.9"], 4, "--sparseloco-ef-decay"),
    (["--sparseloco-algorithm", "sparseloco", "--calculate-per-token-loss"], 4, "--calculate-per-token-loss"),
    (["--sparseloco-algorithm", "sparseloco", "--overlap-param-gather-with-optimizer-step"], 4, "--overlap-param-gather-with-optimizer-step"),
    (["--sparseloco-algorithm", "sparseloco", "--save", "/tmp/x", "--ckpt-format", "torch"], 4, "--ckpt-format"),
    (["--sparseloco-algorithm", "sparseloco", "--tensor-model-parallel-size", "3"], 4, "TP×PP×CP"),
]


@pytest.mark.parametrize("argv,world,flag", BAD, ids=[" ".join(c[0][-2:]) for c in BAD])
def test_bad_input_names_flag_and_fix(argv, world, flag, monkeypatch):
    args = parse(BASE + argv, monkeypatch)
    with pytest.raises(SparseLoCoArgumentError) as err:
        validate_sparseloco_args(args, world_size=world)
    msg = str(err.value)
    assert flag in msg and "Fix:" in msg, msg


def test_workers_need_distributed_optimizer(monkeypatch):
    args = parse(["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "2"], monkeypatch)
    with pytest.raises(SparseLoCoArgumentError, match="--use-distributed-optimizer"):
        validate_sparseloco_args(args, world_size=4)


def test_moe_worker_must_hold_whole_ep_groups(monkeypatch):
    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "4", "--num-experts", "4",
                         "--expert-model-parallel-size", "2"], monkeypatch)
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-workers.*expert"):
        validate_sparseloco_args(args, world_size=4)


def test_every_algorithm_builds_its_strategy_from_flags(monkeypatch):
    """The flag → strategy-config mapping names only fields the strategy accepts."""
    import torch

    cases = [["--sparseloco-algorithm", a] for a in ("sparseloco", "diloco", "average")]
    cases.append(["--sparseloco-algorithm", "gasloc", "--sparseloco-gossip-compress", "--sparseloco-topk", "32"])
    cases.append(["--sparseloco-algorithm", "gasloc"])
    for argv in cases:
        args = parse(BASE + argv + ["--sparseloco-workers", "2"], monkeypatch)
        validate_sparseloco_args(args, world_size=4)
        strategy = strategy_from_args(args)([torch.zeros(8192)], None, ["w"])
        assert strategy.name == args.sparseloco_algorithm


def test_aggregation_flag_reaches_the_strategy(monkeypatch):
    import torch

    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "2",
                         "--sparseloco-aggregation", "reduce-scatter"], monkeypatch)
    validate_sparseloco_args(args, world_size=4)
    strategy = strategy_from_args(args)([torch.zeros(8192)], None, ["w"])
    assert strategy.config.aggregation == "reduce-scatter" and strategy.reduce_scatter is not None


def test_hierarchical_aggregation_flags_reach_the_strategy_and_are_checked_against_w(monkeypatch):
    import torch

    flags = BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "4",
                    "--sparseloco-aggregation", "hierarchical"]
    args = parse(flags + ["--sparseloco-aggregation-groups", "2"], monkeypatch)
    validate_sparseloco_args(args, world_size=4)
    strategy = strategy_from_args(args)([torch.zeros(8192)], None, ["w"])
    assert strategy.config.aggregation_groups == 2 and strategy.site_groups is not None
    for extra, why in ((["--sparseloco-aggregation-groups", "3"], "site groups do not divide the 4 workers"),
                       ([], "number of site groups")):
        args = parse(flags + extra, monkeypatch)
        with pytest.raises(SparseLoCoArgumentError, match=f"(?s)--sparseloco-aggregation-groups.*{why}"):
            validate_sparseloco_args(args, world_size=4)
    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "4",
                         "--sparseloco-aggregation-groups", "2"], monkeypatch)
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-aggregation-groups"):
        validate_sparseloco_args(args, world_size=4)


@pytest.mark.parametrize("extra", [["--sparseloco-chunking", "flat"], ["--sparseloco-index-coding", "entropy"]])
def test_reduce_scatter_needs_tensor_chunking_and_packed_indices(extra, monkeypatch):
    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "2",
                         "--sparseloco-aggregation", "reduce-scatter", *extra], monkeypatch)
    with pytest.raises(SparseLoCoArgumentError, match="--sparseloco-aggregation"):
        validate_sparseloco_args(args, world_size=4)


@pytest.mark.parametrize("extra,shown", [
    ([], "0.75 (default for W = 8: s(N)/√(W·k/C) with W·k/C held in [1/32, 1/4] and s = 0.375 / 0.265 / 0.06625 "
         "at N = 0.446 / 3.26 / 10.8 M parameters (log-interpolated, the end values held outside), the best outer "
         "lr measured at each size (docs/integration.md))"),
    (["--sparseloco-outer-lr", "0.75"], 0.75),
])
def test_startup_block_says_when_the_outer_lr_came_from_the_rule(extra, shown, monkeypatch):
    from megatron_sparseloco.megatron.args.startup_report import resolved_settings
    args = parse(BASE + ["--sparseloco-algorithm", "sparseloco", "--sparseloco-workers", "8", *extra], monkeypatch)
    validate_sparseloco_args(args, world_size=8)
    assert resolved_settings(args)["outer-lr"] == shown
