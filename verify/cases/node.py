"""One operator of a traced model as an operator case (``verify op --model MODEL --node NODE``).

The model (a built-in name, ``NAME@WIDTH`` or ``FILE.py:BUILDER``) is built with the case's seed,
cast to the case's dtype and traced on its step-0 batch, exactly as the localiser
(:mod:`verify.localize.model`) traces it; the node's annotation (registered or derived by a rule) and its
traced lengths and arguments give the sample (:func:`verify.cases.samples.op_sample`, the code that
verifies a plan's pairs), which then runs like any ``verify op`` case.
"""
from __future__ import annotations

import difflib
import warnings

import torch

from nnscaler.ir.graph import IRGraph, IROp
from nnscaler.trace.build import trace

from verify.models.loader import build_model
from verify.cases.batch import cast
from verify.judge.dtypes import to_dtype
from verify.cases.samples import DTYPES, Sample, op_sample


class UnknownNode(ValueError):
    """The model has no annotated operator of that name (bad input: exit 2 on the CLI)."""


def model_graph(model: str, seed: int, dtype: str) -> IRGraph:
    """``model`` built with ``seed``, in ``dtype``, traced on its step-0 batch."""
    dt = DTYPES[dtype]
    case = build_model(model, seed)
    args = cast(case.batch(0), dt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unknown operators: they have no case to run anyway
        return trace(to_dtype(case.model, dt), args)


def node_op(graph: IRGraph, model: str, node: str) -> IROp:
    """The annotated operator ``node`` of ``graph``; :class:`UnknownNode` (closest names) otherwise."""
    ops = {op.name: op for op in graph.ops}
    op = ops.get(node)
    if op is None:
        close = difflib.get_close_matches(node, list(ops), n=4, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else f"; it has {len(ops)} (e.g. {', '.join(list(ops)[:4])})"
        raise UnknownNode(f"model {model!r} has no operator {node!r}{hint}")
    if not op.known:
        raise UnknownNode(f"operator {node} of {model!r} ({op.overload}) has no annotation: every rank runs it whole, "
                          f"there is no partition to verify")
    return op


def node_sample(model: str, node: str, dtype: str, seed: int) -> Sample:
    """The sample of operator ``node`` of ``model``: its traced lengths, arguments and dtypes."""
    op = node_op(model_graph(model, seed, dtype), model, node)
    return op_sample(op, op.bound, seed)[0]
