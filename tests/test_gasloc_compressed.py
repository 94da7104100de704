"""GASLoC with SparseLoCo-compressed proposals and CHOCO public copies (compress=True).

One 4-rank gloo run executes every scenario; the tests check its records against a single-process
fp32 reference of the same compressed math (per-pair copies x̂_{i→j}, dense refresh at a pair's
first meeting, q = C(y − x̂), m = y + ξ Σ_j M_ij (x̂_{j→i} − x̂_{i→j}), heavy-ball on m − θ0), written
here independently of the class with the codec's encode / decode_dense. Also: a lossless codec with
ξ = 1 is the uncompressed gossip; the mean is preserved; disagreement shrinks with no local steps;
bytes equal the payload sizes and are ≥ 30× below the dense exchange; only p2p traffic.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from megatron_sparseloco.comm.topology import neighbours
from megatron_sparseloco.compress import CodecConfig, decode_dense, encode, payload_nbytes
from megatron_sparseloco.outer.base import ConfigError, NonFiniteError
from megatron_sparseloco.outer.gasloc import GASLoC, GASLoCConfig
from megatron_sparseloco.testing.multirank import run_ranks
from outer_testlib import GASLOC_DEFAULTS, gossip_reference

SIZES = (5000, 11384)  # two tensors, 16384 elements = 4 chunks of 4096
N = sum(SIZES)
BUCKET = 8192  # 2 buckets; the first spans both tensors
WORLD = 4
CODEC = dict(chunk=4096, k=64, value_bits=2)

SCENARIOS: Dict[str, dict] = {
    "ring": dict(cfg=dict(topology="ring", proposal_lr=0.9, momentum=0.5, gossip_step=0.3, **CODEC), rounds=4,
                 init="diff", drift=True),
    "random1": dict(cfg=dict(topology="random1", seed=11, proposal_lr=1.0, momentum=0.9, gossip_step=0.5, **CODEC),
                    rounds=5, init="same", drift=True),
    "random2_entropy": dict(cfg=dict(topology="random2", seed=3, mixing_weight=0.25, proposal_lr=1.0, momentum=0.0, gossip_step=0.2,
                                     index_coding="entropy", **CODEC), rounds=3, init="diff", drift=True),
    "lossless_random1": dict(cfg=dict(topology="random1", seed=4, proposal_lr=0.8, momentum=0.9, gossip_step=1.0,
                                      chunk=4096, k=4096, value_bits=32), rounds=4, init="diff", drift=True),
    "consensus_ring": dict(cfg=dict(topology="ring", proposal_lr=1.0, momentum=0.0, **CODEC), rounds=20,
                           init="diff", drift=False),
    "consensus_random1": dict(cfg=dict(topology="random1", seed=7, proposal_lr=1.0, momentum=0.0, **CODEC),
                              rounds=20, init="diff", drift=False),
    "skip": dict(cfg=dict(topology="ring", momentum=0.9, gossip_step=0.3, **CODEC), rounds=3, init="same",
                 drift=True, nan=(1, 2)),
}


def init_theta(kind: str, worker: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 if kind == "same" else 100 + worker))


def drift(worker: int, rnd: int) -> torch.Tensor:
    return 0.01 * (worker + 1) * torch.randn(N, generator=torch.Generator().manual_seed(1000 * rnd + worker))


def _rank_fn(rank: int, world_size: int, scenarios: Dict[str, dict]) -> Dict[str, dict]:
    import torch.distributed as dist

    def forbidden(*a, **k):
        raise AssertionError("a global collective was issued during a GASLoC outer step")
    for fn in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "reduce"):
        setattr(dist, fn, forbidden)
    out = {}
    for name, sc in scenarios.items():
        theta = init_theta(sc["init"], rank)
        params = [theta[:SIZES[0]].clone(), theta[SIZES[0]:].clone()]
        strat = GASLoC(params, None, GASLoCConfig(bucket_numel=BUCKET, compress=True, **sc["cfg"]), names=["a", "b"])
        rec = {"anchors": [], "stats": [], "by_kind": [], "sent": [], "recv": []}
        for r in range(sc["rounds"]):
            if sc["drift"]:
                dlt = drift(rank, r)
                params[0].sub_(dlt[:SIZES[0]])
                params[1].sub_(dlt[SIZES[0]:])
            if sc.get("nan") == (rank, r):
                params[1][3] = float("nan")
            strat.counter.reset()
            st = strat.step()
            rec["stats"].append(st.as_dict())
            rec["by_kind"].append(dict(strat.counter.by_kind))
            rec["sent"].append(strat.counter.bytes_sent)
            rec["recv"].append(strat.counter.bytes_received)
            rec["anchors"].append(strat.anchor.clone())
            assert torch.equal(torch.cat([p.reshape(-1) for p in params]), strat.anchor)
        out[name] = rec
    # abort, last (aborted ranks cannot take part in anything after it): one bucket, worker 1 bad
    params = [init_theta("same", 0)]
    strat = GASLoC(params, None, GASLoCConfig(compress=True, nonfinite_policy="abort", bucket_numel=N, **CODEC))
    strat.step()  # a clean round first: the copies exist, the next exchange is compressed
    before = (strat.anchor.clone(), {p: t.clone() for p, t in strat.heard_copy.items()})
    if rank == 1:
        params[0][2] = float("inf")
    try:
        strat.step()
        out["abort"] = "ok"
    except NonFiniteError as exc:
        assert torch.equal(strat.anchor, before[0])
        assert all(torch.equal(strat.heard_copy[p], t) for p, t in before[1].items()), "copies changed on abort"
        out["abort"] = f"raised: {exc}"
    return out


@pytest.fixture(scope="module")
def runs() -> Dict[str, List[dict]]:
    results = run_ranks(_rank_fn, world_size=WORLD, args=(SCENARIOS,), timeout=300)  # CPU time ≈ 12 s; wall grows on a shared box
    return {name: [results[i][name] for i in range(WORLD)] for name in list(SCENARIOS) + ["abort"]}


def compressed_reference(sc: dict, W: int) -> List[torch.Tensor]:
    """Anchors [W, N] after each round: the compressed math in fp32 with one copy per ordered pair."""
    c = sc["cfg"]
    cfg = CodecConfig(chunk=c["chunk"], k=c["k"], value_bits=c["value_bits"],
                      index_coding=c.get("index_coding", "packed"))
    eta, gamma = (c.get(key, GASLOC_DEFAULTS[key]) for key in ("proposal_lr", "momentum"))
    xi = c["gossip_step"] if "gossip_step" in c else 0.05
    theta0 = [init_theta(sc["init"], i) for i in range(W)]
    d = [torch.zeros(N) for _ in range(W)]
    copy: Dict[tuple, torch.Tensor] = {}  # (i, j) → x̂_{i→j}
    out = []
    for r in range(sc["rounds"]):
        nb = [neighbours(c["topology"], W, r, c.get("seed", 0), i, c.get("mixing_weight")) for i in range(W)]
        ys = []
        for i in range(W):
            local = theta0[i] - drift(i, r) if sc["drift"] else theta0[i].clone()
            if sc.get("nan") == (i, r):
                local = theta0[i].clone()  # skip: that worker's progress is discarded
            ys.append((theta0[i] - local).mul_(-eta).add_(theta0[i]))
        new_copy = {}
        for i in range(W):
            for j, _ in nb[i]:
                x = copy.get((i, j))
                buckets = []
                for s in range(0, N, BUCKET):
                    e = min(N, s + BUCKET)
                    if x is None:
                        buckets.append(ys[i][s:e].clone())
                    else:
                        buckets.append(x[s:e] + decode_dense(encode(ys[i][s:e] - x[s:e], cfg)))
                new_copy[(i, j)] = torch.cat(buckets)
        copy.update(new_copy)
        for i in range(W):
            corr = torch.zeros(N)
            for j, w in nb[i]:
                corr.add_(copy[(j, i)] - copy[(i, j)], alpha=w)
            mix = ys[i].add_(corr, alpha=xi)
            d[i].mul_(gamma).add_(mix.sub_(theta0[i]))
            theta0[i] = theta0[i] + d[i]
        out.append(torch.stack(theta0).clone())
    return out


def uncompressed_reference(sc: dict, W: int) -> List[torch.Tensor]:
    return gossip_reference(sc, W, init_theta, drift)


def _anchors(rec: List[dict], r: int) -> torch.Tensor:
    return torch.stack([rec[i]["anchors"][r] for i in range(len(rec))])


def _disagreement(X: torch.Tensor) -> float:
    X = X.double()
    return float(((X - X.mean(0, keepdim=True)) ** 2).sum())


@pytest.mark.parametrize("name", ["ring", "random1", "random2_entropy", "skip", "consensus_random1"])
def test_distributed_equals_single_process_compressed_reference(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    for r, ref in enumerate(compressed_reference(sc, WORLD)):
        err = (_anchors(rec, r) - ref).abs().max().item()
        assert err < 1e-5, (name, r, err)


def test_lossless_codec_with_unit_step_is_the_uncompressed_gossip(runs):
    sc, rec = SCENARIOS["lossless_random1"], runs["lossless_random1"]
    for r, ref in enumerate(uncompressed_reference(sc, WORLD)):
        err = (_anchors(rec, r).double() - ref).abs().max().item()
        assert err < 2e-5, (r, err)
    assert any(rec[0]["stats"][r]["dense_refresh_peers"] == 0 for r in range(sc["rounds"]))  # some coded rounds


@pytest.mark.parametrize("name", ["consensus_ring", "consensus_random1", "random2_entropy"])
def test_mean_is_preserved(runs, name):
    """γ = 0: mean after round r = mean of the proposals; no local steps → mean of the previous anchors."""
    sc, rec = SCENARIOS[name], runs[name]
    prev = torch.stack([init_theta(sc["init"], i) for i in range(WORLD)])
    for r in range(sc["rounds"]):
        y = prev - torch.stack([drift(i, r) for i in range(WORLD)]) if sc["drift"] else prev
        X = _anchors(rec, r)
        err = (X.double().mean(0) - y.double().mean(0)).abs().max().item()
        assert err < 1e-6, (name, r, err)
        prev = X


@pytest.mark.parametrize("name", ["consensus_ring", "consensus_random1"])
def test_disagreement_shrinks_without_local_steps(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    d0 = _disagreement(torch.stack([init_theta(sc["init"], i) for i in range(WORLD)]))
    ds = [_disagreement(_anchors(rec, r)) / d0 for r in range(sc["rounds"])]
    assert ds[9] < 0.8 and ds[-1] < 0.35, ds  # uncompressed ring would be (1/9)^20; slower is expected
    assert max(ds) < 1.0, ds


@pytest.mark.parametrize("name", ["ring", "random1", "random2_entropy"])
def test_bytes_are_the_payload_sizes_and_only_p2p(runs, name):
    sc, rec = SCENARIOS[name], runs[name]
    c = sc["cfg"]
    cfg = CodecConfig(chunk=c["chunk"], k=c["k"], value_bits=c["value_bits"],
                      index_coding=c.get("index_coding", "packed"))
    buckets = [min(N, s + BUCKET) - s for s in range(0, N, BUCKET)]
    entropy = c.get("index_coding") == "entropy"
    met = [set() for _ in range(WORLD)]
    for r in range(sc["rounds"]):
        for i in range(WORLD):
            st = rec[i]["stats"][r]
            peers = [p for p, _ in neighbours(c["topology"], WORLD, r, c.get("seed", 0), i, c.get("mixing_weight"))]
            fresh = [p for p in peers if p not in met[i]]
            coded = len(peers) - len(fresh)
            assert st["dense_refresh_peers"] == len(fresh)
            dense_bytes = sum(4 * n + 1 for n in buckets) * len(fresh)
            sizes = 8 * len(peers) * len(buckets) if (entropy and peers) else 0
            if not entropy:
                want = dense_bytes + sum(payload_nbytes(n, cfg) + 1 for n in buckets) * coded
                assert rec[i]["sent"][r] == want and rec[i]["recv"][r] == want
            # bytes = what the payloads hold (+1 flag byte each) + the size exchange
            assert rec[i]["sent"][r] == st["payload_bytes"] + len(peers) * len(buckets) + sizes
            kinds = {"p2p": len(buckets)} if peers else {}
            if entropy and peers:
                kinds["p2p_sizes"] = len(buckets)
            assert rec[i]["by_kind"][r] == kinds
            if fresh == [] and peers:  # compressed rounds: ≥ 30× below the dense fp32 exchange
                uncompressed = sum((n + 1) * 4 for n in buckets) * len(peers)
                assert uncompressed / rec[i]["sent"][r] >= 30.0, (uncompressed, rec[i]["sent"][r])
            met[i].update(peers)


def test_copies_memory_static_vs_dynamic(runs):
    shard = 4 * N
    assert runs["ring"][0]["stats"][-1]["copies_bytes"] == 3 * shard  # one own copy + 2 neighbours
    for i in range(WORLD):  # random1: own + heard per distinct peer met
        met = {p for r in range(5) for p, _ in neighbours("random1", WORLD, r, 11, i)}
        assert runs["random1"][i]["stats"][-1]["copies_bytes"] == 2 * len(met) * shard


def test_skip_is_local(runs):
    rec = runs["skip"]
    bad, r = SCENARIOS["skip"]["nan"]
    assert rec[bad]["stats"][r]["skipped"] is True
    assert rec[(bad + 1) % WORLD]["stats"][r]["peers_nonfinite"] == 1.0
    assert rec[(bad + 2) % WORLD]["stats"][r]["peers_nonfinite"] == 0.0
    assert all(torch.isfinite(rec[i]["anchors"][-1]).all() for i in range(WORLD))


def test_abort_raises_on_the_bad_worker_and_neighbours_with_state_untouched(runs):
    out = runs["abort"]
    assert "tensor 'param0' on this worker (rank 1)" in out[1]
    assert "neighbour worker(s) [1]" in out[0] and "neighbour worker(s) [1]" in out[2]
    assert out[3] == "ok"


# ---------------------------------------------------------------- single process
def test_config_accepts_compress_and_checks_its_fields():
    cfg = GASLoCConfig(compress=True, bucket_numel=10000).validate()
    assert cfg.effective_bucket_numel == 8192 and GASLoCConfig(bucket_numel=10000).effective_bucket_numel == 10000
    for kwargs, match in [(dict(gossip_step=0.0), "gossip_step"), (dict(gossip_step=1.5), "gossip_step"),
                          (dict(index_coding="zip"), "index_coding"), (dict(k=0), "k must be")]:
        with pytest.raises(ConfigError, match=match):
            GASLoCConfig(compress=True, **kwargs).validate()


def test_single_worker_compressed_is_heavy_ball_and_resume_drops_copies():
    p = torch.zeros(5000)
    strat = GASLoC([p], None, GASLoCConfig(compress=True, proposal_lr=0.5, momentum=0.9))
    p.sub_(1.0)
    st = strat.step()
    assert torch.allclose(p, torch.full_like(p, -0.5)) and st.bytes_sent == 0
    strat.own_copy[1] = strat.heard_copy[1] = torch.zeros(5000)  # as if a peer had been met
    other = GASLoC([torch.zeros(5000)], None, GASLoCConfig(compress=True))
    other.own_copy[1] = other.heard_copy[1] = torch.zeros(5000)
    other.load_state_dict(strat.state_dict())
    assert other.own_copy == {} and other.heard_copy == {} and torch.equal(other.momentum, strat.momentum)
