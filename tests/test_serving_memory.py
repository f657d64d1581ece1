"""adaflash_hf.serving.memory: the malloc-arena cap (the environment wins, bad values refused) and the heap trim."""

import os
import subprocess
import sys

import pytest

from adaflash_hf.serving import memory


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert memory.limit_malloc_arenas(2) is False


@pytest.mark.parametrize("arenas", [0, -1, 2.0, True, "2"])
def test_bad_arena_counts_are_refused(arenas):
    with pytest.raises(ValueError, match="arenas: expected an int >= 1"):
        memory.limit_malloc_arenas(arenas)


@pytest.mark.skipif(memory._glibc() is None, reason="the C library is not glibc")
def test_glibc_takes_the_cap_and_the_trim():
    code = (
        "import threading\n"
        "from adaflash_hf.serving import memory\n"
        "assert memory.limit_malloc_arenas(2) is True\n"
        "blocks = [bytearray(1 << 16) for _ in range(2000)]\n"
        "threads = [threading.Thread(target=lambda: [bytearray(1 << 12) for _ in range(100)]) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "del blocks\n"
        "assert isinstance(memory.trim_heap(), bool)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_the_engine_thread_trims_the_heap_each_time_it_goes_idle(
    monkeypatch, target_factory, drafter_factory, word_tokenizer
):
    import time

    import openai

    from adaflash_hf.serving import worker as worker_module
    from adaflash_hf.serving.server import BackgroundServer, build_engine, create_app

    trims = []
    monkeypatch.setattr(worker_module, "trim_heap", lambda: trims.append(time.monotonic()) or True)
    target = target_factory("llama", initializer_range=0.2)
    worker = worker_module.EngineWorker(build_engine(target, drafter_factory(target)), word_tokenizer)
    with BackgroundServer(create_app(worker, word_tokenizer, "tiny")) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        assert trims == []  # idle from the start: nothing freed yet
        for prompt in ("w5 w6 w7", "w9 w10"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
            deadline = time.monotonic() + 10
            while len(trims) < 1 + (prompt == "w9 w10") and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.3)  # an idle engine thread keeps polling its inbox: no further trims
    assert len(trims) == 2
