"""GASLoC modes of issue 19 on 4 gloo ranks: the laplacian-momentum rule, bandwidth-aware matchings,
capped public copies; every mode's mean preservation and point-to-point-only traffic (collective spy).

One multi-rank run executes every scenario (ranks start once); the tests check its records against
float64 single-process references:

* rule "laplacian-momentum":  y = θ0 − ηΔ,  θ ← M y + γ(y − y_prev)  (y_prev := θ_0 before round 0),
  on the ring and the complete graph; on the complete graph the workers' *mean* is exactly DiLoCo
  with Nesterov outer momentum (torch.optim.SGD(lr=η, momentum=γ, nesterov=True) on Δ̄).
* topology "bandwidth": the matchings of every round are the ones ``bandwidth_matching`` draws from
  the agreed link-cost table (identical on every worker), a 10× slower link is used rarely, and the
  update equals the matrix reference with those matchings.
* compressed with ``max_copies``: copies held never exceed the cap, dense refreshes happen exactly
  where an independent LRU simulation says, and the mean is still preserved.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List

import pytest
import torch

from megatron_sparseloco.comm.topology import bandwidth_matching, edges, mixing_matrix
from megatron_sparseloco.outer.base import ConfigError
from megatron_sparseloco.outer.gasloc import GASLoC, GASLoCConfig
from megatron_sparseloco.testing.multirank import run_ranks
from outer_testlib import GASLOC_DEFAULTS

WORLD = 4
SIZES = (50, 78)  # two tensors, 128 elements
N = sum(SIZES)
BUCKET = 64
CODEC = dict(compress=True, chunk=64, k=8, value_bits=2)
SLOW = 3          # worker whose links are (reported as) 10x slower in the bandwidth scenarios

SCENARIOS: Dict[str, dict] = {
    "lap_ring": dict(cfg=dict(topology="ring", rule="laplacian-momentum", proposal_lr=0.8, momentum=0.9), rounds=5,
                     init="diff"),
    "lap_complete": dict(cfg=dict(topology="complete", rule="laplacian-momentum", proposal_lr=0.7, momentum=0.9),
                         rounds=6, init="same"),
    "lap_random1": dict(cfg=dict(topology="random1", rule="laplacian-momentum", proposal_lr=1.0, momentum=0.5,
                                 seed=4), rounds=4, init="diff"),
    "bw": dict(cfg=dict(topology="bandwidth", proposal_lr=0.9, momentum=0.9, seed=3, bandwidth_refresh=4),
               rounds=28, init="diff", slow=True),
    "bw_lap": dict(cfg=dict(topology="bandwidth", rule="laplacian-momentum", proposal_lr=1.0, momentum=0.8, seed=8,
                            bandwidth_refresh=3), rounds=12, init="diff", slow=True),
    # mean preservation (γ = 0, η = 1): the workers' mean after a round = mean of the local params before
    "mean_bw": dict(cfg=dict(topology="bandwidth", proposal_lr=1.0, momentum=0.0, bandwidth_refresh=2), rounds=8,
                    init="diff", slow=True),
    "mean_lap": dict(cfg=dict(topology="ring", rule="laplacian-momentum", proposal_lr=1.0, momentum=0.0), rounds=3,
                     init="diff"),
    "cap_random1": dict(cfg=dict(topology="random1", proposal_lr=1.0, momentum=0.0, seed=6, max_copies=1, **CODEC),
                        rounds=12, init="diff"),
    "cap_random2": dict(cfg=dict(topology="random2", proposal_lr=1.0, momentum=0.0, seed=1, max_copies=2, **CODEC),
                        rounds=8, init="diff"),
    "cap_bw_lap": dict(cfg=dict(topology="bandwidth", rule="laplacian-momentum", proposal_lr=1.0, momentum=0.0,
                                max_copies=1, bandwidth_refresh=2, **CODEC), rounds=10, init="diff", slow=True),
    # rule mixed-nesterov, and several mixing steps per outer round
    "mn_ring": dict(cfg=dict(topology="ring", rule="mixed-nesterov", proposal_lr=0.8, momentum=0.9), rounds=5,
                    init="diff"),
    "mn_ring_r2": dict(cfg=dict(topology="ring", rule="mixed-nesterov", proposal_lr=0.8, momentum=0.6,
                                gossip_rounds=2), rounds=4, init="diff"),
    "lap_random1_r3": dict(cfg=dict(topology="random1", rule="laplacian-momentum", proposal_lr=1.0, momentum=0.5,
                                    seed=4, gossip_rounds=3), rounds=3, init="diff"),
    "mn_exp_r2": dict(cfg=dict(topology="exponential", rule="mixed-nesterov", proposal_lr=0.7, momentum=0.6,
                               gossip_rounds=2), rounds=6, init="same"),
    "mn_complete": dict(cfg=dict(topology="complete", rule="mixed-nesterov", proposal_lr=0.7, momentum=0.6),
                        rounds=4, init="same"),
    "mn_c_random1": dict(cfg=dict(topology="random1", rule="mixed-nesterov", proposal_lr=1.0, momentum=0.0, seed=6,
                                  max_copies=1, **CODEC), rounds=6, init="diff"),
    "mean_r2": dict(cfg=dict(topology="ring", rule="mixed-nesterov", proposal_lr=1.0, momentum=0.0, gossip_rounds=2),
                    rounds=3, init="diff"),
}


def init_theta(kind: str, worker: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 if kind == "same" else 100 + worker)
    return torch.randn(N, generator=g)


def drift(worker: int, rnd: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rnd + worker)
    return 0.1 * (worker + 1) * torch.randn(N, generator=g)


def _rank_fn(rank: int, world_size: int, scenarios: Dict[str, dict]) -> dict:
    from megatron_sparseloco.testing import collective_spy
    from megatron_sparseloco.testing.collective_spy import CollectiveSpy

    collective_spy._ALIASES = ()  # no megatron.core here: skip its import (slow), torch.distributed is patched

    out = {}
    with CollectiveSpy() as spy:
        for name, sc in scenarios.items():
            theta = init_theta(sc["init"], rank)
            params = [theta[:SIZES[0]].clone(), theta[SIZES[0]:].clone()]
            strat = GASLoC(params, None, GASLoCConfig(bucket_numel=BUCKET, **sc["cfg"]), names=["a", "b"])
            if sc.get("slow"):  # deterministic "measurements": 1 ns/byte, 10 ns/byte on the slow worker's links
                record = strat._record_link
                strat._record_link = lambda peer, sec, nb, _r=record: _r(
                    peer, (10.0 if SLOW in (rank, peer) else 1.0) * 1e-9 * nb, nb)
            rec = {"anchors": [], "local": [], "stats": [], "by_kind": [], "peers": [], "costs": [], "copies": []}
            for r in range(sc["rounds"]):
                dlt = drift(rank, r)
                params[0].sub_(dlt[:SIZES[0]])
                params[1].sub_(dlt[SIZES[0]:])
                rec["local"].append(torch.cat([p.reshape(-1) for p in params]).clone())
                strat.counter.reset()
                st = strat.step()
                rec["costs"].append(strat.link_costs)  # the table round r was drawn from (agreed at its start)
                rec["peers"].append([p for p, _ in strat.round_neighbours(r)])
                rec["stats"].append(st.as_dict())
                rec["by_kind"].append(dict(strat.counter.by_kind))
                rec["anchors"].append(strat.anchor.clone())
                rec["copies"].append(sorted(strat.heard_copy))
            out[name] = rec
    out["_calls"] = sorted({c[0] for c in spy.calls})
    return out


@pytest.fixture(scope="module")
def runs() -> Dict[str, Dict[int, dict]]:
    results = run_ranks(_rank_fn, world_size=WORLD, args=(SCENARIOS,), timeout=900)
    by_name: Dict[str, Dict[int, dict]] = {"_calls": {r: res["_calls"] for r, res in enumerate(results)}}
    for rank, res in enumerate(results):
        for name, rec in res.items():
            if name != "_calls":
                by_name.setdefault(name, {})[rank] = rec
    return by_name


def _anchors(rec, r) -> torch.Tensor:
    return torch.stack([rec[i]["anchors"][r] for i in range(WORLD)]).double()


def reference(sc: dict, costs_per_round=None) -> List[torch.Tensor]:
    """float64 matrix form of the uncompressed update, both rules; ``costs_per_round[r]``: the bandwidth table."""
    c = sc["cfg"]
    eta, gamma = (c.get(key, GASLOC_DEFAULTS[key]) for key in ("proposal_lr", "momentum"))
    rule = c.get("rule", "ours")
    R = c.get("gossip_rounds", 1)
    theta = torch.stack([init_theta(sc["init"], i) for i in range(WORLD)]).double()
    d = torch.zeros_like(theta)   # ours: momentum
    v = torch.zeros_like(theta)   # laplacian / mixed-nesterov: y_prev − θ
    out = []
    for r in range(sc["rounds"]):
        y = theta - eta * torch.stack([drift(i, r) for i in range(WORLD)]).double()
        costs = costs_per_round[r] if costs_per_round is not None else None
        M = torch.eye(WORLD, dtype=torch.float64)
        for q in range(R):  # mixing step q of round r uses matching r·R + q
            M = mixing_matrix(c["topology"], WORLD, r * R + q, c.get("seed", 0), c.get("mixing_weight"),
                              costs=costs).double() @ M
        if rule == "mixed-nesterov":
            new = M @ (y + gamma * ((y - theta) - v))
            v = y - new
            theta = new
        elif rule == "laplacian-momentum":
            new = M @ y + gamma * ((y - theta) - v)
            v = y - new
            theta = new
        else:
            d = gamma * d + (M @ y - theta)
            theta = theta + d
        out.append(theta.clone())
    return out


@pytest.mark.parametrize("name", ["lap_ring", "lap_complete", "lap_random1", "bw", "bw_lap", "mn_ring", "mn_ring_r2",
                                  "lap_random1_r3", "mn_exp_r2", "mn_complete"])
def test_update_matches_float64_reference(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    costs = rec[0]["costs"] if sc["cfg"]["topology"] == "bandwidth" else None
    for r, ref in enumerate(reference(sc, costs)):
        # fp32 rounding, accumulated over rounds and amplified by momentum up to 1/(1 − γ) = 10:
        # 2e-6·(r + 1)·max|θ| (a wrong matching or rule is off by O(0.1))
        err = (_anchors(rec, r) - ref).abs().max().item()
        assert err < 2e-6 * (r + 1) * max(1.0, ref.abs().max().item()), (name, r, err)


@pytest.mark.parametrize("name", ["mn_exp_r2", "mn_complete"])
def test_exact_averaging_with_mixed_nesterov_is_diloco_nesterov_on_every_worker(runs, name):
    """Exponential with R = log2 W = 2 mixing steps (or the complete graph) averages exactly, so with the
    mixed-nesterov rule every worker holds the same floats after every round, and they follow torch's
    Nesterov SGD on the mean pseudo-gradient Δ̄ (lr η, momentum γ): DiLoCo, point to point only."""
    sc, rec = SCENARIOS[name], runs[name]
    eta, gamma = sc["cfg"]["proposal_lr"], sc["cfg"]["momentum"]
    theta = torch.nn.Parameter(init_theta("same", 0).double().clone())
    opt = torch.optim.SGD([theta], lr=eta, momentum=gamma, nesterov=True)
    for r in range(sc["rounds"]):
        theta.grad = torch.stack([drift(i, r) for i in range(WORLD)]).double().mean(0)
        opt.step()
        for i in range(1, WORLD):
            assert torch.equal(rec[i]["anchors"][r], rec[0]["anchors"][r]), (name, r, i)
        err = (rec[0]["anchors"][r].double() - theta.detach()).abs().max().item()
        assert err < 1e-5, (name, r, err)
    if name == "mn_exp_r2":  # two one-peer exchanges per round: the two partners of the hypercube
        for i in range(WORLD):
            assert rec[i]["stats"][1]["bytes_sent"] == 2 * 4 * (N + 2), rec[i]["stats"][1]  # 2 buckets + flags


def test_laplacian_rule_on_complete_graph_mean_is_diloco_nesterov(runs):
    """θ_{t+1,i} = ȳ_t + γ(y_{t,i} − y_{t−1,i}); averaging: θ̄_{t+1} = ȳ_t + γ(ȳ_t − ȳ_{t−1}), ȳ_t = θ̄_t − ηΔ̄_t,
    which is torch's Nesterov SGD on Δ̄ (lr η, momentum γ, y_{−1} = θ_0 ⇔ an empty buffer)."""
    sc, rec = SCENARIOS["lap_complete"], runs["lap_complete"]
    eta, gamma = sc["cfg"]["proposal_lr"], sc["cfg"]["momentum"]
    theta = torch.nn.Parameter(init_theta("same", 0).double().clone())
    opt = torch.optim.SGD([theta], lr=eta, momentum=gamma, nesterov=True)
    spread = []
    for r in range(sc["rounds"]):
        theta.grad = torch.stack([drift(i, r) for i in range(WORLD)]).double().mean(0)
        opt.step()
        X = _anchors(rec, r)
        err = (X.mean(0) - theta.detach()).abs().max().item()
        assert err < 1e-5, (r, err)
        spread.append((X - X.mean(0)).abs().max().item())
    assert spread[0] > 1e-3  # the workers are NOT identical (momentum on each one's own proposals)


