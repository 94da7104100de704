"""Smoke tests: the real megatron-core (and megatron.training) train a tiny GPT on CPU over gloo.

Each test spawns gloo ranks with ``run_ranks``; the helpers of
``megatron_sparseloco.testing.megatron_harness`` run inside the ranks.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import time

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_sparseloco.testing.multirank import run_ranks  # noqa: E402
from megatron_sparseloco.testing.prefork import use_prefork  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.megatron]

TIMEOUT = 120


# ----------------------------------------------------------------------------------------------
# rank functions (module level: spawn pickles them by reference)
# ----------------------------------------------------------------------------------------------
def _train_rank(rank, world_size, tp, pp, ep, moe, steps, lr):
    """Train a few steps; return parallel ranks, losses and the final params."""
    from megatron.core import parallel_state as ps

    from megatron_sparseloco.testing import megatron_harness as mh

    mh.init_megatron(tp=tp, pp=pp, ep=ep)
    chunks = mh.build_tiny_gpt(moe=moe)
    ddp, opt = mh.wrap_ddp_and_optimizer(chunks, lr=lr, use_distributed_optimizer=True)
    batches = mh.synthetic_batches(0, 2, 32, 128, ps.get_data_parallel_rank())
    losses = [mh.train_step(ddp, opt, batches, num_microbatches=2) for _ in range(steps)]
    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "losses": losses,
        "params": mh.params_fingerprint(ddp),
    }


def _assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def _assert_learns(losses, what: str) -> None:
    assert all(math.isfinite(x) for x in losses), f"{what}: {losses}"
    assert losses[-1] < losses[0] - 0.05, f"{what}: loss did not fall: {losses}"


# ----------------------------------------------------------------------------------------------
def test_dp2_distributed_optimizer():
    """DP2 + distributed optimizer: loss falls on both ranks, params stay bitwise identical."""
    res = run_ranks(_train_rank, 2, args=(1, 1, 1, False, 4, 1e-2), timeout=TIMEOUT)
    for r in res:
        _assert_learns(r["losses"], f"dp rank {r['dp']}")
    assert res[0]["losses"] != res[1]["losses"], "DP ranks must see different data"
    _assert_identical(res[0]["params"], res[1]["params"], "DP replicas")


def test_tp2_dp2():
    """TP2×DP2: TP peers agree on the loss; DP replicas of each TP shard are bitwise identical."""
    res = run_ranks(_train_rank, 4, args=(2, 1, 1, False, 3, 1e-2), timeout=TIMEOUT)
    by = {(r["tp"], r["dp"]): r for r in res}
    assert set(by) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for dp in (0, 1):
        assert by[(0, dp)]["losses"] == pytest.approx(by[(1, dp)]["losses"], abs=1e-5)
        _assert_learns(by[(0, dp)]["losses"], f"dp {dp}")
    for tp in (0, 1):
        _assert_identical(by[(tp, 0)]["params"], by[(tp, 1)]["params"], f"tp {tp} replicas")
    # the two TP ranks hold different shards of the QKV weight
    name = next(n for n in by[(0, 0)]["params"] if "linear_qkv.weight" in n)
    assert not torch.equal(by[(0, 0)]["params"][name], by[(1, 0)]["params"][name])


def test_pp2_dp2():
    """PP2×DP2: the last stage reports a falling loss, the first stage nan; replicas identical;
    the tied embedding / output weight agree across the two stages."""
    res = run_ranks(_train_rank, 4, args=(1, 2, 1, False, 3, 1e-2), timeout=TIMEOUT)
    by = {(r["pp"], r["dp"]): r for r in res}
    assert set(by) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for dp in (0, 1):
        assert all(math.isnan(x) for x in by[(0, dp)]["losses"])
        _assert_learns(by[(1, dp)]["losses"], f"last stage dp {dp}")
    for pp in (0, 1):
        _assert_identical(by[(pp, 0)]["params"], by[(pp, 1)]["params"], f"stage {pp} replicas")
    first, last = by[(0, 0)]["params"], by[(1, 0)]["params"]
    emb = [n for n in first if "word_embeddings.weight" in n]
    out = [n for n in last if "output_layer.weight" in n or "word_embeddings.weight" in n]
    assert emb and out, (list(first), list(last))
    assert torch.equal(first[emb[0]], last[out[0]]), "tied embedding diverged between stages"


def test_moe_ep2_dp2():
    """MoE (4 experts, all-to-all dispatcher) EP2×DP2: loss falls; dense params identical on all
    ranks; expert params identical across expert-DP replicas and different across EP ranks."""
    res = run_ranks(_train_rank, 4, args=(1, 1, 2, True, 3, 1e-2), timeout=TIMEOUT)
    for r in res:
        _assert_learns(r["losses"], f"rank dp {r['dp']} ep {r['ep']}")
    names = list(res[0]["params"])
    experts = [n for n in names if ".experts." in n]
    dense = [n for n in names if ".experts." not in n]
    assert experts and dense
    for r in res[1:]:
        for n in dense:
            assert torch.equal(res[0]["params"][n], r["params"][n]), n
    by_ep = {}
    for r in res:
        by_ep.setdefault(r["ep"], []).append(r)
    assert sorted(by_ep) == [0, 1] and all(len(v) == 2 for v in by_ep.values())
    for ep, (a, b) in by_ep.items():
        for n in experts:
            assert torch.equal(a["params"][n], b["params"][n]), f"ep {ep}: {n}"
    assert any(not torch.equal(by_ep[0][0]["params"][n], by_ep[1][0]["params"][n]) for n in experts)


# ----------------------------------------------------------------------------------------------
def _reduced_grads(ddp, params, group) -> torch.Tensor:
    """Flat reduced gradient of ``params`` as the distributed optimizer sees it.

    After the intra-instance reduce-scatter (+ inter-instance all-reduce) each rank of the instance
    holds the reduced values of its own shard of every bucket; the shards are all-gathered over the
    instance and read back through each param's ``main_grad`` view into the grad buffer.
    """
    import torch.distributed as dist

    size = dist.get_world_size(group)
    full = {}
    for buf in ddp.buffers + ddp.expert_parallel_buffers:
        base = buf.grad_data
        gathered = [torch.empty_like(base) for _ in range(size)]
        dist.all_gather(gathered, base, group=group)
        combined = base.clone()
        for bucket in buf.buckets:
            off = (bucket.grad_data.data_ptr() - base.data_ptr()) // base.element_size()
            shard = bucket.grad_data.numel() // size
            for i in range(size):
                combined[off + i * shard: off + (i + 1) * shard] = gathered[i][off + i * shard: off + (i + 1) * shard]
        full[base.data_ptr()] = (base, combined)
    out = []
    for p in params:
        for base, combined in full.values():
            off = (p.main_grad.data_ptr() - base.data_ptr()) // base.element_size()
            if 0 <= off < base.numel():
                out.append(combined[off: off + p.numel()])
                break
        else:
            raise AssertionError("param main_grad not in any grad buffer")
    return torch.cat(out)


def _two_instances_rank(rank, world_size):
    """DP4 as 2 distributed-optimizer instances of 2: the reduced gradient must be the mean of all
    4 ranks' local gradients (intra-instance reduce-scatter + inter-instance all-reduce)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sparseloco.testing import megatron_harness as mh

    mh.init_megatron(num_distributed_optimizer_instances=2)
    chunks = mh.build_tiny_gpt()
    model = chunks[0]
    batch = next(mh.synthetic_batches(0, 2, 32, 128, ps.get_data_parallel_rank()))

    # Reference: this rank's local gradient of the mean token loss, by plain autograd.
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    loss = (out.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    local = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)

    ddp, opt = mh.wrap_ddp_and_optimizer(chunks, num_distributed_optimizer_instances=2)
    mh.train_step(ddp, opt, iter([batch]), num_microbatches=1)
    intra = ps.get_intra_distributed_optimizer_instance_group()
    reduced = _reduced_grads(ddp[0], params, intra)
    return {"reduced": reduced, "grads": torch.stack(gathered),
            "intra_ranks": dist.get_process_group_ranks(intra),
            "params": mh.params_fingerprint(ddp)}


