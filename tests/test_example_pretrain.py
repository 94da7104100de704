"""examples/pretrain_gpt.py, unmodified, under ``python -m megatron_sparseloco.run`` on 4 CPU ranks.

One real launch (torch.distributed.run, gloo): 2 workers × 2 ranks (distributed optimizer inside
each worker), the byte-level stdlib dataset built by ``megatron_sparseloco.data``, 20 iterations,
H = 5 → 4 outer steps. Checks Megatron's own log lines, a finite held-out loss, and the outer-loop
counters that ``megatron_sparseloco.demo.write_outer_summary`` gathers from every rank.
"""
import json
import math
import re

import pytest

from megatron_sparseloco.demo import build_command, parse_megatron_log, run_training, summarize_counters
from megatron_sparseloco.testing.prefork import use_prefork

ITERS, H, LOG_INTERVAL = 20, 5, 5


def _algorithm() -> str:
    try:
        from megatron_sparseloco.outer.registry import build_outer_strategy  # noqa: F401
        import megatron_sparseloco.outer.sparseloco  # noqa: F401
    except Exception:
        return "diloco"
    return "sparseloco"


def test_parse_megatron_log_reads_iteration_and_validation_lines():
    lines = [
        " [2025-11-30 16:40:01] iteration        5/      20 | consumed samples:           80 | elapsed time per "
        "iteration (ms): 120.3 | learning rate: 1.000000E-03 | global batch size:    16 | lm loss: 5.512345E+00 |"
        " loss scale: 1.0 | grad norm: 1.234 |",
        "-" * 40,
        " validation loss at iteration 10 on validation set | lm loss value: 4.987654E+00 | lm loss PPL: 1.465E+02 | ",
        " validation loss at iteration 20 on validation set | lm loss value: 4.500000E+00 | lm loss PPL: 9.0E+01 | ",
        " validation loss at iteration 20 on test set | lm loss value: 4.600000E+00 | lm loss PPL: 9.9E+01 | ",
    ]
    p = parse_megatron_log(lines)
    assert p["iterations"] == [5]
    assert p["train_loss"] == [(5, 5.512345)]
    assert [v["iteration"] for v in p["validation"]] == [10, 20, 20]
    assert [v["split"] for v in p["validation"]] == ["valid", "valid", "test"]
    assert p["validation"][1]["lm_loss"] == 4.5


