#!/bin/bash
# Mixtral-8x7B-shaped MoE GPT (32 layers, hidden 4096, 8 experts top-2, GQA 32/8) with outer steps.
#
#   ALGO=sparseloco|diloco|gasloc|average  (default sparseloco)
#   Intended job: 4 workers x 4 nodes x 8 GPUs = 128 GPUs; EP8 inside a node, TP1, PP1, so each
#   worker holds whole expert-parallel groups and is 4 consecutive nodes. No pipeline parallelism:
#   with PP and EP together Megatron allows only the default rank order, which spreads every worker
#   over all nodes (the layout helper refuses that across sites).
#   Batch: 128 sequences of 4096 tokens per worker per step.
#
#   PRINT_ARGS=1 bash mixtral_8x7b.sh   print the arguments only
#   elastic, one job per worker (4 nodes), see docs/elastic.md:
#       ELASTIC=1 LIGHTHOUSE=http://HOST:29510 WORKER_INDEX=I TOKEN_FILE=~/.sparseloco-token bash mixtral_8x7b.sh
set -euo pipefail
if [[ "${ELASTIC:-0}" == 1 ]]; then : "${NNODES:=4}"; fi   # elastic: one job = one worker
: "${NNODES:=16}"
: "${WORKERS:=4}"
: "${TP:=1}" "${PP:=1}" "${CP:=1}" "${EP:=8}"
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
    --max-position-embeddings 32768
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm
)

sparseloco_gpu_training_args
TRAINING_ARGS+=(
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP"
    --expert-model-parallel-size "$EP"
)
if (( TP > 1 )); then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi

sparseloco_data_args 32000
sparseloco_output_args
sparseloco_args
sparseloco_elastic_args

ARGS=("${GPT_MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
      "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${SPARSELOCO_ARGS[@]}" "${ELASTIC_ARGS[@]}" "$@")
sparseloco_launch
