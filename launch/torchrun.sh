#!/usr/bin/env bash
# One node, N GPUs (default: all of them). Hydra overrides pass through:
#
#   bash launch/torchrun.sh model=llama3-1b data=synthetic parallel.cp=8 train.seq_len=262144 \
#        train.global_batch=1 train.activation_checkpointing=selective
#
# or a run recipe of configs/recipe/ (found through Hydra's search path), overrides still apply:
#
#   RECIPE=llama3-8b-128k-node bash launch/torchrun.sh data.path=/data/train.bin
#
# Sizing cp: each rank holds seq_len / cp tokens, and the ring hides its K/V transfer behind
# attention only while that chunk is long enough. For the model's heads / kv_heads / head_dim
# (llama3-1b: 32 / 8 / 64) and a topology preset, the planner prints the ring's efficiency per cp
# and the smallest chunk per rank that hides the transfer:
#
#   python -m ringfa4.plan --preset h100-node --heads 32 --kv-heads 8 --head-dim 64 --seq 262144
#
# Take the smallest cp whose activations fit in memory while seq_len / cp stays above that chunk;
# the other GPUs become data-parallel ranks (parallel.dp_shard=-1). seq_len must be a multiple of
# 2 * cp (zigzag layout).
set -euo pipefail

NPROC=${NPROC:-$(nvidia-smi --list-gpus | wc -l)}
RUN=${RUN:-ringfa4-$(date +%Y%m%d-%H%M%S)}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RECIPE_ARGS=()
if [[ -n "${RECIPE:-}" ]]; then
    RECIPE_ARGS=("hydra.searchpath=[file://$REPO/configs]" "recipe=$RECIPE")
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Long sequences allocate activations of many sizes; expandable segments keep fragmentation down.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# A hung collective (e.g. one rank failed a check) aborts the job instead of waiting forever.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# Every rank runs Hydra: hydra.run.dir gives them one output folder, not one per clock second.
exec torchrun --standalone --nproc_per_node="$NPROC" -m ringfa4.train \
    hydra.run.dir="outputs/$RUN" "${RECIPE_ARGS[@]}" "$@"
