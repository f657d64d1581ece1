#!/usr/bin/env bash
# One round of serving over HTTP beside vLLM, one server at a time on this machine: vLLM's CPU build (bf16, plain, its
# prefix cache off), `adaflash serve --drafter none` and `adaflash serve` (default drafting), each warmed by 4
# requests and then loaded by `adaflash bench http --concurrency 1 4 16 --requests 16 --max-tokens 64`:
#   make vllm-env install && experiments/vllm/http_beside_vllm.sh a    # ~12 min; results under runs/http_beside_vllm/
# The label (a, b, ...) names the round: run two to see the host's noise. A figure, not a test.
set -uo pipefail
cd "$(dirname "$0")/../.."
label=${1:?expected a label for this round, e.g. a}
out=runs/http_beside_vllm
target=$out/target
mkdir -p "$out"
if [ ! -f "$target/config.json" ]; then  # the offline target in transformers' format, for vLLM
    .venv/bin/python -c "
import sys
from adaflash_hf.assets import load_target
model, tokenizer = load_target()
model.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])" "$target"
fi
up() {
    for _ in $(seq 1 240); do
        curl -s -o /dev/null "http://127.0.0.1:$1/v1/models" && return 0
        sleep 2
    done
    echo "the server on port $1 did not come up (see $out/server_*_$label.log)" >&2
    return 1
}
load() {  # name port
    .venv/bin/adaflash bench http --server "$1=http://127.0.0.1:$2/v1" --concurrency 4 --requests 4 --max-tokens 16 \
        --output-dir "$out/warm_$1_$label" > /dev/null 2>&1
    .venv/bin/adaflash bench http --server "$1=http://127.0.0.1:$2/v1" --concurrency 1 4 16 --requests 16 \
        --max-tokens 64 --output-dir "$out/http_$1_$label" > "$out/bench_$1_$label.log" 2>&1
}
serve() {  # name port command...
    local name=$1 port=$2
    shift 2
    "$@" > "$out/server_${name}_$label.log" 2>&1 &
    local pid=$!
    up "$port" && load "$name" "$port"
    kill "$pid"
    wait "$pid" 2> /dev/null
    sleep 3
}
VLLM_CPU_KVCACHE_SPACE=4 serve vllm 8101 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model "$target" --dtype bfloat16 --max-model-len 2048 --no-enable-prefix-caching --port 8101
OMP_NUM_THREADS=2 serve plain 8102 .venv/bin/adaflash serve --drafter none --port 8102
OMP_NUM_THREADS=2 serve default 8103 .venv/bin/adaflash serve --port 8103
for name in vllm plain default; do
    echo "$name: $(grep -A5 '^| server' "$out/bench_${name}_$label.log" | grep "^| $name" | cut -d'|' -f3,4 | tr '\n' ' ')"
done
