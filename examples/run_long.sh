#!/usr/bin/env bash
# Issue 22's long run (examples/configs/train_smollm2_stage3.yaml), resumed from its newest checkpoint when it has one:
#   nohup nice -n 19 examples/run_long.sh > runs/train_smollm2_stage3.log 2>&1 &
# Pass another config to run it the same way; DRY_RUN=1 prints the launch command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-examples/configs/train_smollm2_stage3.yaml}"
[ -f "$config" ] || { echo "expected a config file, got $config" >&2; exit 2; }
out=$(sed -n 's/^output_dir: *\([^ #]*\).*/\1/p' "$config")
[ -n "$out" ] || { echo "$config: expected an output_dir line, found none" >&2; exit 2; }
resume=()
newest=$(ls -d "$out"/checkpoint-* 2>/dev/null | sort -V | tail -1 || true)
[ -n "$newest" ] && resume=(--resume_from_checkpoint "$newest")
command=(.venv/bin/accelerate launch trainers/train_drafter.py --config "$config" "${resume[@]}")
[ "${DRY_RUN:-0}" = 1 ] && { echo "${command[*]}"; exit 0; }
echo "$(date -u +%FT%TZ) start $config ${resume[*]:-fresh}"
"${command[@]}"
echo "$(date -u +%FT%TZ) done"
