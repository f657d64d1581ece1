#!/usr/bin/env bash
# The sample-efficiency sweep (experiments/configs/sweep_<arm>.yaml): every arm one after the other, its pinned start
# restored from git history (experiments/restore_start.py), each resumed from its newest complete checkpoint, a
# finished arm (its final model saved in output_dir) skipped:
#   nohup nice -n 19 experiments/run_sweep.sh > runs/sweep/sweep.log 2>&1 &
# Arms default to the three that resume from the pinned start, then the from-scratch pair; pass names to choose.
set -euo pipefail
cd "$(dirname "$0")/.."
arms=("$@")
[ ${#arms[@]} -gt 0 ] || arms=(baseline soft_targets higher_lr init_from_target baseline_scratch)
for arm in "${arms[@]}"; do
    config="experiments/configs/sweep_${arm}.yaml"
    [ -f "$config" ] || { echo "arm $arm: expected $config, found nothing" >&2; exit 2; }
done
mkdir -p runs/sweep
for arm in "${arms[@]}"; do
    config="experiments/configs/sweep_${arm}.yaml"
    out="runs/sweep/${arm}"
    if [ -f "$out/model.safetensors" ]; then
        echo "arm $arm: finished ($out/model.safetensors), skipped"
        continue
    fi
    .venv/bin/python experiments/restore_start.py --config "$config"
    echo "arm $arm: $(date -u +%FT%TZ) start (from its newest complete checkpoint, if any)"
    # `adaflash train`: accelerate launch with every core on a CPU-only machine (plain `accelerate launch` takes one)
    .venv/bin/adaflash train --config "$config" --resume_from_checkpoint last \
        >> "runs/sweep/${arm}.log" 2>&1
    echo "arm $arm: $(date -u +%FT%TZ) done"
done