def test_summarize_counters_sums_ranks_per_worker():
    def rank(r, w, sent, numel):
        return {"rank": r, "worker": w, "num_workers": 2, "inner_steps": 5, "inner_calls": 20, "outer_steps": 4,
                "bytes_sent": sent * 4, "bytes_received": sent * 4, "numel": numel, "last": {"bytes_sent": sent}}

    s = summarize_counters([rank(0, 0, 100, 1000), rank(1, 0, 120, 1000), rank(2, 1, 100, 1000), rank(3, 1, 120, 1000)])
    assert s["outer_steps"] == 4 and s["num_workers"] == 2
    assert s["numel_per_worker"] == 2000
    assert s["bytes_sent_per_worker"] == 4 * 220 == 4 * s["bytes_sent_per_step_per_worker"]
    assert s["dense_fp32_bytes_equivalent"] == 2000 * 4 * 4
    assert s["compression_ratio_vs_fp32"] == pytest.approx(32000 / 880)
    bad = [rank(0, 0, 1, 1), dict(rank(1, 1, 1, 1), outer_steps=3)]
    with pytest.raises(RuntimeError, match="disagree"):
        summarize_counters(bad)


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_example_pretrain_runs_unmodified_with_outer_loop(tmp_path, monkeypatch):
    from megatron_sparseloco.data.build import build_dataset

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # as a user runs it: Megatron's torch.compile on

    data = build_dataset(str(tmp_path / "data"), max_bytes=600_000, valid_percent=10.0, log=lambda *_: None)
    algorithm = _algorithm()
    cmd = build_command({"train": data.prefix("train"), "valid": data.prefix("valid")}, nproc=4, workers=2,
                        algorithm=algorithm, inner_steps=H, train_iters=ITERS, eval_interval=10, eval_iters=2,
                        log_interval=LOG_INTERVAL, micro_batch_size=2, seq_length=64,
                        extra=["--num-layers", "2", "--hidden-size", "64", "--tensorboard-dir", str(tmp_path / "tb"),
                               "--sparseloco-consistency-check-interval", "2"])
    counters_path = str(tmp_path / "counters.json")
    res = run_training(cmd, str(tmp_path / "train.log"), counters_path, timeout=240, echo=lambda *_: None)
    tail = "\n".join(res["log_lines"][-60:])
    assert res["returncode"] == 0, tail

    # Megatron's own progress lines: "iteration N/20" at iteration 1 and every LOG_INTERVAL iterations.
    assert [i for i in res["iterations"] if i != 1] == list(range(LOG_INTERVAL, ITERS + 1, LOG_INTERVAL)), tail
    assert all(math.isfinite(loss) for _, loss in res["train_loss"]), res["train_loss"]
    # Held-out loss Megatron reports, finite and below uniform (ln 257).
    # At the eval interval (10, 20) and the final evaluation after training (20, "on validation set").
    assert [(v["iteration"], v["split"]) for v in res["validation"]] == [(10, "valid"), (20, "valid"), (20, "valid")], \
        res["validation"]
    assert all(math.isfinite(v["lm_loss"]) for v in res["validation"]), res["validation"]
    assert res["validation"][-1]["lm_loss"] < math.log(257), res["validation"]

    # Outer-loop counters gathered from all 4 ranks.
    with open(counters_path, encoding="utf-8") as f:
        s = json.load(f)
    assert s["outer_steps"] == ITERS // H
    assert s["num_workers"] == 2 and sorted(s["workers"]) == ["0", "1"]
    assert sorted(len(w["ranks"]) for w in s["workers"].values()) == [2, 2]
    assert s["bytes_sent_per_worker"] > 0
    assert s["bytes_sent_per_worker"] == s["outer_steps"] * s["bytes_sent_per_step_per_worker"]
    if algorithm == "sparseloco":   # the start-up block: the outer lr the rule resolved for W = 2 and the built model
        from megatron_sparseloco.outer.sparseloco import default_outer_lr
        counted = [ln for ln in res["log_lines"] if "> number of parameters on (tensor" in ln]
        numel = int(counted[0].rsplit(":", 1)[1])   # Megatron's own count: TP = PP = 1, so the whole model
        line = next(ln for ln in res["log_lines"] if "(default for W = 2" in ln)
        assert f" {default_outer_lr(2, 64, 4096, numel):g} (default for W = 2 and N = {numel / 1e6:.3g} M parameters" \
            in line, (line, numel)
    for c in s["per_rank"]:
        assert c["inner_calls"] == ITERS and c["outer_steps"] == ITERS // H
        assert c["bytes_sent"] == c["outer_steps"] * c["last"]["bytes_sent"] > 0

    # The start-up block (rank 0, once, before the first iteration): resolved settings, the worker map,
    # and expected bytes per outer step that match what the outer steps then really sent.
    lines = res["log_lines"]
    start = [i for i, l in enumerate(lines) if "sparseloco | start-up: flags validated" in l]
    first_iter = next(i for i, l in enumerate(lines) if re.search(r"iteration\s+1/", l))
    assert len(start) == 1 and start[0] < first_iter, start
    block = "\n".join(lines[start[0]:first_iter])
    assert f"algorithm: {algorithm}" in block and f"inner steps H: {H}" in block and "workers W: 2" in block
    assert re.search(r"worker 0: ranks 0-1\b", block) and re.search(r"worker 1: ranks 2-3\b", block), block
    from megatron_sparseloco.megatron.metrics import format_mb
    m = re.search(r"per outer step per worker: (\d+) parameters, expected to send ([0-9.]+ MB)", block)
    assert m and int(m.group(1)) == s["numel_per_worker"], block
    assert m.group(2) == format_mb(s["bytes_sent_per_step_per_worker"]), (m.group(2), s["bytes_sent_per_step_per_worker"])
    assert f"dense fp32 would send {format_mb(s['numel_per_worker'] * 4)}" in block
    # --sparseloco-consistency-check-interval 2: a pass line with the fingerprint at outer steps 2 and 4.
    passed = [l for l in lines if "consistency check passed" in l]
    assert [int(re.search(r"outer step (\d+)", l).group(1)) for l in passed] == [2, 4], passed
    assert all(re.search(r"fingerprint [0-9a-f]{16}", l) for l in passed), passed
    # Every parameter of the model takes part in the outer step: the worker's shards add up to
    # the parameter count Megatron itself prints.
    n_params = {int(m.group(1)) for line in res["log_lines"]
                for m in [re.search(r"number of parameters on \(.*?\) model parallel rank \((?:0, )*0\): (\d+)", line)]
                if m}
    assert n_params == {s["numel_per_worker"]}, (n_params, s["numel_per_worker"])
    assert s["dense_fp32_bytes_equivalent"] == s["numel_per_worker"] * 4 * s["outer_steps"]
    if algorithm == "sparseloco":
        # k=64 of 4096 with 2-bit values: far below fp32 (≈ 0.2–0.5 bits/param with headers).
        assert s["compression_ratio_vs_fp32"] > 20, s["compression_ratio_vs_fp32"]
    else:
        assert s["compression_ratio_vs_fp32"] <= 1.01

    # Our line after Megatron's at every --log-interval, and the sparseloco/* TensorBoard scalars.
    ours = [line for line in res["log_lines"] if "sparseloco | outer steps:" in line]
    assert len(ours) == ITERS // LOG_INTERVAL, ours
    assert f"outer steps: {ITERS // H} " in ours[-1] and "ratio vs fp32" in ours[-1], ours[-1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("bytes_sent_per_worker", "compression_ratio_vs_fp32", "compression_ratio_vs_bf16",
                "pseudo_grad_norm", "error_feedback_norm", "outer_steps"):
        assert f"sparseloco/{tag}" in scalars, scalars
    last = events.Scalars("sparseloco/bytes_sent_per_worker")[-1]
    assert last.step == ITERS and last.value == s["bytes_sent_per_worker"]


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(200)
def test_example_pretrain_moe_mock_data(tmp_path):
    """The MoE path (--num-experts) with --mock-data: 2 ranks = 2 workers of 1 rank, H = 2."""
    algorithm = _algorithm()
    cmd = build_command({"train": "unused", "valid": "unused"}, nproc=2, workers=2, algorithm=algorithm, inner_steps=2,
                        train_iters=4, eval_interval=4, eval_iters=1, log_interval=1, micro_batch_size=2, seq_length=32,
                        extra=["--hidden-size", "64", "--num-experts", "4", "--moe-ffn-hidden-size", "64",
                               "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                               # Megatron: no fused bias-GeLU with MoE per-token scales; SequentialMLP's
                               # bias add is in place on a view (autograd error), so no linear biases.
                               "--no-bias-gelu-fusion", "--disable-bias-linear", "--mock-data", "--split", "98,1,1"])
    i = cmd.index("--train-data-path")
    del cmd[i:i + 4]
    counters_path = str(tmp_path / "counters.json")
    res = run_training(use_prefork(cmd), str(tmp_path / "train.log"), counters_path, timeout=180, echo=lambda *_: None)
    tail = "\n".join(res["log_lines"][-60:])
    assert res["returncode"] == 0, tail
    assert res["iterations"] == [1, 2, 3, 4], tail
    assert any("MoE 4 experts" in line for line in res["log_lines"]), tail
    assert res["validation"] and all(math.isfinite(v["lm_loss"]) for v in res["validation"]), res["validation"]
    with open(counters_path, encoding="utf-8") as f:
        s = json.load(f)
    assert s["outer_steps"] == 2 and s["num_workers"] == 2
    assert [w["ranks"] for w in s["workers"].values()] == [[0], [1]]
    n_params = {int(m.group(1)) for line in res["log_lines"]
                for m in [re.search(r"number of parameters on \(.*?\) model parallel rank \((?:0, )*0\): (\d+)", line)]
                if m}
    assert n_params == {s["numel_per_worker"]}, (n_params, s["numel_per_worker"])
    assert s["bytes_sent_per_worker"] == s["outer_steps"] * s["bytes_sent_per_step_per_worker"] > 0
