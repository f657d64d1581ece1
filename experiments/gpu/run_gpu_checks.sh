#!/usr/bin/env bash
# GPU checks, one command on a CUDA machine (about 8 minutes on an H200):
#   1. the Triton kernels against their references on CUDA (tests marked gpu);
#   2. the kernel benchmark (Triton vs naive torch vs chunked fallback, V=151936, N up to 16k; acceptance
#      for B=1..128), printed as a Markdown table and written to $OUT/kernels_gpu.json (or ./);
#   3. speculative decoding on the device (experiments/gpu/cuda_checks.py): generate and the engine against plain
#      greedy, batch invariance of eager and prepared forwards, the verify-cost curve; $OUT/cuda_checks.json.
# Needs the package installed (pip install -e .) with a CUDA torch and triton. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
PYTEST=${PYTEST:-pytest}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# pytest, not "python -m pytest", and python -P: the repo-root kernels/ must not shadow HF's kernels package.
"$PYTEST" -q -m gpu tests/test_kernels_triton_interpret.py
"$PYTHON" -P -m adaflash_hf.bench.kernels --device cuda --vocab 151936 --repeats 3 --output "${OUT:-.}/kernels_gpu.json"
"$PYTHON" -P experiments/gpu/cuda_checks.py --output "${OUT:-.}/cuda_checks.json"
