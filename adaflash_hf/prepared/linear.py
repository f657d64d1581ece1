"""Batch-invariant linear layer: a linear whose every row's result is the same whatever the number of rows in the
call, because every call of one weight is made at one shape (``adaflash_hf.prepared.tiles``), or at one row where
that shape is checked to agree with it.

``invariant_linear(x, weight, bias, packed)`` flattens ``x [..., K]`` to rows and runs them in tiles of the op
``(op, K, N, bias, dtype, device, weight strides)``, then reshapes back. The op is oneDNN's linear on a prepacked
weight (``packed``) where one is given, else ``F.linear``.

Why prepacked. ``F.linear`` on a CPU reorders the weight into the GEMM's blocked layout at every call (oneDNN, bf16)
or runs MKL's small-GEMM path (fp32); reordered once, the same oneDNN kernel gives bitwise the same result and is
faster at every row count (BENCHMARKS.md, "Batch invariance"). It is what vLLM's CPU build runs. The packed weight
is a second copy of the weight, kept beside the module, never in its state dict; it has no backward, so a call that
wants gradients runs ``F.linear`` (in tiles too).
"""

import functools
import weakref

import torch
import torch.nn.functional as F

from adaflash_hf.prepared.four_bit import ATTRIBUTE, four_bit_linear, kernel_of
from adaflash_hf.prepared.four_bit import TILE_ROWS as FOUR_BIT_TILE_ROWS
from adaflash_hf.prepared.tiles import Tiles, tiles_for

# The large calls a linear may make (multiples of its tile; admitted where they agree, adaflash_hf.prepared.tiles): on
# one Intel Xeon with AMX oneDNN's bf16 linears agree at 2 tiles (0.55-0.67x the time of two) and not at 3 or more.
LINEAR_LARGE = (4, 2)
# module -> (weight stamp, op, tiles); kept beside the module so that neither deepcopy nor the state dict sees the
# packed weight
_ROUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sample(features: int, dtype: torch.dtype, device: torch.device, rows: int, generator: torch.Generator):
    # Magnitudes over 2^-8 .. 2^8: partial sums then span a wide range, so a position summed in another order shows
    # after the output's rounding more often than with unit-scale inputs.
    scale = torch.exp2(torch.randint(-8, 9, (rows, features), generator=generator).float())
    return ((torch.randn(rows, features, generator=generator) * scale).to(device=device, dtype=dtype),)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's prepacked linear serves this weight: a CPU tensor in bf16 or fp32, torch built with oneDNN,
    and a CPU (or ``ONEDNN_MAX_CPU_ISA``) whose kernels oneDNN packs that dtype for (bf16 needs AVX-512 or
    AVX-NE-CONVERT; an AVX2-only host runs bf16 through ``F.linear``)."""
    return weight.device.type == "cpu" and _packs(weight.dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    if dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except (AttributeError, RuntimeError):
        return False
    return True


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, each row computed as it would be among any number of rows; on ``packed``
    (oneDNN's ``_reorder_linear_weight(weight)``) where given."""
    if x.numel() == 0:
        return F.linear(x, weight, bias)
    return _run(*_op_and_tiles(weight, bias, packed), x, weight)


