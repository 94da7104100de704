"""Resume refusals name the flag and the way out; --no-load-optim / --finetune print the promised warning."""
import argparse

import pytest

from megatron_sparseloco.megatron.checkpoint.outer_state import FORMAT_VERSION, OuterStateLayoutError, check_saved_metadata
from megatron_sparseloco.megatron.plugin import explain_resume_error
from megatron_sparseloco.megatron.args.startup_report import outer_state_skip_warning

SAVED = {"format": FORMAT_VERSION, "num_workers": 2, "algorithms": ["sparseloco"]}


@pytest.mark.parametrize("saved,workers,algos,flag", [
    (dict(SAVED, num_workers=4), 2, ["sparseloco"], "--sparseloco-workers 4"),
    (SAVED, 2, ["diloco"], "--sparseloco-algorithm sparseloco"),
    (dict(SAVED, format=-1), 2, ["sparseloco"], "megatron_sparseloco that saved it"),
])
def test_each_refusal_names_the_flag_and_the_way_out(saved, workers, algos, flag):
    with pytest.raises(OuterStateLayoutError) as err:
        check_saved_metadata(saved, workers, algos)
    msg = str(err.value)
    assert flag in msg and "Fix:" in msg
    assert "--no-load-optim" in msg and "--finetune" in msg, msg


def _args(**kw):
    base = dict(load=None, pretrained_checkpoint=None, no_load_optim=False, finetune=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("flag", ["no_load_optim", "finetune"])
def test_skipping_the_optimizer_state_warns(flag):
    msg = outer_state_skip_warning(_args(load="/ckpt", **{flag: True}))
    assert msg and f"--{flag.replace('_', '-')}" in msg and "not loaded" in msg and "anchored" in msg


def test_no_warning_when_the_outer_state_is_loaded_or_nothing_is():
    assert outer_state_skip_warning(_args(load="/ckpt")) is None
    assert outer_state_skip_warning(_args(no_load_optim=True)) is None     # no checkpoint at all


def test_tp_change_gets_the_real_fix_instead_of_megatrons_hint():
    from megatron.training import checkpointing as mckpt
    import inspect
    src = inspect.getsource(mckpt)
    assert "(TP, PP) mismatch after resume" in src and "--ckpt-fully-parallel-save" in src, \
        "megatron-core changed this refusal; update explain_resume_error"
    megatron_says = RuntimeError("(TP, PP) mismatch after resume ((2, 1) vs (1, 1) from checkpoint): not supported for "
                                 "DistributedOptimizer with sharding type dp_reshardable. Please use "
                                 "`--ckpt-fully-parallel-save` flag during checkpoint saving.")
    ours = explain_resume_error(megatron_says)
    assert ours.startswith("(TP, PP) mismatch after resume ((2, 1) vs (1, 1) from checkpoint)")
    assert "--tensor-model-parallel-size" in ours and "--no-load-optim" in ours and "Fix:" in ours
    assert explain_resume_error(RuntimeError("something else")) is None
