"""vLLM's DFlash draft model with AdaFlash's length head, loaded from the folder ``adaflash export --format dflash``
writes: z-lab's weights for vLLM's own loader, and the head from the export's sidecar (``adaflash_length_head.json``
and ``adaflash/length_head.safetensors``). A folder without a sidecar loads and runs exactly as stock DFlash.

The head reads the block's final states (``[anchor, MASK × (block_size - 1)]`` per request, after the final norm, as
the drafter was trained), which vLLM's DFlash forward returns request-major; ``forward`` keeps a reference to them for
the proposer. ``load_published`` applies a published version of the whole drafter (z-lab weights through vLLM's
loader, which rebuilds its fused context K/V buffers; the mask embedding and the head copied in place).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as load_safetensors
from vllm.logger import init_logger
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
from vllm.transformers_utils.repo_utils import get_hf_file_bytes

from adaflash_hf.modeling.length_head_adaflash import LENGTH_HEAD_CLASS
from adaflash_hf.modeling.sidecar_adaflash import SIDECAR_CONFIG, SIDECAR_WEIGHTS

logger = init_logger("vllm.plugins.adaflash")  # under vLLM's logger, so its handlers print it


def read_sidecar(folder: str, revision: str | None) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """The export's sidecar settings and tensors, or None where the folder has none (a stock DFlash drafter)."""
    raw = get_hf_file_bytes(SIDECAR_CONFIG, folder, revision)
    if raw is None:
        return None
    meta = json.loads(raw)
    data = get_hf_file_bytes(SIDECAR_WEIGHTS, folder, revision)
    if data is None:
        raise ValueError(f"{folder}: {SIDECAR_CONFIG} names a length head, but {SIDECAR_WEIGHTS} is missing")
    return meta, load_safetensors(data)


class AdaFlashDFlashForCausalLM(DFlashQwen3ForCausalLM):
    """See the module docstring."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.block_hidden: torch.Tensor | None = None
        self.length_head = None
        self.sidecar: dict = {}
        found = read_sidecar(self.draft_model_config.model, self.draft_model_config.revision)
        if found is None:
            return
        meta, tensors = found
        module = meta["length_head_module"]
        head = LENGTH_HEAD_CLASS[meta["length_head_variant"]](
            self.config.hidden_size, meta["length_head_bottleneck"]
        )
        prefix_ = module + "."
        head.load_state_dict({k[len(prefix_) :]: v for k, v in tensors.items() if k.startswith(prefix_)})
        self.length_head = head.float().eval()
        self.sidecar = meta
        logger.info(
            "AdaFlash length head loaded (%s, gamma %s, min_len %s)",
            meta["length_head_variant"],
            meta["length_head_gamma"],
            meta["length_head_min_len"],
        )

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the drafter's own vocabulary and the target ids they stand for: the lm_head's rows of the
        export's ``draft_token_ids`` (a top-level key of its config.json, which vLLM's config keeps without reading),
        the reduced vocabulary the drafter was trained to propose over (FR-Spec), at a sixth of the full projection's
        cost for 8,192 ids of 49,152. Without it, the whole vocabulary through vLLM's own logits processor (ids None)."""
        ids = getattr(self.config, "draft_token_ids", None)
        if ids is None:
            return self.compute_logits(hidden), None
        weight = self.lm_head.weight
        cached = getattr(self, "_draft_head", None)
        if cached is None or cached[0] is not weight:
            index = torch.tensor(ids, dtype=torch.long, device=weight.device)
            cached = self._draft_head = (weight, index, weight.index_select(0, index).contiguous())
        logits = torch.nn.functional.linear(hidden.to(weight.dtype), cached[2])
        processor = self.logits_processor
        if getattr(processor, "soft_cap", None) is not None:
            logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
        if getattr(processor, "scale", 1.0) != 1.0:
            logits = logits * processor.scale
        return logits, cached[1]

    @property
    def head_prefix(self) -> str:
        return self.sidecar.get("length_head_module", "") + "."

    def forward(self, input_ids, positions, inputs_embeds=None):  # type: ignore[override]
        hidden = super().forward(input_ids, positions, inputs_embeds)
        self.block_hidden = hidden
        return hidden

    @torch.no_grad()
    def acceptance(self, batch: int, block: int) -> torch.Tensor:
        """â per request from the last forward's block states (``batch`` requests of ``block`` rows each)."""
        hidden = self.block_hidden[: batch * block].view(batch, block, -1)
        head = self.length_head
        if next(head.parameters()).device != hidden.device:
            self.length_head = head = head.to(hidden.device)
        return head(hidden.float()).float().cpu()

    def published_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors a published version must hold, by name and shape (the drafter's own state-dict names)."""
        data = get_hf_file_bytes(
            "model.safetensors", self.draft_model_config.model, self.draft_model_config.revision
        )
        shapes = {name: tuple(t.shape) for name, t in load_safetensors(data).items()} if data else {}
        shapes |= {
            self.head_prefix + name: tuple(t.shape) for name, t in self.length_head.state_dict().items()
        }
        if self.model.has_separate_mask_embedding:
            shapes["mask_embedding"] = tuple(self.model.mask_embedding.shape)
        return shapes

    def load_weights(self, weights):
        """vLLM's loader, then a hold on each linear layer's weight Parameter (its loader attributes included): on
        CPU vLLM packs the weights for oneDNN after loading and leaves the layers an empty Parameter, so a reload puts
        these back, loads into them and packs again."""
        out = super().load_weights(weights)
        if not hasattr(self, "_linear_weights"):  # the first load, before vLLM packs anything
            self._linear_weights = {
                name: (module, module.weight)
                for name, module in self.model.named_modules()
                if hasattr(module, "quant_method") and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
                and module.weight.dim() == 2
            }  # fmt: skip
        return out

    @torch.no_grad()
    def load_published(self, tensors: dict[str, torch.Tensor]) -> None:
        """Apply a validated published version in place (between steps)."""
        prefix = self.head_prefix
        head = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        mask = tensors.get("mask_embedding")
        rest = {k: v for k, v in tensors.items() if not k.startswith(prefix) and k != "mask_embedding"}
        held = getattr(self, "_linear_weights", {})
        for module, weight in held.values():
            module.weight = weight
        self.load_weights(rest.items())  # vLLM's loader: re-reads the folder's mask file, rebuilds fused K/V
        for module, _ in held.values():
            module.quant_method.process_weights_after_loading(module)  # packs again where vLLM packs
        if mask is not None:
            self.model.mask_embedding.copy_(mask.reshape(-1).to(self.model.mask_embedding.dtype))
            self.model.has_separate_mask_embedding = True
        if head:
            self.length_head.load_state_dict({k: v.float() for k, v in head.items()})
