"""The layout helper must reproduce megatron-core's own process groups, and refuse bad layouts."""
import itertools
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_sparseloco.megatron.placement.rank_layout import (DEFAULT_ORDER, TP_PP_DP_ORDER, LayoutError,
                                                                compute_layout, expand_nodelist, orthogonal_groups)
from megatron_sparseloco.worker_layout import main
from megatron_sparseloco.testing.multirank import run_ranks


def _real_groups(rank, world_size, cases):
    """Build Megatron's real groups on this gloo rank, once per case, and report the ones we predict."""
    import time
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    out = []
    for kw in cases:
        t0 = time.monotonic()
        ps.initialize_model_parallel(**kw)
        intra = sorted(dist.get_process_group_ranks(ps.get_intra_distributed_optimizer_instance_group()))
        inter = dist.get_process_group_ranks(ps.get_inter_distributed_optimizer_instance_group())
        dense_intra = dist.get_process_group_ranks(
            ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True))
        out.append({"intra": intra, "inter": list(inter), "dense_intra": list(dense_intra),
                    "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                    "seconds": time.monotonic() - t0})
        ps.destroy_model_parallel()
        dist.barrier()  # rank 0 hosts the store: nobody leaves while a peer still builds groups
    return out


# (tp, pp, cp, ep, W, order) on 8 real gloo ranks (2 nodes x 4 in the prediction). All cases share
# one set of 8 processes: start-up (importing megatron) dominates on 2 shared cores.
REAL_CASES = [
    (2, 1, 1, 1, 2, DEFAULT_ORDER),
    (1, 2, 1, 1, 2, DEFAULT_ORDER),
    (1, 2, 1, 1, 2, TP_PP_DP_ORDER),
    (2, 2, 1, 1, 2, DEFAULT_ORDER),
    (1, 1, 2, 1, 2, DEFAULT_ORDER),
    (1, 1, 1, 2, 2, DEFAULT_ORDER),
    (2, 1, 1, 1, 4, DEFAULT_ORDER),
]


def test_layout_matches_real_parallel_state():
    world = 8
    cases = [dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                  expert_model_parallel_size=ep, num_distributed_optimizer_instances=W, order=order,
                  create_gloo_process_groups=False) for tp, pp, cp, ep, W, order in REAL_CASES]
    real_all = run_ranks(_real_groups, world_size=world, args=(cases,), timeout=420)
    for i, (tp, pp, cp, ep, W, order) in enumerate(REAL_CASES):
        real = [real_all[r][i] for r in range(world)]
        case = (tp, pp, cp, ep, W, order)
        lay = compute_layout(nodes=2, gpus_per_node=world // 2, tp=tp, pp=pp, cp=cp, ep=ep, workers=W, order=order)
        assert len(lay.worker_ranks) == W
        for r in range(world):
            w = lay.worker_of_rank(r)
            assert real[r]["intra"] == lay.worker_ranks[w], (case, r, real[r], lay.worker_ranks)
            mine = [g for g in lay.cross_worker_groups if r in g]
            assert len(mine) == 1
            assert real[r]["inter"] == mine[0], (case, r, real[r]["inter"], lay.cross_worker_groups)
            dense = [g for g in lay.dense_intra_dp_cp_groups if r in g]
            assert len(dense) == 1 and real[r]["dense_intra"] == dense[0], (case, r)
        # Each cross-worker group: one rank per worker, at the same position in every worker ...
        for g in lay.cross_worker_groups:
            assert [lay.worker_of_rank(r) for r in g] == list(range(W)), case
            assert len({lay.worker_ranks[w].index(r) for w, r in enumerate(g)}) == 1, case
            # ... holding the same model shard (same tp and pp rank).
            assert len({(real[r]["tp"], real[r]["pp"]) for r in g}) == 1, case


def test_orthogonal_groups_match_megatron_generator():
    from megatron.core.parallel_state import generate_masked_orthogonal_rank_groups
    for sizes in ([2, 3, 4], [2, 1, 2, 2], [1, 2, 2, 2, 3], [4, 2, 1, 2, 2]):
        for mask in itertools.product([True, False], repeat=len(sizes)):
            assert orthogonal_groups(sizes, mask) == generate_masked_orthogonal_rank_groups(
                math.prod(sizes), sizes, list(mask)), (sizes, mask)


def test_pp_default_order_interleaves_workers_across_nodes():
    lay = compute_layout(nodes=2, gpus_per_node=4, pp=2, workers=2)
    assert lay.worker_ranks == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lay.worker_nodes == [[0, 1], [0, 1]]
    # The same job split across two sites must be refused, and the fix named.
    with pytest.raises(LayoutError, match="--use-tp-pp-dp-mapping"):
        compute_layout(nodes=2, gpus_per_node=4, pp=2, workers=2, sites="0,1")
    lay = compute_layout(nodes=2, gpus_per_node=4, pp=2, workers=2, sites="0,1", order=TP_PP_DP_ORDER)
    assert lay.worker_ranks == [[0, 1, 2, 3], [4, 5, 6, 7]] and lay.worker_sites == [0, 1]


def test_16_ranks_tp2_pp2_w2_sites():
    lay = compute_layout(nodes=4, gpus_per_node=4, tp=2, pp=2, workers=2, order=TP_PP_DP_ORDER, sites="0,0,1,1")
    assert lay.worker_ranks == [list(range(8)), list(range(8, 16))]
    assert lay.worker_nodes == [[0, 1], [2, 3]] and lay.worker_sites == [0, 1]
    assert sorted(map(tuple, lay.cross_worker_groups)) == [(i, i + 8) for i in range(8)]
    # Sites interleaved node by node: every worker would cross the slow link.
    with pytest.raises(LayoutError, match="spans sites"):
        compute_layout(nodes=4, gpus_per_node=4, tp=2, pp=2, workers=2, order=TP_PP_DP_ORDER, sites="0,1,0,1")


@pytest.mark.parametrize("kw,msg", [
    (dict(nodes=2, gpus_per_node=4, tp=3), "not divisible by tp\\*pp\\*cp"),
    (dict(nodes=2, gpus_per_node=4, tp=2, workers=3), "--sparseloco-workers 3 does not divide the data-parallel size 4"),
    (dict(nodes=2, gpus_per_node=4, ep=8, workers=2), "expert data-parallel size 1"),
    (dict(nodes=2, gpus_per_node=4, workers=2, sites="0,1,1"), "--sites has 3 entries"),
    (dict(nodes=2, gpus_per_node=4, workers=0), "--workers must be >= 1"),
    (dict(nodes=2, gpus_per_node=4, workers=2, sites="0,x"), "comma-separated integer"),
    (dict(nodes=2, gpus_per_node=4, order="tp-dp-pp"), "permutation"),
    (dict(nodes=2, gpus_per_node=4, workers=1, sites="0,1"), "spans sites"),
])
def test_bad_layouts_rejected(kw, msg):
    with pytest.raises(LayoutError, match=msg):
        compute_layout(**kw)


def test_expand_nodelist():
    assert expand_nodelist("node[01-04]") == ["node01", "node02", "node03", "node04"]
    assert expand_nodelist("a,b,c") == ["a", "b", "c"]
    assert expand_nodelist("gpu[8-10,3]x,cpu1") == ["gpu8x", "gpu9x", "gpu10x", "gpu3x", "cpu1"]
    assert expand_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]
    with pytest.raises(LayoutError):
        expand_nodelist("node[01-04")


def test_cli_json_and_errors(capsys):
    assert main(["--nodes", "2", "--gpus-per-node", "4", "--tp", "2", "--workers", "2", "--json",
                 "--hostnames", "n[1-2]"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["worker_ranks"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d["hostnames"] == ["n1", "n2"] and d["dp"] == 4
    assert main(["--nodes", "2", "--gpus-per-node", "4", "--tp", "2", "--workers", "3"]) == 2
    err = capsys.readouterr().err
    assert "--sparseloco-workers 3" in err and "choose W among" in err
    # The console-script entry point in a fresh interpreter (what the sbatch script calls).
    p = subprocess.run([sys.executable, "-m", "megatron_sparseloco.worker_layout", "--nodes", "4",
                        "--gpus-per-node", "2", "--workers", "2", "--sites", "0,0,1,1"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert "worker 0: site 0, ranks 0-3, nodes node0, node1" in p.stdout
    assert "worker 1: site 1, ranks 4-7, nodes node2, node3" in p.stdout


def test_elastic_job_is_one_worker():
    """In elastic mode (--sparseloco-lighthouse) the arguments are one job's: one worker, whatever W."""
    from megatron_sparseloco.worker_layout import sizes_from_megatron_args
    argv = ["--tensor-model-parallel-size", "2", "--sparseloco-workers", "4"]
    assert sizes_from_megatron_args(argv)["workers"] == 4
    assert sizes_from_megatron_args(argv + ["--sparseloco-lighthouse", "http://lh:29510"])["workers"] == 1


def test_the_sbatch_helpers_start_without_importing_torch():
    """The sbatch script calls ``worker_layout`` on every node before torchrun (a node list, the layout): those
    calls must not pay torch's import; only ``--megatron-args`` (the plugin's own flag parser) imports it."""
    code = ("import sys; from megatron_sparseloco.worker_layout import main; "
            "main(['--expand-nodelist', 'n[1-2]']); main(['--nodes', '2', '--gpus-per-node', '4', '--workers', '2', "
            "'--quiet']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["n1", "n2", "False"], out.stdout
