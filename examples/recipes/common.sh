# Shared pieces of the recipes in this folder. Sourced, never run.
#
# A recipe sets its model/training arrays and WORKERS/TP/PP/CP/EP, then calls
#   sparseloco_gpu_training_args -> TRAINING_ARGS: the inner AdamW of the GPU recipes (below)
#   sparseloco_args   -> fills SPARSELOCO_ARGS for ALGO (sparseloco | diloco | gasloc)
#   sparseloco_elastic_args -> ELASTIC_ARGS: the elastic flags when ELASTIC=1 (below), else none
#   sparseloco_launch -> prints or launches:
#       PRINT_ARGS=1    print the pretrain arguments one per line and exit (no GPU, no torchrun)
#       PRINT_ARGS=cmd  print the whole launch command on one line (shell-quoted) and exit
#       otherwise       check the rank layout, then exec torchrun on this node
#
# Elastic mode (ELASTIC=1; docs/elastic.md): this job is ONE worker, its own torchrun world, joined to
# the other workers' jobs through torchft's lighthouse. NNODES defaults to the nodes of one worker;
# the arguments are the single-job run's (--global-batch-size stays the run's: each job trains its
# 1/W slot of it) plus the elastic flags, read from
#   LIGHTHOUSE (http://HOST:PORT of torchft_lighthouse), WORKER_INDEX (this job's slot, 0 <= I < WORKERS),
#   TOKEN_FILE (the run's secret, the same file content at every site), MIN_WORKERS (1: the fewest
#   contributors a round commits with), ELASTIC_HOST (the address other sites reach this job at;
#   default MASTER_ADDR), MANAGER_PORT (its torchft manager server's port, to open in a firewall),
#   OUTER_TIMEOUT (seconds the others wait for a stalled job). CHECKPOINT_DIR gets one
#   subdirectory per job: worker<I>.
#
# Launcher environment (single node needs none of it):
#   GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (6000),
#   SITES (site id per node, "0,0,1,1"; default one site), MEGATRON_LM (Megatron-LM checkout with
#   pretrain_gpt.py), PRETRAIN_SCRIPT (the pretrain script; default $MEGATRON_LM/pretrain_gpt.py, or
#   this repo's examples/pretrain_gpt.py, same CLI, when MEGATRON_LM is unset), PYTHON (default: this
#   repo's .venv/bin/python when it exists, else python), CHECKPOINT_DIR (enables --save/--load:
#   resumes from the latest checkpoint there), TENSORBOARD_DIR, DATA_PATH (Megatron data prefix;
#   unset = --mock-data). CUDA_DEVICE_MAX_CONNECTIONS is exported as 1 (Megatron requires it for
#   TP/CP > 1 and sequence parallelism) unless already set.

: "${ALGO:=sparseloco}"
: "${ELASTIC:=0}"
if [[ "$ELASTIC" != 0 && "$ELASTIC" != 1 ]]; then
    echo "error: ELASTIC=$ELASTIC; use ELASTIC=1 (one job per worker, docs/elastic.md) or ELASTIC=0" >&2; exit 2
fi
: "${GPUS_PER_NODE:=8}"
: "${NNODES:=1}"    # recipes set their own defaults before sourcing this file
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"
: "${MASTER_PORT:=6000}"
SPARSELOCO_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -z "${PYTHON:-}" && -x "$SPARSELOCO_REPO/.venv/bin/python" ]]; then
    PYTHON=$SPARSELOCO_REPO/.venv/bin/python            # what `make demo` / `make test` created
    export PATH="$SPARSELOCO_REPO/.venv/bin:$PATH"       # its torchrun
fi
: "${PYTHON:=python}"
export PYTHONPATH="$SPARSELOCO_REPO${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's megatron_sparseloco
# Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP/CP > 1 (sequence parallelism overlap); harmless otherwise.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
if [[ -z "${PRETRAIN_SCRIPT:-}" ]]; then
    if [[ -n "${MEGATRON_LM:-}" ]]; then
        PRETRAIN_SCRIPT=$MEGATRON_LM/pretrain_gpt.py
    else
        PRETRAIN_SCRIPT=$SPARSELOCO_REPO/examples/pretrain_gpt.py
        PRETRAIN_SCRIPT_NOTE="MEGATRON_LM is not set: using this repo's examples/pretrain_gpt.py (same command line as Megatron-LM's pretrain_gpt.py); set MEGATRON_LM=/path/to/Megatron-LM or PRETRAIN_SCRIPT to use another"
    fi
fi

