"""The sparseloco | log line: only what applies to the algorithm, nothing before the first outer step, one unit."""
import re
import subprocess
import sys

import pytest

from megatron_sparseloco.megatron.args import ALGORITHMS
from megatron_sparseloco.megatron.metrics import ERROR_FEEDBACK_ALGORITHMS, MB, format_log_line, format_mb


def _totals(outer_steps, sent_per_step=12345.0, numel=1_000_000):
    dense = numel * 4 * outer_steps
    sent = sent_per_step * outer_steps
    return {"outer_steps": float(outer_steps), "bytes_sent_per_worker": sent, "bytes_sent_last_outer_step": sent_per_step,
            "compression_ratio_vs_fp32": dense / sent if sent else 0.0, "compression_ratio_vs_bf16": dense / 2 / sent if sent else 0.0,
            "pseudo_grad_norm": 1.5, "error_feedback_norm": 0.25 if outer_steps else 0.0, "update_norm": 1.0,
            "time_compress_s": 0.001, "time_communicate_s": 0.002, "time_apply_s": 0.003}


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_before_first_outer_step_nothing_misleading(algo):
    line = format_log_line(_totals(0), algo, inner_steps=7)
    assert "outer steps: 0" in line and "7" in line
    for word in ("ratio vs", "|e|", "|Δ|", "MB", "x |"):
        assert word not in line, line


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_only_what_applies(algo):
    t = _totals(3)
    line = format_log_line(t, algo, inner_steps=5)
    assert ("|e|:" in line) == (algo in ERROR_FEEDBACK_ALGORITHMS), line
    assert f"ratio vs fp32: {t['compression_ratio_vs_fp32']:.1f}x" in line
    # nothing was sent (one worker): no ratio against a dense baseline that was not needed either
    assert "ratio vs" not in format_log_line(_totals(3, sent_per_step=0.0), algo, inner_steps=5)


def test_one_decimal_unit_in_log_and_demo_summary():
    t = _totals(4)
    line = format_log_line(t, "sparseloco")
    assert "MiB" not in line and "KiB" not in line
    mb = float(re.search(r"sent/worker: ([0-9.]+) MB", line).group(1))
    assert mb == pytest.approx(t["bytes_sent_per_worker"] / 1e6, abs=1e-3)
    kb = float(re.search(r"last step ([0-9.]+) kB", line).group(1))
    assert kb == pytest.approx(t["bytes_sent_last_outer_step"] / 1e3, abs=0.1)
    assert MB == 10 ** 6 and format_mb(2.5e6) == "2.500 MB"
    import inspect

    import megatron_sparseloco.demo as demo
    assert "format_mb" in inspect.getsource(demo.main) and "1e6" not in inspect.getsource(demo.main)


def test_demo_help_describes_every_option(monkeypatch):
    import argparse

    import megatron_sparseloco.demo as demo
    seen = {}

    def capture(self, *a, **kw):
        seen["parser"] = self
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        demo.main([])
    actions = [a for a in seen["parser"]._actions if not isinstance(a, argparse._HelpAction)]
    assert actions and all(a.help for a in actions), [a.dest for a in actions if not a.help]
    p = subprocess.run([sys.executable, "-m", "megatron_sparseloco.demo", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and all(a.help.split()[0] in p.stdout for a in actions), p.stdout


def test_a_round_over_several_strategies_sums_bytes_and_seconds_and_adds_norms_in_quadrature():
    from megatron_sparseloco.megatron.rounds import OuterLog
    from megatron_sparseloco.outer.base import OuterStepStats

    a = OuterStepStats(bytes_sent=100, bytes_received=300, time_compress_s=0.5, time_exposed_s=1.0,
                       delta_norm=3.0, error_norm=1.0, update_norm=6.0, extra={"time_wait_s": 0.25, "density": 0.1})
    b = OuterStepStats(bytes_sent=20, bytes_received=60, time_compress_s=0.25, time_apply_s=2.0,
                       delta_norm=4.0, update_norm=8.0, skipped=True, extra={"time_agree_s": 0.5})
    log = OuterLog()
    log.record([a, b], numel=1000)
    log.record([a], numel=500)
    assert log.last == {"bytes_sent": 100.0, "bytes_received": 300.0, "time_compress_s": 0.5,
                        "time_communicate_s": 0.0, "time_apply_s": 0.0, "time_exposed_s": 1.0, "delta_norm": 3.0,
                        "error_norm": 1.0, "update_norm": 6.0, "skipped": 0.0, "time_wait_s": 0.25,
                        "time_agree_s": 0.0, "time_owner_s": 0.0}
    both = OuterStepStats.merged([a, b])
    assert (both["bytes_sent"], both["bytes_received"], both["time_compress_s"], both["time_apply_s"]) == (
        120.0, 360.0, 0.75, 2.0)
    assert (both["delta_norm"], both["update_norm"], both["error_norm"]) == (5.0, 10.0, 1.0)   # √(3²+4²), √(6²+8²)
    assert both["skipped"] == 1.0 and both["time_wait_s"] == 0.25 and both["time_agree_s"] == 0.5
    assert "density" not in both                                  # a ratio: not added over strategies
    assert (log.bytes_sent, log.bytes_received, log.numel) == (220, 660, 500)
