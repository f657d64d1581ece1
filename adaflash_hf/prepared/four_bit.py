"""4-bit weights for a target that is 4-bit already: the linears of a Q4 GGUF run on its own 4-bit codes.

A target loaded from a Q4_1 GGUF (the offline SmolLM2-135M-Instruct, ``adaflash_hf.assets.load_target``) holds float
weights that are 4-bit codes in disguise: in every group of 32 inputs, each weight is ``m + d * q`` with ``q`` in
0..15. Run in bf16, every decode step reads 2 bytes per weight from memory, and on a small CPU that reading is most of
a linear's time; the codes are half a byte. ``prepare_target(dtype="int4")`` recovers the codes of every linear whose
weights are exactly 4-bit in groups of ``GROUP`` (``four_bit_codes``: each group's 16 levels, from its minimum in steps
of ``(max - min) / 15``, must give back every weight bitwise in fp32; a weight that is not refuses the dtype) and runs
those linears on torch's CPU kernel for 4-bit weights with bf16 activations (``torch.ops.aten._weight_int4pack_mm_for
_cpu``: ``(q - 8) * scale + zero`` per group, scale and zero in bf16). The other linears (the tied output embedding of
a GGUF is 8-bit) and everything else run as the bf16 prepared target does.

So the model is the GGUF's own: the same codes, with each group's step and offset rounded to bf16 where a bf16 target
rounds each weight instead. Every 4-bit linear runs in tiles of one row count (``TILE_ROWS``, smaller than bf16's: the
kernel's cost grows with rows faster than a bf16 GEMM's), so the forward is batch-invariant by the same construction
(``adaflash_hf.prepared.tiles``) and ``prepare_target`` checks it bitwise.

The codes are kept on the module beside its bf16 weight (``ATTRIBUTE``, not in its state dict; a copy of the module
copies them); writing the weight afterwards (a load of other weights) is refused at the next forward, since the codes
would no longer be its weights.
"""

from __future__ import annotations

import torch

GROUP = 32
TILE_ROWS = (4, 8, 16)
ATTRIBUTE = "_adaflash_four_bit"


def four_bit_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(codes [N, K] int32 in 0..15, steps_and_offsets [K / GROUP, N, 2] fp32)`` of a ``[N, K]`` float weight whose
    every group of ``GROUP`` inputs is ``offset + step * code`` bitwise in fp32, else None. ``N`` must be a multiple of
    16 and ``K`` of ``GROUP`` (the kernel's layout); other shapes give None too."""
    out_features, features = weight.shape
    if features % GROUP or out_features % 16 or not weight.is_floating_point():
        return None
    groups = weight.detach().float().reshape(out_features, features // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    codes = torch.round((groups - low) / torch.where(step == 0, 1.0, step)).clamp(0, 15)
    if not torch.equal(low + step * codes, groups):
        return None
    steps_and_offsets = torch.cat([step, low], -1).transpose(0, 1)  # [K / GROUP, N, 2]
    return codes.reshape(out_features, features).to(torch.int32), steps_and_offsets.contiguous()


def kernel_weights(codes: torch.Tensor, steps_and_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's packed codes and its bf16 ``[K / GROUP, N, 2]`` (scale, zero) with ``w = (q - 8) * scale +
    zero``: scale = step, zero = offset + 8 * step."""
    step, offset = steps_and_offsets.unbind(-1)
    scales = torch.stack([step, offset + 8 * step], -1).to(torch.bfloat16).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), scales


def available() -> bool:
    """Whether this torch has the CPU kernel for 4-bit weights."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def attach_codes(target, groups: list[tuple[torch.nn.Linear, ...]]) -> list[str]:
    """Recover and keep the 4-bit codes of every ``nn.Linear`` of ``target`` (fp32 weights) except its output
    embedding, before the cast; returns their names. The projections of one input in ``groups``, which the prepared
    forward runs as one (``adaflash_hf.prepared.linear.projection_groups``), keep one set of codes, concatenated.
    Raises ``ValueError`` naming the first linear whose weights are not 4-bit (nothing kept then)."""
    output = target.get_output_embeddings()
    found = {}
    for name, module in target.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        if module.weight.dtype != torch.float32:
            raise ValueError(
                f"dtype='int4': expected a target in fp32 (the dequantized weights of a 4-bit model, as load_target "
                f"gives a Q4 GGUF), got {name}.weight in {module.weight.dtype}"
            )
        codes = four_bit_codes(module.weight)
        if codes is None:
            raise ValueError(
                f"dtype='int4': expected every linear's weights 4-bit in groups of {GROUP} inputs (a Q4 GGUF's), got "
                f"{name} ({module.out_features}x{module.in_features}) whose weights are not; use bf16 or fp32"
            )
        found[module] = codes
    if not found:
        raise ValueError("dtype='int4': expected linears with 4-bit weights, got a target without any")
    groups = [g for g in groups if all(type(m) is torch.nn.Linear and m in found for m in g)]
    grouped = {m for g in groups for m in g}
    for members in [*groups, *((m,) for m in found if m not in grouped)]:
        codes = torch.cat([found[m][0] for m in members])
        steps_and_offsets = torch.cat([found[m][1] for m in members], dim=1)
        kept = [
            *kernel_weights(codes, steps_and_offsets),
            None,
            members,
        ]  # versions: set after the cast (seal)
        for module in members:
            setattr(module, ATTRIBUTE, kept)
    return [name for name, module in target.named_modules() if module in found]


def seal(target) -> None:
    """Record the 4-bit linears' weight versions (after the cast): a later write of a weight is then detected."""
    for module in target.modules():
        kept = getattr(module, ATTRIBUTE, None)
        if kept is not None:
            kept[2] = [m.weight._version for m in kept[3]]


def kernel_of(module, members: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The packed codes and scales of ``module`` run alone, or of its projection group ``members`` run as one; None
    where it has none. Raises where a weight was written since, or where the codes were kept for other members."""
    kept = module.__dict__.get(ATTRIBUTE)
    if kept is None:
        return None
    if tuple(kept[3]) != (members or (module,)):
        raise RuntimeError(
            "a 4-bit linear runs with other projections than its codes were kept for; prepare a fresh copy"
        )
    if kept[2] is not None and [m.weight._version for m in kept[3]] != kept[2]:
        raise RuntimeError(
            "a 4-bit linear's weight was written after prepare_target(dtype='int4'): its codes are no longer its "
            "weights; prepare a fresh copy of the target"
        )
    return kept[0], kept[1]


def four_bit_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """``x [rows, K]`` (bf16) times the 4-bit weight, plus ``bias``."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, GROUP, scales)
    return out if bias is None else out + bias
