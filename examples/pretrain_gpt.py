"""Pretrain a GPT with megatron.training (megatron-core 0.19 style), our own script.

A plain Megatron pretrain script: nothing in it knows about DiLoCo / SparseLoCo. Run it as is
(``torchrun examples/pretrain_gpt.py <Megatron args>``), or with the outer loop added by the
plugin, unmodified ("way (a)")::

    torchrun --nproc-per-node 4 -m megatron_sparseloco.run examples/pretrain_gpt.py \\
        <Megatron args> --sparseloco-algorithm sparseloco --sparseloco-workers 2 --sparseloco-inner-steps 15

Structure (0.19): ``parse_and_validate_args()`` → ``pretrain_cfg_container_from_args(args)`` →
``pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
forward_step, model_provider=model_provider)``.

* Model: ``GPTModel``; layer spec from Transformer Engine when ``--transformer-impl
  transformer_engine`` (Megatron's default) and TE is importable, else the local (pure PyTorch)
  spec — without TE the script switches ``--transformer-impl`` to ``local`` and says so. MoE:
  ``--num-experts N`` (+ Megatron's ``--moe-*`` flags) builds the MoE decoder block spec.
* Data: ``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` from ``--data-path`` with
  ``--split``, or ``--train-data-path`` / ``--valid-data-path`` (e.g. the indexed dataset written by
  ``python -m megatron_sparseloco.data.build``; use ``--tokenizer-type NullTokenizer --vocab-size
  257``), or ``--mock-data``.
* Batches: the dataset's tokens / labels / loss mask / position ids; with TP > 1 tensor-parallel
  rank 0 reads them and broadcasts them to its TP group. The causal mask is built by the attention
  layer (no mask tensor in the batch). Context parallelism is not supported by this script.

Demo hook (off unless the environment variable ``SPARSELOCO_SUMMARY_PATH`` is set): every rank
records the optimizer that ``setup_model_and_optimizer`` builds (with the plugin, the
``OuterLoopOptimizer``); after ``pretrain`` returns, the ranks gather their outer-loop counters and
rank 0 writes them to that path as JSON (``megatron_sparseloco.demo.write_outer_summary``).
"""
import os
import warnings
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_attr_wrapped_model
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import core_transformer_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

SUMMARY_ENV = "SPARSELOCO_SUMMARY_PATH"


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ------------------------------------------------------------------------------------ model
def layer_spec(args, config, vp_stage=None):
    """The GPT layer (or, for MoE, decoder-block) spec for ``args``."""
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm,
            multi_latent_attention=args.multi_latent_attention, qk_l2_norm=args.qk_l2_norm)
    return get_gpt_layer_local_spec(
        num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention, normalization=args.normalization,
        qk_l2_norm=args.qk_l2_norm)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build this rank's GPTModel chunk (called by megatron.training's ``get_model``)."""
    args = get_args()
    print_rank_0(f"> building GPT model ({args.transformer_impl} layer spec"
                 f"{', MoE %d experts' % args.num_experts if args.num_experts else ''}) ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


# ------------------------------------------------------------------------------------ batches
_BATCH_KEYS = (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32),
               ("position_ids", torch.int64))


def get_batch(data_iterator, vp_stage=None):
    """(tokens, labels, loss_mask, position_ids) on this rank; None on middle pipeline stages."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None
    args = get_args()
    device = _device()
    shape = (args.micro_batch_size, args.seq_length)
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        out = [batch[k].to(device=device, dtype=dt, non_blocking=True).contiguous() for k, dt in _BATCH_KEYS]
    else:
        out = [torch.empty(shape, dtype=dt, device=device) for _, dt in _BATCH_KEYS]
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        src = parallel_state.get_tensor_model_parallel_src_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        for t in out:
            torch.distributed.broadcast(t, src, group=group)
    return tuple(out)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses over unmasked tokens, their count, and the report for logging."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).to(loss.dtype)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch forward; Megatron calls the returned closure on the output."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    # The virtual-pipeline stage sits on the GPTModel inside the DDP / Float16Module wrappers.
    tokens, labels, loss_mask, position_ids = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


# ------------------------------------------------------------------------------------ data
def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,           # the attention layer builds the causal mask
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train / valid / test datasets for megatron.training (None where a split has no data)."""
    args = get_args()
    config = gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_type.__name__}) ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


train_valid_test_datasets_provider.is_distributed = True


# ------------------------------------------------------------------------------------ main
def main():
    args = parse_and_validate_args()
    if args.context_parallel_size > 1:
        raise SystemExit("examples/pretrain_gpt.py: context parallelism is not supported by this script; "
                         "drop --context-parallel-size")
    if args.transformer_impl == "transformer_engine" and not _have_transformer_engine():
        print_rank_0("> Transformer Engine is not installed: using --transformer-impl local")
        args.transformer_impl = "local"
    with warnings.catch_warnings():
        # We pass a model_provider instead of a ModelConfig on purpose (explicit layer spec).
        warnings.filterwarnings("ignore", message=r"\s*It is recommended to use a ModelConfig")
        config = pretrain_cfg_container_from_args(args)

    summary_path = os.environ.get(SUMMARY_ENV)
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)

    if summary_path:
        from megatron_sparseloco.demo import write_outer_summary
        write_outer_summary(summary_path)

    # Tear the process groups down explicitly: leaving them to interpreter shutdown sometimes
    # aborted a rank ("terminate called without an active exception") after a finished run.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
