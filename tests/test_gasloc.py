"""GASLoC on 4 gloo ranks against a single-process reference computed with the mixing matrix.

One multi-rank run executes every scenario (ranks start once, ~10 s); the tests check its records:
the update equals the matrix form θ0 + d, d ← γd + (M y − θ0), y = θ0 − ηΔ (ring, exponential,
random1, random2, odd W in a subgroup with an idle worker); mixing preserves the mean; disagreement
shrinks at the predicted rate; the complete graph is DiLoCo with heavy-ball momentum (checked against
torch.optim.SGD); only point-to-point traffic happens, with the bytes predicted; the non-finite guard.
"""
from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch

from megatron_sparseloco.comm.topology import consensus_rate, mixing_matrix, neighbours
from megatron_sparseloco.outer.base import ConfigError, NonFiniteError
from megatron_sparseloco.outer.gasloc import GASLoC, GASLoCConfig
from megatron_sparseloco.testing.multirank import run_ranks
from outer_testlib import gossip_reference

SIZES = (7, 13)  # two tensors, 20 elements
N = sum(SIZES)
BUCKET = 8  # buckets [0,8) [8,16) [16,20): one spans both tensors
WORLD = 4

SCENARIOS: Dict[str, dict] = {
    "ring": dict(cfg=dict(topology="ring", proposal_lr=0.8, momentum=0.9, seed=5), rounds=4, init="same", drift=True),
    "exponential": dict(cfg=dict(topology="exponential", proposal_lr=1.1, momentum=0.5), rounds=4, init="same",
                        drift=True),
    "random1": dict(cfg=dict(topology="random1", proposal_lr=0.9, momentum=0.9, seed=11), rounds=4, init="diff",
                    drift=True),
    "random2": dict(cfg=dict(topology="random2", proposal_lr=1.0, momentum=0.8, seed=3, mixing_weight=0.25),
                    rounds=4, init="diff", drift=True),
    "odd_sub": dict(cfg=dict(topology="random1", proposal_lr=1.0, momentum=0.9, seed=2), rounds=4, init="diff",
                    drift=True, group=[1, 2, 3]),
    "mean": dict(cfg=dict(topology="ring", proposal_lr=1.0, momentum=0.0), rounds=3, init="diff", drift=True),
    "consensus_ring": dict(cfg=dict(topology="ring", proposal_lr=1.0, momentum=0.0), rounds=3, init="diff",
                           drift=False),
    "eigen_ring": dict(cfg=dict(topology="ring", proposal_lr=1.0, momentum=0.0), rounds=2, init="eigen", drift=False),
    "consensus_exp": dict(cfg=dict(topology="exponential", proposal_lr=1.0, momentum=0.0), rounds=2, init="diff",
                          drift=False),
    "complete": dict(cfg=dict(topology="complete", proposal_lr=0.7, momentum=0.9), rounds=5, init="same", drift=True),
    "skip": dict(cfg=dict(topology="ring", proposal_lr=1.0, momentum=0.9, nonfinite_policy="skip"), rounds=3,
                 init="same", drift=True, nan=(1, 1)),
}


