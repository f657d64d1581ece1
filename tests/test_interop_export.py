"""Export to the z-lab DFlash layout (SGLang/vLLM) and import from foreign layouts: schema, sidecar, bitwise
round trips, and clear errors for bad inputs."""

import json
import os
import stat
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.interop import (
    MASK_EMBEDDING_FILE,
    SIDECAR_CONFIG,
    SIDECAR_WEIGHTS,
    export_dflash,
    import_checkpoint,
    load_drafter,
)

ZLAB_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")
# keys transformers/save_pretrained add or rename; everything else in the config must survive a round trip
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "architectures",
    "auto_map",
    "dtype",
    "transformers_version",
    "source_layout",
}


def _keys(path):
    with safe_open(path, framework="pt") as handle:
        return set(handle.keys())


def _assert_same_drafter(expected: AdaFlashDrafter, actual: AdaFlashDrafter):
    expected_state, actual_state = expected.state_dict(), actual.state_dict()
    assert expected_state.keys() == actual_state.keys()
    for name, tensor in expected_state.items():
        assert actual_state[name].dtype == tensor.dtype, name
        assert torch.equal(actual_state[name], tensor), name
    expected_config = {k: v for k, v in expected.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    actual_config = {k: v for k, v in actual.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    assert actual_config == expected_config


@pytest.fixture
def drafter(target_factory, drafter_factory):
    return drafter_factory(target_factory("qwen3"))


def test_export_writes_the_zlab_config_schema(drafter, tmp_path):
    out = export_dflash(drafter, tmp_path / "dflash")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 16
    assert config["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [0, 3]}
    assert config["num_target_layers"] == 4
    assert config["rope_theta"] == drafter.config.rope_parameters["rope_theta"]
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64 and config["vocab_size"] == 512
    assert "auto_map" not in config and "adaflash" not in json.dumps(config)


def test_export_keeps_the_length_head_out_of_model_safetensors(drafter, tmp_path):
    out = export_dflash(drafter, tmp_path / "dflash")
    assert all(key.startswith(ZLAB_PREFIXES) for key in _keys(out / "model.safetensors"))
    assert _keys(out / SIDECAR_WEIGHTS) == set(drafter.length_head_parameter_names())
    meta = json.loads((out / SIDECAR_CONFIG).read_text())
    assert meta["length_head_variant"] == "two_model" and meta["length_head_bottleneck"] == 256
    assert meta["length_head_gamma"] == 1.0 and meta["length_head_min_len"] == 1
    assert not (out / MASK_EMBEDDING_FILE).exists()


@pytest.mark.parametrize(
    "overrides, dtype",
    [
        ({}, torch.bfloat16),
        (
            {"learned_mask_embedding": True, "length_head_variant": "paper", "length_head_gamma": 1.3},
            torch.float32,
        ),
    ],
    ids=["two_model-bf16", "paper-learned_mask-fp32"],
)
def test_export_then_import_round_trips_bitwise(target_factory, drafter_factory, tmp_path, overrides, dtype):
    original = drafter_factory(target_factory("qwen3"), **overrides).to(dtype)
    export_dflash(original, tmp_path / "dflash")
    import_checkpoint(tmp_path / "dflash", tmp_path / "ours")
    _assert_same_drafter(original, AdaFlashDrafter.from_pretrained(tmp_path / "ours"))


def test_exported_folder_loads_completely_with_from_pretrained(target_factory, drafter_factory, tmp_path):
    # from_pretrained is the one loader: the sidecar's head and settings and mask_embedding.pt are restored, silently.
    drafter = drafter_factory(target_factory("llama"), learned_mask_embedding=True, length_head_gamma=1.7)
    export_dflash(drafter, tmp_path / "dflash")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = AdaFlashDrafter.from_pretrained(tmp_path / "dflash")
    assert loaded.config.source_layout == "dflash"
    assert loaded.config.length_head_gamma == 1.7 and loaded.config.learned_mask_embedding
    assert loaded.state_dict().keys() == drafter.state_dict().keys()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_exported_folder_without_its_sidecar_loads_as_zlab_with_a_fresh_head_warning(drafter, tmp_path):
    out = export_dflash(drafter, tmp_path / "dflash")
    (out / SIDECAR_CONFIG).unlink()
    (out / SIDECAR_WEIGHTS).unlink()
    with pytest.warns(UserWarning, match="without a length head"):
        loaded = AdaFlashDrafter.from_pretrained(out)
    head = set(drafter.length_head_parameter_names())
    for name, tensor in drafter.state_dict().items():
        if name not in head:
            assert torch.equal(loaded.state_dict()[name], tensor), name


def test_truncated_sidecar_names_the_file(drafter, tmp_path):
    out = export_dflash(drafter, tmp_path / "dflash")
    data = (out / SIDECAR_WEIGHTS).read_bytes()
    (out / SIDECAR_WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError, match=rf"{SIDECAR_WEIGHTS}: expected a complete safetensors file, got one"
    ):
        AdaFlashDrafter.from_pretrained(out)


def test_a_damaged_sidecar_json_names_the_file(drafter, tmp_path):
    out = export_dflash(drafter, tmp_path / "dflash")
    (out / SIDECAR_CONFIG).write_text('{"format_version": 1,')
    with pytest.raises(ValueError, match=rf"{SIDECAR_CONFIG}: expected valid JSON, got .* at line 1, column"):
        AdaFlashDrafter.from_pretrained(out)


def test_a_damaged_target_config_json_names_the_file(drafter, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"')
    with pytest.raises(ValueError, match=r"config.json: expected valid JSON, got .* at line 1, column"):
        export_dflash(drafter, tmp_path / "dflash", target_config=tmp_path / "config.json")


def test_a_missing_target_config_folder_is_named_as_missing(drafter, tmp_path):
    with pytest.raises(
        FileNotFoundError, match=rf"target_config: .*got '{tmp_path / 'nope'}', a path where nothing"
    ):
        export_dflash(drafter, tmp_path / "dflash", target_config=tmp_path / "nope")


def test_learned_mask_embedding_goes_to_mask_embedding_pt_with_a_warning(
    target_factory, drafter_factory, tmp_path, caplog
):
    drafter = drafter_factory(target_factory("llama"), learned_mask_embedding=True)
    out = export_dflash(drafter, tmp_path / "dflash")
    assert "mask_embedding.pt (read by vLLM" in caplog.text
    saved = torch.load(out / MASK_EMBEDDING_FILE, weights_only=True)
    assert saved.shape == (64,) and torch.equal(saved, drafter.mask_embedding.detach())
    assert "mask_embedding" in _keys(out / SIDECAR_WEIGHTS)


def test_import_reads_a_bare_mask_embedding_pt_as_learned_mask(target_factory, drafter_factory, tmp_path):
    drafter = drafter_factory(target_factory("llama"), learned_mask_embedding=True)
    out = export_dflash(drafter, tmp_path / "dflash")
    (out / SIDECAR_CONFIG).unlink()
    (out / SIDECAR_WEIGHTS).unlink()
    with pytest.warns(UserWarning, match="without a length head"):
        loaded = load_drafter(out)
    assert loaded.config.learned_mask_embedding
    assert torch.equal(loaded.mask_embedding, drafter.mask_embedding)


def test_official_format_keeps_the_head_inside_model_safetensors(drafter, tmp_path):
    out = export_dflash(drafter, tmp_path / "official", format="adaflash-official")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["use_thresh_head_two_model"] is True
    assert config["dflash_config"]["thresh_head_bottleneck_dim"] == 256
    assert set(drafter.length_head_parameter_names()) <= _keys(out / "model.safetensors")
    assert not (out / SIDECAR_WEIGHTS).exists()
    loaded = AdaFlashDrafter.from_pretrained(out)  # the official layout needs no sidecar
    assert loaded.config.source_layout == "adaflash_official"
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())
    _assert_same_drafter(drafter, load_drafter(out))  # the sidecar restores gamma/min_len too


def test_official_format_rejects_the_paper_head(target_factory, drafter_factory, tmp_path):
    drafter = drafter_factory(target_factory("qwen3"), length_head_variant="paper")
    with pytest.raises(ValueError, match="length_head_variant: expected 'two_model'.*got 'paper'"):
        export_dflash(drafter, tmp_path / "official", format="adaflash-official")
    assert not (tmp_path / "official").exists()


def test_import_of_a_zlab_checkpoint_records_the_target_fingerprint(drafter, target_factory, tmp_path):
    export_dflash(drafter, tmp_path / "dflash")
    for name in (SIDECAR_CONFIG, SIDECAR_WEIGHTS):
        (tmp_path / "dflash" / name).unlink()
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert "target_hidden_size" not in config
    with pytest.warns(UserWarning, match="length head"):
        import_checkpoint(
            tmp_path / "dflash", tmp_path / "ours", target_config=target_factory("qwen3").config
        )
    imported = AdaFlashDrafter.from_pretrained(tmp_path / "ours")
    assert imported.config.target_hidden_size == 64 and imported.config.target_model_type == "qwen3"


# --------------------------------------------------------------------------------------------- bad inputs
def test_mismatched_target_fingerprint_names_field_expected_and_actual(drafter, target_factory, tmp_path):
    other = target_factory("qwen3", num_hidden_layers=6).config
    with pytest.raises(
        ValueError, match=r"target_num_hidden_layers: expected the target's num_hidden_layers=6, got 4"
    ):
        export_dflash(drafter, tmp_path / "dflash", target_config=other)
    assert not (tmp_path / "dflash").exists()
    other_type = target_factory("llama").config
    with pytest.raises(
        ValueError, match=r"target_model_type: expected the target's model_type='llama', got 'qwen3'"
    ):
        export_dflash(drafter, tmp_path / "dflash", target_config=other_type)


def test_target_config_may_be_a_json_file(drafter, target_factory, tmp_path):
    target_factory("qwen3", hidden_size=128).config.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="hidden_size: expected the target.s 128, got 64"):
        export_dflash(drafter, tmp_path / "dflash", target_config=tmp_path / "target" / "config.json")


def test_missing_checkpoint_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected an existing folder or an 'org/name' Hub repo id"):
        import_checkpoint(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="got no config.json"):
        import_checkpoint(tmp_path / "empty", tmp_path / "out")


def test_unknown_layout_is_a_clear_error(target_factory, tmp_path):
    target_factory("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"config.json: expected an AdaFlash .* got model_type='llama'"):
        import_checkpoint(tmp_path / "llama", tmp_path / "out")


def test_missing_tensor_is_a_clear_error(drafter, tmp_path):
    out = export_dflash(drafter, tmp_path / "dflash")
    tensors = load_file(out / "model.safetensors")
    del tensors["fc.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \['fc.weight'\]"):
        import_checkpoint(out, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_existing_output_is_not_overwritten_by_default(drafter, tmp_path):
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_dflash(drafter, tmp_path / "dflash")
    export_dflash(drafter, tmp_path / "dflash", overwrite=True)
    assert not (tmp_path / "dflash" / "keep.txt").exists()


def test_unknown_export_format_is_rejected(drafter, tmp_path):
    with pytest.raises(
        ValueError, match=r"format: expected one of \('dflash', 'adaflash-official'\), got 'eagle'"
    ):
        export_dflash(drafter, tmp_path / "x", format="eagle")


def test_export_and_import_folders_follow_the_umask(drafter, tmp_path):
    # Another service user (an SGLang or vLLM server) must be able to read the folders.
    previous = os.umask(0o022)
    try:
        exported = export_dflash(drafter, tmp_path / "dflash")
        imported = import_checkpoint(exported, tmp_path / "ours")
    finally:
        os.umask(previous)
    for folder in (exported, imported):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
        for path in folder.rglob("*"):
            assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path


def test_the_export_root_holds_only_the_zlab_weights_as_safetensors(
    target_factory, drafter_factory, tmp_path
):
    # vLLM and SGLang load every *.safetensors of the root as draft weights; vLLM refuses the head's tensors there.
    drafter = drafter_factory(target_factory("llama"), learned_mask_embedding=True)
    out = export_dflash(drafter, tmp_path / "dflash")
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert all(key.startswith(ZLAB_PREFIXES) for key in _keys(out / "model.safetensors"))
    assert _keys(out / SIDECAR_WEIGHTS) == {*drafter.length_head_parameter_names(), "mask_embedding"}
    _assert_same_drafter(drafter, load_drafter(out))


def test_an_export_with_its_head_tensors_in_the_root_still_loads(drafter, tmp_path):
    from adaflash_hf.modeling.sidecar_adaflash import ROOT_SIDECAR_WEIGHTS

    out = export_dflash(drafter, tmp_path / "dflash")
    (out / SIDECAR_WEIGHTS).rename(out / ROOT_SIDECAR_WEIGHTS)
    (out / SIDECAR_WEIGHTS).parent.rmdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fresh-head warning: the head was found
        _assert_same_drafter(drafter, load_drafter(out))


@pytest.mark.parametrize("command", ["export", "import"])
def test_overwrite_replaces_a_folder_never_a_file(drafter, tmp_path, capsys, command):
    from adaflash_hf.cli import main

    drafter.save_pretrained(tmp_path / "drafter")
    out = tmp_path / "out"
    out.write_text("not a folder")
    with pytest.raises(FileExistsError, match=f"out: expected a folder to write .*got the file {out}"):
        (export_dflash if command == "export" else import_checkpoint)(drafter, out, overwrite=True)
    assert main([command, str(tmp_path / "drafter"), str(out), "--overwrite"]) == 1
    assert "got the file" in capsys.readouterr().err
    assert out.read_text() == "not a folder"


@pytest.mark.parametrize("command", ["export", "import"])
def test_an_out_path_inside_a_file_names_the_file(drafter, tmp_path, capsys, command):
    from adaflash_hf.cli import main

    drafter.save_pretrained(tmp_path / "drafter")
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" / "out"
    assert main([command, str(tmp_path / "drafter"), str(out)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"adaflash {command}: error: out: expected a folder to write, got {out}, inside the file {tmp_path / 'file'}"
    )
