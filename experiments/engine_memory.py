"""Resident memory of an engine serving many short requests as a serving loop drives it (add up to a capacity of 16,
step, never clear anything): RSS, the requests the engine still holds and its step records, every 250 requests.

    .venv/bin/python experiments/engine_memory.py 1500

Run it from another checkout with ``PYTHONPATH=<checkout>`` to compare versions of the engine; the last line names
the checkout that ran.
"""

from __future__ import annotations

import gc
import sys
import time

import torch

import adaflash_hf
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.assets import load_target
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams

CAPACITY = 16


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def main(total: int) -> None:
    torch.set_num_threads(2)
    target, _ = load_target()
    drafter = AdaFlashDrafter.from_pretrained("examples/drafters/smollm2-135m-adaflash").eval()
    engine = AdaFlashEngine(target, drafter, admission=AdmissionConfig(max_running=CAPACITY))
    params = SamplingParams(max_new_tokens=8)
    generator = torch.Generator().manual_seed(0)
    added = done = 0
    started = time.time()
    while done < total:
        while added < total and added - done < CAPACITY:
            length = int(torch.randint(20, 120, (1,), generator=generator))
            engine.add_request(torch.randint(0, 49000, (length,), generator=generator).tolist(), params)
            added += 1
        for output in engine.step():
            done += output.finished
            if output.finished and done % 250 == 0:
                gc.collect()
                print(
                    f"{done} requests: RSS {rss_mib():.0f} MiB, engine holds {len(engine.requests)} requests and "
                    f"{len(engine.stats)} step records ({time.time() - started:.0f} s)",
                    flush=True,
                )
    print("code:", adaflash_hf.__file__)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1500)