def test_dp4_two_distributed_optimizer_instances():
    res = run_ranks(_two_instances_rank, 4, timeout=TIMEOUT)
    grads = res[0]["grads"]
    instances = {tuple(r["intra_ranks"]) for r in res}
    assert len(instances) == 2 and all(len(i) == 2 for i in instances), instances
    expected = grads.mean(0)
    for r in res:
        torch.testing.assert_close(r["reduced"], expected, rtol=1e-5, atol=1e-7)
        _assert_identical(res[0]["params"], r["params"], "replicas after the step")
    # Guard: the check can tell an intra-instance-only reduction from the full one.
    inst = sorted(instances)[0]
    assert (grads[list(inst)].mean(0) - expected).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------
def test_megatron_training_pretrain_two_ranks(tmp_path):
    """megatron.training.pretrain trains a tiny GPT on 2 gloo ranks with --mock-data: examples/pretrain_gpt.py
    under megatron_sparseloco.run with no --sparseloco-* flag (plugin off: plain Megatron + CPU bridges)."""
    from megatron_sparseloco.demo import build_command

    iters = 5
    cmd = build_command({"train": "unused", "valid": "unused"}, nproc=2, algorithm="none", train_iters=iters,
                        eval_interval=iters, eval_iters=1, log_interval=1, micro_batch_size=2, seq_length=32,
                        extra=["--hidden-size", "64", "--mock-data", "--split", "98,1,1", "--ckpt-format", "torch_dist",
                               "--save", str(tmp_path / "ckpt"), "--save-interval", str(iters)])
    i = cmd.index("--train-data-path")
    del cmd[i:i + 4]  # --train-data-path X --valid-data-path Y: mock data instead
    assert "--sparseloco-algorithm" not in cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    t0 = time.monotonic()
    proc = subprocess.run(use_prefork(cmd), env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    seen = [int(m) for m in re.findall(r"iteration\s+(\d+)/\s*%d" % iters, out)]
    assert seen == list(range(1, iters + 1)), out[-8000:]
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.eE+-]+)", out)]
    assert len(losses) >= iters and all(math.isfinite(x) for x in losses), out[-8000:]
    # the torch_dist checkpoint written at the last iteration (one shard file per rank)
    ckpt = tmp_path / "ckpt" / f"iter_{iters:07d}"
    assert (ckpt / "metadata.json").exists() and len(list(ckpt.glob("*.distcp"))) == 2, out[-4000:]
    print(f"pretrain: {time.monotonic() - t0:.1f} s, losses {losses}")