def init_theta(kind: str, worker: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 if kind in ("same",) else 100 + worker)
    if kind == "eigen":  # θ_i = cos(2π i / 4)·v: an eigenvector of the ring with eigenvalue 1/3
        v = torch.randn(N, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        return (math.cos(2 * math.pi * worker / WORLD) * v + 1.0).float()
    return torch.randn(N, generator=g)


def drift(worker: int, rnd: int) -> torch.Tensor:
    """What worker ``worker``'s inner steps of round ``rnd`` subtract from θ (different per worker)."""
    g = torch.Generator().manual_seed(1000 * rnd + worker)
    return 0.1 * (worker + 1) * torch.randn(N, generator=g)


def _rank_fn(rank: int, world_size: int, scenarios: Dict[str, dict]) -> Dict[str, dict]:
    import torch.distributed as dist

    groups = {name: dist.new_group(ranks=sc["group"]) for name, sc in scenarios.items() if "group" in sc}
    # Any global collective during an outer step fails the run.
    def forbidden(*a, **k):
        raise AssertionError("a global collective was issued during a GASLoC outer step")
    for fn in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "reduce"):
        setattr(dist, fn, forbidden)
    out = {}
    for name, sc in scenarios.items():
        group = groups.get(name)
        if group is not None and rank not in sc["group"]:
            continue
        worker = dist.get_rank(group)
        theta = init_theta(sc["init"], worker)
        params = [theta[:SIZES[0]].clone(), theta[SIZES[0]:].clone()]
        strat = GASLoC(params, group, GASLoCConfig(bucket_numel=BUCKET, **sc["cfg"]), names=["a", "b"])
        rec = {"worker": worker, "anchors": [], "local": [], "stats": [], "by_kind": [], "sent": [], "recv": []}
        for r in range(sc["rounds"]):
            if sc["drift"]:
                dlt = drift(worker, r)
                params[0].sub_(dlt[:SIZES[0]])
                params[1].sub_(dlt[SIZES[0]:])
            rec["local"].append(torch.cat([p.reshape(-1) for p in params]).clone())
            if sc.get("nan") == (worker, r):
                params[1][3] = float("nan")
            strat.counter.reset()
            st = strat.step()
            rec["stats"].append(st.as_dict())
            rec["by_kind"].append(dict(strat.counter.by_kind))
            rec["sent"].append(strat.counter.bytes_sent)
            rec["recv"].append(strat.counter.bytes_received)
            rec["anchors"].append(strat.anchor.clone())
            assert torch.equal(torch.cat([p.reshape(-1) for p in params]), strat.anchor)  # θ_local ← θ_outer
        rec["state"] = strat.state_dict()
        out[name] = rec
    return out


@pytest.fixture(scope="module")
def runs() -> Dict[str, Dict[int, dict]]:
    results = run_ranks(_rank_fn, world_size=WORLD, args=(SCENARIOS,), timeout=150)
    by_name: Dict[str, Dict[int, dict]] = {}
    for rank_out in results:
        for name, rec in rank_out.items():
            by_name.setdefault(name, {})[rec["worker"]] = rec
    return by_name


def reference(sc: dict, W: int) -> List[torch.Tensor]:
    return gossip_reference(sc, W, init_theta, drift)


def _anchors(rec: Dict[int, dict], r: int) -> torch.Tensor:
    return torch.stack([rec[i]["anchors"][r] for i in sorted(rec)]).double()


def _disagreement(X: torch.Tensor) -> float:
    return float(((X - X.mean(0, keepdim=True)) ** 2).sum())


