"""SparseLoCo with ``aggregation="hierarchical"`` (outer/sparse_hierarchical.py).

* θ_outer and the error feedback equal all-gather's bit for bit on every rank, for W = 4 in 1, 2
  and 4 site groups and W = 6 in 3 groups of 2 (tensor chunking) and W = 4 in 2 groups (flat chunking);
* bytes: each phase counted exactly — the rail exchange (G − 1 payloads out and in, the WAN bytes
  in the stats) and the site gather (the G-payload rail set to and from each of the g − 1 members);
* a corrupted payload is still rejected naming its worker, on every rank that received it;
* bad settings are refused naming ``aggregation_groups`` before any rank starts.
"""
from __future__ import annotations

import re

import pytest
import torch

from megatron_sparseloco.compress.errors import PayloadError
from megatron_sparseloco.outer.base import ConfigError
from megatron_sparseloco.outer.sparse_hierarchical import SiteGroups
from megatron_sparseloco.outer.sparseloco import SparseLoCoConfig
from test_outer_sparseloco_tensor import add_drift, layout_strategy

LAYOUT = "pos1of3"
BASE = dict(chunk=64, k=4, bucket_numel=2000)
FLAT = dict(BASE, chunking="flat")
STEPS = 3


def test_site_groups_layout():
    sg = SiteGroups(6, 5, 3)
    assert (sg.size, sg.site, sg.index, sg.members, sg.rail) == (2, 2, 1, [4, 5], [1, 3, 5])
    with pytest.raises(ValueError, match="cannot be cut into 4 equal groups"):
        SiteGroups(6, 0, 4)


def test_config_refuses_what_hierarchical_cannot_do():
    with pytest.raises(ConfigError, match="number of site groups"):
        SparseLoCoConfig(aggregation="hierarchical").validate()
    with pytest.raises(ConfigError, match="index_coding='packed'"):
        SparseLoCoConfig(aggregation="hierarchical", aggregation_groups=2, index_coding="entropy").validate()
    with pytest.raises(ConfigError, match="aggregation_groups"):
        SparseLoCoConfig(aggregation_groups=2).validate_given({"aggregation_groups"})
    cfg = SparseLoCoConfig(aggregation="hierarchical", aggregation_groups=4).validate()
    with pytest.raises(ConfigError, match="4 site groups do not divide the 6 workers.*e.g. 3"):
        cfg.check_workers(6)
    cfg.check_workers(8)


def drive(rank: int, world: int, fields: dict, corrupt_rank=None, steps=STEPS):
    sls, params, strat = layout_strategy(LAYOUT, fields)
    if corrupt_rank == rank:
        compress = strat._compress

        def corrupt(*a):
            payload, local = compress(*a)
            payload = payload.clone()
            payload[0] ^= 1   # the bucket header's magic
            return payload, local
        strat._compress = corrupt
    out = {"anchor": [], "error": [], "stats": [], "buckets": len(list(strat.buckets())),
           "expected_sent": strat.expected_payload_bytes()}
    for step in range(1, steps + 1):
        add_drift(params, sls, rank, step)
        try:
            st = strat.step()
        except PayloadError as exc:
            return {"error": str(exc)}
        out["stats"].append(st.as_dict())
        out["anchor"].append(strat.anchor.clone())
        out["error"].append(strat.error_feedback.clone())
        out["by_kind"] = dict(strat.counter.by_kind)
    return out


def drive_jobs(rank, world, jobs):
    return [drive(rank, world, **j) for j in jobs]


CASES = {4: {"allgather": dict(fields=BASE), "g1": dict(fields=dict(BASE, aggregation="hierarchical", aggregation_groups=1)),
             "g2": dict(fields=dict(BASE, aggregation="hierarchical", aggregation_groups=2)),
             "g4": dict(fields=dict(BASE, aggregation="hierarchical", aggregation_groups=4)),
             "flat": dict(fields=FLAT), "flat_g2": dict(fields=dict(FLAT, aggregation="hierarchical", aggregation_groups=2)),
             "corrupt": dict(fields=dict(BASE, aggregation="hierarchical", aggregation_groups=2), corrupt_rank=3,
                         steps=1)},
         6: {"allgather": dict(fields=BASE), "g3": dict(fields=dict(BASE, aggregation="hierarchical", aggregation_groups=3))}}
PAIRS = [(4, "g1", "allgather"), (4, "g2", "allgather"), (4, "g4", "allgather"), (4, "flat_g2", "flat"),
         (6, "g3", "allgather")]


@pytest.fixture(scope="module")
def runs():
    from megatron_sparseloco.testing.multirank import run_ranks

    out = {}
    for world, jobs in CASES.items():
        per_rank = run_ranks(drive_jobs, world, args=(list(jobs.values()),), timeout=400)
        out[world] = {k: [per_rank[r][i] for r in range(world)] for i, k in enumerate(jobs)}
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world,mode,ref", PAIRS)
def test_hierarchical_equals_allgather_bit_for_bit(runs, world, mode, ref):
    for t in range(STEPS):
        for r in range(world):
            got, want = runs[world][mode][r], runs[world][ref][r]
            assert torch.equal(got["anchor"][t], want["anchor"][t]), (t, r)
            assert torch.equal(got["error"][t], want["error"][t]), (t, r)
            assert torch.equal(got["anchor"][t], runs[world][mode][0]["anchor"][t])
        if t:
            assert runs[world][ref][0]["anchor"][t].ne(runs[world][ref][0]["anchor"][t - 1]).any()  # it moved


@pytest.mark.multirank
@pytest.mark.parametrize("world,mode,ref", PAIRS)
def test_bytes_of_each_phase(runs, world, mode, ref):
    groups = CASES[world][mode]["fields"]["aggregation_groups"]
    g = world // groups
    for r in range(world):
        ag = runs[world][ref][r]["stats"][0]
        P = ag["bytes_sent"] - 4                              # this rank's payload bytes (+ the 4-byte flag)
        assert ag["bytes_received"] - 4 == (world - 1) * P    # all-gather: W − 1 payloads in
        both = (groups - 1) * P + (g - 1) * groups * P      # rail exchange + site gather
        assert both == (world - 1) * P                       # what all-gather receives, by another path
        for st in runs[world][mode][r]["stats"]:
            assert (st["bytes_sent"] - 4, st["bytes_received"] - 4) == (both, both), r
            assert st["bytes_sent"] - 4 == runs[world][mode][r]["expected_sent"]   # what the start-up block states
            assert st["wan_bytes_sent"] == st["wan_bytes_received"] == (groups - 1) * P
        kinds = runs[world][mode][r]["by_kind"]
        buckets = runs[world][mode][r]["buckets"]
        assert kinds.get("site_exchange", 0) == (STEPS * buckets if groups > 1 else 0)
        assert kinds.get("group_gather", 0) == (STEPS * buckets if g > 1 else 0)
        assert "all_gather" not in kinds


@pytest.mark.multirank
def test_corrupted_payload_is_rejected_naming_the_worker(runs):
    """Worker 3 corrupts what it sends (its own copy was decoded before): every other rank — its rail
    peer in the other site, which got it directly, and the others, which got it in a rail set — names it."""
    for r, res in enumerate(runs[4]["corrupt"][:3]):
        assert "error" in res and re.search(r"payload (of worker )?3\b", res["error"]), (r, res.get("error"))
