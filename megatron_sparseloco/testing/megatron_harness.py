"""Testing only: drive the real megatron-core inside a rank function run by ``run_ranks``.

    def rank_fn(rank, world_size):
        init_megatron(tp=2)
        chunks = build_tiny_gpt()
        ddp, opt = wrap_ddp_and_optimizer(chunks)
        batches = synthetic_batches(0, 2, 32, 128, parallel_state.get_data_parallel_rank())
        losses = [train_step(ddp, opt, batches) for _ in range(3)]

On a CPU-only machine :func:`init_megatron` applies :mod:`.cpu_bridges` and uses the gloo default
process group that ``run_ranks`` created. On a CUDA machine no bridge is applied: each rank binds
``cuda:LOCAL_RANK`` and, if no default process group exists yet, initialises NCCL from the usual
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` variables (that path is written but not
tested here: no GPU). ``run_ranks`` always creates a gloo group, so on CUDA launch ranks with
``torch.distributed.run`` instead.

What megatron-core needs initialised for these helpers: ``parallel_state`` (model-parallel groups)
and the model-parallel RNG tracker (``model_parallel_cuda_manual_seed``). The core pipeline
schedules take ``num_microbatches`` as an argument, so the global num-microbatches calculator of
``megatron.core.num_microbatches_calculator`` is *not* needed by the helpers here;
:func:`init_megatron` still initialises it (constant, one micro-batch of the global batch per DP
rank) so code that reads ``get_num_microbatches()`` works.
"""
from __future__ import annotations

import math
import os
from functools import partial
from typing import TYPE_CHECKING, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer


def _have_cuda() -> bool:
    return torch.cuda.is_available()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if _have_cuda() else torch.device("cpu")


def init_megatron(tp: int = 1, pp: int = 1, ep: int = 1, num_distributed_optimizer_instances: int = 1,
                  seed: int = 1234) -> None:
    """Initialise megatron-core's parallel state and RNG on this rank (idempotent per call).

    Any previous parallel state is destroyed first, so a rank function may call it again with
    other sizes. Data parallel size is ``world_size / (tp * pp)``; experts use ``ep`` with
    expert-tensor-parallel size 1.
    """
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import tensor_parallel

    if _have_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl")
    else:
        from megatron_sparseloco.testing.cpu_bridges import apply_cpu_bridges
        apply_cpu_bridges()
        if not dist.is_initialized():
            dist.init_process_group("gloo")

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        create_gloo_process_groups=not _have_cuda(),
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)

    dp = parallel_state.get_data_parallel_world_size()
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(rank=dist.get_rank(), rampup_batch_size=None,
                                         global_batch_size=dp, micro_batch_size=1,
                                         data_parallel_size=dp)


