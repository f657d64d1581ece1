"""experiments/gpu/train_drafter.sh on its CPU dry path (DEVICE=cpu): a tiny target, corpus and starting drafter, a time
budget that stops the first run after one step, and a second run of the same command that resumes to max_steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_script_inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu" / "train_drafter.sh"


@pytest.fixture
def tiny_setup(target_factory, drafter_factory, tmp_path):
    target = target_factory("llama")
    tiny_script_inputs(target, tmp_path)
    # The "shipped drafter" the first run starts from: one layer, a draft vocabulary of 64 ids.
    drafter_factory(target, num_hidden_layers=1, draft_token_ids=list(range(0, 512, 8))).save_pretrained(
        tmp_path / "drafter"
    )
    return tmp_path


def run_script(tmp_path, budget):
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PYTHON": sys.executable,
        "OUTPUT_DIR": str(tmp_path / "out"),
        "TIME_BUDGET": budget,
        "DRAFTER_INIT": str(tmp_path / "drafter"),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "OUT": "",
    }
    tiny = [
        "--target_model", str(tmp_path / "target"), "--corpus_dir", str(tmp_path / "corpus"), "--domains", "math",
        "--heldout_corpus_dir", "", "--draft_vocab_size", "64", "--max_steps", "3", "--save_steps", "100",
        "--per_device_train_batch_size", "2", "--num_anchors", "4", "--logging_steps", "1", "--disable_tqdm", "true",
    ]  # fmt: skip
    result = subprocess.run(
        ["bash", str(SCRIPT), *tiny], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_gpu_script_stops_at_its_time_budget_and_the_same_command_resumes(tiny_setup):
    tmp_path = tiny_setup
    first = run_script(tmp_path, budget="1e-9")  # spent after the first step
    assert "resume_from_checkpoint last: no complete checkpoint, a fresh start" in first.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1"]
    assert json.loads(first.stdout.strip().splitlines()[-1])["global_step"] == 1

    second = run_script(tmp_path, budget="600")
    assert f"resume_from_checkpoint last: {tmp_path / 'out' / 'checkpoint-1'}" in second.stderr
    reached = json.loads((tmp_path / "out" / "reached.json").read_text())
    assert reached["global_step"] == 3 and reached["blocks_seen"] > 0
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]  # one history, continued
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cuda_checks_dry_run_on_cpu(tmp_path):
    """experiments/gpu/cuda_checks.py on its CPU dry path: every arm of generate and the engine equal plain greedy in
    fp32, and the prepared bf16 target passes the bitwise invariance check (whether the eager one does depends on
    the CPU's kernels, so the report only says)."""
    output = tmp_path / "cuda_checks.json"
    command = [sys.executable, "-P", str(ROOT / "experiments" / "gpu" / "cuda_checks.py"), "--device", "cpu"]
    command += [
        "--targets",
        "tiny-qwen3",
        "--prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--output",
        str(output),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env, cwd=tmp_path, capture_output=True, timeout=300)
    report = json.loads(output.read_text())
    fp32 = [row for row in report["generate"] if row["dtype"] == "float32"]
    assert len(fp32) == 5 and all(row["exact"] == "2/2" for row in fp32), fp32
    assert [row["exact"] for row in report["engine"]] == ["2/2"]
    bf16 = next(row for row in report["invariance"] if row["dtype"] == "bfloat16")
    assert bf16["prepared"].startswith("prepared: batch-invariant"), bf16
    assert bf16["eager"], bf16
