"""Checkpoints: our own format round trips bitwise and ships remote code; published layouts (z-lab DFlash, the
official AdaFlash checkpoint, transformers' Muse-Glimmer assistant) load strictly and compute what they computed."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModel, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 64, 4, 2, 16, 128, 2
BLOCK, MASK_ID, VOCAB, TARGET_LAYER_IDS, ROPE_THETA = 8, 511, 512, [0, 2], 1_000_000.0


def inputs(seed=0, n_ctx=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, BLOCK, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    context = torch.randn(1, n_ctx, len(TARGET_LAYER_IDS) * HIDDEN, generator=g, dtype=torch.float64).to(
        dtype
    )
    return noise, context


def run(drafter, noise, context):
    with torch.no_grad():
        return drafter(noise_embeds=noise, context_hidden_states=context)


def assert_state_dicts_bitwise_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------------------------------------------- our format
@pytest.mark.parametrize("learned_mask_embedding", [False, True])
@pytest.mark.parametrize("variant", ["two_model", "paper"])
def test_save_load_round_trip_is_bitwise(
    tmp_path, qwen3_target, drafter_factory, variant, learned_mask_embedding
):
    drafter = drafter_factory(
        qwen3_target, length_head_variant=variant, learned_mask_embedding=learned_mask_embedding
    )
    drafter.save_pretrained(tmp_path)
    loaded = AdaFlashDrafter.from_pretrained(tmp_path).eval()

    assert_state_dicts_bitwise_equal(drafter, loaded)
    assert torch.equal(drafter.rotary_emb.inv_freq, loaded.rotary_emb.inv_freq)
    for field in (
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "learned_mask_embedding",
        "length_head_variant",
    ):
        assert getattr(loaded.config, field) == getattr(drafter.config, field), field
    noise = torch.randn(1, 2 * drafter.config.block_size, drafter.config.hidden_size)
    context = torch.randn(1, 6, drafter.fc.in_features)
    expected, actual = run(drafter, noise, context), run(loaded, noise, context)
    assert torch.equal(expected.last_hidden_state, actual.last_hidden_state)
    assert torch.equal(expected.acceptance_prob, actual.acceptance_prob)


def test_save_pretrained_writes_safetensors_only(tmp_path, qwen3_target, drafter_factory):
    drafter_factory(qwen3_target).save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert "model.safetensors" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth"))]


def test_save_pretrained_refuses_pickle_serialization(tmp_path, qwen3_target, drafter_factory):
    with pytest.raises(ValueError, match="safe_serialization: expected True"):
        drafter_factory(qwen3_target).save_pretrained(tmp_path, safe_serialization=False)


def test_saved_folder_carries_remote_code(tmp_path, qwen3_target, drafter_factory):
    drafter_factory(qwen3_target).save_pretrained(tmp_path)
    remote_code = {
        path.name for path in (Path(__file__).resolve().parents[1] / "modeling").glob("*_adaflash.py")
    }
    assert {"configuration_adaflash.py", "modeling_adaflash.py", "sidecar_adaflash.py"} <= remote_code
    assert remote_code <= set(os.listdir(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "adaflash"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_adaflash.AdaFlashConfig",
        "AutoModel": "modeling_adaflash.AdaFlashDrafter",
    }


REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["adaflash_hf"] = None  # any import of adaflash_hf (or a submodule) now raises ImportError
    try:
        import adaflash_hf  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("adaflash_hf is importable; the test would not prove anything")
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    model_dir, inputs_path, outputs_path = sys.argv[1:4]
    drafter = AutoModel.from_pretrained(model_dir, trust_remote_code=True).eval()
    x = load_file(inputs_path)
    with torch.no_grad():
        out = drafter(noise_embeds=x["noise"], context_hidden_states=x["context"])
    save_file({"hidden": out.last_hidden_state.contiguous(), "prob": out.acceptance_prob.contiguous()}, outputs_path)
    print(type(drafter).__module__)
    """
)


