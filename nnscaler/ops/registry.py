"""The one table of partitionable operators: ``opzoo`` and user code fill it, the compiler and the
verification harness both read it."""
from __future__ import annotations

import difflib
import inspect
import warnings
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator, Mapping

from ..dimops.grammar import AnnotationError
from .lint import AnnotationWarning, lint_static
from .rules import Rule, aten_overload
from .spec import OpSpec


class UnknownOpError(KeyError):
    """No operator of that name; the message suggests the closest registered names."""

    def __str__(self) -> str:
        return self.args[0]


class OpRegistry:
    """Operators by name, and by the ATen overloads they stand for.

    ``catalogues``: an entry-point group whose modules register the built-in operators; they are
    imported the first time the registry is read (as DTensor's package loads its op catalogue), so
    no user has to import the catalogue first. The default registry reads ``nnscaler.ops``, under
    which ``opzoo`` is installed. ``infer``: an ATen call no rule or entry annotates is annotated by
    probing it (:func:`nnscaler.trace.leaves.infer_rule`); on in the default registry, off in a new
    one (which then knows only what is added to it)."""

    def __init__(self, catalogues: str | None = None, infer: bool = False) -> None:
        self._ops: dict[str, OpSpec] = {}
        self._rules: dict[str, list[Rule]] = {}
        self._rewrites: list[Callable] = []
        self._catalogues = catalogues  # set to None once they are loaded
        self.infer = infer
        self.inferred: dict[str, Any] = {}  # a probed call's spec (or None) by the call's text: probed once

    def _load(self) -> None:
        if self._catalogues is None:
            return
        group, self._catalogues = self._catalogues, None  # first: the catalogue reads the registry as it loads
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            ep.load()

    def add_rule(self, overload: str, rule: Rule, *, first: bool = False) -> Rule:
        """Register ``rule`` for every call of ``overload`` (e.g. ``"aten.view.default"``); ``first``
        puts it before the rules already there (it is asked first)."""
        aten_overload(overload)  # fail now on a misspelt overload
        self._load()  # the catalogue first: a rule added now comes after (or, ``first``, before) its rules
        rules = self._rules.setdefault(overload, [])
        if rule not in rules:
            rules.insert(0, rule) if first else rules.append(rule)
        return rule

    def remove_rules(self, keep: Callable[[Rule], bool]) -> None:
        """Drop every rule (and module rewrite) for which ``keep(rule)`` is false."""
        for rules in self._rules.values():
            rules[:] = [r for r in rules if keep(r)]
        self._rewrites[:] = [r for r in self._rewrites if keep(r)]

    def add_module_rewrite(self, rewrite: Callable) -> Callable:
        """Register ``rewrite(module) -> forward | None``: while the model is traced, each module it
        answers for runs that forward instead of its own (a library's layer computed as one annotated
        operator, whose rule says how it splits); the model itself is left as it was."""
        self._load()
        if rewrite not in self._rewrites:
            self._rewrites.append(rewrite)
        return rewrite

    def module_rewrites(self) -> list[Callable]:
        self._load()
        return list(self._rewrites)

    def rules(self, overload: str) -> list[Rule]:
        self._load()
        return list(self._rules.get(overload, ()))

    def rule_overloads(self) -> list[str]:
        self._load()
        return sorted(self._rules)

    def add(self, spec: OpSpec) -> OpSpec:
        self._load()  # the catalogue first: a user's operator of the same name is refused, not the catalogue
        old = self._ops.get(spec.name)
        if old is not None and (old.fn is not spec.fn or old.annotation != spec.annotation):
            raise ValueError(f"operator {spec.name!r} is already registered (as {old.annotation!r}); pick another name")
        self._ops[spec.name] = spec
        return spec

    def rederive(self, spec: OpSpec) -> OpSpec:
        """Put ``spec`` in place of the registered operator of its name (an example derived again by
        :func:`opzoo.rulekit.rederive_examples` after its rules changed)."""
        self._load()
        if spec.name not in self._ops:
            raise UnknownOpError(f"unknown operator {spec.name!r}: nothing to derive again")
        self._ops[spec.name] = spec
        return spec

    def get(self, name: str) -> OpSpec:
        self._load()
        try:
            return self._ops[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._ops, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else "; run 'python -m verify list' to see them"
            raise UnknownOpError(f"unknown operator {name!r}{hint}") from None

    def by_aten(self, overload: str) -> list[OpSpec]:
        """Specs standing for an ATen overload such as ``aten.linear.default``."""
        self._load()
        return [s for s in self._ops.values() if overload in s.aten]

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._ops

    def __iter__(self) -> Iterator[OpSpec]:
        self._load()
        return iter(sorted(self._ops.values(), key=lambda s: (s.family, s.name)))

    def __len__(self) -> int:
        self._load()
        return len(self._ops)

    def fingerprint(self) -> tuple:
        """What annotating a traced operator depends on: every operator's name and annotation, and
        which rules stand for each overload, and whether it infers (equal fingerprints annotate every
        graph alike)."""
        self._load()
        return (tuple((n, s.annotation, id(s)) for n, s in sorted(self._ops.items())),
                tuple((o, tuple(id(r) for r in rules)) for o, rules in sorted(self._rules.items())), self.infer)


DEFAULT_REGISTRY = OpRegistry(catalogues="nnscaler.ops", infer=True)
"""Filled by the catalogues installed under the ``nnscaler.ops`` entry point (``opzoo``), loaded on
first use, and by ``register_op`` decorators, as ``torch.library`` is."""


def _position(fn: Callable, key: int | str, nargs: int) -> int:
    if isinstance(key, int):
        return key
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise ValueError(f"cannot name argument {key!r} of {fn!r}; give its position instead") from None
    if key not in params[:nargs]:
        raise ValueError(f"{fn.__name__} has no annotated argument {key!r} (arguments: {', '.join(params[:nargs])})")
    return params.index(key)


def register_op(annotation: str | Callable[..., str], name: str | None = None, *, registry: OpRegistry | None = None,
                args: Mapping[int | str, Any] | None = None, inputs: Mapping[int | str, Any] | None = None,
                **options) -> Callable[[Callable], Callable]:
    """Decorator: register a function of tensors with its dimops annotation.

    ``annotation`` may be a function of the call's arguments returning the text (nnScaler's callable
    annotations; give ``examples=[...]`` calls to verify): see :mod:`nnscaler.ops.callable_anno`.

    A ``torch.library.custom_op`` is looked up by its graph node (``ns.name.default``) without
    further ado. A plain Python function (or a ``torch.autograd.Function`` class) becomes a custom op
    ``nnscaler_user::NAME`` (see :mod:`nnscaler.ops.custom`) so a model calling it keeps it as one
    operator: call what the decorator returns (a ``Function``'s ``apply`` is replaced in place). ``args`` fixes the values of ``?`` arguments and ``inputs`` constrains sample values (both keyed
    by position or argument name); ``kwargs``, ``sizes``, ``tolerance``, ``local``, ``aten``,
    ``family`` and ``differentiable`` are passed to :class:`~nnscaler.ops.spec.OpSpec`.
    """
    target = DEFAULT_REGISTRY if registry is None else registry

    def deco(fn: Callable) -> Callable:
        from ..dimops.grammar import parse
        from .custom import is_autograd_function, is_plain_function, make_custom_op
        if callable(annotation):
            return _register_callable(fn, annotation, name, target, inputs, options)
        anno = parse(annotation)
        n = len(anno.inputs)
        returned, cls = fn, None
        if is_autograd_function(fn):  # its apply becomes one custom op with the Function's own backward
            cls, fn = fn, fn.apply
        positions = {_position(fn, k, n): v for k, v in (args or {}).items()}
        qualname = getattr(fn, "_qualname", None)  # a torch.library.custom_op: "ns::op"
        op_name = name or (qualname if qualname and "::" in qualname else None) or \
            getattr(cls or fn, "__name__", None) or repr(fn)
        if (cls is not None or is_plain_function(fn)) and not options.get("aten") and not options.get("local"):
            op = make_custom_op(fn, anno, positions, op_name)
            options["aten"] = (op._qualname.replace("::", ".") + ".default",)
            if cls is not None:
                cls.apply, cls._nnscaler_custom_op = op, op
            else:
                returned = op
        if qualname and "::" in qualname and not options.get("aten"):
            options["aten"] = (qualname.replace("::", ".") + ".default",)
        spec = OpSpec.create(op_name, annotation, fn, args=positions,
                             inputs={_position(fn, k, n): v for k, v in (inputs or {}).items()}, **options)
        _refuse_empty_dims(spec)
        target.add(spec)
        for finding in lint_static(spec):  # a likely mistake is said now, before any rank runs
            warnings.warn(str(finding), AnnotationWarning, stacklevel=2)
        return returned

    return deco


def _refuse_empty_dims(spec: OpSpec) -> None:
    """A registered operator's annotation with a fixed length 0 (``a 0 -> a 0``): its tensors are
    empty, so no value is compared and no dim split; refused, where a rule's traced call may yield one."""
    for t in spec.anno.inputs + spec.anno.outputs:
        for d in t.dims:
            for i in d.idents:
                if i.is_number and int(i.name) == 0:
                    raise AnnotationError(f"annotation {spec.annotation!r}, column {i.col + 1}: a dimension of "
                                          f"length 0 has nothing to verify; give it a positive length")


def _register_callable(fn: Callable, anno_fn: Callable[..., str], name: str | None, target: OpRegistry,
                       inputs: Mapping[int | str, Any] | None, options: dict) -> Callable:
    """``register_op`` with a callable annotation (kept apart from the string path)."""
    from .callable_anno import register_callable
    examples = options.pop("examples", ())
    qualname = getattr(fn, "_qualname", None)
    aten = options.pop("aten", ())
    overloads = ((aten,) if isinstance(aten, str) else tuple(aten)) or (
        (qualname.replace("::", ".") + ".default",) if qualname and "::" in qualname else ())
    if inputs:
        options["inputs"] = {_position(fn, k, 10 ** 6): v for k, v in inputs.items()}
    register_callable(target, anno_fn, fn, name or getattr(fn, "__name__", None) or repr(fn), examples,
                      overloads, options)
    return fn


def annotation_rule(*overloads: str, registry: OpRegistry | None = None) -> Callable[[Rule], Rule]:
    """Decorator: register a rule deriving the annotation of calls of these ATen overloads."""
    target = DEFAULT_REGISTRY if registry is None else registry

    def deco(rule: Rule) -> Rule:
        for overload in overloads:
            target.add_rule(overload, rule)
        return rule

    return deco
