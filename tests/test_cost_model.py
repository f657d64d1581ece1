"""The cost model's calibration is measured once per machine and saved: a second process starts calibrated."""

import json

import pytest
import torch

from adaflash_hf.cost_model import CostModel, calibrate_once, calibration_path, cost_model_for

SIZES = dict(sizes=(1, 2, 4), repeats=1, budget_s=0.0, context=16)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    return tmp_path


def test_a_calibration_is_saved_and_a_fresh_model_loads_it_without_a_forward(cache, target_factory):
    target = target_factory("llama")
    first = CostModel()
    assert calibrate_once(target, first, "generate", **SIZES) == "measured"
    path = calibration_path(target, "generate")
    assert path.parent.parent == cache and sorted(json.loads(path.read_text())["target"]) == ["1", "2", "4"]
    calls = []
    target.register_forward_pre_hook(lambda *_: calls.append(1))
    second = CostModel()
    assert calibrate_once(target, second, "generate", **SIZES) == "loaded"
    assert calls == [] and second.calibrated
    assert [second.target_seconds(n) for n in (1, 2, 4)] == [first.target_seconds(n) for n in (1, 2, 4)]
    assert calibrate_once(target, second, "generate", **SIZES) == "calibrated"


def test_another_dtype_kind_or_thread_count_is_another_machine(cache, target_factory, monkeypatch):
    target = target_factory("llama")
    fp32, engine = calibration_path(target, "generate"), calibration_path(target, "engine")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    threads = calibration_path(target, "generate")
    assert len({fp32, engine, threads, calibration_path(target.to(torch.bfloat16), "generate")}) == 4


def test_a_damaged_file_is_measured_again_and_rewritten(cache, target_factory):
    target = target_factory("llama")
    path = calibration_path(target, "generate")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert calibrate_once(target, CostModel(), "generate", **SIZES) == "measured"
    assert "target" in json.loads(path.read_text())


def test_an_empty_cache_setting_saves_nothing(tmp_path, target_factory, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", "")
    target = target_factory("llama")
    assert calibration_path(target, "generate") is None
    assert calibrate_once(target, CostModel(), "generate", **SIZES) == "measured"
    assert not any(tmp_path.iterdir())


def test_the_second_goodput_generate_on_a_machine_runs_no_calibration_forward(
    cache, target_factory, drafter_factory
):
    prompt = torch.tensor([[5, 17, 99, 3]])
    forwards = []
    for _ in range(2):  # two "processes": each a fresh target object (its own cost model)
        target = target_factory("llama")
        drafter = drafter_factory(target)
        target.register_forward_pre_hook(lambda *_: forwards.append(1))
        target.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=drafter)
        forwards.append("call")
        assert cost_model_for(target, "generate").calibrated
    first, second = "".join(map(str, forwards)).split("call")[:2]
    assert len(second) <= 6 < len(first)  # the second call's forwards are its decoding steps alone