def test_saved_folder_loads_as_remote_code_without_adaflash_hf(tmp_path, qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target, length_head_variant="paper")
    model_dir = tmp_path / "drafter"
    drafter.save_pretrained(model_dir)
    noise = torch.randn(1, drafter.config.block_size, drafter.config.hidden_size)
    context = torch.randn(1, 4, drafter.fc.in_features)
    save_file({"noise": noise, "context": context}, tmp_path / "inputs.safetensors")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            REMOTE_CODE_SCRIPT,
            str(model_dir),
            "inputs.safetensors",
            "outputs.safetensors",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith("transformers_modules."), result.stdout
    remote = load_file(tmp_path / "outputs.safetensors")
    local = run(drafter, noise, context)
    assert torch.equal(remote["hidden"], local.last_hidden_state)
    assert torch.equal(remote["prob"], local.acceptance_prob)


def test_auto_model_loads_a_saved_drafter_without_remote_code(tmp_path, qwen3_target, drafter_factory):
    drafter_factory(qwen3_target).save_pretrained(tmp_path)
    assert type(AutoModel.from_pretrained(tmp_path)) is AdaFlashDrafter


# --------------------------------------------------------------------------------------------- strict loading
def saved_checkpoint(tmp_path, target, drafter_factory):
    drafter_factory(target).save_pretrained(tmp_path)
    return tmp_path / "model.safetensors"


def edit_tensors(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_loading_a_checkpoint_with_a_missing_tensor_raises(tmp_path, qwen3_target, drafter_factory):
    path = saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    edit_tensors(path, lambda t: t.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing keys \['layers\.0\.mlp\.up_proj\.weight'\]"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_loading_our_checkpoint_without_its_length_head_raises(tmp_path, qwen3_target, drafter_factory):
    path = saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    edit_tensors(path, lambda t: [t.pop(k) for k in list(t) if k.startswith("thresh_head_two_model.")])
    with pytest.raises(ValueError, match=r"missing keys \['thresh_head_two_model\."):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_loading_a_checkpoint_with_an_unexpected_tensor_raises(tmp_path, qwen3_target, drafter_factory):
    path = saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    edit_tensors(path, lambda t: t.__setitem__("layers.0.extra.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"unexpected keys \['layers\.0\.extra\.weight'\]"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_the_strict_loading_error_names_the_layout_it_expected(tmp_path, qwen3_target, drafter_factory):
    path = saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    edit_tensors(path, lambda t: t.__setitem__("layers.0.extra.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"expected exactly the tensors of the 'adaflash' layout \(plus "):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_loading_a_checkpoint_with_a_wrong_shaped_tensor_raises(tmp_path, qwen3_target, drafter_factory):
    path = saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    edit_tensors(path, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 64)))
    with pytest.raises(ValueError, match=r"wrong-shaped keys .*fc\.weight.*\[64, 64\].*\[64, 128\]"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_loading_refuses_ignore_mismatched_sizes(tmp_path, qwen3_target, drafter_factory):
    saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    with pytest.raises(ValueError, match="ignore_mismatched_sizes: expected False"):
        AdaFlashDrafter.from_pretrained(tmp_path, ignore_mismatched_sizes=True)


def test_loading_a_truncated_safetensors_file_names_the_file(tmp_path, qwen3_target, drafter_factory):
    path = saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(path))}: expected a complete safetensors file, got one that cannot be read",
    ):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_folder_without_config_json_names_the_missing_file(tmp_path, qwen3_target, drafter_factory):
    saved_checkpoint(tmp_path, qwen3_target, drafter_factory)
    (tmp_path / "config.json").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"expected a drafter checkpoint folder with config.json, got no config.json"
    ):
        AdaFlashDrafter.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------- published layouts
def random_dflash_tensors(seed=0, with_official_head=False, bottleneck=32):
    """The tensor names and shapes of a z-lab DFlash checkpoint (plus the official AdaFlash head), tiny and random."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1, offset=0.0):
        return torch.randn(*shape, generator=g) * scale + offset

    t = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        t[p + "self_attn.q_norm.weight"] = rand(HEAD_DIM, offset=1.0)
        t[p + "self_attn.k_norm.weight"] = rand(HEAD_DIM, offset=1.0)
        t[p + "input_layernorm.weight"] = rand(HIDDEN, offset=1.0)
        t[p + "post_attention_layernorm.weight"] = rand(HIDDEN, offset=1.0)
        t[p + "mlp.gate_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE)
    t["fc.weight"] = rand(HIDDEN, len(TARGET_LAYER_IDS) * HIDDEN)
    t["hidden_norm.weight"] = rand(HIDDEN, offset=1.0)
    t["norm.weight"] = rand(HIDDEN, offset=1.0)
    if with_official_head:
        head = "thresh_head_two_model."
        t[head + "down.weight"], t[head + "down.bias"] = rand(bottleneck, 2 * HIDDEN), rand(bottleneck)
        t[head + "res.0.weight"], t[head + "res.0.bias"] = rand(bottleneck, bottleneck), rand(bottleneck)
        t[head + "out.weight"], t[head + "out.bias"] = rand(1, bottleneck), rand(1)
    return {k: v.to(torch.bfloat16) for k, v in t.items()}  # published drafters ship bf16


def zlab_config(**extra):
    """A tiny config.json in the z-lab DFlash schema (fields as in z-lab/Qwen3-4B-DFlash-b16)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS, **extra},
        "dtype": "bfloat16",
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "layer_types": ["full_attention"] * LAYERS,
        "max_position_embeddings": 512,
        "max_window_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": 4,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def write_checkpoint(folder, config, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions):
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
    freqs = positions[:, None].double() * inv_freq.double()
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    rotated = torch.cat((-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]), dim=-1)
    return x * cos + rotated * sin


