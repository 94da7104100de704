"""Test-only launcher: megatron.training.pretrain on a tiny GPT with mock data (CPU/gloo or CUDA).

    python -m torch.distributed.run --nproc-per-node=2 tests/tiny_pretrain_gpt.py --train-iters 5

Built-in defaults (a 2-layer, hidden-64 GPT, sequence 32, NullTokenizer with vocab 128, mock
data, a log line every iteration, the flags a CPU run needs) come first on the command line, so
any argument given to this script overrides them. On a CPU-only machine the testing bridges of
``megatron_sparseloco.testing.cpu_bridges`` are applied before megatron starts.
"""
from __future__ import annotations

import sys
from functools import partial

import torch

DEFAULT_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--weight-decay", "0.01", "--clip-grad", "1.0",
    "--train-iters", "5", "--eval-interval", "1000", "--eval-iters", "1",
    "--log-interval", "1", "--mock-data", "--split", "98,1,1",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local", "--use-cpu-initialization", "--position-embedding-type", "learned_absolute",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--use-distributed-optimizer",
    "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--seed", "1234",
]
CPU_ARGS = [
    "--distributed-backend", "gloo", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
]


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build a GPTModel with megatron-core's local (no Transformer Engine) layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-sum loss, token count, and the [sum, count] pair megatron.training logs."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum().detach()])}


def forward_step(data_iterator, model):
    """One micro-batch: the mock dataset yields tokens/labels/loss_mask/position_ids."""
    device = next(model.parameters()).device
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device)
    labels = batch["labels"].to(device)
    position_ids = batch["position_ids"].to(device)
    loss_mask = batch["loss_mask"].to(device)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """MockGPTDataset splits through BlendedMegatronDatasetBuilder."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, lambda: True, config
    ).build()


train_valid_test_datasets_provider.is_distributed = True


def main(argv) -> None:
    """Parse megatron arguments (defaults first, then ``argv``) and run ``pretrain``."""
    if not torch.cuda.is_available():
        from megatron_sparseloco.testing.cpu_bridges import apply_cpu_bridges
        apply_cpu_bridges()
        defaults = DEFAULT_ARGS + CPU_ARGS
    else:
        from megatron_sparseloco.testing.cpu_bridges import apply_packaging_bridges
        apply_packaging_bridges()
        defaults = DEFAULT_ARGS + ["--no-masked-softmax-fusion"]
    sys.argv = [sys.argv[0]] + defaults + list(argv)

    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain

    args = parse_and_validate_args()
    cfg = pretrain_cfg_container_from_args(args)
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)


if __name__ == "__main__":
    main(sys.argv[1:])
