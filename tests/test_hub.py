"""Hub publishing and downloading, offline: the model card (and the shipped drafter's, which say to load the drafter
in the target's dtype for the native path), one-commit uploads recorded by an autospec'd HfApi,
``drafter.push_to_hub``, loading from a hand-built Hub cache with HF_HUB_OFFLINE=1, and the remote-code path in a
process where adaflash_hf cannot be imported."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest.mock import create_autospec

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import EntryNotFoundError

from adaflash_hf.hub import load_bench_results, push_drafter, render_model_card
from adaflash_hf.interop import export_dflash

REPO = Path(__file__).resolve().parents[1]
BENCH = {
    "device": "cpu",
    "target": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "results": [
        {"method": "plain", "dataset": "gsm8k", "tau": 1.0, "speedup": 1.0},
        {"method": "adaflash", "dataset": "gsm8k", "tau": 3.42, "speedup": 1.87, "histogram": [1, 2]},
    ],
}
EXPECTED_FILES = {
    "README.md",
    "attention_adaflash.py",
    "config.json",
    "configuration_adaflash.py",
    "length_head_adaflash.py",
    "modeling_adaflash.py",
    "model.safetensors",
    "sidecar_adaflash.py",
}


@pytest.fixture
def target(target_factory):
    return target_factory("qwen3")


@pytest.fixture
def drafter(target, drafter_factory):
    return drafter_factory(target)


@pytest.fixture
def api():
    return create_autospec(HfApi, instance=True)


def _committed_files(api) -> set[str]:
    return {op.path_in_repo for op in api.create_commit.call_args.kwargs["operations"]}


# ------------------------------------------------------------------------------------------------- model card
def test_card_parses_with_modelcard_and_carries_the_metadata(drafter):
    card = render_model_card(
        drafter.config,
        "org/tiny-adaflash",
        base_model="Qwen/Qwen3-8B",
        bench_json=BENCH,
        training_command="adaflash train --config examples/configs/train.yaml",
        datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"],
    )
    parsed = ModelCard(str(card))
    assert parsed.data.base_model == "Qwen/Qwen3-8B"
    assert parsed.data.library_name == "transformers"
    assert {"adaflash", "dflash", "speculative-decoding"} <= set(parsed.data.tags)
    assert parsed.data.datasets == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    assert parsed.data.license == "apache-2.0"
    assert parsed.data.to_dict().get("pipeline_tag") is None  # a drafter cannot generate on its own


def test_card_body_has_usage_results_table_and_training_command(drafter):
    card = render_model_card(
        drafter.config,
        "org/tiny-adaflash",
        bench_json=BENCH,
        training_command="adaflash opd --config opd.yaml",
    )
    text = card.text
    assert 'AdaFlashDrafter.from_pretrained("org/tiny-adaflash"' in text
    assert "assistant_model=drafter" in text and "trust_remote_code=True" in text
    assert "| method | dataset | τ | speed-up |" in text
    assert "| adaflash | gsm8k | 3.42 | 1.87 |" in text
    assert "histogram" not in text  # non-scalar columns are left out
    assert "device: cpu" in text
    assert "adaflash opd --config opd.yaml" in text


def test_card_installs_from_the_repository_and_marks_the_hub_example(drafter):
    text = render_model_card(drafter.config, "org/x").text
    usage = text[text.index("## How to use") : text.index("## Drafter")]
    assert "pip install adaflash-hf" not in usage  # no package index serves it
    assert "in a clone of it, `pip install -e .`" in usage
    assert usage.index("With Hub access") < usage.index('AdaFlashDrafter.from_pretrained("org/x"')


def test_card_without_bench_says_no_results_were_recorded(drafter):
    assert "No benchmark results were recorded" in render_model_card(drafter.config, "org/x").text


def test_bench_json_accepts_rows_results_and_name_maps(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"adaflash": {"tau": 3.0}, "dflash": {"tau": 2.5}}))
    rows, _ = load_bench_results(path)
    assert rows == [{"method": "adaflash", "tau": 3.0}, {"method": "dflash", "tau": 2.5}]
    assert load_bench_results([{"tau": 2.0}])[0] == [{"tau": 2.0}]


def test_bad_bench_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench_json: expected an existing JSON file"):
        load_bench_results(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="bench_json: expected a list of result rows"):
        load_bench_results({"tau": 3.0})


def test_base_model_must_be_a_repo_id(drafter):
    with pytest.raises(ValueError, match="base_model: expected a Hub repo id"):
        render_model_card(drafter.config, "org/x", base_model="not a repo id")


# --------------------------------------------------------------------------------------------------- upload
def test_push_uploads_everything_in_one_commit(drafter, api):
    push_drafter(drafter, "org/tiny-adaflash", private=True, revision="v1", bench_json=BENCH, api=api)
    api.create_repo.assert_called_once_with(
        "org/tiny-adaflash", private=True, exist_ok=True, token=None, repo_type="model"
    )
    api.create_branch.assert_called_once_with(
        "org/tiny-adaflash", branch="v1", exist_ok=True, token=None, repo_type="model"
    )
    api.create_commit.assert_called_once()
    assert api.create_commit.call_args.kwargs["revision"] == "v1"
    assert _committed_files(api) == EXPECTED_FILES
    assert not api.upload_file.called and not api.upload_folder.called
    assert [name for name, *_ in api.method_calls] == ["create_repo", "create_branch", "create_commit"]


def test_push_to_main_creates_no_branch(drafter, api):
    push_drafter(drafter, "org/tiny-adaflash", api=api)
    assert not api.create_branch.called
    assert api.create_repo.call_args.kwargs["private"] is False
    assert api.create_commit.call_args.kwargs["revision"] is None


def test_push_takes_base_model_from_target_config(drafter, target, api):
    uploaded = {}

    def read_files(repo_id, operations, **kwargs):  # the staged files exist only during the commit
        uploaded.update({op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations})

    api.create_commit.side_effect = read_files
    target.config._name_or_path = "Qwen/Qwen3-0.6B"
    push_drafter(drafter, "org/tiny-adaflash", target_config=target.config, api=api)
    card = ModelCard(uploaded["README.md"].decode())
    assert card.data.base_model == "Qwen/Qwen3-0.6B"
    config = json.loads(uploaded["config.json"])
    assert config["auto_map"]["AutoModel"] == "modeling_adaflash.AdaFlashDrafter"


def test_failed_commit_leaves_no_other_write(drafter, api):
    api.create_commit.side_effect = RuntimeError("connection reset")
    with pytest.raises(RuntimeError, match="connection reset"):
        push_drafter(drafter, "org/tiny-adaflash", revision="v2", api=api)
    # every file was in the one failed commit: nothing was uploaded separately that a later load could see
    assert not api.upload_file.called and not api.upload_folder.called and not api.preupload_lfs_files.called


def test_bad_inputs_fail_before_touching_the_hub(drafter, target_factory, api, tmp_path):
    with pytest.raises(FileNotFoundError, match="bench_json"):
        push_drafter(drafter, "org/x", bench_json=tmp_path / "missing.json", api=api)
    with pytest.raises(ValueError, match="hidden_size: expected the target.s 128, got 64"):
        push_drafter(drafter, "org/x", target_config=target_factory("qwen3", hidden_size=128).config, api=api)
    with pytest.raises(FileNotFoundError, match="expected an existing folder"):
        push_drafter(tmp_path / "missing", "org/x", api=api)
    assert api.method_calls == []


def test_push_from_a_zlab_folder_uploads_our_layout(drafter, api, tmp_path):
    export_dflash(drafter, tmp_path / "dflash")
    push_drafter(tmp_path / "dflash", "org/tiny-adaflash", api=api)
    assert _committed_files(api) == EXPECTED_FILES


def test_dry_run_lists_files_without_calling_the_hub(drafter, api):
    planned = push_drafter(drafter, "org/tiny-adaflash", dry_run=True, api=api)
    assert {path for path, _ in planned} == EXPECTED_FILES and all(size > 0 for _, size in planned)
    assert api.method_calls == []


def test_inherited_push_to_hub_uploads_weights_config_and_remote_code(drafter, api, monkeypatch):
    import transformers.utils.hub as transformers_hub

    def no_remote_card(*args, **kwargs):
        raise EntryNotFoundError("no README.md yet")

    monkeypatch.setattr(transformers_hub, "_hf_api", api)
    monkeypatch.setattr(transformers_hub.ModelCard, "load", no_remote_card)
    api.create_repo.return_value.repo_id = "org/tiny-adaflash"
    drafter.push_to_hub("org/tiny-adaflash", private=True)
    api.create_commit.assert_called_once()
    assert _committed_files(api) == EXPECTED_FILES


# ------------------------------------------------------------------------------------- download (subprocess)
def _add_to_hub_cache(cache: Path, repo_id: str, ref: str, folder: Path) -> str:
    """Lay ``folder`` out as huggingface_hub's cache does: refs/<ref> holds a commit, snapshots/<commit>/ the files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    return commit


