"""Per-request KV state for the engine: a slot pool per layer, the packed target attention, the drafter cache.

Layout. Each running request owns one slot; per layer the pool holds ``keys/values [slots, capacity, kv_heads,
head_dim]`` and a request's K/V at absolute position p lives at ``[slot, p]``. A request's length is engine
state, not pool state: rollback of rejected drafts is just not advancing the length, and the next write
overwrites those positions. Positions at or past a request's length are never attended (masks compare key
positions with query positions), and a slot is zeroed when it is handed to a new request so that stale values
(possibly non-finite, from a broken drafter) cannot leak through ``0 * NaN`` in masked attention.

Target forward. All requests' new tokens (a whole prompt for a prefill, ``[anchor, drafts]`` for a verify) go
through the Hugging Face target as ONE packed row ``[1, T]`` with per-token absolute positions. The target runs
with the ``"ada_ragged"`` attention (registered with ``transformers.AttentionInterface``) and ``use_cache=False``:
the attention function receives the new keys/values of the layer, scatters them into the pool, and attends
each request's queries to that request's own slot (prefix + causal within its new tokens) with
``adaflash_hf.kernels.verify_attention.slot_verify_attention``: on CUDA a Triton kernel that reads each request's
keys from its slot; on CPU the verify requests are one padded SDPA call ([requests, max k̂+1] queries against
[requests, max length] keys) and each prefill is its own call (``kernels/verify_packing.py``). A target prepared with
the batch-invariant forward (``adaflash_hf.prepare_target``) runs ``slot_invariant_attention`` instead: each request
through the attention ``generate`` runs on that target, so its rows are bitwise the same batched, served alone or
decoded by ``generate``.

Drafter. ``DrafterSlotCache`` is the ``Cache`` given to the drafter's batched forward ([requests, block]
queries): it writes each request's new context K/V at its positions and its block K/V right after them (block
rows are scratch: the next round's context overwrites them), and returns the padded per-request keys that the
4-D mask of ``DrafterBatch`` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from adaflash_hf.kernels.verify_attention import slot_verify_attention
from adaflash_hf.kernels.verify_packing import SlotPacking
from adaflash_hf.prepared.attention import slot_invariant_attention
from adaflash_hf.prepared.choice import PREFILL
from adaflash_hf.prepared.prepare import is_prepared

ATTENTION_NAME = "ada_ragged"


def _round_up_pow2(n: int, minimum: int = 64) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


class SlotKVStore:
    """K/V pool ``[slots, capacity, kv_heads, head_dim]`` per layer, allocated lazily and grown by doubling."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slots = 1
        self.capacity = 64

    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for ``slots`` requests of up to ``capacity`` positions (applied at each layer's next write)."""
        self.slots = max(self.slots, _round_up_pow2(slots, 1))
        self.capacity = max(self.capacity, _round_up_pow2(capacity))

    def clear_slot(self, slot: int) -> None:
        for tensor in (*self.keys, *self.values):
            if tensor is not None and slot < tensor.shape[0]:
                tensor[slot].zero_()

    def _layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or keys.shape[0] < self.slots or keys.shape[1] < self.capacity:
            shape = (self.slots, self.capacity, like.shape[-2], like.shape[-1])
            new_keys, new_values = like.new_zeros(shape), like.new_zeros(shape)
            if keys is not None:
                new_keys[: keys.shape[0], : keys.shape[1]] = keys
                new_values[: values.shape[0], : values.shape[1]] = values
            self.keys[layer], self.values[layer] = keys, values = new_keys, new_values
        return keys, values

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slot_index, position_index) -> None:
        """Scatter ``keys/values [M, kv_heads, head_dim]`` to ``(slot_index[m], position_index[m])``."""
        pool_keys, pool_values = self._layer(layer, keys)
        pool_keys[slot_index, position_index] = keys.to(pool_keys.dtype)
        pool_values[slot_index, position_index] = values.to(pool_values.dtype)

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of ``slots`` up to ``length`` positions: ``[len(slots), kv_heads, length, head_dim]``."""
        keys, values = self.keys[layer], self.values[layer]
        return keys[slots, :length].transpose(1, 2), values[slots, :length].transpose(1, 2)


@dataclass
class RaggedBatch:
    """One packed target forward, handed to the attention function as the ``ragged`` kwarg: the target pool and
    the packing geometry (``adaflash_hf.kernels.verify_packing.SlotPacking``).

    Request i contributes ``lengths[i]`` tokens at positions ``starts[i] ..`` of slot ``slots[i]``. Requests with at
    most ``group_width`` new tokens (verifies) share one padded attention call on the torch path; longer ones
    (prefills) get one call each. ``invariant``: attend with ``slot_invariant_attention`` instead (set by
    ``packed_target_forward`` for a prepared target).
    """

    store: SlotKVStore
    packing: SlotPacking
    invariant: bool = False

    @classmethod
    def build(cls, store, slots, starts, lengths, group_width: int, device) -> RaggedBatch:
        return cls(store, SlotPacking.build(slots, starts, lengths, group_width, device))

    @property
    def token_positions(self) -> torch.Tensor:
        return self.packing.token_positions


def ragged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: query/key/value ``[1, heads, T, head_dim]`` of the packed row. Writes the
    layer's new keys/values into the pool, then ``slot_verify_attention`` over it."""
    ragged: RaggedBatch | None = kwargs.get("ragged")
    if ragged is None or query.shape[0] != 1:
        raise ValueError(
            f"{ATTENTION_NAME} attention: expected a packed row (batch 1) and the engine's `ragged` forward kwarg, "
            f"got batch {query.shape[0]} and ragged={ragged!r}"
        )
    layer, packing = module.layer_idx, ragged.packing
    store = ragged.store
    store.write(
        layer, key[0].transpose(0, 1), value[0].transpose(0, 1), packing.token_slots, packing.token_positions
    )
    attention = slot_invariant_attention if ragged.invariant else slot_verify_attention
    out = attention(query[0].transpose(0, 1), store.keys[layer], store.values[layer], packing, scaling)
    return out[None], None


