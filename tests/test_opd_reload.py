"""Hot reload and checkpoints: versioned atomic payloads, swaps between engine steps that keep outputs lossless,
τ following a degraded and a restored drafter, every bad payload kind rejected while serving continues, and
checkpoints that are never loaded half-written."""

import copy
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from adaflash_hf.online.weights import (
    MANIFEST,
    HotReloader,
    PayloadError,
    latest_checkpoint,
    publish_weights,
    publishable_state,
    save_checkpoint,
    sha256_file,
    verify_checkpoint,
)
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from tests.conftest import finished_requests


def perturbed(drafter, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in drafter.state_dict().items()}


def greedy(target, prompt, n):
    return target.generate(prompt[None], max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


def test_publish_writes_a_checksummed_manifest_and_keeps_the_newest_files(
    target_factory, drafter_factory, tmp_path
):
    drafter = drafter_factory(target_factory("llama"))
    for version in range(1, 6):
        publish_weights(tmp_path, drafter.state_dict(), version, keep=2)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["version"] == 5 and manifest["sha256"] == sha256_file(tmp_path / manifest["file"])
    assert sorted(p.name for p in tmp_path.glob("drafter-v*")) == [
        "drafter-v000004.safetensors",
        manifest["file"],
    ]
    assert not list(tmp_path.glob("*.tmp"))


def test_swaps_between_engine_steps_keep_outputs_lossless(target_factory, drafter_factory, tmp_path):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    engine = AdaFlashEngine(target, copy.deepcopy(drafter), length_mode="fixed")
    reloader = HotReloader(engine.drafter, tmp_path)
    versions = []
    engine.round_recorder = lambda request, record: versions.append(record.drafter_version)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 500, (n,), generator=g) for n in (4, 11, 7, 15)]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    version, finished = 0, {}
    while engine.has_unfinished():
        version += 1
        publish_weights(tmp_path, perturbed(drafter, version), version)
        assert reloader.poll() and engine.drafter.weights_version == version
        finished |= finished_requests(engine.step())
    for request_id, prompt in zip(ids, prompts):
        assert finished[request_id].output == greedy(target, prompt, 20)
    assert reloader.swaps == version and versions == sorted(versions) and versions[-1] == version


def constant_target(target_factory):
    """A target whose greedy chain is token 0 forever: its final norm is zero, so all its logits tie."""
    target = target_factory("llama")
    with torch.no_grad():
        target.model.norm.weight.zero_()
    return target


def serve_tau(engine, prompts, n=24):
    start = engine.step_count
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=n))
    steps = list(engine.stats)[start - engine.step_count :]
    return sum(s.committed for s in steps) / sum(s.verifies for s in steps), outputs


def test_degraded_drafter_lowers_tau_and_the_restored_one_brings_it_back(
    target_factory, drafter_factory, tmp_path
):
    target = constant_target(target_factory)
    good = drafter_factory(target)
    with torch.no_grad():
        good.norm.weight.zero_()  # drafts token 0 everywhere: exactly the target's chain
    engine = AdaFlashEngine(target, copy.deepcopy(good), length_mode="fixed")
    reloader = HotReloader(engine.drafter, tmp_path)
    prompts = [torch.arange(4, 4 + n) for n in (3, 8, 5)]
    reference = [[0] * 24] * 3

    tau_good, out = serve_tau(engine, prompts)
    assert out == reference
    degraded = {n: t.clone() for n, t in good.state_dict().items()}
    degraded["norm.weight"] = torch.ones_like(degraded["norm.weight"])
    publish_weights(tmp_path, degraded, 1)
    assert reloader.poll()
    tau_bad, out = serve_tau(engine, prompts)
    assert out == reference
    publish_weights(tmp_path, good.state_dict(), 2)
    assert reloader.poll()
    tau_restored, out = serve_tau(engine, prompts)
    assert out == reference
    assert tau_good > 4 and tau_bad < tau_good - 2 and tau_restored == pytest.approx(tau_good, abs=0.1)