def reference_dflash_forward(t, noise, context):
    """z-lab DFlash's forward written out from the checkpoint tensors (float64, batch 1, no cache, no mask)."""
    t = {k: v.double() for k, v in t.items()}
    n_ctx, q_len = context.shape[1], noise.shape[1]
    positions = torch.arange(n_ctx + q_len)
    ctx = _rms(context[0] @ t["fc.weight"].T, t["hidden_norm.weight"])
    h = noise[0]
    for i in range(LAYERS):
        p = f"layers.{i}."
        x = _rms(h, t[p + "input_layernorm.weight"])
        kv = torch.cat([ctx, x])
        q = _rms(
            (x @ t[p + "self_attn.q_proj.weight"].T).view(q_len, HEADS, HEAD_DIM),
            t[p + "self_attn.q_norm.weight"],
        )
        k = _rms(
            (kv @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM),
            t[p + "self_attn.k_norm.weight"],
        )
        v = (kv @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)
        q = _rope(q.transpose(0, 1), positions[-q_len:])  # [heads, q_len, hd]
        k = _rope(k.transpose(0, 1), positions).repeat_interleave(HEADS // KV_HEADS, 0)
        v = v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        attn = torch.softmax(q @ k.transpose(1, 2) / HEAD_DIM**0.5, dim=-1) @ v  # every query sees every key
        h = h + attn.transpose(0, 1).reshape(q_len, -1) @ t[p + "self_attn.o_proj.weight"].T
        x = _rms(h, t[p + "post_attention_layernorm.weight"])
        mlp = F.silu(x @ t[p + "mlp.gate_proj.weight"].T) * (x @ t[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ t[p + "mlp.down_proj.weight"].T
    return _rms(h, t["norm.weight"])[None]


def reference_official_head(t, block_hidden):
    """ZinYY/AdaFlash ThreshHeadTwoModel written out: concat(mean, last) -> down -> SiLU -> +res -> out -> sigmoid."""
    t = {k: v.double() for k, v in t.items() if k.startswith("thresh_head_two_model.")}
    w = lambda name: (t[f"thresh_head_two_model.{name}.weight"], t[f"thresh_head_two_model.{name}.bias"])  # noqa: E731
    features = torch.cat([block_hidden.mean(-2), block_hidden[..., -1, :]], dim=-1)
    x = F.silu(F.linear(features, *w("down")))
    x = x + F.silu(F.linear(x, *w("res.0")))
    return torch.sigmoid(F.linear(x, *w("out"))).squeeze(-1)


def test_zlab_dflash_checkpoint_loads_with_a_fresh_head_warning(tmp_path):
    tensors = random_dflash_tensors()
    folder = write_checkpoint(tmp_path / "zlab", zlab_config(), tensors)
    with pytest.warns(UserWarning, match="without a length head.*freshly initialised"):
        drafter = AdaFlashDrafter.from_pretrained(folder, dtype=torch.float64).eval()

    cfg = drafter.config
    assert (cfg.source_layout, cfg.block_size, cfg.mask_token_id) == ("dflash", BLOCK, MASK_ID)
    assert cfg.target_layer_ids == TARGET_LAYER_IDS and cfg.target_num_hidden_layers == 4
    assert cfg.rope_parameters["rope_theta"] == ROPE_THETA
    noise, context = inputs(dtype=torch.float64)
    actual = run(drafter, noise, context).last_hidden_state
    torch.testing.assert_close(actual, reference_dflash_forward(tensors, noise, context), rtol=0, atol=1e-10)


def test_zlab_dflash_target_layer_ids_default_from_num_target_layers(tmp_path):
    config = zlab_config()
    del config["dflash_config"]["target_layer_ids"]
    folder = write_checkpoint(tmp_path / "zlab", config, random_dflash_tensors())
    assert AdaFlashConfig.from_pretrained(folder).target_layer_ids == [0, 3]  # spread over a 4-layer target


def test_converted_zlab_drafter_saves_in_our_format_and_reloads_silently(tmp_path):
    folder = write_checkpoint(tmp_path / "zlab", zlab_config(), random_dflash_tensors())
    with pytest.warns(UserWarning):
        drafter = AdaFlashDrafter.from_pretrained(folder)
    drafter.save_pretrained(tmp_path / "ours")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reloaded = AdaFlashDrafter.from_pretrained(tmp_path / "ours")
    assert reloaded.config.source_layout == "adaflash"
    assert_state_dicts_bitwise_equal(drafter, reloaded)


def test_official_adaflash_checkpoint_loads_its_head_without_warning(tmp_path):
    tensors = random_dflash_tensors(with_official_head=True, bottleneck=32)
    config = zlab_config(
        thresh_head_bottleneck_dim=32, use_thresh_head_two_model=True, thresh_head_direct_len=True
    )
    folder = write_checkpoint(tmp_path / "official", config, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter = AdaFlashDrafter.from_pretrained(folder, dtype=torch.float64).eval()

    assert drafter.config.source_layout == "adaflash_official"
    assert drafter.config.length_head_bottleneck == 32
    noise, context = inputs(dtype=torch.float64)
    out = run(drafter, noise, context)
    expected_hidden = reference_dflash_forward(tensors, noise, context)
    torch.testing.assert_close(out.last_hidden_state, expected_hidden, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        out.acceptance_prob, reference_official_head(tensors, expected_hidden), rtol=0, atol=1e-10
    )


def tiny_muse_glimmer_config(layer_types):
    return MuseGlimmerAssistantConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        layer_types=layer_types,
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        target_layer_ids=TARGET_LAYER_IDS,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def write_muse_glimmer_checkpoint(folder, layer_types):
    torch.manual_seed(0)
    model = MuseGlimmerAssistantModel(tiny_muse_glimmer_config(layer_types)).eval()
    with torch.no_grad():
        for param in model.parameters():  # move the norms off 1.0 so a swapped norm would show
            param.add_(torch.randn_like(param) * 0.1)
    model.config.save_pretrained(folder)
    save_file(model.state_dict(), folder / "model.safetensors", metadata={"format": "pt"})
    return model


def test_muse_glimmer_checkpoint_computes_what_transformers_computes(tmp_path):
    reference = write_muse_glimmer_checkpoint(tmp_path, ["full_attention"] * LAYERS)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "muse_glimmer_assistant"
    assert "encoder.fc.weight" in load_file(tmp_path / "model.safetensors")

    with pytest.warns(UserWarning, match="without a length head"):
        drafter = AdaFlashDrafter.from_pretrained(tmp_path).eval()
    assert drafter.config.source_layout == "muse_glimmer"
    noise, context = inputs()
    expected = run(reference, noise, context).last_hidden_state
    torch.testing.assert_close(run(drafter, noise, context).last_hidden_state, expected, rtol=0, atol=1e-5)


def test_muse_glimmer_checkpoint_with_sliding_layers_is_not_implemented(tmp_path):
    write_muse_glimmer_checkpoint(tmp_path, None)  # Muse-Glimmer's default: every layer sliding
    with pytest.raises(NotImplementedError, match="layer_types: only 'full_attention'.*sliding_attention"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_unknown_config_layout_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN}))
    with pytest.raises(ValueError, match="config.json: expected an AdaFlash .* got model_type='llama'"):
        AdaFlashConfig.from_pretrained(tmp_path)
