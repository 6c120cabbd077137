"""Expert parallelism: a mixture-of-experts layer as one annotated operator whose split by expert
runs the all-to-all token dispatch expert parallelism needs.

``nnscaler::moe_experts(hidden, top_k_index, top_k_weights, gate_up, down, act)`` computes what
transformers' experts compute (each token through its ``k`` routed experts, ``act(gate) * up`` then
``down``, weighted and summed over the ``k`` slots). Its annotation ties the tokens and the experts
to one identifier ``g`` (a hidden first factor of both, ``g = gcd(tokens, experts)``)::

    (g r) h^, (g r) k^, (g r) k^, (g f) (2 i+) h^, (g f) h^ i+, ? -> (g r) h^

so one split of ``g`` gives every rank a contiguous chunk of the tokens AND of the experts: under
``dp`` the batch split is the expert split, each rank holds ``1/W`` of the expert weights, and
:func:`expert_parallel` sends each (token, slot) row to the rank owning its expert with
:func:`nnscaler.runtime.collectives.all_to_all_v` (one exchange of counts, one all-to-all of rows
there and one back per layer; the backward mirrors them), so no rank ever holds another's experts.
The dimops grammar gives one mesh axis per identifier; sharing ``g`` is how one axis splits both.
``i`` (the experts' FFN width) splits every expert by columns then rows (the output a partial sum):
what ``tp`` takes, with any expert count.

transformers picks its experts' code by ``config._experts_implementation``; :func:`register_transformers`
adds ``"nnscaler_ep"`` (this op) next to its ``"grouped_mm"`` and ``"batched_mm"``.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from nnscaler.ops import Index, OpCall
from nnscaler.ops.registry import DEFAULT_REGISTRY
from nnscaler.runtime import collectives as C

from ..rulekit import T, build, register_examples, usable

FAMILY = "moe"
OVERLOAD = "nnscaler.moe_experts.default"
IMPLEMENTATION = "nnscaler_ep"
ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(ACTS[act](gate) * up, down)


def run_experts(x: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                act: str) -> torch.Tensor:
    """Row ``j`` of ``x`` through expert ``expert[j]`` (an index into the local ``gate_up``/``down``).
    The result always depends on ``x`` and the weights (by a zero term), so a rank that got no rows
    still joins the backward's all-to-all and gives its experts a (zero) gradient like the others."""
    out = x.new_zeros(x.shape[0], down.shape[1])
    if torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad or down.requires_grad):
        out = out + 0 * (x.sum() + gate_up.sum() + down.sum())
    for e in range(gate_up.shape[0]):
        rows = (expert == e).nonzero().squeeze(1)
        if rows.numel():
            out = out.index_copy(0, rows, _ffn(x.index_select(0, rows), gate_up[e], down[e], act))
    return out


