"""Activation recompute in the generated program (``ComputeConfig(recompute=...)``): runs of
operators are wrapped into nested functions called through ``torch.utils.checkpoint.checkpoint``
(non-reentrant), so their activations are not kept for backward but recomputed from the region's
inputs when backward reaches them (collectives inside a region run again then, on every rank alike).

Which operators form a region comes from the model module each one ran in (``IROp.scope``, from
``torch.export``'s ``nn_module_stack``):

* ``"full"``: each block: an operator belongs to the outermost module of its scope whose name ends in
  a number (the children of an ``nn.ModuleList`` / ``nn.Sequential``: ``h.0``, ``model.layers.3``), or,
  with ``recompute_modules``, to the outermost module it ran in that is named there (or inside one).
* ``"selective"``: the attention core only (Megatron-LM's selective recompute): the operators of an
  attention module (its class or name says ``attn``/``attention``) that read no parameter (the
  projections stay out), as runs holding a softmax, an attention kernel or a matmul.
* ``"full-except-core"``: each block as ``"full"`` but its attention kernels left out (of each run
  ``"selective"`` recomputes, its first softmax/attention/matmul operator to its last), so the block is
  two regions, before and after them: at long sequences the kernel holds most of a block's FLOPs (and,
  under context parallelism, its exchange) while what it keeps for backward (its inputs and output, which
  are the regions' output and input) is a few activations wide; the linears, norms and MLP are recomputed.

Whatever the mode, the operators of each ``torch.utils.checkpoint`` call the model makes itself
(``IROp.checkpoint``, :mod:`nnscaler.trace.checkpoints`) form a region of their own where the mode puts
them in none (inside a block that ``"full"`` recomputes they are recomputed with it).

A region's inputs are the variables it reads that the program made before it; its outputs those
it makes that the program reads after it. Parameters (``p``) and groups (``g``) are read through
the enclosing function.
"""
from __future__ import annotations

import ast
import re
from typing import Sequence

import warnings

from ..config import PlanError
from ..ir.graph import PARAM, IROp

_BLOCK = re.compile(r"(^|\.)\d+$")
_ATTN = re.compile(r"attn|attention", re.I)
_CORE = re.compile(r"softmax|scaled_dot_product|flash|efficient_attention|matmul|bmm|baddbmm")


EXCEPT_CORE = "full-except-core"
HAND = "torch.utils.checkpoint #"  # the key prefix of a region the model's own checkpoint call made


def region_key(op: IROp, mode: str, modules: Sequence[str] | None = None) -> str | None:
    """The region ``op`` is recomputed in (a module name, or the model's own checkpoint call), or None."""
    key = _mode_key(op, mode, modules)
    if key is None and op.checkpoint is not None:
        return f"{HAND}{op.checkpoint}"
    return key


def _mode_key(op: IROp, mode: str, modules: Sequence[str] | None = None) -> str | None:
    if mode in ("full", EXCEPT_CORE):
        for path in op.scope:
            if modules is not None:
                if any(path == m or path.startswith(m + ".") for m in modules):
                    return next(m for m in modules if path == m or path.startswith(m + "."))
            elif _BLOCK.search(path):
                return path
        return None
    if mode == "selective":
        for path, kind in reversed(list(zip(op.scope, op.scope_types))):
            if _ATTN.search(kind) or _ATTN.search(path.rpartition(".")[2]):
                reads_param = any(t.kind == PARAM for t in op.tensor_inputs())
                return None if reads_param else path
        return None
    return None