@pytest.mark.parametrize("name", ["mean_bw", "mean_lap", "cap_random1", "cap_random2", "cap_bw_lap", "mn_c_random1",
                                  "mean_r2"])
def test_every_mode_preserves_the_workers_mean(runs, name):
    """γ = 0, η = 1: mean_i θ_i after round r = mean_i θ_local,i before it (= mean before + mean local
    progress), to fp32 rounding: |err| ≤ 1e-6 for O(1) values (the pairwise mixing terms cancel exactly)."""
    rec = runs[name]
    for r in range(SCENARIOS[name]["rounds"]):
        local = torch.stack([rec[i]["local"][r] for i in range(WORLD)]).double()
        err = (_anchors(rec, r).mean(0) - local.mean(0)).abs().max().item()
        assert err < 1e-6, (name, r, err)


def test_bandwidth_matchings_agree_and_avoid_the_slow_link(runs):
    rec = runs["bw"]
    sc = SCENARIOS["bw"]
    refresh = sc["cfg"]["bandwidth_refresh"]
    slow_uses = fast_uses = 0
    for r in range(sc["rounds"]):
        tables = [rec[i]["costs"][r] for i in range(WORLD)]
        assert all(t == tables[0] for t in tables), r          # one table everywhere
        assert (tables[0] is None) == (r < refresh)             # uniform until the first agreement
        pairs = bandwidth_matching(WORLD, r, sc["cfg"]["seed"], tables[0])
        for i in range(WORLD):
            expect = sorted([b for a, b in pairs if a == i] + [a for a, b in pairs if b == i])
            assert rec[i]["peers"][r] == expect, (r, i)
        if r >= refresh:
            slow_uses += sum(1 for p in pairs if SLOW in p)
            fast_uses += sum(1 for p in pairs if SLOW not in p)
    table = rec[0]["costs"][-1]
    assert table[0][SLOW] == pytest.approx(10 * table[0][1], rel=1e-9)   # the measured 10x shows in the table
    # 24 rounds drawn from the table: the slow links (3 of the 6) are used about 1/10 as often as the fast ones
    assert fast_uses >= 18 and slow_uses <= fast_uses / 4, (slow_uses, fast_uses)
    kinds = set().union(*[set(k) for i in range(WORLD) for k in rec[i]["by_kind"]])
    assert kinds <= {"p2p", "p2p_sync", "p2p_costs"}
    assert rec[0]["by_kind"][refresh].get("p2p_costs") == 1 and "p2p_costs" not in rec[0]["by_kind"][1]


