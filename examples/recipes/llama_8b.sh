#!/bin/bash
# Llama-3-8B-shaped GPT (32 layers, hidden 4096, GQA 32/8, SwiGLU, RoPE) with DiLoCo-style outer steps.
#
#   ALGO=sparseloco|diloco|gasloc|average  (default sparseloco)
#   Intended job: 4 workers x 2 nodes x 8 GPUs = 64 GPUs; TP2 with sequence parallelism inside a
#   node, 8-way data parallelism inside a worker. TP2 keeps the 8B model, its fp32 main-param shard
#   and the outer state (anchor + error feedback) within 80 GB per GPU at sequence length 4096.
#   Batch: 128 sequences of 4096 tokens per worker per step (0.5 M tokens, as the 2048 x 256 of
#   the SparseLoCo paper).
#
#   PRINT_ARGS=1 bash llama_8b.sh       print the arguments only
#   elastic, one job per worker (2 nodes), see docs/elastic.md:
#       ELASTIC=1 LIGHTHOUSE=http://HOST:29510 WORKER_INDEX=I TOKEN_FILE=~/.sparseloco-token bash llama_8b.sh
set -euo pipefail
if [[ "${ELASTIC:-0}" == 1 ]]; then : "${NNODES:=2}"; fi   # elastic: one job = one worker
: "${NNODES:=8}"
: "${WORKERS:=4}"
: "${TP:=2}" "${PP:=1}" "${CP:=1}" "${EP:=1}"
: "${SEQ_LEN:=4096}"
: "${SEQ_PER_WORKER:=128}"
: "${MICRO_BATCH:=1}"
: "${TRAIN_ITERS:=50000}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # after the defaults above, which it keeps

GPT_MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length "$SEQ_LEN"
    --max-position-embeddings "$SEQ_LEN"
    --position-embedding-type rope
    --rotary-base 500000
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

sparseloco_gpu_training_args
TRAINING_ARGS+=(
    --recompute-granularity selective
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP"
)
if (( TP > 1 )); then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi
# With pipeline parallelism the default rank order gives every worker a slice of every stage, spread
# over all nodes; tp-pp-dp order keeps each worker on consecutive nodes (see docs/recipes.md).
if (( PP > 1 )); then MODEL_PARALLEL_ARGS+=(--use-tp-pp-dp-mapping); fi

sparseloco_data_args 128256
sparseloco_output_args
sparseloco_args
sparseloco_elastic_args

ARGS=("${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${OUTPUT_ARGS[@]}" "${SPARSELOCO_ARGS[@]}" "${ELASTIC_ARGS[@]}" "$@")
sparseloco_launch