# Outer-step flags for ALGO. Defaults (docs/design.md §1; docs/recipes.md has the sources):
#   sparseloco: H=15 (reference code; Covenant-72B used 30), top-64 of 4096 (1.56 %), 2-bit values,
#               error-feedback decay 0.95, outer SGD without momentum at the plugin's outer lr.
#   diloco:     H=15 here to match the SparseLoCo comparison (the DiLoCo paper used 500),
#               outer Nesterov SGD at the plugin's lr / momentum, fp32 all-reduce.
#   gasloc:     ring gossip at the plugin's proposal step and momentum.
#   average:    plain model averaging every H steps (outer lr 1, no momentum), fp32 all-reduce.
# The outer lr and momentum are the plugin's own defaults unless OUTER_LR / OUTER_MOMENTUM are set: no
# value is repeated here (sparseloco's lr follows W, k and the model's size N, s(N)/sqrt(W*k/C): 1.5 at W = 2,
# 1.06 at W = 4, 0.75 at W = 8 for k = 64 on a 3.26 M model, held at the 10.8 M model's values above it
# (docs/integration.md: sweep OUTER_LR downwards on a large model); diloco 0.7 / 0.9 Nesterov; gasloc
# momentum 0.6; the start-up block prints them).
outer_setting_args() {
    [[ -n "${OUTER_LR:-}" ]] && SPARSELOCO_ARGS+=(--sparseloco-outer-lr "$OUTER_LR")
    [[ -n "${OUTER_MOMENTUM:-}" ]] && SPARSELOCO_ARGS+=(--sparseloco-outer-momentum "$OUTER_MOMENTUM")
    return 0
}
sparseloco_args() {
    SPARSELOCO_ARGS=(--sparseloco-algorithm "$ALGO" --sparseloco-workers "$WORKERS")
    case "$ALGO" in
        sparseloco)
            SPARSELOCO_ARGS+=(
                --sparseloco-inner-steps "${INNER_STEPS:-15}"
                --sparseloco-topk "${TOPK:-64}"
                --sparseloco-chunk-size "${CHUNK_SIZE:-4096}"
                --sparseloco-value-bits "${VALUE_BITS:-2}"
                --sparseloco-ef-decay "${EF_DECAY:-0.95}"
                --sparseloco-reduce "${REDUCE:-contributors}"
            )
            outer_setting_args ;;
        diloco)
            SPARSELOCO_ARGS+=(
                --sparseloco-inner-steps "${INNER_STEPS:-15}"
                --sparseloco-diloco-comm-dtype "${COMM_DTYPE:-fp32}"
            )
            outer_setting_args ;;
        gasloc)
            SPARSELOCO_ARGS+=(
                --sparseloco-inner-steps "${INNER_STEPS:-15}"
                --sparseloco-gossip-topology "${GOSSIP_TOPOLOGY:-ring}"
            )
            outer_setting_args ;;
        average)
            SPARSELOCO_ARGS+=(
                --sparseloco-inner-steps "${INNER_STEPS:-15}"
                --sparseloco-diloco-comm-dtype "${COMM_DTYPE:-fp32}"
            ) ;;
        *)
            echo "error: ALGO=$ALGO; use ALGO=sparseloco, ALGO=diloco, ALGO=gasloc or ALGO=average" >&2
            exit 2 ;;
    esac
}

# Inner optimiser of the GPU recipes (SparseLoCo reference): AdamW lr 1e-3 (DiLoCo baseline 8e-4,
# INNER_LR overrides), betas (0.9, 0.95), wd 0.1, clip 1.0, 500 warm-up steps, cosine decay to 0.1x,
# bf16, distributed optimizer with overlapped grad reduce / param gather. Reads MICRO_BATCH,
# SEQ_PER_WORKER, WORKERS, TRAIN_ITERS; a recipe appends its own flags (recompute) to TRAINING_ARGS.
sparseloco_gpu_training_args() {
    if [[ "$ALGO" == diloco ]]; then INNER_LR=${INNER_LR:-8e-4}; else INNER_LR=${INNER_LR:-1e-3}; fi
    TRAINING_ARGS=(
        --micro-batch-size "$MICRO_BATCH"
        --global-batch-size $((SEQ_PER_WORKER * WORKERS))
        --train-iters "$TRAIN_ITERS"
        --lr "$INNER_LR"
        --min-lr "$(awk -v lr="$INNER_LR" 'BEGIN { printf "%g", lr / 10 }')"
        --lr-decay-style cosine
        --lr-warmup-iters 500
        --weight-decay 0.1
        --adam-beta1 0.9
        --adam-beta2 0.95
        --clip-grad 1.0
        --init-method-std 0.02
        --bf16
        --use-distributed-optimizer
        --overlap-grad-reduce
        --overlap-param-gather
    )
}

