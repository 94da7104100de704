#!/bin/bash
# A tiny MoE GPT (2 layers, hidden 64, 4 experts top-2, EP2) sized for CPUs: 4 gloo ranks, 2 workers
# of 2 ranks, each worker one whole expert-parallel group, mock data.
#
#   ALGO=sparseloco|diloco|gasloc|average bash cpu_tiny_moe.sh
#   PRINT_ARGS=1 bash cpu_tiny_moe.sh
#   elastic, one job per worker (2 ranks), see docs/elastic.md:
#       ELASTIC=1 LIGHTHOUSE=http://HOST:29510 WORKER_INDEX=I TOKEN_FILE=~/.sparseloco-token bash cpu_tiny_moe.sh
set -euo pipefail
: "${NNODES:=1}"
if [[ "${ELASTIC:-0}" == 1 ]]; then : "${GPUS_PER_NODE:=2}"; fi   # elastic: one job = one worker
: "${GPUS_PER_NODE:=4}"     # ranks (processes) on this machine
: "${WORKERS:=2}"
: "${TP:=1}" "${PP:=1}" "${CP:=1}" "${EP:=2}"
: "${TRAIN_ITERS:=60}"
: "${INNER_STEPS:=5}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # after the defaults above, which it keeps
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

GPT_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size $((4 * WORKERS))
    --train-iters "$TRAIN_ITERS"
    --lr "${INNER_LR:-1e-3}"
    --min-lr 1e-4
    --lr-decay-style cosine
    --lr-warmup-iters 5
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --use-distributed-optimizer
    --seed 1234
)

sparseloco_cpu_args

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP"
)

DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 256)
LOG_INTERVAL=${LOG_INTERVAL:-5} EVAL_INTERVAL=${EVAL_INTERVAL:-30} EVAL_ITERS=${EVAL_ITERS:-2} \
    SAVE_INTERVAL=${SAVE_INTERVAL:-30} sparseloco_output_args
sparseloco_args
sparseloco_elastic_args

ARGS=("${GPT_MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${CPU_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
      "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${SPARSELOCO_ARGS[@]}" "${ELASTIC_ARGS[@]}" "$@")
sparseloco_launch