def _run(op, tiles, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as rows through ``tiles`` and back to ``[..., N]``."""
    return tiles.run(op, x.reshape(-1, weight.shape[1])).reshape(*x.shape[:-1], weight.shape[0])


def _op_and_tiles(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    if packed is not None:
        op, kind = functools.partial(_packed_linear, packed=packed, bias=bias), "packed_linear"
    else:
        op, kind = functools.partial(F.linear, weight=weight, bias=bias), "linear"
    features, out_features = weight.shape[1], weight.shape[0]
    key = (kind, features, out_features, bias is not None, weight.dtype, weight.device, weight.stride())
    return op, tiles_for(
        key,
        op,
        functools.partial(_sample, features, weight.dtype, weight.device),
        pads=(0.0,),
        small=1,
        large=LINEAR_LARGE,
    )


@torch.no_grad()
def linear_tiles(features: int, out_features: int, bias: bool, dtype: torch.dtype, device) -> Tiles:
    """The tiles a prepared linear of this shape runs in on this machine (made now, on a random weight, where no
    linear of that shape has run yet): ``.rows == 1`` means no tile size was position-invariant."""
    weight = torch.randn(out_features, features).to(device=device, dtype=dtype)
    zeros = torch.zeros(out_features, dtype=dtype, device=device) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight) if can_pack(weight) else None
    return _op_and_tiles(weight, zeros, packed)[1]


# Projections of one input that a prepared target runs as one linear over their concatenated weights: (attribute
# names on one module). Each keeps its own parameters; the first computes the group, the others take their part.
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
GROUP = "_adaflash_group"  # on each member: (members, index)
_STASH = "_adaflash_stash"  # on a member: (the input the group last ran on, this member's part of the output)


def projection_groups(model) -> list[tuple[torch.nn.Linear, ...]]:
    """Every ``PROJECTION_GROUPS`` group of ``model``'s modules whose members are linears with one input width, one
    dtype and biases on all or none (the projections of one input)."""
    groups = []
    for module in model.modules():
        for names in PROJECTION_GROUPS:
            members = tuple(getattr(module, name, None) for name in names)
            if not all(isinstance(m, torch.nn.Linear) for m in members):
                continue
            if len({(m.in_features, m.weight.dtype, m.bias is None) for m in members}) == 1:
                groups.append(members)
    return groups


def group_projections(model) -> int:
    """Mark ``model``'s projection groups (``projection_groups``) of ``InvariantLinear`` s to run as one; how many."""
    groups = [g for g in projection_groups(model) if all(isinstance(m, InvariantLinear) for m in g)]
    for members in groups:
        for index, member in enumerate(members):
            member.__dict__[GROUP] = (members, index)
    return len(groups)


def _group_weights(members) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.detach() for m in members])
    bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
    return weight, bias


def runs_fast(module: torch.nn.Linear, x: torch.Tensor) -> bool:
    """Whether ``InvariantLinear`` ``module`` runs ``x`` on its kept route (its 4-bit codes for a bf16 input, else its
    prepacked weight where one serves) rather than through ``invariant_linear``: an input in the weight's dtype that
    wants no gradient."""
    if ATTRIBUTE in module.__dict__ and x.dtype == torch.bfloat16:
        return True
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)
    return not wants_grad and x.dtype == module.weight.dtype and x.numel() > 0


class InvariantLinear(torch.nn.Linear):
    """``nn.Linear`` running ``invariant_linear``, on the prepacked weight where it serves (no gradient wanted, input
    in the weight's dtype); a prepared target's linears have this class (same parameters, same state dict).

    A linear of a 4-bit target (``prepare_target(dtype="int4")``) runs on its 4-bit codes whenever its input is bf16.
    Projections of one input (``group_projections``: q/k/v, gate/up) run as one linear over their concatenated
    weights: the first member's call computes all, each other member returns its part of that output when called on
    the same input (and computes the group again, keeping its part, when called on another). A decode step calls
    ~120 linears, so the op and its tiles are looked up once per weight (its storage, in-place version and the thread
    count stamp it), not at every call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not runs_fast(self, x):
            return invariant_linear(x, weight, self.bias)
        group = self.__dict__.get(GROUP)
        if group is not None:
            return self._grouped(x, *group)
        _, op, tiles, _ = linear_route(self)
        return _run(op, tiles, x, weight)

    def _grouped(self, x: torch.Tensor, members, index: int) -> torch.Tensor:
        stash = self.__dict__.pop(_STASH, None)
        if stash is not None and stash[0] is x:
            return stash[1]
        parts = group_output(members, x)
        for member, part in zip(members, parts):
            if member is not self:
                member.__dict__[_STASH] = (x, part)
        return parts[index]

    @staticmethod
    def _route(weight: torch.Tensor, bias: torch.Tensor | None, four_bit):
        """The op and tiles of a linear of ``weight`` and ``bias``: on ``four_bit`` (its 4-bit codes, packed, and
        scales: ``adaflash_hf.prepared.four_bit``) where given, else the prepacked weight where oneDNN packs it, else
        ``F.linear``."""
        if four_bit is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if can_pack(weight) else None
            return _op_and_tiles(weight, bias, packed)
        op = functools.partial(four_bit_linear, codes=four_bit[0], scales=four_bit[1], bias=bias)
        features, out_features = weight.shape[1], weight.shape[0]
        key = ("four_bit_linear", features, out_features, bias is not None, weight.device)
        sample = functools.partial(_sample, features, torch.bfloat16, weight.device)
        return op, tiles_for(
            key, op, sample, pads=(0.0,), candidates=FOUR_BIT_TILE_ROWS, small=1, large=LINEAR_LARGE
        )


def group_output(members: tuple[InvariantLinear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of a projection group (``group_projections``) on ``x``, each a view of ``group_matrix``'s."""
    return group_matrix(members, x).split([m.out_features for m in members], dim=-1)


