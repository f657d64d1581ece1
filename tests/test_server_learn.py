"""``adaflash serve --learn``: the drafter weights version rises while requests keep completing with lossless greedy
text; SIGTERM finishes the running request, writes the learner's checkpoint and exits 0; a restart resumes from it;
a SIGKILL, during a publish or anywhere else, leaves the newest complete version loadable."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
import torch

from adaflash_hf.online.weights import (
    MANIFEST,
    HotReloader,
    LearnerState,
    latest_checkpoint,
    publish_weights,
    read_manifest,
    save_online_checkpoint,
)
from adaflash_hf.serving.server import BackgroundServer, build_engine, create_app
from adaflash_hf.serving.worker import EngineWorker
from adaflash_hf.trainers.opd_live import learn_configs, live_learner

PROMPT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def target(target_factory):
    return target_factory("llama", initializer_range=0.2)


def metrics(base_url) -> dict[str, float]:
    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    return {name: float(value) for name, value in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def ask(base_url, max_tokens=16, **options):
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    return client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, **options
    )


def plain_text(target, tokenizer, max_new_tokens):
    prompt = tokenizer(PROMPT)["input_ids"]
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)


def serve_until(base_url, version: int, expected: str, limit: int = 80) -> list[int]:
    """Greedy requests until the served drafter reaches ``version``; every text must equal ``expected``."""
    versions = []
    for _ in range(limit):
        response = ask(base_url)
        assert response.choices[0].text == expected
        versions.append(response.adaflash["drafter_version"])
        if versions[-1] >= version:
            return versions
    raise AssertionError(f"drafter version: expected {version} within {limit} requests, got {versions[-5:]}")


def test_learning_raises_the_version_while_requests_complete_lossless(
    target, drafter_factory, word_tokenizer, tmp_path
):
    engine = build_engine(target, drafter_factory(target), length_mode="adaptive")
    learner = live_learner(engine, target, word_tokenizer, tmp_path, train_threshold=2)
    worker = EngineWorker(engine, word_tokenizer, learner=learner)
    with BackgroundServer(create_app(worker, word_tokenizer, "tiny", learner=learner)) as server:
        versions = serve_until(server.base_url, 2, plain_text(target, word_tokenizer, 16))
        values = metrics(server.base_url)
    assert versions == sorted(versions) and versions[0] == 0
    assert values["adaflash_trainer_rounds"] >= 2 and values["adaflash_reload_swaps"] >= 2
    assert values["adaflash_drafter_weights_version"] >= 2 and values["adaflash_reload_rejected"] == 0


@pytest.mark.parametrize("restart", ["checkpoints deleted", "resume false"])
def test_a_restart_serves_the_trainers_weights_under_a_version_above_any_left_on_disk(
    target, drafter_factory, word_tokenizer, tmp_path, restart
):
    old = {n: t + 1.0 for n, t in drafter_factory(target).state_dict().items()}
    publish_weights(tmp_path / "weights", old, 3)
    overrides = {}
    if restart == "resume false":
        save_online_checkpoint(tmp_path / "checkpoints", LearnerState(old, None, 3), {"round": 3})
        overrides["resume"] = False
    engine = build_engine(target, drafter_factory(target), length_mode="adaptive")
    learner = live_learner(engine, target, word_tokenizer, tmp_path, train_threshold=2, **overrides)
    assert learner.trainer.weights_version == 4 and read_manifest(tmp_path / "weights")["version"] == 4
    learner.between_steps()
    served, trained = engine.drafter.state_dict(), learner.trainer.publishable_state()
    assert engine.drafter.weights_version == 4
    assert all(torch.equal(served[name], trained[name]) for name in trained)


def test_a_learn_dir_inside_a_file_is_refused_naming_the_option_and_the_file(
    target, drafter_factory, tmp_path
):
    (tmp_path / "file").write_text("x")
    engine = build_engine(target, drafter_factory(target), length_mode="adaptive")
    with pytest.raises(
        FileExistsError, match=r"--learn-dir: expected a folder to write, got .*, inside the file"
    ):
        live_learner(engine, target, None, tmp_path / "file" / "learn")


def test_a_misspelt_opd_config_key_is_refused_naming_the_nearest_key(tmp_path):
    (tmp_path / "opd.yaml").write_text("learning_ratee: 0.1\n")
    with pytest.raises(ValueError, match=r"got 'learning_ratee' \(did you mean 'learning_rate'\?\)"):
        learn_configs(tmp_path, str(tmp_path / "opd.yaml"))


def test_opd_script_keys_a_server_does_not_use_are_named_in_a_warning(tmp_path, caplog):
    (tmp_path / "opd.yaml").write_text("learning_rate: 0.1\ndomains: [chat]\ntrain_threshold: 4\n")
    with caplog.at_level(logging.WARNING, logger="adaflash_hf.trainers.opd_live"):
        training, online = learn_configs(tmp_path, str(tmp_path / "opd.yaml"))
    assert training.learning_rate == 0.1 and online.train_threshold == 4
    assert any("domains set the OPD script's" in r.getMessage() for r in caplog.records)


def test_an_opd_config_with_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    (tmp_path / "opd.yaml").write_text("alpha: 0.5\ndelta: [0.1\n")
    with pytest.raises(ValueError, match=r"opd.yaml: expected valid YAML, got .* at line 3, column 1"):
        learn_configs(tmp_path, str(tmp_path / "opd.yaml"))


# ----------------------------------------------------------------------------------------- the command, end to end
def keep_asking(base_url) -> None:
    """Requests until the server is gone."""
    try:
        while True:
            ask(base_url)
    except openai.APIConnectionError:
        return


def start_server(tmp_path, *extra) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "adaflash_hf.cli", "serve", "--target", str(tmp_path / "target")]
    command += ["--drafter", str(tmp_path / "drafter"), "--port", "0", "--served-model-name", "tiny", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    line = process.stdout.readline()
    match = re.search(r"on (http://\S+/v1)", line)
    assert match, f"expected the address on stdout, got {line!r}"
    base_url = match.group(1)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=5)
            return process, base_url
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "server: expected it to come up"
            time.sleep(0.2)


def test_sigterm_finishes_checkpoints_and_exits_0_then_a_restart_resumes_and_survives_sigkill(
    target, drafter_factory, word_tokenizer, tmp_path
):
    target.save_pretrained(tmp_path / "target")
    word_tokenizer.save_pretrained(tmp_path / "target")
    drafter_factory(target).save_pretrained(tmp_path / "drafter")
    learn = [
        "--learn",
        "--learn-dir",
        str(tmp_path / "learn"),
        "--train-threshold",
        "2",
        "--grace-period",
        "60",
    ]
    process, base_url = start_server(tmp_path, *learn)
    expected = plain_text(target, word_tokenizer, 16)
    try:
        serve_until(base_url, 1, expected)
        stream = ask(base_url, max_tokens=200, stream=True)
        chunks = [next(iter(stream))]
        process.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"  # finished within the grace period
        assert process.wait(120) == 0
    finally:
        process.kill()
    checkpoint = latest_checkpoint(tmp_path / "learn" / "checkpoints")
    saved = json.loads((checkpoint / "checkpoint.json").read_text())["state"]["version"]
    assert saved >= 1

    process, base_url = start_server(tmp_path, *learn)
    try:
        assert ask(base_url).choices[0].text == expected
        assert metrics(base_url)["adaflash_drafter_weights_version"] == saved  # resumed, not from 0
        traffic = threading.Thread(target=keep_asking, args=(base_url,), daemon=True)
        traffic.start()
        time.sleep(1.0)  # somewhere in serving and learning
        process.send_signal(signal.SIGKILL)
        process.wait(60)
        traffic.join(60)
    finally:
        process.kill()
    drafter = drafter_factory(target)
    reloader = HotReloader(drafter, tmp_path / "learn" / "weights")
    assert reloader.poll() and reloader.version == read_manifest(tmp_path / "learn" / "weights")["version"]


PUBLISHER = """
import sys, torch
from adaflash_hf.online.weights import publish_weights
weight = torch.zeros(2000, 1000)
for version in range(1, 100_000):
    publish_weights(sys.argv[1], {"weight": weight + version, "bias": torch.zeros(2000)}, version)
    if version == 1:
        print("published", flush=True)
"""


def test_a_sigkill_during_a_publish_leaves_the_previous_version_loadable(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(tmp_path)],
        stdout=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert process.stdout.readline().strip() == b"published"
    time.sleep(0.5)  # several publishes later, most likely inside one
    process.send_signal(signal.SIGKILL)
    process.wait()
    model = torch.nn.Linear(1000, 2000)
    reloader = HotReloader(model, tmp_path, canary=None)
    assert reloader.poll(), reloader.rejected
    version = json.loads((tmp_path / MANIFEST).read_text())["version"]
    assert reloader.version == version and bool((model.weight == version).all())
    publish_weights(
        tmp_path, {"weight": model.weight + 1, "bias": model.bias}, version + 1
    )  # publishing goes on
    assert reloader.poll() and reloader.version == version + 1
