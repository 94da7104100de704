"""The elastic flags: every bad value refused with one error naming the flag and the fix."""
import argparse
import os

import pytest

from megatron_sparseloco.elastic.config import ElasticConfig, add_elastic_args, elastic_flags, validate_elastic_args
from megatron_sparseloco.megatron.args import SparseLoCoArgumentError, dest_of


def parse(argv, **extra):
    parser = argparse.ArgumentParser()
    add_elastic_args(parser)
    args = parser.parse_args(argv)
    defaults = dict(sparseloco_algorithm="sparseloco", sparseloco_workers=3, num_distributed_optimizer_instances=1)
    for k, v in {**defaults, **extra}.items():
        setattr(args, k, v)
    return args


def good(token, *more):
    return ["--sparseloco-lighthouse", "http://lighthouse:29510", "--sparseloco-worker-index", "2",
            "--sparseloco-elastic-token-file", token, *more]


def refused(argv, flag, **extra):
    with pytest.raises(SparseLoCoArgumentError) as exc:
        validate_elastic_args(parse(argv, **extra))
    msg = str(exc.value)
    assert msg.startswith(flag + ":") or flag in msg.split(". Fix:")[0], msg
    assert "Fix:" in msg, msg
    return msg


def test_a_complete_set_is_accepted_and_attached_to_args(token):
    args = parse(good(token, "--sparseloco-min-workers", "2", "--sparseloco-elastic-manager-port", "29600"),
                 sparseloco_aggregation="allgather", sparseloco_fragments=1, sparseloco_overlap_steps=0)
    config = validate_elastic_args(args)
    assert isinstance(config, ElasticConfig) and args.sparseloco_elastic is config
    assert (config.worker_index, config.min_workers, config.manager_port) == (2, 2, 29600)
    assert config.heal_timeout == 600.0 and validate_elastic_args(parse(good(
        token, "--sparseloco-elastic-heal-timeout", "1.5"))).heal_timeout == 1.5


def test_elastic_mode_is_off_without_a_lighthouse_and_changes_nothing():
    args = parse([])
    before = vars(args).copy()
    assert validate_elastic_args(args) is None and vars(args) == before


def test_every_flag_has_its_dest_and_help():
    parser = add_elastic_args(argparse.ArgumentParser())
    assert add_elastic_args(parser) is parser   # idempotent
    dests = {a.dest for a in parser._actions}
    for flag, spec in elastic_flags().items():
        assert dest_of(flag) in dests and spec.help
    assert {"lighthouse", "worker-index", "min-workers", "elastic-token-file"} <= set(elastic_flags())


@pytest.mark.parametrize("flag,value", [("--sparseloco-worker-index", "1"), ("--sparseloco-min-workers", "2"),
                                        ("--sparseloco-elastic-token-file", "x")])
def test_elastic_flags_without_a_lighthouse_are_refused(flag, value):
    msg = refused([flag, value], flag)
    assert "--sparseloco-lighthouse" in msg


def test_a_lighthouse_needs_an_algorithm(token):
    refused(good(token), "--sparseloco-lighthouse", sparseloco_algorithm=None)


@pytest.mark.parametrize("url", ["lighthouse:29510", "http://lighthouse", "ftp://lighthouse:1", "http://:29510",
                                 "http://lighthouse:29510/path", "http://lighthouse:port"])
def test_bad_lighthouse_urls(token, url):
    argv = good(token)
    argv[1] = url
    refused(argv, "--sparseloco-lighthouse")


@pytest.mark.parametrize("argv_edit,extra,flag", [
    ((), {"sparseloco_workers": None}, "--sparseloco-workers"),
    ((), {"sparseloco_workers": 0}, "--sparseloco-workers"),
    ((("--sparseloco-worker-index", "3"),), {}, "--sparseloco-worker-index"),
    ((("--sparseloco-worker-index", "-1"),), {}, "--sparseloco-worker-index"),
    ((("--sparseloco-min-workers", "0"),), {}, "--sparseloco-min-workers"),
    ((("--sparseloco-min-workers", "4"),), {}, "--sparseloco-min-workers"),
    ((), {"num_distributed_optimizer_instances": 2}, "--num-distributed-optimizer-instances"),
])
def test_bad_slots(token, argv_edit, extra, flag):
    argv = good(token, *[x for pair in argv_edit for x in pair])   # argparse keeps the last value given
    refused(argv, flag, **extra)


def test_a_missing_worker_index_is_refused(token):
    argv = good(token)
    del argv[2:4]
    refused(argv, "--sparseloco-worker-index")


@pytest.mark.parametrize("flag,value", [
    ("--sparseloco-elastic-quorum-timeout", "0"), ("--sparseloco-elastic-quorum-timeout", "nan"),
    ("--sparseloco-elastic-connect-timeout", "-1"), ("--sparseloco-elastic-heartbeat-interval", "0"),
    ("--sparseloco-elastic-manager-port", "65536"), ("--sparseloco-elastic-manager-port", "-1"),
    ("--sparseloco-elastic-max-failed-rounds", "-1"), ("--sparseloco-elastic-heal-chunk-mb", "0"),
    ("--sparseloco-elastic-heal-chunk-mb", "1025"), ("--sparseloco-elastic-heal-timeout", "0"),
    ("--sparseloco-elastic-heal-timeout", "nan"),
])
def test_bad_numbers(token, flag, value):
    refused(good(token, flag, value), flag)


def test_a_token_file_is_required(token):
    argv = good(token)
    del argv[4:6]
    refused(argv, "--sparseloco-elastic-token-file")


@pytest.mark.parametrize("case", ["missing", "directory", "other-readable", "short"])
def test_bad_token_files(tmp_path, token, case):
    path = tmp_path / "bad"
    if case == "directory":
        path.mkdir()
        os.chmod(path, 0o700)
    elif case != "missing":
        path.write_text("short\n" if case == "short" else "0123456789abcdef0123456789abcdef")
        os.chmod(path, 0o604 if case == "other-readable" else 0o600)
    msg = refused(good(str(path)), "--sparseloco-elastic-token-file")
    assert str(path) in msg
    if case == "other-readable":
        assert "chmod" in msg


@pytest.mark.parametrize("attr,value,flag", [
    ("sparseloco_aggregation", "reduce-scatter", "--sparseloco-aggregation"),
    ("sparseloco_aggregation", "hierarchical", "--sparseloco-aggregation"),
    ("sparseloco_inner_steps_per_worker", "30,30,15", "--sparseloco-inner-steps-per-worker"),
])
def test_modes_not_membership_aware_are_refused(token, attr, value, flag):
    msg = refused(good(token), flag, **{attr: value})
    assert "elastic mode" in msg


def test_elastic_overlap_and_fragments_and_grace_are_accepted(token):
    """Delayed rounds (τ), fragments (P) and the straggler grace follow a changing membership."""
    args = parse(good(token, "--sparseloco-elastic-grace", "1.5"), sparseloco_overlap_steps=2, sparseloco_fragments=2)
    config = validate_elastic_args(args)
    assert config is not None and config.grace == 1.5


def test_a_negative_elastic_grace_is_refused(token):
    assert ">= 0" in refused(good(token, "--sparseloco-elastic-grace", "-1"), "--sparseloco-elastic-grace")
