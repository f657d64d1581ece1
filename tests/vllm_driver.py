"""Runs in vLLM's own environment (``.venv-vllm``) for tests/test_vllm_plugin.py: one vLLM engine per call, greedy,
fp32, on the exported target and drafter the test prepared, writing what it saw to ``<work>/<phase>.json``.

    python tests/vllm_driver.py plain|plugin|goodput WORK

``plain``: vLLM without drafting, every prompt in one batch (16 in flight) and the first ``ONE_AT_A_TIME`` alone.
``plugin``/``goodput``: the same through the AdaFlash plugin (the policy from ADAFLASH_VLLM_POLICY, set by the test),
with its statistics; ``plugin`` also reloads mid-traffic (a published version with the drafter's fusion layer
zeroed, so acceptance must fall), serves a batch on it, and then is offered a corrupt version (refused).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from adaflash_hf.vllm.launch import speculative_config

ONE_AT_A_TIME = 4
MAX_TOKENS = 40


def _outputs(llm, prompts, params) -> list[list[int]]:
    from vllm import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _stats(llm) -> dict:
    return llm.collective_rpc("adaflash_stats")[0]


def _publish(work: Path, version: int, zero_fc: bool, corrupt: bool) -> None:
    """The exported drafter as a published version (the drafter's own state-dict names: the export's tensors)."""
    from safetensors.torch import load_file

    from adaflash_hf.online.weights import publish_weights

    drafter = work / "drafter"
    tensors = load_file(drafter / "model.safetensors") | load_file(
        drafter / "adaflash" / "length_head.safetensors"
    )
    tensors = {k: v.float() for k, v in tensors.items()}
    if zero_fc:
        tensors["fc.weight"] = tensors["fc.weight"] * 0
    publish_weights(work / "weights", tensors, version)
    if corrupt:
        manifest = json.loads((work / "weights" / "latest.json").read_text())
        manifest["sha256"] = "0" * 64
        (work / "weights" / "latest.json").write_text(json.dumps(manifest))


def _mid_traffic_reload(llm, prompts, params, work: Path) -> tuple[list[list[int]], int]:
    """Every prompt in flight; after a few steps a new version is published and polled; all must finish."""
    from vllm import TokensPrompt

    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=prompt), params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            _publish(work, 1, zero_fc=True, corrupt=False)
    version_mid = _stats(llm)["drafter_version"]
    return [done[f"r{i}"] for i in range(len(prompts))], version_mid


def main(phase: str, work: Path) -> None:
    from vllm import LLM, SamplingParams

    prompts = json.loads((work / "prompts.json").read_text())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    options = dict(
        model=str(work / "target"), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0
    )
    options |= dict(max_num_seqs=16, enable_prefix_caching=False)
    if phase != "plain":
        options |= dict(
            speculative_config=speculative_config(work / "drafter"),
            worker_extension_cls="adaflash_hf.vllm.worker.AdaFlashWorkerExtension",
        )
    llm = LLM(**options)
    result = {"batch": _outputs(llm, prompts, params)}
    if phase != "plain":
        result["stats_batch"] = _stats(llm)
    result["alone"] = [_outputs(llm, [p], params)[0] for p in prompts[:ONE_AT_A_TIME]]
    if phase == "plugin":
        result["reload"], result["version_after_reload"] = _mid_traffic_reload(llm, prompts, params, work)
        result["stats_reloaded"] = _stats(llm)
        result["degraded"] = _outputs(llm, prompts, params)
        result["stats_degraded"] = _stats(llm)
        _publish(work, 2, zero_fc=False, corrupt=True)
        result["after_corrupt"] = _outputs(llm, prompts, params)
        result["stats_after_corrupt"] = _stats(llm)
    (work / f"{phase}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