def _combine(y: torch.Tensor, top_k_weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    t, k = top_k_weights.shape
    return (y * top_k_weights.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1).to(hidden.dtype)


def moe_experts_math(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The layer on one device (any float dtype, float64 included)."""
    if act not in ACTS:
        raise ValueError(f"moe_experts: activation {act!r} is not one of {sorted(ACTS)}")
    k = top_k_index.shape[1]
    y = run_experts(hidden.repeat_interleave(k, 0), top_k_index.reshape(-1), gate_up, down, act)
    return _combine(y, top_k_weights, hidden)


@torch.library.custom_op("nnscaler::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One custom op (``torch.export`` keeps it as one node): see :func:`moe_experts_math`."""
    with torch.no_grad():
        return moe_experts_math(hidden, top_k_index, top_k_weights, gate_up, down, act)


@moe_experts.register_fake
def _fake(hidden, top_k_index, top_k_weights, gate_up, down, act):
    return hidden.new_empty(hidden.shape)


def _setup(ctx, inputs, output):
    ctx.inputs = inputs


def _backward(ctx, grad):
    """Recompute the layer under autograd and differentiate it (weights are small next to the
    activations a saved graph would keep)."""
    hidden, idx, w, gate_up, down, act = ctx.inputs
    xs = [t.detach().requires_grad_() for t in (hidden, w, gate_up, down)]
    with torch.enable_grad():
        out = moe_experts_math(xs[0], idx, xs[1], xs[2], xs[3], act)
        g = torch.autograd.grad(out, xs, grad, allow_unused=True)
    return g[0], None, g[1], g[2], g[3], None


moe_experts.register_autograd(_backward, setup_context=_setup)


def expert_parallel(shard, hidden, top_k_index, top_k_weights, gate_up, down, act="silu", *, ident="g"):
    """The layer on this rank's tokens and experts: each (token, slot) row goes to the rank owning its
    expert (:func:`~nnscaler.runtime.collectives.all_to_all_v`), through the expert, and back; the
    routing weights and the sum over slots stay with the token. Unsplit: :func:`moe_experts_math`."""
    group = shard.group(ident)
    if group is None:
        return moe_experts_math(hidden, top_k_index, top_k_weights, gate_up, down, act)
    n, local = shard.factor(ident), gate_up.shape[0]
    k = top_k_index.shape[1]
    expert = top_k_index.reshape(-1)
    owner = torch.div(expert, local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=n)
    recv = C.exchange_counts(send, group)
    send, recv = send.tolist(), recv.tolist()
    rows = C.all_to_all_v(hidden.repeat_interleave(k, 0).index_select(0, order), send, recv, group)
    ids = C.all_to_all_v(expert.index_select(0, order), send, recv, group) - shard.index(ident) * local
    back = C.all_to_all_v(run_experts(rows, ids, gate_up, down, act), recv, send, group)
    y = back.new_zeros(back.shape).index_copy(0, order, back)  # undo the sort by owner
    return _combine(y, top_k_weights, hidden)


# the gate and up halves of ``gate_up``'s rows: splitting ``i`` gives each rank its chunk of both
FFN_UP = "(2 i+)"


def experts_rule(call: OpCall):
    """``(g r) h^, (g r) k^, (g r) k^, (g f) (2 i+) h^, (g f) h^ i+, ? -> (g r) h^`` with ``g`` the
    greatest common divisor of the token and expert counts (see the module); where that is 1 (3
    experts, an even batch), ``t h^, t k^, t k^, e^ (2 i+) h^, e^ h^ i+, ? -> t h^``: tokens alone.
    ``i`` (each expert's FFN width) splits every expert Megatron's way (tensor parallelism inside
    the experts: gate and up by columns, down by rows, the output a partial sum), whatever the
    expert count: the split ``tp`` takes where no ``g`` divides the ranks."""
    if not usable(call):
        return None
    hidden, idx, w, gate_up, down = (call.tensor(p) for p in range(5))
    (t, h), (e, n, h2), (e2, h3, i) = hidden.shape, gate_up.shape, down.shape
    k = idx.shape[1]
    if (h, h, e, t, k) != (h2, h3, e2, idx.shape[0], w.shape[1]) or n != 2 * i or w.shape[0] != t:
        return None
    g = math.gcd(t, e)
    if g == 1:  # no factor of the expert count splits the tokens: split the tokens alone, each rank running
        # every expert on its own (data parallel, the experts whole), rather than no split at all
        return build(call, FAMILY, {0: ["t", "h^"], 1: ["t", "k^"], 2: ["t", "k^"], 3: ["e^", FFN_UP, "h^"],
                                    4: ["e^", "h^", "i+"]}, [["t", "h^"]], sizes=dict(t=t, h=h, k=k, e=e, i=i),
                     fn=moe_experts_math, inputs={1: Index(e)})
    sizes = dict(g=g, r=t // g, f=e // g, h=h, k=k, i=i)
    tokens, experts = "(g r)", "(g f)"
    return build(call, FAMILY, {0: [tokens, "h^"], 1: [tokens, "k^"], 2: [tokens, "k^"], 3: [experts, FFN_UP, "h^"],
                                4: [experts, "h^", "i+"]}, [[tokens, "h^"]], sizes=sizes,
                 fn=moe_experts_math, local=expert_parallel, inputs={1: Index(e)})


DEFAULT_REGISTRY.add_rule(OVERLOAD, experts_rule)
_IDX = torch.int64
register_examples(OVERLOAD, [(T(16, 8), T(16, 2, dtype=_IDX), T(16, 2), T(4, 12, 8), T(4, 8, 6), "silu"),
                             (T(12, 6), T(12, 1, dtype=_IDX), T(12, 1), T(6, 8, 6), T(6, 6, 4), "gelu"),
                             (T(10, 8), T(10, 2, dtype=_IDX), T(10, 2), T(3, 12, 8), T(3, 8, 6), "silu")])


# activation modules by class name (torch's and transformers' ACT2FN) -> the name ACTS knows
_ACT_NAMES = {"SiLU": "silu", "SiLUActivation": "silu", "GELU": "gelu", "GELUActivation": "gelu", "ReLU": "relu"}


def _act_name(module: torch.nn.Module) -> str:
    act = module.act_fn
    name = _ACT_NAMES.get(type(act).__name__)
    if name is not None and getattr(act, "approximate", "none") == "none":
        return name
    raise ValueError(f"experts implementation {IMPLEMENTATION!r}: activation {type(module.act_fn).__name__} is "
                     f"not one of {sorted(ACTS)}; use experts_implementation='grouped_mm' for it")


def transformers_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface: ``(module, hidden, top_k_index, top_k_weights) -> hidden``."""
    if getattr(self, "has_bias", False) or not getattr(self, "has_gate", True) or getattr(self, "is_transposed", False):
        raise ValueError(f"experts implementation {IMPLEMENTATION!r} supports gated experts without bias "
                         f"(gate_up_proj [E, 2I, H], down_proj [E, H, I]), as Mixtral's")
    return moe_experts(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), self.gate_up_proj,
                       self.down_proj, _act_name(self))


def experts_rewrite(module: torch.nn.Module):
    """The tracer's rewrite (:meth:`~nnscaler.ops.registry.OpRegistry.add_module_rewrite`) of
    transformers' experts modules that :func:`transformers_forward` computes exactly (gated, no bias,
    gate and up concatenated, the default gate, an activation :data:`ACTS` has, Mixtral's weight
    layout), whichever implementation the config names: they trace as one ``moe_experts`` operator, so
    plans split them by expert and the tokens with them, never gathering the batch (the library's
    grouped or batched matmuls group rows by expert, which no split of the batch keeps). The model
    itself still runs its own code (the single-device reference)."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3):
        return None
    if not getattr(module, "is_concatenated", False) or getattr(module, "has_bias", True) or \
            not getattr(module, "has_gate", False) or getattr(module, "is_transposed", True) or \
            getattr(module, "has_post_expert_norm", False):
        return None
    from transformers.integrations.moe import _default_apply_gate  # (the module is transformers': it imports)
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        return None
    (e, n, h), (e2, h2, i) = up.shape, down.shape
    if (e, h, n) != (e2, h2, 2 * i):
        return None
    try:
        _act_name(module)
    except (ValueError, AttributeError):
        return None
    return functools.partial(transformers_forward, module)


DEFAULT_REGISTRY.add_module_rewrite(experts_rewrite)


def batched_rewrite(module: torch.nn.Module):
    """The tracer's rewrite of the transformers experts modules :func:`experts_rewrite` leaves alone
    (biases, interleaved or custom gates, post-expert norms, transposed weights) whose config runs them
    grouped (or eagerly): they trace through the library's own ``batched_mm`` implementation, which
    gathers each (token, slot) row's expert weights and computes row by row, so a split of the batch
    splits its rows with no gather; the grouped one sorts every row of the batch by expert (a global
    permutation no batch split keeps), and the eager one loops over the experts the batch hit. The
    library computes the same layer either way (its ``_apply_gate``, biases and norms included); the
    model itself still runs its own code (the single-device reference)."""
    config = getattr(module, "config", None)
    if not hasattr(module, "_is_expert_parallel") or getattr(module, "_is_expert_parallel") or \
            getattr(config, "_experts_implementation", None) not in ("grouped_mm", "eager"):
        return None
    from transformers.integrations.moe import batched_mm_experts_forward  # (the module is transformers')
    return functools.partial(batched_mm_experts_forward, module)


DEFAULT_REGISTRY.add_module_rewrite(batched_rewrite)


def register_transformers() -> None:
    """Make ``experts_implementation="nnscaler_ep"`` available to transformers' MoE models."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(IMPLEMENTATION, transformers_forward)
