"""Runs in vLLM's own environment (``.venv-vllm``) for tests/test_vllm_plugin.py: one vLLM engine per call, greedy,
fp32, on the exported target and drafter the test prepared, writing what it saw to ``<work>/<phase>.json``.

    python tests/vllm_driver.py plain|plugin|goodput|cached|context|context-eager|draft-logits WORK

``plain``: vLLM without drafting, every prompt in one batch (16 in flight) and the first ``ONE_AT_A_TIME`` alone.
``plugin``/``goodput``: the same through the AdaFlash plugin (the policy from ADAFLASH_VLLM_POLICY, set by the test),
with its statistics; ``plugin`` also reloads mid-traffic (a published version with the drafter's fusion layer
zeroed, so acceptance must fall), serves a batch on it, and then is offered a corrupt version (refused).
``cached``: the plugin (adaptive) with vLLM's prefix caching on, as ``adaflash serve --engine vllm`` runs it: long
prompts sent alone, then again, their prefixes now from the cache (the drafter's context K/V included).
``context``/``context-eager``: the adaptive rule, the drafter left out of all but every ``DRAFT_EVERY``-th step, in
this process (no engine process), every prompt in one batch: the drafter's context from the steps it sits out kept in
the stash (``context``) or written at once (``context-eager``); every drafting step's drafts before truncation, and
the stash's cache slots checked against those vLLM's own DFlash input kernel computes on every drafting step, and
against the target's own slot mapping on every step the drafter sits out.
``draft-logits``: the plugin's projection over the drafter's own vocabulary on a stand-in model (no engine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from adaflash_hf.vllm.launch import speculative_config

ONE_AT_A_TIME = 4
MAX_TOKENS = 40
LONG_PROMPTS, LONG_TOKENS = 2, 300  # prompts past two of the CPU build's 128-token KV blocks
DRAFT_EVERY = 3


def _long_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Held-out prompts joined into ``LONG_PROMPTS`` longer ones (a conversation of several turns)."""
    return [sum(prompts[i::LONG_PROMPTS], [])[:LONG_TOKENS] for i in range(LONG_PROMPTS)]


def _rounds(before: dict, after: dict) -> dict:
    return {key: after[key] - before[key] for key in ("rounds", "accepted")}


def _resent(llm, prompts, params) -> dict:
    """Each long prompt alone, then each again: the second time its prefix comes from vLLM's prefix cache."""
    from vllm import TokensPrompt

    result, start = {}, _stats(llm)
    result["long_first"] = [_outputs(llm, [p], params)[0] for p in prompts]
    middle = _stats(llm)
    outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0] for p in prompts]
    result["long_again"] = [list(o.outputs[0].token_ids) for o in outs]
    result["cached_tokens"] = [o.num_cached_tokens for o in outs]
    result["rounds_first"], result["rounds_again"] = _rounds(start, middle), _rounds(middle, _stats(llm))
    result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    result["lengths"] = [len(p) for p in prompts]
    return result


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


def _draft_logits(work: Path) -> None:
    """``AdaFlashDFlashForCausalLM.draft_logits`` on a stand-in model: a 12-row lm_head whose best row for the hidden
    state (row 1) is outside the draft vocabulary [0, 2, 4, ...], a logit scale of 2 and no soft cap; and on one
    without a draft vocabulary (vLLM's own logits)."""
    from types import SimpleNamespace

    import torch

    from adaflash_hf.vllm.model import AdaFlashDFlashForCausalLM

    torch.manual_seed(0)
    weight = torch.randn(12, 8)
    hidden = torch.stack([10 * weight[1], weight[4]])
    ids = list(range(0, 12, 2))
    model = SimpleNamespace(
        config=SimpleNamespace(draft_token_ids=ids),
        lm_head=SimpleNamespace(weight=weight),
        logits_processor=SimpleNamespace(scale=2.0, soft_cap=None),
        compute_logits=lambda h: 2.0 * h @ weight.T,
    )
    logits, vocabulary = AdaFlashDFlashForCausalLM.draft_logits(model, hidden)
    full = SimpleNamespace(**{**vars(model), "config": SimpleNamespace(draft_token_ids=None)})
    whole, none = AdaFlashDFlashForCausalLM.draft_logits(full, hidden)
    result = {
        "full_argmax": (2.0 * hidden @ weight.T).argmax(-1).tolist(),
        "drafts": vocabulary[logits.argmax(-1)].tolist(),
        "expected": (2.0 * hidden @ weight[ids].T).tolist(),
        "logits": logits.tolist(),
        "ids": vocabulary.tolist(),
        "whole_shape": list(whole.shape),
        "whole_ids": none,
    }
    (work / "draft_logits.json").write_text(json.dumps(result))


