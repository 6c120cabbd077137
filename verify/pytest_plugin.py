"""pytest plugin: equivalence suites in a user's own pytest run (entry point ``pytest11``).

Fixtures:

* ``verify_gang`` (session): one persistent rank gang for the whole run, sized by
  ``--verify-world-size`` (or the ini option ``verify_world_sizes``; default ``2 4``).
* ``verify_op``: ``verify_op(op, *, world_sizes=None, seeds=(0,), dtype="float32", partition=None)``
  verifies a registered operator (its name, or the function given to ``register_op``) under every
  partition it admits: one subtest per (world size, partition, seed).
* ``verify_model``: ``verify_model(model, *, policies=("dp", "tp"), world_sizes=None, seeds=(0,),
  steps=3, dtype="float32", microbatches=1, recipe=None, **recipe_fields)`` trains a model (a registered
  name, ``"file.py:builder"``, or the builder function itself) under each policy: one subtest per
  (world size, policy, seed). The training recipe is ``recipe`` (an :class:`nnscaler.recipe.Recipe`)
  and/or its fields as keywords, as ``verify model`` takes them as flags (``precision="bf16-mixed"``,
  ``zero=1``, ``clip_grad_norm=1.0``, ``recompute="full"``, ``grad_reduce_dtype``, ``bucket_bytes``,
  ``recompute_modules``); a keyword overrides ``recipe``'s field.
  With ``parallelize=fn`` (``"file.py:fn"`` or the function) and ``mesh="tp"`` (or ``"dp"``,
  ``"dp=2,tp=2"``) it verifies your own torch parallelization instead (``verify model
  --parallelize``; :mod:`verify.api`): one subtest per (world size, seed).

A failing subtest carries the tolerance message and the command that reruns the row alone. The
file that defines the operator or builder is imported by the ranks too (the gang restarts once to
take a new file in).
"""
from __future__ import annotations

import inspect
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable, Sequence

import pytest

from nnscaler.recipe import Recipe, RecipeError

from verify.config import RunConfig

from verify.judge.row import Row

from verify.rows.run import run_model, run_op
from verify.runner.gang import Gang
from verify.runner.worker import load_modules



def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nnscaler-verify", "verify parallel programs on real ranks")
    group.addoption("--verify-world-size", type=int, nargs="+", default=None, metavar="N",
                    help="world sizes for verify_op / verify_model (default: ini verify_world_sizes, or 2 4)")
    parser.addini("verify_world_sizes", "world sizes for verify_op / verify_model", type="args", default=["2", "4"])
    parser.addini("verify_modules", "files whose register_op / register_model calls the ranks import "
                  "(relative to the ini file)", type="paths", default=[])


class GangSession:
    """The session's gang and its settings; restarts the gang when a new operator file appears."""

    def __init__(self, world_sizes: Sequence[int], modules: Sequence[str], known: set[str]):
        self.world_sizes = tuple(world_sizes)
        self.modules = [str(Path(m).resolve()) for m in modules]
        self.known = known  # what every rank registers by itself; the rest came from test files
        self.gang = Gang(max(self.world_sizes), self.modules, self.world_sizes)
        self.gang.start()

    def need(self, path: str | None) -> None:
        """Make the ranks import ``path`` (a no-op for files they already have)."""
        if path is None:
            return
        path = str(Path(path).resolve())
        if path not in self.modules:
            self.modules.append(path)  # the parent has it already: pytest imported the test file
            self.gang.modules = list(self.modules)
            self.gang.restart()

    def config(self, world_sizes, **options) -> RunConfig:
        return RunConfig(world_sizes=tuple(world_sizes or self.world_sizes), modules=tuple(self.modules), **options)


_BUILTIN = pytest.StashKey[set]()


def pytest_configure(config: pytest.Config) -> None:
    """Before test files are imported: note what opzoo and the ini modules register (the ranks
    register the same by themselves; anything later comes from a test file the ranks must import)."""
    from nnscaler.ops.registry import DEFAULT_REGISTRY
    load_modules([str(p) for p in config.getini("verify_modules")])
    config.stash[_BUILTIN] = {s.name for s in DEFAULT_REGISTRY}


@pytest.fixture(scope="session")
def verify_gang(pytestconfig: pytest.Config):
    """One rank gang for the session, serving every world size asked for."""
    sizes = pytestconfig.getoption("--verify-world-size") or [int(w) for w in pytestconfig.getini("verify_world_sizes")]
    modules = [str(p) for p in pytestconfig.getini("verify_modules")]
    session = GangSession(sizes, modules, pytestconfig.stash[_BUILTIN])
    try:
        yield session
    finally:
        session.gang.stop()


def _source_file(obj) -> str | None:
    try:
        return inspect.getsourcefile(obj)
    except TypeError:  # a builtin (torch.softmax): nothing for the ranks to import
        return None


def _report(subtests, rows: list[Row], what: str) -> list[Row]:
    if not rows:
        pytest.fail(f"{what}: no case ran")
    for row in rows:
        where = f"W={row.world_size} {row.partition}" if row.world_size else "sampling"
        with subtests.test(msg=f"{where} seed={row.seed}"):
            assert row.ok, (f"{what} {row.case_label} seed {row.seed}: {row.status}: "
                            f"{row.detail}\nrerun: {row.rerun}")
    return rows