# the compiled layer of a prepared Llama target (adaflash_hf.prepared.native) runs this function's ops itself in an
# invariant packed forward: the mark says it may
ragged_attention_forward.packed_attention = True


def register_ragged_attention() -> str:
    """Register the engine's attention with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTENTION_NAME, ragged_attention_forward)
    return ATTENTION_NAME


def packed_target_forward(target, input_ids: torch.Tensor, batch: RaggedBatch, **kwargs):
    """Run ``target`` on the packed row ``input_ids [1, T]`` with the ragged attention.

    The attention implementation is switched only for this call, so the same target keeps working with
    ``generate`` and any other caller between engine steps. A target prepared with the batch-invariant forward
    gets the invariant attention here too.
    """
    prepared = is_prepared(target)
    if prepared is not None and prepared.invariant:
        batch = replace(batch, invariant=True)
    config = target.config
    original = config._attn_implementation
    config._attn_implementation = register_ragged_attention()
    try:
        return target(
            input_ids, position_ids=batch.token_positions[None], use_cache=False, ragged=batch, **kwargs
        )
    finally:
        config._attn_implementation = original


@dataclass
class DrafterBatch:
    """Geometry of one batched drafter forward over R requests: new context right-padded to ``width`` rows,
    then the block. Request r's context goes to positions ``context_starts[r] ..`` and its block to
    ``block_starts[r] ..`` (= its anchor position)."""

    slots: torch.Tensor  # [R]
    source_index: torch.Tensor  # [M] rows of the flattened [R * (width + block)] new keys that are written
    slot_index: torch.Tensor  # [M]
    position_index: torch.Tensor  # [M]
    key_length: int
    mask: torch.Tensor  # [R, 1, block, key_length] bool
    position_ids: torch.Tensor  # [R, width + block]

    @classmethod
    def build(cls, slots, context_starts, context_lengths, block: int, device) -> DrafterBatch:
        rows = len(slots)
        width = max(context_lengths)
        starts = torch.tensor(context_starts, device=device)
        lengths = torch.tensor(context_lengths, device=device)
        block_starts = starts + lengths
        steps = torch.arange(width + block, device=device)
        is_context = steps[None, :] < width
        positions = torch.where(
            is_context, starts[:, None] + steps[None, :], block_starts[:, None] + steps[None, :] - width
        )
        written = (steps[None, :] < lengths[:, None]) | ~is_context
        slot_t = torch.tensor(slots, device=device)
        key_length = int(block_starts.max()) + block
        keys = torch.arange(key_length, device=device)
        mask = (keys[None, :] < (block_starts + block)[:, None])[:, None, None, :].expand(
            rows, 1, block, key_length
        )
        flat = written.reshape(-1)
        return cls(
            slots=slot_t,
            source_index=torch.arange(flat.numel(), device=device)[flat],
            slot_index=slot_t[:, None].expand(rows, width + block).reshape(-1)[flat],
            position_index=positions.reshape(-1)[flat],
            key_length=key_length,
            mask=mask,
            position_ids=positions,
        )


class DrafterSlotCache(Cache):
    """The drafter's ``Cache`` for one batched forward: writes into the drafter pool, returns padded keys."""

    def __init__(self, store: SlotKVStore, batch: DrafterBatch):
        super().__init__(layers=[])
        self.store = store
        self.batch = batch

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        b = self.batch
        heads, dim = key_states.shape[1], key_states.shape[3]
        new_keys = key_states.transpose(1, 2).reshape(-1, heads, dim)[b.source_index]
        new_values = value_states.transpose(1, 2).reshape(-1, heads, dim)[b.source_index]
        self.store.write(layer_idx, new_keys, new_values, b.slot_index, b.position_index)
        return self.store.read(layer_idx, b.slots, b.key_length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Positions and the mask are always given explicitly; the drafter reads this only for its defaults.
        return 0


@torch.inference_mode()
def packed_forward_timer(
    target, requests: int = 16, sizes=(1, 4, 8), context: int = 64, repeats: int = 2
) -> dict[int, float]:
    """Median seconds of the engine's packed forward of ``requests`` requests with n new tokens each, after a prompt of
    ``context`` tokens per request, for each n of ``sizes``, and under ``PREFILL`` (0) the seconds per prompt token of
    prefilling those prompts in one forward: what ``adaflash serve --dtype auto`` compares its candidates by
    (``adaflash_hf.prepared.choice``)."""
    import statistics
    import time

    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (requests, context + max(sizes)), generator=generator).to(device)
    store = SlotKVStore(target.config.get_text_config().num_hidden_layers)
    store.reserve(requests, context + max(sizes))
    slots = list(range(requests))
    prefills = []
    for _ in range(2):  # the first warms up (tiles, packed weights)
        prompts = RaggedBatch.build(store, slots, [0] * requests, [context] * requests, max(sizes), device)
        start = time.perf_counter()
        packed_target_forward(target, ids[:, :context].reshape(1, -1), prompts, logits_to_keep=1)
        prefills.append((time.perf_counter() - start) / context)
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats + 1):
        for n in sizes:
            batch = RaggedBatch.build(store, slots, [context] * requests, [n] * requests, max(sizes), device)
            start = time.perf_counter()
            packed_target_forward(target, ids[:, context : context + n].reshape(1, -1), batch)
            if repeat:  # the first round warms up (tiles, packed weights)
                seconds[n].append(time.perf_counter() - start)
    return {PREFILL: prefills[-1], **{n: statistics.median(values) for n, values in seconds.items()}}
