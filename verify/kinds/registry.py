"""The case kinds: ``@case_kind("model")`` registers a class per kind, and the runner looks a job's
kind up here (:func:`kind_of`) without knowing any kind (pytest's "the runner knows no kind of test");
the sweep asks a unit's kind (:func:`kind_class`) for its label, its rerun line and its verdict-cache
key. The kinds register themselves when :mod:`verify.kinds` is imported."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
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

    # -- the parent's side: what the sweep (verify/sweep/) asks of a unit of this kind ------------------------
    @classmethod
    def label(cls, unit) -> str:
        """What the progress line and the verdict cache call ``unit`` (a :class:`verify.sweep.selection.Unit`
        of this kind): ``KIND:NAME W=.. seed ..`` unless the kind says otherwise."""
        return f"{cls.name}:{unit.name} W={','.join(map(str, unit.world_sizes))} seed {','.join(map(str, unit.seeds))}"

    @classmethod
    def rerun_command(cls, cfg: Any, *args, **kwargs) -> str:
        """The command that reruns one row of this kind alone (``cfg``: the :class:`verify.config.RunConfig`;
        the row's own settings as the kind takes them), assembled by :meth:`verify.config.RunConfig.command`."""
        raise NotImplementedError(f"case kind {cls.name!r} has no rerun line")

    @classmethod
    def cache_key(cls, unit, root: Path) -> dict:
        """The unit's entries in its verdict-cache key (the run's settings are the cache's own,
        :class:`verify.sweep.cache.VerdictCache`): every field of the unit; a kind adds what else
        changes its rows (a saved plan's file content). ``root``: the checkout the unit's files lie in."""
        return {"unit": asdict(unit)}

    @classmethod
    def units(cls, world_sizes: tuple[int, ...], seeds: tuple[int, ...]) -> list[dict]:
        """The units of this kind ``verify all`` runs beyond its built-in matrix (operators, models, torch
        parallelizations, saved plans), each as the fields of a :class:`verify.sweep.selection.Unit` but
        its kind, every one in the default sample too: none unless the kind says."""
        return []

    @classmethod
    def rows(cls, gang: Any, unit, cfg: Any, gen_dir: str, skip, used: Any):
        """The rows (:class:`verify.judge.row.Row`) of one sweep unit of this kind, its jobs run on ``gang``
        (``gang.run(job, ranks, limit_s)`` -> the ranks' answers), leaving out the rows whose keys are in
        ``skip``; ``used``: a :class:`verify.sweep.cache.Used` to hand the answers to. The built-in kinds'
        rows are driven from ``verify/rows/`` (above the kinds: they ask them for their rerun lines), by
        ``verify/sweep/drive.py``; a kind of the sweep's own answers here."""
        raise NotImplementedError(f"case kind {cls.name!r} has no rows of its own in the sweep")

    @property
    def localizes(self) -> bool:
        """Whether a failing check of this kind is localised (the ranks then agree on the first failure)."""
        return type(self).localize is not CaseKind.localize


def kind_class(name: str) -> type[CaseKind]:
    """The class registered as kind ``name``."""
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownKind(f"no case kind {name!r} (registered: {', '.join(sorted(KINDS))})") from None


def kind_of(job: dict) -> CaseKind:
    """The registered kind's case for ``job``."""
    return kind_class(job.get("kind")).from_dict(job)