def _context_patches(eager: bool) -> dict:
    """The ``context`` phases' instruments: the drafter in every ``DRAFT_EVERY``-th step only, a record of each
    drafting step's drafts, and the stash's slot formula checked against vLLM's DFlash kernel at every drafting step
    and against the target's slot mapping at every step the drafter sits out."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from adaflash_hf.vllm import context, proposer

    seen = {"drafts": [], "slot_checks": 0, "slot_mismatches": 0, "stash_checks": 0, "stash_mismatches": 0}
    seen |= {"stash_writes": 0, "stashed_tokens": 0}
    calls = [0]

    def sit_out_most_steps(self, batch_size):
        calls[0] += 1
        return calls[0] % DRAFT_EVERY != 0

    proposer.Session.skip_drafter = sit_out_most_steps
    if eager:
        proposer.ContextStash = lambda: context.ContextStash(limit_tokens=0)
    first_pass = DFlashProposer.set_inputs_first_pass

    def first_pass_checking_slots(self, *args, **kwargs):
        out = first_pass(self, *args, **kwargs)
        cad = kwargs["cad"]
        count = int(cad.query_start_loc_cpu[cad.batch_size()])
        slots = self.formula_slots(kwargs["target_positions"][:count], cad)
        seen["slot_checks"] += 1
        seen["slot_mismatches"] += int((slots != self._context_slot_mapping_buffer[:count]).sum())
        return out

    DFlashProposer.set_inputs_first_pass = first_pass_checking_slots
    stash = proposer.AdaFlashProposer._stash_context

    def stash_checking_slots(self, states, positions, cad):
        count = int(cad.query_start_loc_cpu[cad.batch_size()])
        slots = self.formula_slots(positions[:count], cad)
        # the target's own slots for the step's tokens: the same blocks, the same size here
        seen["stash_checks"] += 1
        seen["stash_mismatches"] += int((slots != cad.slot_mapping[:count]).sum())
        return stash(self, states, positions, cad)

    proposer.AdaFlashProposer._stash_context = stash_checking_slots
    after = proposer.Session.after_drafting

    def after_drafting_noting_drafts(self, drafts, *args, **kwargs):
        seen["drafts"].append(drafts.tolist())
        return after(self, drafts, *args, **kwargs)

    proposer.Session.after_drafting = after_drafting_noting_drafts
    take = context.ContextStash.take

    def take_counting(self):
        seen["stash_writes"] += bool(self.tokens)
        seen["stashed_tokens"] += self.tokens
        return take(self)

    context.ContextStash.take = take_counting
    return seen


def main(phase: str, work: Path) -> None:
    if phase == "draft-logits":
        return _draft_logits(work)
    seen = None
    if phase.startswith("context"):
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patches must reach the engine
        # lengths from the length head alone, not from timings
        os.environ["ADAFLASH_VLLM_POLICY"] = "adaptive"
        seen = _context_patches(eager=phase == "context-eager")
    from vllm import LLM, SamplingParams

    prompts = json.loads((work / "prompts.json").read_text())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    options = dict(
        model=str(work / "target"), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0
    )
    options |= dict(max_num_seqs=16, enable_prefix_caching=phase == "cached")
    if phase != "plain":
        options |= dict(
            speculative_config=speculative_config(work / "drafter"),
            worker_extension_cls="adaflash_hf.vllm.worker.AdaFlashWorkerExtension",
        )
    llm = LLM(**options)
    if phase == "cached":
        (work / f"{phase}.json").write_text(json.dumps(_resent(llm, _long_prompts(prompts), params)))
        return
    result = {"batch": _outputs(llm, prompts, params)}
    if seen is not None:
        (work / f"{phase}.json").write_text(json.dumps(result | seen | {"stats": _stats(llm)}))
        return
    if phase != "plain":
        result["stats_batch"] = _stats(llm)
    result["alone"] = [_outputs(llm, [p], params)[0] for p in prompts[:ONE_AT_A_TIME]]
    if phase == "plain":
        result["long"] = [_outputs(llm, [p], params)[0] for p in _long_prompts(prompts)]
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