def group_matrix(members: tuple[InvariantLinear, ...], x: torch.Tensor) -> torch.Tensor:
    """The members' outputs on ``x`` side by side ``[..., sum of out_features]``, computed as one linear over their
    concatenated weights. For inputs its members run on their fast path (``runs_fast``)."""
    _, op, tiles, weight = group_route(members)
    return _run(op, tiles, x, weight)


def linear_route(module: InvariantLinear) -> tuple:
    """``(stamp, op, tiles, weight)`` a lone ``InvariantLinear`` runs on its fast path (``runs_fast``), made again
    where its weight was replaced or written, or the thread count changed, since the last call."""
    weight = module.weight
    stamp = (weight.data_ptr(), weight._version, torch.get_num_threads())
    route = _ROUTES.get(module)
    if route is None or route[0] != stamp:
        route = _ROUTES[module] = (stamp, *module._route(weight, module.bias, kernel_of(module)), weight)
    return route


def group_route(members: tuple[InvariantLinear, ...]) -> tuple:
    """``(stamp, op, tiles, weight)`` a projection group runs on (``linear_route``'s, for the concatenated weights)."""
    leader = members[0]
    stamp = (*((m.weight.data_ptr(), m.weight._version) for m in members), torch.get_num_threads())
    route = _ROUTES.get(leader)
    if route is None or route[0] != stamp:
        weight, bias = _group_weights(members)
        route = _ROUTES[leader] = (stamp, *leader._route(weight, bias, kernel_of(leader, members)), weight)
    return route


def row_tile(model) -> int | None:
    """Rows per call of most of ``model``'s linear calls: the tile of the routes its invariant linears have run on
    (each projection group counted once), the most common one; 0 for a model without invariant linears; None while
    none has run yet (0 too for what is not a torch module)."""
    if not isinstance(model, torch.nn.Module):
        return 0
    linears = [m for m in model.modules() if isinstance(m, InvariantLinear)]
    if not linears:
        return 0
    counts: dict[int, int] = {}
    for module in linears:
        route = _ROUTES.get(module)
        if route is not None:
            counts[route[2].rows] = counts.get(route[2].rows, 0) + 1
    return max(counts, key=counts.get) if counts else None


# id(weight) -> (weakref to the weight, its stamp, oneDNN's prepacked copy): fast_linear's (``kept_for_weight``)
_FAST: dict[int, tuple] = {}


def kept_for_weight(cache: dict, weight: torch.Tensor, stamp: tuple, make):
    """``make()``, kept in ``cache`` for ``weight`` while ``stamp`` stays the same; an entry leaves with its weight
    (keyed by the tensor's id: a tensor's ``==`` is elementwise, so it cannot be a dict key)."""
    kept = cache.get(id(weight))
    if kept is None or kept[0]() is not weight:
        weakref.finalize(weight, cache.pop, id(weight), None)
    elif kept[1] == stamp:
        return kept[2]
    kept = cache[id(weight)] = (weakref.ref(weight), stamp, make())
    return kept[2]


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, at inference on oneDNN's prepacked copy of ``weight`` where it packs one (kept
    while the weight's storage and version stay; ``F.linear`` in bf16 reorders the weight at every call). Not
    batch-invariant: for the drafter, whose drafts only the target's verification judges."""
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if (
        wants_grad
        or x.dtype != weight.dtype
        or x.numel() == 0
        or x.device.type != "cpu"
        or not can_pack(weight)
        or weight.is_inference()  # no version to tell a write in place by
    ):
        return F.linear(x, weight, bias)
    stamp = (weight.data_ptr(), weight._version, weight.dtype)
    packed = kept_for_weight(
        _FAST, weight, stamp, lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    )
    out = _packed_linear(x.reshape(-1, weight.shape[1]), packed, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class FastLinear(torch.nn.Linear):
    """``nn.Linear`` running ``fast_linear`` (same parameters, same state dict): a drafter's linears where it serves
    (``fast_linears``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight, self.bias)


def fast_linears(model: torch.nn.Module) -> int:
    """Give ``model``'s ``nn.Linear`` s the class ``FastLinear`` (idempotent); how many changed. A weight written in
    place (a hot reload) or replaced is packed again at its next call; a call that wants gradients runs ``F.linear``."""
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = FastLinear
            changed += 1
    return changed