# What CPU + gloo needs (docs/design.md §3): no fused CUDA kernels (they come from Apex / TE),
# CPU initialisation. Used by the cpu_tiny_* recipes.
sparseloco_cpu_args() {
    CPU_ARGS=(
        --distributed-backend gloo
        --transformer-impl local
        --use-cpu-initialization
        --no-persist-layer-norm
        --no-gradient-accumulation-fusion
        --no-masked-softmax-fusion
        --no-rope-fusion
        --no-bias-swiglu-fusion
        --no-bias-dropout-fusion
    )
}

# Data: DATA_PATH (Megatron indexed-dataset prefix) with a Hugging Face tokenizer, else mock data.
sparseloco_data_args() {
    local vocab=$1
    if [[ -n "${DATA_PATH:-}" ]]; then
        DATA_ARGS=(--data-path "$DATA_PATH" --split "${SPLIT:-99,1,0}"
                   --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL (HF name or path) with DATA_PATH}")
    else
        DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$vocab")
    fi
}

# Checkpoints and logs: one shared CHECKPOINT_DIR per run; --load of the same directory resumes
# from its latest checkpoint (Megatron starts from scratch when the directory holds none).
sparseloco_output_args() {
    OUTPUT_ARGS=(--log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-1000}"
                 --eval-iters "${EVAL_ITERS:-10}" --ckpt-format torch_dist)
    if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
        local dir=$CHECKPOINT_DIR
        if [[ "$ELASTIC" == 1 ]]; then dir=$CHECKPOINT_DIR/worker${WORKER_INDEX:?ELASTIC=1 needs WORKER_INDEX}; fi
        OUTPUT_ARGS+=(--save "$dir" --load "$dir" --save-interval "${SAVE_INTERVAL:-1000}")
    fi
    if [[ -n "${TENSORBOARD_DIR:-}" ]]; then
        OUTPUT_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
    fi
}

# The elastic flags (ELASTIC=1; megatron_sparseloco/elastic/config.py has all of them): every value
# required here is checked again, with the fix, by the plugin before the model is built.
sparseloco_elastic_args() {
    ELASTIC_ARGS=()
    if [[ "$ELASTIC" != 1 ]]; then return 0; fi
    : "${LIGHTHOUSE:?ELASTIC=1 needs LIGHTHOUSE=http://HOST:PORT, the torchft_lighthouse every job reaches}"
    : "${WORKER_INDEX:?ELASTIC=1 needs WORKER_INDEX, the worker slot of this job, 0..WORKERS-1 (one per job)}"
    : "${TOKEN_FILE:?ELASTIC=1 needs TOKEN_FILE, the secret of the run (the same content at every site, mode 600)}"
    ELASTIC_ARGS=(
        --sparseloco-lighthouse "$LIGHTHOUSE"
        --sparseloco-worker-index "$WORKER_INDEX"
        --sparseloco-min-workers "${MIN_WORKERS:-1}"
        --sparseloco-elastic-token-file "$TOKEN_FILE"
    )
    if [[ -n "${ELASTIC_HOST:-}" ]]; then ELASTIC_ARGS+=(--sparseloco-elastic-host "$ELASTIC_HOST"); fi
    if [[ -n "${MANAGER_PORT:-}" ]]; then ELASTIC_ARGS+=(--sparseloco-elastic-manager-port "$MANAGER_PORT"); fi
    if [[ -n "${OUTER_TIMEOUT:-}" ]]; then ELASTIC_ARGS+=(--sparseloco-outer-timeout "$OUTER_TIMEOUT"); fi
}

sparseloco_launch() {
    # ARGS must be set by the recipe; extra command-line arguments of the recipe come last (they win).
    if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
        printf '%s\n' "${ARGS[@]}"
        exit 0
    fi
    local launch=(torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
                  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
                  -m megatron_sparseloco.run "$PRETRAIN_SCRIPT")
    if [[ "${PRINT_ARGS:-0}" == cmd ]]; then
        printf '%q ' "${launch[@]}" "${ARGS[@]}"
        echo
        exit 0
    fi
    if [[ -n "${PRETRAIN_SCRIPT_NOTE:-}" ]]; then echo "recipe: $PRETRAIN_SCRIPT_NOTE" >&2; fi
    if [[ ! -f "$PRETRAIN_SCRIPT" ]]; then
        echo "recipe: error: pretrain script $PRETRAIN_SCRIPT not found. Fix: set MEGATRON_LM to a Megatron-LM checkout" \
             "(holding pretrain_gpt.py), or PRETRAIN_SCRIPT to a script, or unset both to use examples/pretrain_gpt.py" >&2
        exit 2
    fi
    # Refuse a layout where a worker spans two sites, W does not divide DP, ... before starting.
    "$PYTHON" -m megatron_sparseloco.worker_layout --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" \
        ${SITES:+--sites "$SITES"} --quiet --megatron-args "${ARGS[@]}" || exit 2
    exec "${launch[@]}" "${ARGS[@]}"
}