def _bad_payloads(drafter):
    good = drafter.state_dict()
    first = next(iter(good))
    return {
        "missing_keys": {n: t for n, t in good.items() if n != first},
        "unexpected_keys": {**good, "target.lm_head.weight": torch.zeros(2, 2)},
        "shape": {**good, "fc.weight": torch.zeros(3, 3)},
        "dtype": {**good, "fc.weight": good["fc.weight"].double()},
        "non_finite": {**good, "norm.weight": torch.full_like(good["norm.weight"], float("nan"))},
        # Finite weights whose forward overflows: only the canary can tell.
        "canary": {**good, "fc.weight": torch.full_like(good["fc.weight"], 3e38)},
    }


@pytest.mark.parametrize(
    "kind",
    [
        "missing_keys",
        "unexpected_keys",
        "shape",
        "dtype",
        "non_finite",
        "canary",
        "checksum",
        "unreadable",
        "manifest",
    ],
)
def test_each_bad_payload_is_rejected_and_serving_continues_on_the_previous_version(
    target_factory, drafter_factory, tmp_path, kind
):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    engine = AdaFlashEngine(target, copy.deepcopy(drafter), length_mode="fixed")
    reloader = HotReloader(engine.drafter, tmp_path)
    publish_weights(tmp_path, perturbed(drafter, 1), 1)
    assert reloader.poll()
    served = {n: t.clone() for n, t in engine.drafter.state_dict().items()}

    if kind in ("checksum", "unreadable", "manifest"):
        path = publish_weights(tmp_path, perturbed(drafter, 2), 2)
        if kind == "checksum":
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF  # a flipped bit in the tensor data
            path.write_bytes(bytes(data))
        elif kind == "unreadable":
            path.unlink()
        else:
            (tmp_path / MANIFEST).write_text("{not json")
        reason = "unreadable" if kind == "manifest" else kind
    else:
        publish_weights(tmp_path, _bad_payloads(drafter)[kind], 2)
        reason = kind
    assert not reloader.poll()
    assert reloader.rejected == {reason: 1}
    assert not reloader.poll() and reloader.rejected == {reason: 1}  # remembered, counted once
    assert engine.drafter.weights_version == 1
    for name, tensor in engine.drafter.state_dict().items():
        assert torch.equal(tensor, served[name]), name
    prompt = torch.arange(4, 13)
    assert engine.generate([prompt], SamplingParams(max_new_tokens=10))[0] == greedy(target, prompt, 10)
    publish_weights(tmp_path, perturbed(drafter, 3), 3)
    assert reloader.poll() and engine.drafter.weights_version == 3  # a good payload still gets through


def test_lora_publishes_only_adapters_and_the_head_and_hot_reloads(target_factory, drafter_factory, tmp_path):
    from peft import LoraConfig, get_peft_model

    target = target_factory("llama")
    drafter = drafter_factory(target)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["thresh_head_two_model"])
    trained = get_peft_model(copy.deepcopy(drafter), config)
    serving = get_peft_model(copy.deepcopy(drafter), config)
    state = publishable_state(trained)
    assert state and all("lora_" in n or "thresh_head_two_model" in n for n in state)
    assert not any(n.endswith("fc.weight") or "mlp" in n for n in state)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_()
    publish_weights(tmp_path, publishable_state(trained), 1)
    reloader = HotReloader(serving, tmp_path)
    assert reloader.poll() and serving.weights_version == 1
    for name, tensor in publishable_state(serving).items():
        assert torch.equal(tensor, publishable_state(trained)[name]), name
    engine = AdaFlashEngine(target, serving)
    prompt = torch.arange(4, 13)
    assert engine.generate([prompt], SamplingParams(max_new_tokens=10))[0] == greedy(target, prompt, 10)


def _write_files(payload: bytes, fail_after: int | None = None):
    def write(directory):
        for i in range(3):
            if fail_after is not None and i == fail_after:
                raise OSError("disk full")
            (directory / f"part{i}.bin").write_bytes(payload)

    return write