@pytest.fixture
def verify_op(verify_gang: GangSession, subtests) -> Callable[..., list[Row]]:
    """``verify_op(name_or_fn, ...)``: every partition of a registered operator, one subtest per row."""
    from nnscaler.ops.registry import DEFAULT_REGISTRY

    def run(op, *, world_sizes: Sequence[int] | None = None, seeds: Sequence[int] = (0,), dtype: str = "float32",
            partition: str | None = None) -> list[Row]:
        if isinstance(op, str):
            spec = DEFAULT_REGISTRY.get(op)
        else:
            node = getattr(op, "_qualname", "").replace("::", ".") + ".default"  # what register_op returned
            spec = next((s for s in DEFAULT_REGISTRY if s.fn is op or node in s.aten), None)
            if spec is None:
                raise LookupError(f"{getattr(op, '__name__', op)!r} is not registered; decorate it with "
                                  f"nnscaler.register_op('<annotation>') first")
        if spec.name not in verify_gang.known:  # registered by a test file: the ranks import that file too
            verify_gang.need(_source_file(spec.fn))
        cfg = verify_gang.config(world_sizes, seeds=tuple(seeds), dtype=dtype, partition=partition)
        return _report(subtests, list(run_op(verify_gang.gang, spec, cfg)), spec.name)

    return run


RECIPE_KEYWORDS = tuple(f.name for f in fields(Recipe) if f.name != "num_microbatches")  # that one: ``microbatches``
"""The recipe fields ``verify_model`` takes as keywords."""


def model_recipe(recipe: Recipe | None, microbatches: int, options: dict, policies: Sequence[str],
                 world_sizes: Sequence[int], dtype: str = "float32") -> Recipe:
    """``recipe`` (default: the defaults) with ``options`` (recipe fields by name) and ``microbatches``
    over it, checked as ``verify model`` checks its flags: an unknown keyword is a ``TypeError``, a
    bad value or a ZeRO stage a policy has no data-parallel ranks for a ``ValueError``."""
    from verify.cases.zero import zero_refusal
    unknown = sorted(set(options) - set(RECIPE_KEYWORDS))
    if unknown:
        raise TypeError(f"verify_model() got an unexpected keyword argument {unknown[0]!r} (recipe fields: "
                        f"{', '.join(RECIPE_KEYWORDS)})")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an nnscaler.recipe.Recipe, got {type(recipe).__name__}")
    flat = dict(options, **({"num_microbatches": microbatches} if microbatches != 1 else {}))
    out = replace(recipe or Recipe(), **flat)
    try:
        out.check()
    except RecipeError as exc:
        raise ValueError(str(exc)) from None
    if out.precision != "32-true" and dtype != "float32":
        raise ValueError(f"precision={out.precision!r} sets the dtypes itself; leave dtype at float32 (got {dtype})")
    for policy in policies:
        reason = zero_refusal(out.zero, policy, world_sizes)
        if reason:
            raise ValueError(reason)
    return out


@pytest.fixture
def verify_model(verify_gang: GangSession, subtests) -> Callable[..., list[Row]]:
    """``verify_model(model, ...)``: train under each policy against one device, one subtest per row."""

    def run(model, *, policies: Sequence[str] = ("dp", "tp"), world_sizes: Sequence[int] | None = None,
            seeds: Sequence[int] = (0,), steps: int = 3, dtype: str = "float32", microbatches: int = 1,
            parallelize=None, mesh: str = "tp", recipe: Recipe | None = None, **recipe_fields) -> list[Row]:
        if parallelize is not None and (recipe is not None or recipe_fields or microbatches != 1):
            raise TypeError("a recipe applies to the compiler's policies, not to parallelize=")
        if parallelize is not None:  # the user's own torch parallelization
            from verify.torch_parallel import verify_parallelization
            from verify.cases.torchpar.mesh import parse_mesh
            fixed = all(n for _, n in parse_mesh(mesh))  # a mesh of fixed sizes sets its world size
            sizes = world_sizes or (None if fixed else list(verify_gang.world_sizes))
            rows = verify_parallelization(model, parallelize, mesh=mesh, world_sizes=sizes, seeds=seeds,
                                          steps=steps, dtype=dtype, gang=verify_gang.gang)
            return _report(subtests, rows, getattr(model, "__name__", model))
        if callable(model):
            path = _source_file(model)
            if path is None:
                raise LookupError(f"cannot find the file that defines {model!r}; pass 'file.py:builder'")
            model = f"{path}:{model.__name__}"  # the ranks import the builder's file themselves
        sizes = tuple(world_sizes or verify_gang.world_sizes)
        cfg = verify_gang.config(sizes, seeds=tuple(seeds), dtype=dtype,
                                 recipe=model_recipe(recipe, microbatches, recipe_fields, policies, sizes, dtype))
        with tempfile.TemporaryDirectory() as tmp:
            rows = list(run_model(verify_gang.gang, model, tuple(policies), cfg, tmp, steps=steps))
        return _report(subtests, rows, model)

    return run

