"""What the engine's thread is built on: ``in_own_thread`` and the server's use of it (OpenMP gives every thread that
ran a parallel op a team for its life; the engine's thread must be the only one)."""

import threading
from types import SimpleNamespace

import pytest

from adaflash_hf.serving import server
from adaflash_hf.serving.worker import in_own_thread


def test_in_own_thread_returns_the_value_computed_on_a_thread_that_has_ended():
    seen = []

    def build(a, b=0):
        seen.append(threading.current_thread())
        return a + b

    assert in_own_thread(build, 2, b=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_in_own_thread_raises_the_functions_own_error_on_the_caller():
    error = ValueError("dtype: expected auto, got fp8")

    def build():
        raise error

    with pytest.raises(ValueError) as raised:
        in_own_thread(build)
    assert raised.value is error


def test_the_server_builds_its_engine_and_learner_off_the_thread_that_serves(monkeypatch):
    built_on = {}

    class Stop(Exception):
        pass

    def served_engine(*args, **kwargs):
        built_on["engine"] = threading.current_thread()
        return "engine", "target", "tokenizer"

    def learner_factory(engine, target, tokenizer):
        built_on["learner"] = threading.current_thread()
        raise Stop  # nothing is served

    monkeypatch.setattr(server, "served_engine", served_engine)
    options = SimpleNamespace(
        learn=False, drafter=None, dtype="auto", host="127.0.0.1", port=0, target="t", draft_source="auto",
        length_mode=None, max_running=4, token_budget=None,
    )  # fmt: skip
    with pytest.raises(Stop):
        server.serve(options, learner_factory)
    main = threading.current_thread()
    assert built_on["engine"] is not main and built_on["learner"] is not main
    assert not built_on["engine"].is_alive() and not built_on["learner"].is_alive()


def _on_a_thread(function):
    out = []
    thread = threading.Thread(target=lambda: out.append(function()))
    thread.start()
    thread.join()
    return out[0]


def test_a_pinned_thread_keeps_its_count_when_another_sets_torch_s_later():
    import torch

    from adaflash_hf.serving.worker import pin_torch_threads

    before = torch.get_num_threads()
    pinned, go = threading.Event(), threading.Event()

    def worker():
        pin_torch_threads(1)
        pinned.set()
        go.wait()
        torch.ones(512, 512) @ torch.ones(512, 512)  # a parallel op after another thread's set
        return torch.get_num_threads()

    out = []
    thread = threading.Thread(target=lambda: out.append(worker()))
    thread.start()
    pinned.wait()
    torch.set_num_threads(2)
    go.set()
    thread.join()
    torch.set_num_threads(before)
    assert out == [1]


def test_a_learner_beside_an_engine_of_this_process_trains_on_one_torch_thread(monkeypatch):
    import torch

    from adaflash_hf.online.live import LiveLearner

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    learner = object.__new__(LiveLearner)  # only the thread's set-up is exercised here
    monkeypatch.setattr(learner, "train", lambda: torch.get_num_threads(), raising=False)
    learner.reloader = object()  # an engine in this process hot-reloads
    beside_engine = _on_a_thread(lambda: (learner._train_beside(), torch.get_num_threads())[1])
    torch.set_num_threads(2)  # torch's count for threads not yet started (pinning set it to 1)
    learner.reloader = None  # vLLM's engine, another process
    beside_vllm = _on_a_thread(lambda: (learner._train_beside(), torch.get_num_threads())[1])
    torch.set_num_threads(before)
    assert (beside_engine, beside_vllm) == (1, 2)
