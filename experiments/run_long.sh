#!/usr/bin/env bash
# A long training run (experiments/configs/long_run.yaml unless another config is given), resumed from its newest
# complete checkpoint when it has one (`--resume_from_checkpoint last`: step count, LR schedule and learning curve
# carry on); a finished run (its final model.safetensors in output_dir) is not rerun:
#   nohup nice -n 19 experiments/run_long.sh experiments/configs/long_run.yaml > runs/long_run.log 2>&1 &
# The config's pinned start (drafter_init: runs/starts/NAME) is restored from git history first
# (experiments/restore_start.py). RESUME_FROM=FOLDER copies a weights-only checkpoint (weights and trainer state,
# trainers/weights_only_checkpoint.py) into output_dir first, unless output_dir has a checkpoint at or after its step.
# DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-experiments/configs/long_run.yaml}"
[ -f "$config" ] || { echo "expected a config file, got $config" >&2; exit 2; }
out=$(sed -n 's/^output_dir: *["'"'"']\{0,1\}\([^"'"'"' #]*\).*/\1/p' "$config")
[ -n "$out" ] || { echo "$config: expected an output_dir line, found none" >&2; exit 2; }
if [ -f "$out/model.safetensors" ]; then
    echo "$config: finished ($out/model.safetensors), not rerun"
    exit 0
fi
run() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "$*"; else "$@"; fi; }
run .venv/bin/python experiments/restore_start.py --config "$config"
if [ -n "${RESUME_FROM:-}" ]; then
    run .venv/bin/python -m adaflash_hf.trainers.weights_only_checkpoint restore "$RESUME_FROM" "$out"
fi
# `accelerate launch` without --cpu sets OMP_NUM_THREADS=1 when it is unset: one core of a CPU-only machine. Every core
# here (THREADS to choose), unless a GPU is present or OMP_NUM_THREADS is set.
threads=()
if [ -z "${OMP_NUM_THREADS:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    threads=(--num_cpu_threads_per_process "${THREADS:-$(nproc)}")
fi
command=(.venv/bin/accelerate launch "${threads[@]}" trainers/train_drafter.py --config "$config" --resume_from_checkpoint last)
[ "${DRY_RUN:-0}" = 1 ] && { echo "${command[*]}"; exit 0; }
echo "$(date -u +%FT%TZ) start $config"
"${command[@]}"
echo "$(date -u +%FT%TZ) done"
