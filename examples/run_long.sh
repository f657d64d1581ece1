#!/usr/bin/env bash
# Issue 22's long run (examples/configs/train_smollm2_stage3.yaml), resumed from its newest complete checkpoint when
# it has one (`--resume_from_checkpoint last`: step count, LR schedule and learning curve carry on); a finished run
# (its final model.safetensors in output_dir) is not rerun:
#   nohup nice -n 19 examples/run_long.sh > runs/train_smollm2_stage3.log 2>&1 &
# runs/ does not outlast a working period on a fresh checkout, so a committed resume point (weights and trainer state,
# trainers/resume_point.py; RESUME_POINT, by default <learning_curve_dir>/resume) is restored into output_dir first
# when output_dir has no checkpoint at or after its step. At a stop, commit the newest checkpoint as the resume point:
#   .venv/bin/python -m adaflash_hf.trainers.resume_point save runs/train_smollm2_stage3/checkpoint-N examples/results/stage3/resume
# Pass another config to run it the same way; DRY_RUN=1 prints the launch command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-examples/configs/train_smollm2_stage3.yaml}"
[ -f "$config" ] || { echo "expected a config file, got $config" >&2; exit 2; }
out=$(sed -n 's/^output_dir: *["'"'"']\{0,1\}\([^"'"'"' #]*\).*/\1/p' "$config")
[ -n "$out" ] || { echo "$config: expected an output_dir line, found none" >&2; exit 2; }
if [ -f "$out/model.safetensors" ]; then
    echo "$config: finished ($out/model.safetensors), not rerun"
    exit 0
fi
curve_dir=$(sed -n 's/^learning_curve_dir: *["'"'"']\{0,1\}\([^"'"'"' #]*\).*/\1/p' "$config")
resume_point="${RESUME_POINT:-${curve_dir:+$curve_dir/resume}}"
if [ -n "$resume_point" ] && [ -d "$resume_point" ]; then
    restore=(.venv/bin/python -m adaflash_hf.trainers.resume_point restore "$resume_point" "$out")
    if [ "${DRY_RUN:-0}" = 1 ]; then echo "${restore[*]}"; else "${restore[@]}"; fi
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
