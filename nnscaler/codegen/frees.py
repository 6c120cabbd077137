"""Freeing the generated program's intermediates: ``del`` of each local of ``forward`` (and of each
recompute region's nested function) right after the statement that last reads or writes it.

Without it every value of the forward stays bound to a Python local until ``forward`` returns, so
the peak holds every activation, saved for backward or not; autograd keeps what backward needs by
itself. A ``del`` changes no number: the name is never read again. Names kept: the state ``p``,
the groups ``g``, ``probe``, ``_``, and any name a nested function reads from ``forward``'s scope
(a closure cell, which a recompute region would read again in backward).
"""
from __future__ import annotations

import ast

KEEP = frozenset({"p", "g", "probe", "_"})


def _stores(stmt: ast.stmt) -> set[str]:
    """Names ``stmt`` binds in its own scope (a nested function's body is not walked)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {stmt.name}
    out: set[str] = set()
    todo: list[ast.AST] = [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _loads(stmt: ast.stmt) -> set[str]:
    """Names ``stmt`` reads anywhere (nested bodies included: a conservative last use)."""
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _cells(code) -> set[str]:
    """Every name a function's nested functions capture from it, for ``code`` and its nested code."""
    out = set(code.co_cellvars)
    for c in code.co_consts:
        if hasattr(c, "co_cellvars"):
            out |= _cells(c)
    return out


def _plan(fn: ast.FunctionDef, keep: set[str], at: dict[int, list[str]]) -> None:
    """Record in ``at`` (line number after which -> names) the frees of ``fn``'s body, recursively."""
    args = {a.arg for a in fn.args.args}
    last: dict[str, int] = {}
    for i, stmt in enumerate(fn.body):
        for name in _loads(stmt) | _stores(stmt):
            last[name] = i
        if isinstance(stmt, ast.FunctionDef):
            _plan(stmt, keep, at)
    local = args.union(*(_stores(s) for s in fn.body))
    for i, stmt in enumerate(fn.body):
        if isinstance(stmt, ast.Return):
            continue
        dead = sorted(n for n in local - keep if last.get(n) == i)
        if dead:
            at.setdefault(stmt.end_lineno, []).extend(dead)


def free_dead(lines: list[str]) -> list[str]:
    """``lines`` (the body of ``forward``, indented four spaces) with a ``del`` of each local after its
    last use (see the module's docstring)."""
    src = "def forward():\n" + "\n".join(lines) + "\n"
    tree = ast.parse(src)
    fn = tree.body[0]
    code = next(c for c in compile(tree, "<forward>", "exec").co_consts if hasattr(c, "co_cellvars"))
    at: dict[int, list[str]] = {}
    _plan(fn, set(KEEP) | _cells(code), at)
    indent = {}  # line number -> the indentation of the statement ending there
    for node in ast.walk(fn):
        if isinstance(node, ast.stmt) and node.end_lineno in at:
            indent.setdefault(node.end_lineno, " " * node.col_offset)
    out: list[str] = []
    for k, line in enumerate(lines, start=2):  # line 1 is the def
        out.append(line)
        if k in at:
            out.append(f"{indent[k]}del {', '.join(at[k])}")
    return out
