"""A case's verdict from its ranks' answers: the statuses, the worst check of a kind, and where a
mismatching program first diverged (:class:`Divergence`)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from verify.judge.answer import RankAnswer

MATCH, MISMATCH, ERROR, TIMEOUT, CRASH = "match", "MISMATCH", "error", "timeout", "crash"
WIDENED = "note: widened bound"  # the check that names bounds far over their dtype's rounding (verify/judge/compare.py)
UNVERIFIABLE = "unverifiable"  # a random operator: never a match, never a mismatch


class Unverifiable(Exception):
    """A case whose parallel program cannot equal the single-device one by design (it draws random
    numbers: each rank's shard gets its own); the row is ``unverifiable``, never a mismatch."""


class RaisedAfter(Exception):
    """A case that raised (``cause``) after it had made ``checks`` (a resume that failed after the training
    checks): the row is an ``error`` naming the cause, and keeps those checks, so nothing computed is lost."""

    def __init__(self, checks: list, cause: BaseException, where: str):
        super().__init__(f"{where} raised {type(cause).__name__}: {cause}")
        self.checks, self.cause, self.where = checks, cause, where


def check_deterministic(graph, why: str) -> None:
    """Raise :class:`Unverifiable` naming the operators of ``graph`` that draw random numbers, which
    cannot equal one device's draws because the ranks see the batch in pieces (``why``)."""
    random = [op for op in graph.ops if op.draws_random]
    if random:
        where = "; ".join(f"{op.name} ({op.overload}) at {op.source or '?'}" for op in random[:3])
        more = f" and {len(random) - 3} more" if len(random) > 3 else ""
        raise Unverifiable(f"{len(random)} operators draw random numbers in training ({where}{more}): with "
                           f"{why} each piece draws its own mask, unlike one device drawing the whole batch's; "
                           f"verify this plan without them, or with dropout p=0 or in eval mode")


@dataclass
class Divergence:
    """Where a parallel program first leaves the single-device one: the first tensor beyond its bound
    and what made it (``kind``): an ``operator`` (its inputs match, its output does not; or, backward,
    its output's gradient matches and an input's does not), a ``conversion`` between operators (its
    input matches and its output does not; or its consumers' gradients match and the gradient it
    hands back does not), the ``state`` the ranks hold (a parameter, buffer or input as laid out), or
    the ``accumulation`` of a tensor's gradient over its uses."""

    op: str  # IR name (a conversion: its consumer's), or "output"
    overload: str  # ATen overload, or the registered name
    source: str  # the model's file:line: code
    partition: str  # the op's partition in the plan (``m=2``), or ``replicate``
    direction: str  # "forward" (a value) | "backward" (a gradient)
    err: float
    tol: float
    rerun: str = ""  # python -m verify op ... --partition ... that runs this operator alone (annotated ones)
    where: str = ""  # the program it was found in, when not the case's own (``stage 1 of 2 (ranks 2-3)``)
    kind: str = "operator"  # operator | conversion | state | accumulation
    tensor: str = ""  # the traced tensor whose value or gradient diverged (a module: which of its tensors)
    input_index: int | None = None  # which input of ``op`` (a gradient of an input, a conversion's read)
    layouts: str = ""  # what ``op`` reads (layouts, and the conversions that made them) and writes
    conversion: str = ""  # a conversion: its layouts, consumers and steps
    reason: str = ""  # the check's own words (ranks holding copies that differ, a missing piece)
    what: str = "operator"  # "module" where a torch parallelization is localised by module hooks

    def _what(self) -> str:
        if self.kind == "operator":
            if self.direction == "forward":
                return f"output {self.tensor}"
            return f"gradient of its input {self.input_index} ({self.tensor}; its output's gradient matches)"
        if self.kind == "conversion":
            return "value after it" if self.direction == "forward" else "gradient it hands back"
        if self.kind == "state":
            return "value as held"
        return "sum of the gradients its conversions hand back"

    def describe(self, modules=()) -> str:
        """One line for the report; ``modules`` are the ``--module`` files the op's rerun needs."""
        at = f"[{self.partition}]" + (f" in {self.where}" if self.where else "")
        if self.what == "module":  # verify/cases/torchpar/localize.py: a module of the user's own program
            what = self.tensor or ("output" if self.direction == "forward" else "gradient of its output")
            return (f"first divergent module: {self.op} ({self.overload}) {at}, {what} error {self.err:.3g} > "
                    f"tolerance {self.tol:.3g}" + (f"; {self.layouts}" if self.layouts else ""))
        if self.kind == "operator":
            text = f"first divergent operator: {self.op} ({self.overload}) {at}"
        elif self.kind == "conversion":
            text = (f"first divergent conversion: {self.conversion}; into {self.op} ({self.overload}) {at}")
        elif self.kind == "state":
            text = f"first divergent tensor: {self.tensor} as the ranks hold it, read by {self.op} ({self.overload}) {at}"
        else:
            text = (f"first divergent gradient: {self.tensor}, output of {self.op} ({self.overload}) {at}: each "
                    f"conversion of it hands back a matching gradient but their sum does not")
        text += f", {self._what()} error {self.err:.3g} > tolerance {self.tol:.3g}"
        if self.reason and "tolerance" not in self.reason:
            text += f" ({self.reason})"
        if self.source:
            text += f" at {self.source}"
        if self.layouts and self.kind != "conversion":
            text += f"; {self.layouts}"
        if self.rerun:
            text += f"; alone: {self.alone(modules)}"
        return text

    def alone(self, modules=()) -> str:
        """The command that verifies the culprit operator alone, with the ``--module`` files it needs
        (empty for a conversion: it exists only inside the whole program; the row's rerun reproduces it)."""
        return self.rerun + "".join(f" --module {shlex.quote(m)}" for m in modules) if self.rerun else ""


def localization(answers: list[RankAnswer], modules=()) -> dict | None:
    """What a mismatching model case's ranks found (the first rank that localised): ``divergence``
    (a :class:`Divergence` as a dict), ``text`` (its line in the row's detail), ``alone`` (the command
    verifying the culprit alone, with ``modules``), ``note`` and ``profile`` (``[label, F|B, err, tol]``
    per compared tensor along the program); ``None`` where nothing was localised."""
    for a in answers:
        r = a.result or {}
        if any(k in r for k in ("divergence", "divergence_note", "divergence_profile")):
            d = Divergence(**r["divergence"]) if r.get("divergence") else None
            return {"divergence": r.get("divergence"), "text": d.describe(modules) if d else "",
                    "alone": d.alone(modules) if d else "", "note": r.get("divergence_note", ""),
                    "profile": r.get("divergence_profile", [])}
    return None


def worst(checks: list[dict], kind: str) -> dict | None:
    mine = [c for c in checks if c["name"].startswith(kind)]
    if not mine:
        return None

    def ratio(c):
        if not c["ok"]:
            return float("inf")
        return c["err"] / c["tol"] if c["tol"] > 0 else 0.0

    return max(mine, key=ratio)


def _merged(answers: list[RankAnswer]) -> list[dict]:
    """The checks of ``answers``, one per name in first-seen order: the worst rank's (a failing one first)."""
    merged: dict[str, dict] = {}
    for a in answers:
        for c in a.result.get("checks", []):
            c = dict(c, rank=a.rank)
            old = merged.get(c["name"])
            if old is None or (not c["ok"] and old["ok"]) or (c["ok"] == old["ok"] and c["err"] > old["err"]):
                merged[c["name"]] = c
    return list(merged.values())


def judge(answers: list[RankAnswer], expected: list[str | tuple[str, ...]] | None = None, modules=()
          ) -> tuple[str, str, list[dict], str]:
    """Status, detail, merged checks (worst rank per tensor) and a traceback from per-rank answers.

    A dead rank (crash, memory cap) outranks everything; then a rank's own exception, with its
    traceback, whatever its peers did (a peer stuck in a collective after the error is a consequence);
    a timeout only when no rank raised and the limit truly passed. A rank that returns no checks, or
    (given ``expected``; a tuple there: any one of its names) lacks any expected check, fails the case;
    a matching case's detail is the reasons of its passing ``note: ...`` checks that give one. A mismatching model case names its
    first divergent operator (``modules``: the files that operator's rerun command needs)."""
    for kinds, status in ((("crash", "memory"), CRASH),):
        dead = [a for a in answers if a.failure and a.kind in kinds]
        if dead:
            return status, dead[0].failure, [], ""
    errors = [a for a in answers if a.result and a.result.get("error")]
    if errors:  # every rank's own reason (a failing pipeline stage names each rank that raised)
        a = errors[0]
        same = [b.rank for b in errors[1:] if b.result["error"] == a.result["error"]]
        other = "".join(f"; rank {b.rank}: {b.result['error']}" for b in errors[1:]
                        if b.result["error"] != a.result["error"])
        peers = sorted(b.rank for b in answers if b.failure)
        note = f" (ranks {peers} then gave no answer)" if peers else ""
        also = f"; the same on ranks {same}" if same else ""
        made = _merged([b for b in errors if b.result.get("checks")])  # what the ranks checked before they raised
        passed = f"; before it, {sum(c['ok'] for c in made)} of {len(made)} checks passed" if made else ""
        first = next((c for c in made if not c["ok"]), None)
        failed = f" (first failing: {first['name']} on rank {first['rank']}: {first['reason']})" if first else ""
        return ERROR, f"rank {a.rank}: {a.result['error']}{also}{other}{note}{passed}{failed}", made, \
            a.result.get("traceback", "")
    late = [a for a in answers if a.failure]
    if late:
        more = f" (and ranks {[b.rank for b in late[1:]]})" if len(late) > 1 else ""
        return TIMEOUT, late[0].failure + more, [], ""
    unverifiable = next((a.result["unverifiable"] for a in answers if a.result.get("unverifiable")), None)
    if unverifiable:
        return UNVERIFIABLE, unverifiable, [], ""
    short = ""
    for a in answers:
        names = {c["name"] for c in a.result.get("checks", [])}
        if not names:
            return MISMATCH, f"rank {a.rank} returned no checks", [], ""
        lacking = [n if isinstance(n, str) else n[0] for n in expected or ()  # a tuple: any one of its names
                   if (n not in names if isinstance(n, str) else not names.intersection(n))]
        if lacking and not short:
            short = f"rank {a.rank} returned {len(names)} checks and lacks {len(lacking)}: {', '.join(lacking[:3])}"
    checks = _merged(answers)
    bad = next((c for c in checks if not c["ok"]), None)
    if bad:
        detail = f"{bad['name']} on rank {bad['rank']}: {bad['reason']}"
        where = answers[0].result.get("divergence")
        if where:
            detail += "; " + Divergence(**where).describe(modules)
        elif answers[0].result.get("divergence_note"):
            detail += "; " + answers[0].result["divergence_note"]
        elif answers[0].result.get("divergence_error"):
            detail += f"; no operator localised ({answers[0].result['divergence_error']})"
        return MISMATCH, detail, checks, ""
    if short:
        return MISMATCH, short, checks, ""
    notes = [f"{c['name'][len('note: '):]}: {c['reason']}" for c in checks  # a note with its reason: said in the row
             if c["ok"] and c["name"].startswith("note: ") and c.get("reason")]
    wide = next((c["name"] for c in checks if c["name"].startswith(WIDENED)), "")  # a widened check is never silent
    notes += [wide.removeprefix("note: ")] if wide else []
    return MATCH, "; ".join(notes), checks, ""