def _run_python(code: str, hf_home: Path) -> str:
    env = {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # One thread, as conftest.py sets here: the outputs are compared bit for bit, and CPU matmuls sum in another
        # order on more threads.
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def hub_cache(tmp_path, target, drafter_factory):
    """A Hub cache with org/name at main (drafter seed 1, learned mask) and branch v1 (seed 2), plus inputs and the
    expected outputs of both."""
    hf_home = tmp_path / "hf_home"
    torch.manual_seed(0)
    inputs = {"noise_embeds": torch.randn(1, 16, 64), "context_hidden_states": torch.randn(1, 5, 128)}
    expected = {}
    for ref, seed in (("main", 1), ("v1", 2)):
        drafter = drafter_factory(target, seed=seed, learned_mask_embedding=ref == "main")
        drafter.save_pretrained(tmp_path / ref)
        _add_to_hub_cache(hf_home / "hub", "org/name", ref, tmp_path / ref)
        with torch.no_grad():
            output = drafter(**inputs)
        expected[ref] = (output.last_hidden_state, output.acceptance_prob)
    torch.save({"inputs": inputs, "expected": expected}, tmp_path / "io.pt")
    return hf_home, tmp_path / "io.pt"


def test_from_pretrained_serves_from_the_hub_cache_offline(hub_cache, tmp_path):
    hf_home, io = hub_cache
    out = _run_python(
        f"""
        import torch
        from huggingface_hub import constants
        from adaflash_hf import AdaFlashDrafter
        from adaflash_hf.interop import import_checkpoint

        assert constants.HF_HUB_OFFLINE
        io = torch.load({str(io)!r}, weights_only=True)
        for revision in ("main", "v1"):
            drafter = AdaFlashDrafter.from_pretrained("org/name", revision=revision)
            with torch.no_grad():
                output = drafter(**io["inputs"])
            hidden, prob = io["expected"][revision]
            assert torch.equal(output.last_hidden_state, hidden), revision
            assert torch.equal(output.acceptance_prob, prob), revision
        import_checkpoint("org/name", {str(tmp_path / "imported")!r}, revision="v1")
        try:
            AdaFlashDrafter.from_pretrained("org/name", revision="v9")
        except OSError as error:
            print("missing revision:", type(error).__name__)
        print("OK")
        """,
        hf_home,
    )
    assert "OK" in out and "missing revision" in out
    assert (tmp_path / "imported" / "model.safetensors").is_file()


def test_remote_code_loads_where_adaflash_hf_is_not_importable(hub_cache):
    hf_home, io = hub_cache
    out = _run_python(
        f"""
        import sys
        sys.modules["adaflash_hf"] = None  # as if adaflash-hf were not installed
        import torch
        from transformers import AutoModel

        try:
            import adaflash_hf
        except ImportError:
            pass
        else:
            raise AssertionError("adaflash_hf is importable")
        io = torch.load({str(io)!r}, weights_only=True)
        drafter = AutoModel.from_pretrained("org/name", trust_remote_code=True)
        assert type(drafter).__module__.startswith("transformers_modules."), type(drafter).__module__
        with torch.no_grad():
            output = drafter(**io["inputs"])
        hidden, prob = io["expected"]["main"]
        assert torch.equal(output.last_hidden_state, hidden) and torch.equal(output.acceptance_prob, prob)
        print("OK", type(drafter).__name__)
        """,
        hf_home,
    )
    assert "OK AdaFlashDrafter" in out


def test_the_bench_jsons_we_write_render_as_a_card(drafter):
    """`adaflash publish --bench-json` takes what `adaflash bench generate` and `bench serve` write."""
    results = Path(__file__).resolve().parents[1] / "experiments" / "results"
    for name, first in (
        ("bench_generate.json", "| method | domain | τ |"),
        ("bench_serve.json", "| mode | concurrency | τ | speed-up |"),
    ):
        rows, setup = load_bench_results(results / name)
        raw = json.loads((results / name).read_text())["summary"]
        assert len(rows) == len(raw) and all("tau" in row and "lossless" in row for row in rows), name
        assert any("zero_length_share" in row for row in raw)  # diagnostics the bench writes ...
        for hidden in ("zero_length_share", "acceptance_per_position", "seconds", "rounds", "steps"):
            assert all(hidden not in row for row in rows), (name, hidden)  # ... that a card leaves out
        assert "drafter" not in setup and "records" not in setup, name
        assert first in render_model_card(drafter.config, "org/x", bench_json=results / name).text, name


@pytest.mark.parametrize(
    "card", ["adaflash_hf/templates/model_card.md", "examples/drafters/smollm2-135m-adaflash/README.md"]
)
def test_the_model_card_says_to_load_the_drafter_in_the_target_dtype_for_the_native_path(card):
    text = " ".join((REPO / card).read_text().split())
    assert (
        "Load it in the target's dtype (`dtype=target.dtype` as above, or `drafter.to(target.dtype)`)" in text
    )