@pytest.mark.parametrize("name", ["ring", "exponential", "random1", "random2", "odd_sub", "skip"])
def test_update_matches_matrix_reference(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    W = len(rec)
    assert W == len(sc.get("group", range(WORLD)))
    for r, ref in enumerate(reference(sc, W)):
        err = (_anchors(rec, r) - ref).abs().max().item()
        assert err < 2e-5, (name, r, err)
    # workers on a sparse graph really differ after gossip (each keeps its own anchor)
    assert _disagreement(_anchors(rec, sc["rounds"] - 1)) > 1e-3


def test_odd_w_idles_one_worker_each_round(runs):
    rec = runs["odd_sub"]
    for r in range(SCENARIOS["odd_sub"]["rounds"]):
        peers = [rec[i]["stats"][r]["gossip_peers"] for i in range(3)]
        assert sorted(peers) == [0.0, 1.0, 1.0]
        idle = peers.index(0.0)
        assert rec[idle]["sent"][r] == 0 and rec[idle]["by_kind"][r] == {}


def test_mixing_preserves_mean(runs):
    rec = runs["mean"]  # γ = 0, η = 1: y_i = θ_local,i, so mean after = mean of the proposals
    for r in range(SCENARIOS["mean"]["rounds"]):
        proposals = torch.stack([rec[i]["local"][r] for i in range(WORLD)]).double()
        err = (_anchors(rec, r).mean(0) - proposals.mean(0)).abs().max().item()
        assert err < 1e-6, (r, err)
        assert (_anchors(rec, r) - proposals).abs().max().item() > 1e-2  # mixing did move the workers


@pytest.mark.parametrize("name", ["consensus_ring", "consensus_exp"])
def test_disagreement_shrinks_at_the_rate_of_the_graph(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    c = sc["cfg"]
    prev = torch.stack([init_theta(sc["init"], i) for i in range(WORLD)]).double()
    ratios = []
    for r in range(sc["rounds"]):
        X = _anchors(rec, r)
        M = mixing_matrix(c["topology"], WORLD, r)
        ratio = _disagreement(X) / _disagreement(prev)
        ratios.append(ratio)
        assert ratio <= consensus_rate(M) + 1e-5, (name, r, ratio, consensus_rate(M))
        predicted = _disagreement(M @ prev) / _disagreement(prev)
        assert ratio == pytest.approx(predicted, rel=1e-4, abs=1e-9)
        prev = X
    if c["topology"] == "ring":
        assert consensus_rate(mixing_matrix("ring", WORLD, 0)) == pytest.approx(1 / 9)
        assert max(ratios) < 1 / 9 + 1e-5
    else:  # one-peer hypercube, W = 4: log2 4 = 2 rounds average exactly
        assert _disagreement(_anchors(rec, 1)) < 1e-9 * _disagreement(
            torch.stack([init_theta("diff", i) for i in range(WORLD)]).double())


def test_ring_eigenvector_contracts_exactly_at_lambda2_squared(runs):
    rec = runs["eigen_ring"]
    prev = torch.stack([init_theta("eigen", i) for i in range(WORLD)]).double()
    for r in range(2):
        X = _anchors(rec, r)
        assert _disagreement(X) / _disagreement(prev) == pytest.approx(1 / 9, rel=1e-4)
        prev = X


def test_complete_graph_is_diloco_with_heavy_ball(runs):
    sc, rec = SCENARIOS["complete"], runs["complete"]
    eta, gamma = sc["cfg"]["proposal_lr"], sc["cfg"]["momentum"]
    # DiLoCo reference: one θ_outer, outer SGD(lr=η, momentum=γ, nesterov=False) on the mean Δ.
    theta = torch.nn.Parameter(init_theta("same", 0).clone())
    opt = torch.optim.SGD([theta], lr=eta, momentum=gamma, nesterov=False)
    for r in range(sc["rounds"]):
        deltas = torch.stack([drift(i, r) for i in range(WORLD)])  # Δ_i = θ_outer − θ_i = drift
        theta.grad = deltas.mean(0)
        opt.step()
        X = _anchors(rec, r)
        for i in range(1, WORLD):  # workers stay bit-identical on the complete graph
            assert torch.equal(rec[i]["anchors"][r], rec[0]["anchors"][r])
        err = (X[0] - theta.detach().double()).abs().max().item()
        assert err < 1e-5, (r, err)


@pytest.mark.parametrize("name", ["ring", "random2", "complete", "odd_sub"])
def test_only_p2p_traffic_and_bytes_match_the_payloads(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    c = sc["cfg"]
    W = len(rec)
    buckets = [min(N, s + BUCKET) - s for s in range(0, N, BUCKET)]
    for i in range(W):
        for r in range(sc["rounds"]):
            peers = neighbours(c["topology"], W, r, c.get("seed", 0), i, c.get("mixing_weight"))
            expected = sum((n + 1) * 4 for n in buckets) * len(peers)  # fp32 proposal + 1 flag element
            assert rec[i]["sent"][r] == expected and rec[i]["recv"][r] == expected
            assert rec[i]["by_kind"][r] == ({"p2p": len(buckets)} if peers else {})
            assert rec[i]["stats"][r]["bytes_sent"] == expected


def test_skip_discards_only_the_bad_workers_progress(runs):
    rec = runs["skip"]
    bad, r = SCENARIOS["skip"]["nan"]
    assert rec[bad]["stats"][r]["skipped"] is True
    assert all(not rec[i]["stats"][r]["skipped"] for i in range(WORLD) if i != bad)
    assert rec[(bad + 1) % WORLD]["stats"][r]["peers_nonfinite"] == 1.0
    assert rec[(bad + 2) % WORLD]["stats"][r]["peers_nonfinite"] == 0.0
    assert all(torch.isfinite(rec[i]["anchors"][-1]).all() for i in range(WORLD))


def test_state_dict_holds_anchor_and_momentum(runs):
    sd = runs["ring"][0]["state"]
    assert sd["name"] == "gasloc" and sd["outer_steps"] == 4 and set(sd) >= {"anchor", "momentum"}
    assert torch.equal(sd["anchor"], runs["ring"][0]["anchors"][-1])
    assert sd["momentum"].abs().sum() > 0


def _abort_fn(rank: int, world_size: int) -> str:
    params = [torch.full((6,), float(rank)), torch.ones(5)]
    strat = GASLoC(params, None, GASLoCConfig(topology="ring", nonfinite_policy="abort", bucket_numel=100))
    before = strat.anchor.clone()
    if rank == 1:
        params[0][2] = float("inf")
    try:
        strat.step()
    except NonFiniteError as exc:
        assert torch.equal(strat.anchor, before), "θ_outer changed although the step aborted"
        return f"raised: {exc}"
    return "ok"


def test_abort_raises_on_the_bad_worker_and_its_neighbours_only():
    out = run_ranks(_abort_fn, world_size=WORLD, timeout=90)
    assert "tensor 'param0' on this worker (rank 1)" in out[1]
    assert "neighbour worker(s) [1]" in out[0] and "neighbour worker(s) [1]" in out[2]
    assert out[3] == "ok"  # not a ring neighbour of 1: its single bucket exchange completed


def test_single_worker_is_heavy_ball_on_its_own_delta():
    p = torch.zeros(5)
    strat = GASLoC([p], None, GASLoCConfig(topology="ring", proposal_lr=0.5, momentum=0.9))
    assert strat.round_neighbours() == []
    p.sub_(1.0)  # Δ = 1
    strat.step()
    assert torch.allclose(p, torch.full((5,), -0.5))  # d = −ηΔ
    p.sub_(1.0)  # Δ = 1 again
    strat.step()
    assert torch.allclose(p, torch.full((5,), -0.5 - (0.9 * 0.5 + 0.5)))
    sd = strat.state_dict()
    other = GASLoC([torch.zeros(5)], None, GASLoCConfig(topology="ring"))
    other.load_state_dict(sd)
    assert torch.equal(other.momentum, strat.momentum) and other.outer_steps == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(topology="star"), "topology must be one of"),
    (dict(topology="complete", mixing_weight=0.3), "mixing_weight.*complete"),
    (dict(topology="ring", mixing_weight=0.7), r"mixing_weight.*\(0, 0.5\]"),
    (dict(proposal_lr=0.0), "proposal_lr"),
    (dict(momentum=1.0), "momentum"),
    (dict(seed=-1), "seed"),
    (dict(k=5000), "k must be"),
    (dict(value_bits=3), "value_bits"),
    (dict(ef_beta=1.5), "ef_beta"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GASLoCConfig(**kwargs).validate()


def test_registered_and_buildable_by_name():
    from megatron_sparseloco.outer.registry import available_outer_strategies, build_outer_strategy

    assert "gasloc" in available_outer_strategies()
    strat = build_outer_strategy("gasloc", [torch.zeros(3)], None, topology="exponential", momentum=0.5)
    assert isinstance(strat, GASLoC) and strat.config.topology == "exponential"
    with pytest.raises(ConfigError, match="no config field"):
        build_outer_strategy("gasloc", [torch.zeros(3)], None, lr=0.7)
