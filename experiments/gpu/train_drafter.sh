#!/usr/bin/env bash
# Train the drafter recipe on one CUDA GPU within a time budget, resumable, in one command:
#   experiments/gpu/train_drafter.sh                                # 600 s of training (TIME_BUDGET), then stop
#   TIME_BUDGET=3600 experiments/gpu/train_drafter.sh --per_device_train_batch_size 32
# Recipe: examples/configs/train_smollm2_gpu.yaml (bf16, 16 sequences a step, the target's features computed on the
# GPU from the committed corpus token ids). Training stops at max_steps or after TIME_BUDGET seconds of training,
# whichever comes first, with a checkpoint, a log line and a held-out learning-curve point; model loading, held-out
# features and the final save add about a minute. Run the same command again to continue from the newest checkpoint in
# OUTPUT_DIR: the step count, the LR schedule and learning_curve.json carry on. The first run starts from the shipped
# drafter (DRAFTER_INIT; set it empty to start from scratch). Arguments after the script go to
# trainers/train_drafter.py and override the config. DEVICE=cpu runs the same path on CPU in float32 (the tests' dry
# run, with a tiny target and corpus given as arguments). Needs the package installed with a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
CONFIG=${CONFIG:-examples/configs/train_smollm2_gpu.yaml}
OUTPUT_DIR=${OUTPUT_DIR:-runs/gpu_train}
TIME_BUDGET=${TIME_BUDGET:-600}
DRAFTER_INIT=${DRAFTER_INIT-examples/drafters/smollm2-135m-adaflash}
DEVICE=${DEVICE:-cuda}

args=(--config "$CONFIG" --output_dir "$OUTPUT_DIR" --max_train_seconds "$TIME_BUDGET")
# The drafter is built from DRAFTER_INIT first; a checkpoint's weights, optimizer and schedule then replace its state.
if [[ -n "$DRAFTER_INIT" ]]; then
  args+=(--drafter_init "$DRAFTER_INIT")
fi
# The newest complete checkpoint in OUTPUT_DIR, or a fresh start when it has none (trainers/train_drafter.py).
args+=(--resume_from_checkpoint last)
if [[ "$DEVICE" == cpu ]]; then
  args+=(--use_cpu true --bf16 false)
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
# python -P: the repo-root kernels/ must not shadow HF's kernels package.
"$PYTHON" -P trainers/train_drafter.py "${args[@]}" "$@"
# What the run reached (also kept in $OUTPUT_DIR): steps, blocks seen, the last held-out curve point.
"$PYTHON" -P - "$OUTPUT_DIR" "${OUT:-}" <<'PY'
import json, shutil, sys
from pathlib import Path

out, copy_to = Path(sys.argv[1]), sys.argv[2]
states = sorted(out.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
state = json.loads(states[-1].read_text()) if states else {"global_step": 0, "log_history": []}
seen = [e["blocks_seen"] for e in state["log_history"] if "blocks_seen" in e]
curve = out / "learning_curve.json"
point = json.loads(curve.read_text())["points"][-1] if curve.is_file() else None
summary = {
    "global_step": state["global_step"],
    "blocks_seen": seen[-1] if seen else 0,
    "first_position": {d: m["first_position"] for d, m in point["metrics"].items()} if point else None,
    "tau_fixed": {d: m["tau_fixed"] for d, m in point["metrics"].items()} if point else None,
}
print(json.dumps(summary))
(out / "reached.json").write_text(json.dumps(summary, indent=1) + "\n")
if copy_to:
    for path in [out / "reached.json", curve, out / "learning_curve.png"]:
        if path.is_file():
            shutil.copy(path, copy_to)
PY