def test_a_checkpoint_failing_mid_save_is_never_loaded(tmp_path):
    save_checkpoint(tmp_path, "checkpoint-v000001", _write_files(b"a" * 100), {"version": 1})
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(
            tmp_path, "checkpoint-v000002", _write_files(b"b" * 100, fail_after=2), {"version": 2}
        )
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "checkpoint-v000001" and verify_checkpoint(latest) == {"version": 1}
    assert not (tmp_path / "checkpoint-v000002").exists() and not list(tmp_path.glob(".staging-*"))


def test_a_checkpoint_with_a_corrupted_file_is_skipped(tmp_path):
    save_checkpoint(tmp_path, "checkpoint-v000001", _write_files(b"a" * 100), {"version": 1})
    save_checkpoint(tmp_path, "checkpoint-v000002", _write_files(b"b" * 100), {"version": 2})
    (tmp_path / "checkpoint-v000002" / "part1.bin").write_bytes(b"b" * 99)
    assert latest_checkpoint(tmp_path).name == "checkpoint-v000001"


def test_a_refused_checkpoint_is_logged_with_its_reason_and_the_one_used_instead(tmp_path, caplog):
    save_checkpoint(tmp_path, "checkpoint-v000001", _write_files(b"a" * 100), {"version": 1})
    save_checkpoint(tmp_path, "checkpoint-v000002", _write_files(b"b" * 100), {"version": 2})
    (tmp_path / "checkpoint-v000002" / "part1.bin").write_bytes(b"c" * 100)
    with caplog.at_level(logging.WARNING, logger="adaflash_hf.online.weights"):
        assert latest_checkpoint(tmp_path).name == "checkpoint-v000001"
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "checkpoint-v000002 refused (part1.bin sha256: expected" in message
    assert f"using {tmp_path / 'checkpoint-v000001'} instead" in message


def test_publishing_a_version_below_the_published_one_is_refused(tmp_path):
    publish_weights(tmp_path, {"w": torch.zeros(2)}, 3)
    publish_weights(tmp_path, {"w": torch.zeros(2)}, 3)  # the same version again: a resumed checkpoint
    with pytest.raises(ValueError, match=r"version: expected >= 3 \(the newest published in .*\), got 1"):
        publish_weights(tmp_path, {"w": torch.ones(2)}, 1)
    assert json.loads((tmp_path / MANIFEST).read_text())["version"] == 3


SAVER = """
import sys, torch
from safetensors.torch import save_file
from adaflash_hf.online.weights import save_checkpoint
root = sys.argv[1]
big = {"w": torch.randn(2_000_000)}
print("ready", flush=True)
for version in range(1, 10_000):
    def write(directory, version=version):
        save_file({"w": big["w"] + version}, str(directory / "drafter.safetensors"))
        torch.save({"step": version, "w": big["w"]}, directory / "optimizer.pt")
    save_checkpoint(root, f"checkpoint-v{version:06d}", write, {"version": version})
"""


def test_a_save_killed_by_sigkill_leaves_only_complete_checkpoints(tmp_path):
    from safetensors.torch import load_file

    process = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert process.stdout.readline().strip() == b"ready"
    deadline = time.time() + 60
    while latest_checkpoint(tmp_path) is None and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # well inside a later save
    process.send_signal(signal.SIGKILL)
    process.wait()
    latest = latest_checkpoint(tmp_path)
    state = verify_checkpoint(latest)
    assert state is not None and latest.name == f"checkpoint-v{state['version']:06d}"
    assert torch.load(latest / "optimizer.pt", weights_only=True)["step"] == state["version"]
    assert load_file(str(latest / "drafter.safetensors"))["w"].numel() == 2_000_000
    for directory in tmp_path.glob("checkpoint-*"):
        assert verify_checkpoint(directory) is not None, directory  # only staging dirs may be partial


def test_payload_error_names_the_tensor_and_shapes():
    from adaflash_hf.online.weights import validate_payload

    with pytest.raises(PayloadError, match=r"fc.weight shape: expected \(2, 2\), got \(3,\)") as info:
        validate_payload({"fc.weight": torch.zeros(3)}, {"fc.weight": torch.zeros(2, 2)})
    assert info.value.reason == "shape"