def build_tiny_gpt(moe: bool = False, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                   vocab: int = 128, seq_len: int = 32, num_experts: int = 4,
                   bf16: bool = False) -> list:
    """Build this rank's GPTModel chunk(s) with the local (no Transformer Engine) layer spec.

    Pre/post-process follow the pipeline stage; input embedding and output layer are tied (as in
    megatron.training's default), so with PP > 1 the two stages' copies stay in sync through the
    embedding group. MoE uses the local MoE spec, the all-to-all
    dispatcher, top-2 routing and ``num_experts`` experts split over the expert-parallel group.
    Returns a list of one model chunk (no virtual pipeline).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    moe_kwargs = {}
    if moe:
        moe_kwargs = dict(num_moe_experts=num_experts, moe_router_topk=2,
                          moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                          moe_router_load_balancing_type="aux_loss",
                          expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        use_cpu_initialization=True, params_dtype=dtype, bf16=bf16, pipeline_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False,
        **moe_kwargs,
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts if moe else None, moe_grouped_gemm=False)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
    )
    model.to(_device())
    return [model]


def tiny_gpt_parameter_counts(rank: int, world: int, build: Optional[dict] = None) -> Tuple[int, int]:
    """A ``run_ranks`` target on one rank: build ``build_tiny_gpt(**build)`` without parallelism and return
    (the sum of its parameters' sizes, ``model_parameter_count`` of it), to check a count against the model."""
    from megatron_sparseloco.megatron.args.model_size import model_parameter_count
    init_megatron()
    chunks = build_tiny_gpt(**(build or {}))
    return sum(p.numel() for c in chunks for p in c.parameters()), model_parameter_count(chunks)


def wrap_ddp_and_optimizer(model_chunks, *, optimizer: str = "adam", lr: float = 1e-3,
                           use_distributed_optimizer: bool = True,
                           num_distributed_optimizer_instances: int = 1,
                           overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                           bf16: bool = False, clip_grad: float = 0.0, weight_decay: float = 0.0,
                           average_in_collective: bool = False) -> Tuple[list, "MegatronOptimizer"]:
    """Wrap chunks in megatron-core DDP and build the Megatron optimizer over them.

    ``optimizer`` is ``"adam"`` or ``"sgd"`` (SGD without momentum). Also installs
    ``finalize_model_grads`` as ``config.finalize_model_grads_func`` and the grad-sync hooks
    (``no_sync_func`` / ``grad_sync_func`` / ``param_sync_func``) so the core schedules drive
    gradient reduction like megatron.training does.
    """
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model_chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        average_in_collective=average_in_collective,
    )
    ddp_chunks = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0))
        for i, chunk in enumerate(model_chunks)
    ]
    for chunk in ddp_chunks:
        chunk.broadcast_params()

    opt_config = OptimizerConfig(
        optimizer=optimizer, lr=lr, weight_decay=weight_decay, bf16=bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer, clip_grad=clip_grad,
        sgd_momentum=0.0, adam_beta1=0.9, adam_beta2=0.95,
        overlap_param_gather=overlap_param_gather,
    )
    opt = get_megatron_optimizer(opt_config, ddp_chunks)

    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:
        no_sync = [c.no_sync for c in ddp_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        grad_sync = [c.start_grad_sync for c in ddp_chunks]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if overlap_param_gather:
        param_sync = [c.start_param_sync for c in ddp_chunks]
        config.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync
    return ddp_chunks, opt


def synthetic_batches(seed: int, micro_batch_size: int, seq_len: int, vocab: int,
                      data_parallel_rank: int) -> Iterator[Dict[str, Optional[torch.Tensor]]]:
    """Endless deterministic, learnable micro-batches for one data-parallel rank.

    Each row is an arithmetic sequence ``t_i = (a + b·i) mod vocab`` with per-row start ``a`` and
    stride ``b`` drawn from a generator seeded by ``(seed, data_parallel_rank)``: the next token is
    predictable from the previous two, so the loss falls within a few steps; different DP ranks
    see different rows. Yields the keys megatron's GPT forward takes: ``tokens``, ``labels``
    (next token), ``loss_mask`` (ones), ``attention_mask`` (None: the local spec's causal mask
    type needs none), ``position_ids``.
    """
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(data_parallel_rank))
    positions = torch.arange(seq_len + 1)
    while True:
        start = torch.randint(0, vocab, (micro_batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (micro_batch_size, 1), generator=gen)
        seq = (start + stride * positions) % vocab
        yield {
            "tokens": seq[:, :-1].contiguous(),
            "labels": seq[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq_len, dtype=torch.float32),
            "attention_mask": None,
            "position_ids": positions[:-1].unsqueeze(0).expand(micro_batch_size, -1).contiguous(),
        }


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token-mean loss in the 3-tuple form the core schedules accept (sum, num_tokens, log)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """Forward one micro-batch (core-schedule ``forward_step_func``)."""
    dev = _device()
    batch = next(data_iterator)
    batch = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def train_step(ddp_chunks, optimizer, batch_iter, num_microbatches: int = 1, seq_len: int = 32,
               micro_batch_size: int = 2) -> float:
    """One optimizer step through megatron-core's schedules; returns this rank's mean token loss.

    The loss is the token-weighted mean over this rank's ``num_microbatches`` micro-batches. Only
    the last pipeline stage computes it: other stages return ``nan``. ``batch_iter`` is consumed
    only on stages that need data (first and last) — pass the same iterator everywhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    fb = get_forward_backward_func()
    results = fb(forward_step_func=forward_step, data_iterator=batch_iter, model=ddp_chunks,
                 num_microbatches=num_microbatches, seq_length=seq_len,
                 micro_batch_size=micro_batch_size, decoder_seq_length=seq_len, forward_only=False)
    ok, _grad_norm, _zeros = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer.step() reported a skipped update (overflow)")
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not results:
        return math.nan
    total = torch.stack([r["lm loss"] for r in results]).sum(0)
    return float(total[0] / total[1])


def params_fingerprint(ddp_chunks) -> Dict[str, torch.Tensor]:
    """``name -> detached CPU clone`` of every local parameter, for bitwise comparisons."""
    out: Dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(ddp_chunks):
        for name, p in chunk.named_parameters():
            out[f"{i}.{name}" if len(ddp_chunks) > 1 else name] = p.detach().cpu().clone()
    return out
