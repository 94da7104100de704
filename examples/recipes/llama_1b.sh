#!/bin/bash
# Llama-3.2-1B-shaped GPT (16 layers, hidden 2048, GQA 32/8, SwiGLU, RoPE) with DiLoCo-style outer steps.
#
#   ALGO=sparseloco|diloco|gasloc|average  (default sparseloco)
#   Intended job: 8 workers x 1 node of 8 GPUs = 64 GPUs, TP1 PP1; each worker is one node, so all
#   per-step traffic stays inside a node and only the outer step crosses nodes.
#   Batch as in the SparseLoCo paper: 256 sequences of 2048 tokens per worker per step.
#
#   single node (2 workers of 4 GPUs):  NNODES=1 WORKERS=2 bash llama_1b.sh
#   multi node:                         see examples/slurm/sparseloco.sbatch
#   print the arguments only:           PRINT_ARGS=1 bash llama_1b.sh
#   elastic, one job per worker (1 node), see docs/elastic.md:
#       ELASTIC=1 LIGHTHOUSE=http://HOST:29510 WORKER_INDEX=I TOKEN_FILE=~/.sparseloco-token bash llama_1b.sh
set -euo pipefail
if [[ "${ELASTIC:-0}" == 1 ]]; then : "${NNODES:=1}"; fi   # elastic: one job = one worker
: "${NNODES:=8}"
: "${WORKERS:=8}"
: "${TP:=1}" "${PP:=1}" "${CP:=1}" "${EP:=1}"
: "${SEQ_PER_WORKER:=256}"
: "${MICRO_BATCH:=4}"
: "${TRAIN_ITERS:=30000}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # after the defaults above, which it keeps

GPT_MODEL_ARGS=(
    --num-layers 16
    --hidden-size 2048
    --ffn-hidden-size 8192
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 2048
    --max-position-embeddings 2048
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

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP"
)
# With PP the default rank order spreads every worker over all nodes; tp-pp-dp keeps it contiguous.
if (( PP > 1 )); then MODEL_PARALLEL_ARGS+=(--use-tp-pp-dp-mapping); fi

sparseloco_data_args 128256
sparseloco_output_args
sparseloco_args
sparseloco_elastic_args

ARGS=("${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${OUTPUT_ARGS[@]}" "${SPARSELOCO_ARGS[@]}" "${ELASTIC_ARGS[@]}" "$@")
sparseloco_launch
