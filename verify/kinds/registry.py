"""The case kinds a rank answers: ``@case_kind("model")`` registers a class per kind, and the runner
looks a job's kind up here (:func:`kind_of`) without knowing any kind (pytest's "the runner knows no
kind of test"). The kinds register themselves when :mod:`verify.kinds` is imported."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

KINDS: dict[str, type["CaseKind"]] = {}


class UnknownKind(KeyError):
    """A job whose ``kind`` no module registered."""


def case_kind(name: str) -> Callable[[type["CaseKind"]], type["CaseKind"]]:
    """Register the decorated class as the kind ``name`` (the job's ``"kind"`` value)."""
    def register(cls: type[CaseKind]) -> type[CaseKind]:
        if name in KINDS:
            raise ValueError(f"case kind {name!r} registered twice ({KINDS[name].__qualname__}, {cls.__qualname__})")
        cls.name = name
        KINDS[name] = cls
        return cls
    return register


@dataclass(frozen=True)
class CaseKind:
    """One case of a kind, as it crosses to a rank: the job dict (:meth:`from_dict` / :meth:`to_dict`;
    its keys are the kind's own, the recipe's among them, handed on whole). A kind answers
    :meth:`run` on every rank of the case; one whose checks can fail says where in :meth:`localize`."""

    job: dict
    name: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, job: dict) -> "CaseKind":
        return cls(dict(job))

    def to_dict(self) -> dict:
        return dict(self.job, kind=self.name)

    def run(self, state: Any) -> dict:
        """This rank's answer (``checks``, or what the kind answers instead); ``state``: the rank's
        :class:`verify.runner.worker.RankState`."""
        raise NotImplementedError

    def localize(self, state: Any, first_failure: str) -> Any:
        """Where the programs part ways (a :class:`verify.judge.verdict.Divergence`, a result with
        ``.result()``, a line saying why none was named, or None); every rank of the case calls it."""
        return None

    @property
    def localizes(self) -> bool:
        """Whether a failing check of this kind is localised (the ranks then agree on the first failure)."""
        return type(self).localize is not CaseKind.localize


def kind_of(job: dict) -> CaseKind:
    """The registered kind's case for ``job``."""
    try:
        cls = KINDS[job["kind"]]
    except KeyError:
        raise UnknownKind(f"no case kind {job.get('kind')!r} (registered: {', '.join(sorted(KINDS))})") from None
    return cls.from_dict(job)