def regions(spans: list[tuple[IROp, int, int]], mode: str, modules: Sequence[str] | None = None
            ) -> list[tuple[str, int, int]]:
    """``(key, first line, end line)`` of each run of consecutive operators with one region key."""
    if mode == EXCEPT_CORE:  # kept: each core's attention kernels and what runs between them (not its views)
        kernels = [a for op, a, _ in spans if _CORE.search(op.overload)]
        core = [(min(inside), max(inside)) for k, s, e in regions(spans, "selective") if not k.startswith(HAND)
                for inside in [[a for a in kernels if s <= a < e]]]
        kept = {a for _, a, _ in spans if any(s <= a <= e for s, e in core)}
        keys = [region_key(op, "none") if a in kept else region_key(op, "full", modules) for op, a, _ in spans]
    else:
        keys = [region_key(op, mode, modules) for op, _, _ in spans]
    out: list[tuple[str, int, int]] = []
    for key, (op, start, end) in zip(keys, spans):
        if key is None:
            continue
        if out and out[-1][0] == key and out[-1][2] == start:
            out[-1] = (key, out[-1][1], end)
        else:
            out.append((key, start, end))
    if mode == "selective":
        ops_in = lambda s, e: [op for op, a, b in spans if s <= a and b <= e]  # noqa: E731
        out = [r for r in out if r[0].startswith(HAND) or any(_CORE.search(op.overload) for op in ops_in(r[1], r[2]))]
    return out


def _names(line: str) -> tuple[set[str], set[str]]:
    """(names a line assigns, names it reads)."""
    text = line.strip()
    if not text or text.startswith("#"):
        return set(), set()
    tree = ast.parse(text)
    stores = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return stores, loads


class RecomputeWarning(UserWarning):
    """``recompute`` asked for, but the model has no region of that kind: nothing is recomputed."""


def wrap(lines: list[str], spans: list[tuple[IROp, int, int]], mode: str, params: Sequence[str],
         modules: Sequence[str] | None = None) -> tuple[list[str], int]:
    """``lines`` (the body of ``forward``) with each region a nested function run through
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; also how many regions. Raises
    :class:`~nnscaler.config.PlanError` for a name of ``modules`` no operator ran in; warns
    (:class:`RecomputeWarning`) when the program has no region to recompute."""
    found = regions(spans, mode, modules)
    if modules is not None:
        missing = [m for m in modules if m not in {k for k, _, _ in found}]
        if missing:
            blocks = sorted({p for op, _, _ in spans for p in op.scope if _BLOCK.search(p)})[:4]
            raise PlanError(f"recompute_modules names {missing[0]!r}, which runs no operator of this program"
                            + (f" (blocks here: {', '.join(blocks)})" if blocks else ""))
    if not found and mode == "none":
        return lines, 0
    if not any(not k.startswith(HAND) for k, _, _ in found) and mode != "none":
        what = "no block (no child of an nn.ModuleList or nn.Sequential; name them with recompute_modules=)" \
            if mode in ("full", EXCEPT_CORE) else "no attention core (no module named attn/attention with a softmax or attention op)"
        warnings.warn(f"recompute={mode!r}: the program has {what}; nothing is recomputed"
                      + (" but the model's own torch.utils.checkpoint calls" if found else ""), RecomputeWarning,
                      stacklevel=2)
        if not found:
            return lines, 0
    names = [_names(line) for line in lines]
    made: set[str] = set(params)  # variables of forward known so far
    out: list[str] = []
    pos = 0
    for i, (key, start, end) in enumerate(found):
        for j in range(pos, start):
            out.append(lines[j])
            made |= names[j][0]
        inside_made, reads = set(), []
        for j in range(start, end):
            reads += [n for n in sorted(names[j][1]) if n in made and n not in inside_made and n not in reads]
            inside_made |= names[j][0]
        later = set().union(*(names[j][1] for j in range(end, len(lines)))) if end < len(lines) else set()
        outs = sorted(n for n in inside_made & later if n != "_")
        if not outs:
            out += lines[start:end]
            made |= inside_made
            pos = end
            continue
        fn = f"_recompute_{i}"
        out.append(f"    # recompute ({'the model' if key.startswith(HAND) else mode}): {key}")
        out.append(f"    def {fn}({', '.join(reads)}):")
        out += ["    " + lines[j] for j in range(start, end)]
        out.append(f"        return ({', '.join(outs)},)")
        out.append(f"    ({', '.join(outs)},) = checkpoint({', '.join([fn, *reads])}, use_reentrant=False)")
        made |= inside_made
        pos = end
    for j in range(pos, len(lines)):
        out.append(lines[j])
    return out, len(found)
