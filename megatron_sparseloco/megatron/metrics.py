"""Outer-loop metrics in Megatron's style: the ``--log-interval`` line, TensorBoard / W&B scalars.

Per rank, the strategies report what *this rank's shard* did. A worker's numbers are sums over
its ranks (bytes) or root-sum-squares (norms); ``worker_totals`` combines them with one small
all-reduce inside the worker (never across workers), at log iterations only.

Scalars (``sparseloco/...``): bytes sent per outer step and cumulative (per worker), dense-fp32 and
dense-bf16 bytes the same outer steps would have sent, the compression ratios against both,
pseudo-gradient norm, error-feedback norm, applied-update norm, outer steps, and the outer-step
time split (compress / communicate / apply) and the exposed outer time: the wall time the training
loop spent in the last round's outer step (blocking: all of it; with ``--sparseloco-overlap-steps``
only launch + wait + apply + merge, the communication hidden behind inner steps is not in it),
and ``time_wait_s``, the part of it spent waiting for the collective.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import collective_device


def worker_totals(wrapper, intra_group: Optional[dist.ProcessGroup]) -> Dict[str, float]:
    """This worker's outer-loop totals (an all-reduce over ``intra_group``, the worker's ranks)."""
    last = wrapper.log.last or {}
    vals = torch.tensor([
        float(wrapper.log.bytes_sent), float(wrapper.log.bytes_received), float(wrapper.log.numel),
        float(last.get("bytes_sent", 0.0)), last.get("delta_norm", 0.0) ** 2, last.get("error_norm", 0.0) ** 2,
        last.get("update_norm", 0.0) ** 2,
    ], dtype=torch.float64, device=collective_device(intra_group))  # NCCL refuses CPU tensors
    if intra_group is not None and dist.is_initialized() and dist.get_world_size(intra_group) > 1:
        dist.all_reduce(vals, group=intra_group)
    steps = max(wrapper.outer_steps, 1)
    bytes_sent, bytes_recv, numel, last_bytes, d2, e2, u2 = vals.tolist()
    dense_fp32 = numel * 4 * wrapper.outer_steps
    out = {
        "outer_steps": float(wrapper.outer_steps),
        "bytes_sent_per_worker": bytes_sent,
        "bytes_received_per_worker": bytes_recv,
        "bytes_sent_last_outer_step": last_bytes,
        "numel_per_worker": numel,
        "dense_fp32_bytes_equivalent": dense_fp32,
        "dense_bf16_bytes_equivalent": dense_fp32 / 2,
        "compression_ratio_vs_fp32": dense_fp32 / bytes_sent if bytes_sent else 0.0,
        "compression_ratio_vs_bf16": dense_fp32 / 2 / bytes_sent if bytes_sent else 0.0,
        "pseudo_grad_norm": d2 ** 0.5,
        "error_feedback_norm": e2 ** 0.5,
        "update_norm": u2 ** 0.5,
        "bytes_sent_per_outer_step_mean": bytes_sent / steps,
    }
    for key in ("time_compress_s", "time_communicate_s", "time_apply_s", "time_exposed_s", "time_wait_s"):
        out[key] = float(last.get(key, 0.0))
    return out


MB = 10 ** 6   # the one byte unit of the log line, the demo summary and the docs (decimal megabytes)


def format_mb(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / MB:.3f} MB"


def _error_feedback_algorithms():
    from megatron_sparseloco.outer.registry import outer_strategy_classes
    return tuple(name for name, cls in outer_strategy_classes().items() if cls.capabilities.has_error_feedback)


#: algorithms whose strategy keeps an error-feedback buffer (|e| means something)
ERROR_FEEDBACK_ALGORITHMS = _error_feedback_algorithms()


def format_log_line(totals: Dict[str, float], algorithm: Optional[str] = None,
                    inner_steps: Optional[int] = None) -> str:
    """The ``sparseloco |`` line: only what applies to ``algorithm``, nothing before the first outer step.

    Bytes are decimal (1 MB = 10^6 bytes, 1 kB = 10^3), as in the demo summary and the docs.
    """
    steps = int(totals["outer_steps"])
    head = f" sparseloco | outer steps: {steps} |"
    if steps == 0:
        when = f" at iteration {inner_steps}" if inner_steps else ""
        return f"{head} no outer step yet (first{when}) |"
    sent = totals["bytes_sent_per_worker"]
    line = (f"{head} sent/worker: {format_mb(sent)} "
            f"(last step {totals['bytes_sent_last_outer_step'] / 1e3:.1f} kB) |")
    if sent > 0:
        line += (f" ratio vs fp32: {totals['compression_ratio_vs_fp32']:.1f}x |"
                 f" vs bf16: {totals['compression_ratio_vs_bf16']:.1f}x |")
    line += f" |Δ|: {totals['pseudo_grad_norm']:.3e} |"
    if algorithm is None or algorithm in ERROR_FEEDBACK_ALGORITHMS:
        line += f" |e|: {totals['error_feedback_norm']:.3e} |"
    line += (f" outer time c/comm/apply: {totals['time_compress_s'] * 1e3:.1f}/"
             f"{totals['time_communicate_s'] * 1e3:.1f}/{totals['time_apply_s'] * 1e3:.1f} ms |")
    if "time_exposed_s" in totals:
        line += f" exposed: {totals['time_exposed_s'] * 1e3:.1f} ms |"
    return line


def write_scalars(totals: Dict[str, float], iteration: int, tb_writer=None, wandb_writer=None) -> None:
    scalars = {f"sparseloco/{k}": v for k, v in totals.items()}
    if tb_writer is not None:
        for k, v in scalars.items():
            tb_writer.add_scalar(k, v, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)
