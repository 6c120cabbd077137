"""A traced model as repeated blocks: the facts the cluster cost model needs, read once from the graph.

``model_shape(graph)`` groups the operators into the part before the repeated blocks (embeddings,
position tables), one representative block (``layers.0``: the blocks whose operator sequences are equal
are one block costed once) and the part after them (final norm, head, loss). Each operator becomes an
:class:`OpFacts`: its forward FLOPs and the GEMM shape of a linear, the elements it reads and writes,
the elements it leaves saved for backward, and whether tensor parallelism splits it.

Tensor parallelism follows Megatron-LM's rule on the dataflow: a linear whose input is whole is
column-parallel (its output split over ``tp``), one whose input is split is row-parallel (its output a
partial sum, all-reduced); every other operator is split when one of its inputs is. An embedding with
a parameter is vocabulary-parallel (its output all-reduced). Outside the split regions the operators
are whole on every ``tp`` rank unless sequence parallelism splits their sequence dim. This is the plan
:func:`nnscaler.policies.builtin.tp` builds per operator; here it is read as counts, so a 126-layer
model costs as fast as one block.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from ..ir.graph import PARAM, IRGraph, IROp, IRTensor
from ..cost.compute import op_flops

# operators that move no data (views, metadata, dtype asserts): no time, nothing saved
ALIASES = ("view", "_unsafe_view", "reshape", "transpose", "unsqueeze", "squeeze", "expand", "slice", "alias",
           "_assert", "t.", "permute", "contiguous", "to.", "to_copy", "detach", "clone", "select", "split",
           "unbind", "flatten", "lift_fresh", "_to_copy")
_LINEAR = "aten.linear.default"
_SDPA = "aten.scaled_dot_product_attention.default"
_EMBED = "aten.embedding.default"
_BLOCK = re.compile(r"^(.*)\.(\d+)$")
# what an operator keeps for its backward (autograd's saved tensors): its floating activation inputs for products
# and nonlinearities, its output too for those whose derivative reads it; sums, negations, concatenations keep none
_SAVES_INPUTS = ("linear", "mul", "div", "pow", "silu", "gelu", "sigmoid", "tanh", "softmax", "_softmax", "log_softmax",
                 "layer_norm", "native_layer_norm", "rms_norm", "cross_entropy_loss", "dropout", "relu", "matmul", "bmm",
                 "scaled_dot_product_attention", "baddbmm", "addmm")
_SAVES_OUTPUT = ("scaled_dot_product_attention", "rsqrt", "sigmoid", "tanh", "softmax", "_softmax", "exp", "log_softmax")
# products: the gradient of one operand needs the others, so an operand is kept only when another one needs a
# gradient (``q * cos`` of rotary embeddings keeps ``cos``, not ``q``); the rest keep an input needing a gradient
_PRODUCTS = ("linear", "mul", "div", "matmul", "bmm", "baddbmm", "addmm")
# bf16-mixed (torch.autocast): the operators autocast computes in bf16 (a saved input of theirs is its bf16 cast) and
# those it computes in fp32; every other operator computes in the widest dtype of its floating inputs, fp32 parameters
# (master weights) included, and a model's explicit cast (``x.to(torch.float32)``, the trace's only float dtype) is
# fp32. So the residual stream from an fp32 embedding, the norms and rotary products stay fp32 (4 bytes a saved
# element): measured at real width on fake tensors, Llama-3 8B saves 1.41 GiB a block where 2 bytes an element gave
# 1.16 (bench/results/real_memory.md)
_AUTOCAST_LOW = ("linear", "matmul", "bmm", "baddbmm", "addmm", "mm", "scaled_dot_product_attention", "conv")
_AUTOCAST_FP32 = ("pow", "rsqrt", "exp", "log", "softmax", "_softmax", "log_softmax", "layer_norm", "native_layer_norm",
                  "rms_norm", "cross_entropy_loss", "nll_loss", "sum", "prod", "cumsum", "norm", "reciprocal",
                  "softplus", "mse_loss")


@dataclass
class OpFacts:
    """One operator as the cluster cost model sees it (per traced sample; scale by the micro-batch)."""

    name: str
    kind: str  # "linear", "attention", "lookup", "memory" or "free"
    flops: float  # forward FLOPs of the whole operator
    gemm: tuple[int, int, int] = (0, 0, 0)  # a linear's (tokens, in, out)
    column: bool = False  # a column-parallel linear (output split), else row-parallel
    elements: float = 0.0  # elements read and written (memory-bound operators)
    saved: float = 0.0  # elements it keeps for backward that tensor parallelism splits
    saved_whole: float = 0.0  # ... that stay whole on every tp rank (split only by sequence parallelism)
    saved_fp32: float = 0.0  # of ``saved``, the elements bf16-mixed keeps in fp32 (``_AUTOCAST_FP32``)
    saved_whole_fp32: float = 0.0  # of ``saved_whole``, likewise
    saved_gathered: float = 0.0  # bf16-mixed: autocast's copies, whole on every tp rank even under sequence parallelism
    saved_shared: float = 0.0  # of ``saved_whole``, what those copies replace (one fp32 tensor, counted once)
    mask_bias: float = 0.0  # bf16-mixed: torch's attention with a mask keeps a bf16 bias of it per call (not the ring's)
    # of ``saved``, broadcast views wider than their base (grouped-query attention's repeated kv heads): the reshape
    # after the expand copies them while a rank holds several of the base's heads, and is a view of the base's storage
    # once it holds one (``repeat_heads`` <= tp); ``_base``: their bases' elements; ``_cast``: the part bf16-mixed
    # casts afresh from fp32 for a bf16 operator (a cast of a broadcast view is dense: its own elements, copied)
    saved_repeat: float = 0.0
    saved_repeat_base: float = 0.0
    saved_repeat_cast: float = 0.0
    saved_repeat_cast_base: float = 0.0
    repeat_heads: int = 0
    split: bool = False  # split over tp (inside a tensor-parallel region)
    tokens: bool = False  # has the sequence dim (sequence parallelism can split it)
    core: bool = False  # the attention core: what selective recompute recomputes
    # of a core operator, what selective recompute keeps in place of the core's saved tensors (the checkpointed
    # region's boundary, nnscaler/codegen/recompute.py): the storages of the region's inputs made in the section (the
    # checkpoint holds them), and those of its outputs an operator after it saves; each storage once, on the first
    # core operator reading or making it (``_boundary``); split / whole and their fp32 parts as ``saved``
    boundary: float = 0.0
    boundary_whole: float = 0.0
    boundary_fp32: float = 0.0
    boundary_whole_fp32: float = 0.0
    scores: float = 0.0  # an attention's score elements (batch x heads x queries x keys): what a non-flash kernel writes
    params: int = 0  # parameter elements it owns (first reader)
    params_split: bool = False
    tp_collectives: int = 0  # all-reduces of an activation per forward (1 after a row-parallel linear)
    tp_bwd_collectives: int = 0  # all-reduces in backward (1 per distinct input of column-parallel linears)


@dataclass
class Section:
    """A run of operators: before the blocks, one block, or after them."""

    ops: list[OpFacts] = field(default_factory=list)

    def total(self, attr: str) -> float:
        return sum(getattr(o, attr) for o in self.ops)

    def params(self, tp: int) -> float:
        return sum(o.params / (tp if o.params_split else 1) for o in self.ops)


@dataclass
class ModelShape:
    """A traced model as ``pre + layers x block + post`` (see the module docstring)."""

    pre: Section
    block: Section
    layers: int
    post: Section
    batch: int  # sequences in the traced sample
    seq: int  # tokens per sequence
    hidden: int  # width of the activation passed between blocks
    heads: int
    kv_heads: int
    vocab: int
    causal: bool  # attention under a causal mask (flash attention skips half the scores)
    fwd_flops: float  # forward FLOPs of the whole traced sample (attention counted in full)
    params: int
    buffers_bytes: int
    block_names: list[str] = field(default_factory=list)
    block_fwd_flops: float = 0.0  # forward FLOPs of one block (what each block adds to ``fwd_flops``)

    @property
    def block_params(self) -> float:
        return self.block.params(1)

    def describe(self) -> str:
        return (f"{self.layers} x block ({self.block_params / 1e6:.0f} M parameters each) + "
                f"{(self.pre.params(1) + self.post.params(1)) / 1e6:.0f} M outside; hidden {self.hidden}, "
                f"{self.heads} heads / {self.kv_heads} kv heads, vocab {self.vocab}, seq {self.seq}")


def _is_alias(op: IROp) -> bool:
    short = op.overload.removeprefix("aten.")
    return any(short.startswith(a) for a in ALIASES)


def _block_of(op: IROp) -> tuple[str, int] | None:
    for s in op.scope:
        m = _BLOCK.match(s)
        if m:
            return m.group(1), int(m.group(2))
    return None


def _elements(t: IRTensor | None) -> int:
    return math.prod(t.shape) if t is not None else 0


def _kv_heads(k: IRTensor) -> int:
    """Key heads before grouped-query attention repeats them (the fewest heads along k's chain of views)."""
    heads, t = k.shape[1], k
    while t.producer is not None and _is_alias(t.producer):
        ins = [x for x in t.producer.tensor_inputs() if x.kind != PARAM]
        if not ins:
            break
        t = ins[0]
        if len(t.shape) == 4:
            heads = min(heads, t.shape[1])
    return heads


def _needs_grad(graph: IRGraph) -> set[int]:
    """Ids of the tensors autograd tracks: floating parameters and everything computed from one (token
    ids, position tables, masks and buffers are not, so a product with one of them saves less)."""
    out = {id(t) for t in graph.params if t.dtype.is_floating_point}
    for op in graph.ops:
        if any(id(t) in out for t in op.tensor_inputs()):
            out.update(id(o) for o in op.outputs if o is not None and o.dtype.is_floating_point)
    return out


def _signature(ops: list[IROp]) -> tuple:
    return tuple((op.overload, tuple(tuple(o.shape) for o in op.outputs if o is not None)) for op in ops)


def model_shape(graph: IRGraph, batch: int, seq: int) -> ModelShape:
    """Group ``graph`` (traced on ``batch`` sequences of ``seq`` tokens) into repeated blocks and read
    each operator's facts. Raises ``ValueError`` when the model has no repeated blocks."""
    groups: dict[str, dict[int, list[IROp]]] = {}
    for op in graph.ops:
        b = _block_of(op)
        if b is not None:
            groups.setdefault(b[0], {}).setdefault(b[1], []).append(op)
    if not groups:
        raise ValueError("the model has no repeated blocks (no module list such as layers.0, layers.1, ...)")
    prefix = max(groups, key=lambda p: len(groups[p]))
    layers = groups[prefix]
    idx = sorted(layers)
    first = layers[idx[0]]
    sig = _signature(first)
    odd = [i for i in idx if _signature(layers[i]) != sig]
    if odd:
        raise ValueError(f"blocks {prefix}.{odd[0]} and {prefix}.{idx[0]} differ: the cluster planner costs one "
                         f"repeated block (heterogeneous blocks are not supported yet)")
    in_block = {op.name for i in idx for op in layers[i]}
    first_pos = graph.ops.index(first[0])
    last_pos = max(graph.ops.index(layers[idx[-1]][-1]), first_pos)
    pre_ops = [op for op in graph.ops[:first_pos] if op.name not in in_block]
    post_ops = [op for op in graph.ops[last_pos + 1:] if op.name not in in_block]

    split: set[int] = set()  # ids of tensors split over tp
    owned: set[int] = set()
    kept: set[int] = set()  # ids of tensors counted as saved once
    wide: set[int] = {id(t) for t in graph.inputs + graph.params if t.dtype.is_floating_point}  # fp32 under bf16-mixed
    grad = _needs_grad(graph)
    root: dict[int, int] = {}  # a view's id -> the id of the tensor it views
    root_el: dict[int, float] = {}  # a viewed tensor's id -> its elements (a saved view keeps its base's storage)
    saves: dict[str, list] = {}  # an operator's name -> (storage id, tensor, fp32) of each activation it saves
    owner: dict[int, str] = {}  # a saved storage's id -> the operator it is counted on (the first saving it)
    hidden = 0
    heads = kv = 0
    vocab = 0
    causal = False

    def facts(op: IROp, tail: bool) -> OpFacts:
        nonlocal hidden, heads, kv, vocab, causal
        ins = op.tensor_inputs()
        outs = [o for o in op.outputs if o is not None]
        params = [t for t in ins if t.kind == PARAM and id(t) not in owned]
        for t in params:
            owned.add(id(t))
        n_params = sum(_elements(t) for t in params)
        acts = [t for t in ins if t.kind != PARAM]
        in_split = any(id(t) in split for t in acts)
        has_tokens = any(seq in o.shape for o in outs)
        out_el = sum(_elements(o) for o in outs if o.dtype.is_floating_point)
        f = OpFacts(op.name, "free", 0.0, tokens=has_tokens, params=n_params)
        if _is_alias(op):
            for o in outs:  # a view is the tensor it views (saved once)
                root[id(o)] = root.get(id(acts[0]), id(acts[0])) if acts else id(o)
            if acts and id(acts[0]) not in root:
                root_el[id(acts[0])] = float(_elements(acts[0]))
            if in_split:
                split.update(id(o) for o in outs)
            short = op.overload.removeprefix("aten.")
            if short.startswith(("to.", "_to_copy")) or any(id(t) in wide for t in acts):
                wide.update(id(o) for o in outs if o.dtype.is_floating_point)  # a view keeps its dtype; a cast: fp32
            f.split = in_split
            return f
        if op.overload == _LINEAR and params:
            w = params[0]
            x = acts[0] if acts else None
            tokens = _elements(x) // x.shape[-1] if x is not None else 0
            out_f, in_f = w.shape[0], w.shape[-1]
            f.kind, f.flops, f.gemm = "linear", 2.0 * tokens * in_f * out_f, (tokens, in_f, out_f)
            f.column = not in_split
            f.params_split = True
            f.split = f.column
            f.tp_collectives = 0 if f.column else 1
            if f.column:
                split.update(id(o) for o in outs)
            else:
                hidden = hidden or out_f
            if tail and f.column:
                vocab = max(vocab, out_f)
        elif op.overload == _SDPA:
            flops, _ = op_flops(op, None)
            q, k = acts[0], acts[1]
            heads, kv = heads or q.shape[1], kv or _kv_heads(k)
            causal = causal or bool(op.kwargs.get("is_causal")) or len(acts) > 3
            f.kind, f.flops, f.split = "attention", flops, in_split
            f.scores = float(math.prod(q.shape[:-1]) * k.shape[-2])
            if in_split:
                split.update(id(o) for o in outs)
        elif op.overload == _EMBED and params:
            f.kind, f.params_split = "lookup", True
            f.elements = 2.0 * out_el
            f.tp_collectives = 1
            vocab = max(vocab, params[0].shape[0])
            hidden = hidden or params[0].shape[-1]
        else:
            flops, _ = op_flops(op, None) if op.known else (0.0, 0.0)
            f.kind, f.flops = "memory", flops
            f.elements = float(sum(_elements(t) for t in acts if t.dtype.is_floating_point) + out_el)
            f.split = in_split
            if in_split:
                split.update(id(o) for o in outs)
        base = op.overload.removeprefix("aten.").split(".")[0]
        floating = [t for t in acts if t.dtype.is_floating_point]
        low = any(base.startswith(a) for a in _AUTOCAST_LOW)
        if not low and (base in _AUTOCAST_FP32 or base in ("to", "_to_copy")
                        or any(id(t) in wide for t in ins if t.dtype.is_floating_point)):
            wide.update(id(o) for o in outs if o.dtype.is_floating_point)
        if base in _PRODUCTS:
            keep = [t for t in floating if any(id(o) in grad for o in ins if o is not t)]
        else:
            keep = [t for t in floating if id(t) in grad] if base in _SAVES_INPUTS else []
        if op.overload == _SDPA and len(acts) > 3:  # bf16-mixed: the attention mask's bf16 cast, kept for backward
            f.mask_bias += sum(_elements(t) for t in acts[3:] if seq in t.shape)
        if base in _SAVES_OUTPUT and any(id(t) in grad for t in ins):
            keep += [o for o in outs if o.dtype.is_floating_point]
        for t in keep:
            r = root.get(id(t), id(t))
            if low and id(t) in wide and id(t) not in split and seq in t.shape:
                # autocast casts an fp32 activation afresh for each bf16 operator reading it (q, k and v, gate and
                # up: five bf16 copies of a Llama block's normed input), and a column-parallel linear keeps the
                # input it read: under sequence parallelism the all-gathered whole sequence (measured:
                # bench/results/real_memory.md)
                f.saved_gathered += _elements(t)
                if r not in kept:
                    f.saved_shared += _elements(t)
            if seq not in t.shape:
                continue
            # a bf16 operator saves its input's bf16 cast; one autocast runs in fp32 saves its input's fp32 cast
            # (nanoGPT's loss on bf16 logits keeps them in fp32: measured at real width, bench/results/real_memory.md)
            fp32 = not low and (id(t) in wide or base in _AUTOCAST_FP32)
            saves.setdefault(op.name, []).append((r, t, fp32))
            if r in kept:
                continue
            kept.add(r)
            owner[r] = op.name
            # the loss kernel (opzoo/kernels.py ``cross_entropy``, Megatron's vocabulary-parallel form) keeps the
            # exp of the shifted logits as well as the logits: twice their elements (measured, Llama-3 8B's head).
            # A saved slice keeps the whole storage it views (q, k and v split from one fused projection: all three);
            # a view larger than its base (an expand, copied by the reshape after it: repeated kv heads) its own
            n = max(root_el.get(r, 0.0), _elements(t)) * (2 if base == "cross_entropy_loss" else 1)
            if id(t) in split and r != id(t) and _elements(t) > root_el.get(r, 0.0) and len(t.shape) == 4:
                cast = low and id(t) in wide  # bf16-mixed copies it (dense) whatever tp
                f.repeat_heads = f.repeat_heads or _kv_heads(t)
                if cast:
                    f.saved_repeat_cast += n
                    f.saved_repeat_cast_base += root_el.get(r, 0.0)
                else:
                    f.saved_repeat += n
                    f.saved_repeat_base += root_el.get(r, 0.0)
            if id(t) in split:
                f.saved += n
                f.saved_fp32 += n if fp32 else 0
            else:
                f.saved_whole += n
                f.saved_whole_fp32 += n if fp32 else 0
        f.core = f.split and not params and any("Attention" in s for s in op.scope_types)
        return f

    pre = Section([facts(op, False) for op in pre_ops])
    block = Section([facts(op, False) for op in first])
    # the other blocks' parameters are owned by their own copies of this block: skip their facts, count params
    for i in idx[1:]:
        for op in layers[i]:
            for t in op.tensor_inputs():
                if t.kind == PARAM:
                    owned.add(id(t))
    post = Section([facts(op, True) for op in post_ops])

    def _boundary(sec: Section, ops: list[IROp]) -> None:
        """Fill the core operators' ``boundary`` facts: under selective recompute the region (the attention module's
        operators that read no parameter, views included) keeps its inputs, through the checkpoint, at their own
        storages, and an operator after it keeps the outputs it saves; the core's own saved tensors are recomputed
        (measured at real width on fake tensors: bench/results/real_memory.md, round 14)."""
        core = {op.name: f for f, op in zip(sec.ops, ops) if f.core}
        if not core:
            return
        made = {id(o) for op in ops for o in op.outputs if o is not None}  # storages the section makes
        inside: set[int] = set()  # tensors the region makes (the core's outputs and views of them)
        for op in ops:
            if op.name in core or (_is_alias(op) and any(id(t) in inside for t in op.tensor_inputs())):
                inside.update(id(o) for o in op.outputs if o is not None)
        counted: set[int] = set()  # storages selective keeps: a non-core operator's, or the boundary's counted here

        def add(f: OpFacts, r: int, t: IRTensor, n: float, fp32: bool) -> None:
            counted.add(r)
            if id(t) in split:
                f.boundary += n
                f.boundary_fp32 += n if fp32 else 0
            else:
                f.boundary_whole += n
                f.boundary_whole_fp32 += n if fp32 else 0

        for op in ops:  # what a non-core operator saves and is counted on it: kept as it is
            if op.name not in core:
                counted.update(r for r, _, _ in saves.get(op.name, []) if owner.get(r) == op.name)
        for op in ops:
            if op.name in core:  # the region's inputs the section made: the storage each views, as it is
                for t in op.tensor_inputs():
                    r = root.get(id(t), id(t))
                    if (t.kind == PARAM or not t.dtype.is_floating_point or seq not in t.shape or r not in made
                            or r in counted or id(t) in inside):
                        continue
                    add(core[op.name], r, t, root_el[r] if r != id(t) else _elements(t), id(t) in wide)
            else:  # the region's outputs an operator after it saves (counted on the core operator that saved them)
                for r, t, fp32 in saves.get(op.name, []):
                    if r not in counted and owner.get(r) in core:
                        add(core[owner[r]], r, t, max(root_el.get(r, 0.0), _elements(t)), fp32)

    _boundary(block, first)
    # backward all-reduces: one per distinct whole input of column-parallel linears (Megatron's f operator)
    for sec, ops in ((pre, pre_ops), (block, first), (post, post_ops)):
        seen: set[int] = set()
        for f, op in zip(sec.ops, ops):
            if f.kind == "linear" and f.column:
                x = next((t for t in op.tensor_inputs() if t.kind != PARAM), None)
                if x is not None and id(x) not in seen:
                    seen.add(id(x))
                    f.tp_bwd_collectives = 1
    fwd = sum(op_flops(op, None)[0] for op in graph.ops if op.known and not _is_alias(op))
    block_fwd = sum(op_flops(op, None)[0] for op in first if op.known and not _is_alias(op))
    params = sum(_elements(t) for t in graph.params)
    buffers = sum(_elements(t) * t.dtype.itemsize for t in graph.buffers)
    return ModelShape(pre, block, len(idx), post, batch, seq, hidden, heads, kv, vocab, causal, fwd, params, buffers,
                      [f"{prefix}.{i}" for i in idx], block_fwd)


def with_layers(shape: ModelShape, layers: int, block_buffer_bytes: int = 0) -> ModelShape:
    """``shape`` (traced with fewer blocks) as the model with ``layers`` blocks: each block adds its
    parameters, forward FLOPs and ``block_buffer_bytes``; the block itself is unchanged."""
    extra = layers - shape.layers
    prefix = shape.block_names[0].rsplit(".", 1)[0] if shape.block_names else "layers"
    return dataclasses.replace(shape, layers=layers, params=shape.params + extra * round(shape.block.params(1)),
                               fwd_flops=shape.fwd_flops + extra * shape.block_fwd_flops,
                               buffers_bytes=shape.buffers_bytes + extra * block_buffer_bytes,
                               block_names=[f"{prefix}.{i}" for i in range(layers)])