def _lru_valid_sets(sc: dict, costs_per_round) -> List[List[set]]:
    """Independent simulation: per round, per worker, the peers whose copies are valid after the round."""
    c = sc["cfg"]
    cap = c["max_copies"]
    lru = [OrderedDict() for _ in range(WORLD)]
    out = []
    for r in range(sc["rounds"]):
        for i, j, _ in edges(c["topology"], WORLD, r, c.get("seed", 0), None, costs_per_round[r]):
            for a, b in ((i, j), (j, i)):
                lru[a].pop(b, None)
                lru[a][b] = None
                while len(lru[a]) > cap:
                    lru[a].popitem(last=False)
        out.append([{p for p in lru[i] if i in lru[p]} for i in range(WORLD)])
    return out


@pytest.mark.parametrize("name", ["cap_random1", "cap_random2", "cap_bw_lap"])
def test_copies_are_capped_and_refreshed_where_the_lru_says(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    cap = sc["cfg"]["max_copies"]
    valid = _lru_valid_sets(sc, rec[0]["costs"])
    refreshes = 0
    for r in range(sc["rounds"]):
        for i in range(WORLD):
            st = rec[i]["stats"][r]
            assert set(rec[i]["copies"][r]) == valid[r][i], (name, r, i)
            assert len(rec[i]["copies"][r]) <= cap
            assert st["copies_bytes"] <= 2 * cap * N * 4
            before = valid[r - 1][i] if r else set()
            expect_fresh = [p for p in rec[i]["peers"][r] if p not in before]
            assert st["dense_refresh_peers"] == len(expect_fresh), (name, r, i)
            refreshes += len(expect_fresh)
    assert refreshes < WORLD * sc["rounds"]  # some rounds did send compressed residuals


def test_only_point_to_point_traffic(runs):
    """Collective spy over every scenario (all modes): nothing but isend/irecv batches."""
    for rank, calls in runs["_calls"].items():
        assert set(calls) <= {"batch_isend_irecv", "isend", "irecv"}, (rank, calls)
        assert "batch_isend_irecv" in calls


@pytest.mark.parametrize("kwargs, W, match", [
    (dict(topology="ring", max_copies=1, **CODEC), 4, r"max_copies=1 is below the 2 neighbours.*1 \+ 2 fp32 copies"),
    (dict(topology="complete", max_copies=4, **CODEC), 8, "below the 7 neighbours"),
    (dict(topology="random2", max_copies=1, **CODEC), 4, "max_copies must be >= 2"),
    (dict(rule="nesterov"), 4, "rule must be one of"),
    (dict(gossip_rounds=2, **CODEC), 4, "gossip_rounds=2 needs uncompressed"),
    (dict(gossip_rounds=0), 4, "gossip_rounds"),
    (dict(topology="bandwidth", bandwidth_refresh=0), 4, "bandwidth_refresh"),
])
def test_bad_settings_are_refused_with_the_field(kwargs, W, match):
    with pytest.raises(ConfigError, match=match):
        GASLoCConfig(bucket_numel=BUCKET, **kwargs).validate().check_workers(W)


def test_static_refusal_names_the_memory_of_this_shard():
    cfg = GASLoCConfig(bucket_numel=BUCKET, topology="ring", max_copies=1, **CODEC)
    with pytest.raises(ConfigError, match=r"0\.0 MiB for this rank's 128-element shard"):
        cfg.check_copies(4, N)
    GASLoCConfig(bucket_numel=BUCKET, topology="ring", max_copies=2, **CODEC).check_copies(4, N)


def test_bandwidth_matching_is_deterministic_and_uniform_without_a_table():
    for r in range(20):
        assert bandwidth_matching(6, r, 1) == bandwidth_matching(6, r, 1)
        flat = [x for p in bandwidth_matching(6, r, 1) for x in p]
        assert sorted(flat) == list(range(6))   # no table: a perfect matching
    c = [[0.0 if i == j else (1e-8 if 2 in (i, j) else 1e-9) for j in range(4)] for i in range(4)]
    uses = sum(1 for r in range(400) for p in bandwidth_matching(4, r, 0, c) if 2 in p)
    fast = sum(1 for r in range(400) for p in bandwidth_matching(4, r, 0, c) if 2 not in p)
    assert uses < fast / 5


BASE_ARGS = ["--use-distributed-optimizer", "--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "4"]


@pytest.mark.parametrize("argv, flag", [
    (["--sparseloco-gossip-compress", "--sparseloco-gossip-max-copies", "1"], "--sparseloco-gossip-max-copies"),
    (["--sparseloco-gossip-compress", "--sparseloco-gossip-topology", "random2", "--sparseloco-gossip-max-copies", "1"],
     "--sparseloco-gossip-max-copies"),
    (["--sparseloco-gossip-max-copies", "3"], "--sparseloco-gossip-max-copies"),          # without compress
    (["--sparseloco-gossip-bandwidth-refresh", "3"], "--sparseloco-gossip-bandwidth-refresh"),  # not bandwidth
    (["--sparseloco-gossip-rule", "nesterov"], "--sparseloco-gossip-rule"),
])
def test_bad_flags_are_refused_before_training(argv, flag, monkeypatch):
    import sys

    from megatron.training.arguments import parse_args

    from megatron_sparseloco.megatron.args import (SparseLoCoArgumentError, add_sparseloco_args,
                                                        validate_sparseloco_args)
    monkeypatch.setattr(sys, "argv", ["x"] + BASE_ARGS + argv)
    try:
        args = parse_args(add_sparseloco_args)
    except SystemExit:  # argparse refuses a bad choice itself, naming the flag on stderr
        assert flag == "--sparseloco-gossip-rule"
        return
    with pytest.raises(SparseLoCoArgumentError) as err:
        validate_sparseloco_args(args, world_size=4)
    assert flag in str(err.value), str(err.value)


def test_new_flags_reach_the_config(monkeypatch):
    import sys

    from megatron.training.arguments import parse_args

    from megatron_sparseloco.megatron.args import add_sparseloco_args, validate_sparseloco_args
    monkeypatch.setattr(sys, "argv", ["x"] + BASE_ARGS + [
        "--sparseloco-gossip-topology", "bandwidth", "--sparseloco-gossip-rule", "laplacian-momentum",
        "--sparseloco-gossip-bandwidth-refresh", "5", "--sparseloco-gossip-compress", "--sparseloco-gossip-max-copies", "2"])
    args = parse_args(add_sparseloco_args)
    validate_sparseloco_args(args, world_size=4)
    cfg = args.sparseloco_outer_config
    assert isinstance(cfg, GASLoCConfig)
    assert (cfg.topology, cfg.rule, cfg.bandwidth_refresh, cfg.compress, cfg.max_copies) == (
        "bandwidth", "laplacian-momentum", 5, True, 2)
    monkeypatch.setattr(sys, "argv", ["x"] + BASE_ARGS + [
        "--sparseloco-gossip-topology", "exponential", "--sparseloco-gossip-rule", "mixed-nesterov",
        "--sparseloco-gossip-rounds", "2"])
    args = parse_args(add_sparseloco_args)
    validate_sparseloco_args(args, world_size=4)
    cfg = args.sparseloco_outer_config
    assert isinstance(cfg, GASLoCConfig)
    assert (cfg.topology, cfg.rule, cfg.gossip_rounds) == ("exponential", "mixed-nesterov", 2)
