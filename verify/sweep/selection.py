"""What ``verify all`` runs: its units, the whole matrix (``--full``) and the default sample of it.

A :class:`Unit` is the piece the sweep runs, caches, shards and counts progress by: one registered
operator under every partition, world size and seed, or one whole-model case (a model under one
policy at one world size and seed, with its micro-batches, replicas, recipe and whether it resumes
from a checkpoint), or one of torch's own parallelizations.

The default sample keeps every operator row and every model under every policy at least once, and
samples the expensive axes so each code path runs once per sweep (see :func:`default_units`):
world sizes alternate over models and policies, seeded policies take each seed on some models, each
model resumes from its checkpoint under one policy and each (policy, world size) resumes somewhere,
micro-batches, pipelines, replicas and recipes run each of their kinds once. Its order puts the
fastest, most telling units first, so a broken compiler shows within seconds; ``--full`` runs the
default units first, then the rest of the matrix.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from verify.config import RECIPE  # noqa: F401  (verify all's sample recipe, its recipe units')
from verify.cases.pipeline import (PIPELINE_MICROBATCHES, PIPELINE_MODELS, PIPELINE_POLICIES, SWEPT, pipeline_applies,
                                   pipeline_microbatches)
from verify.rows.replicas import ALL_REPLICAS, replica_world_sizes
from verify.names import MICROBATCH_POLICIES, SEEDED_POLICIES, SEQUENCE_POLICIES, TWO_D_RESUME
from verify.kinds import KINDS, kind_class
RECIPE_MODELS = ("nanogpt", "llama")  # the default sample's recipe units (--full: every model)
FIRST = ("weightnorm_mlp", "bucketed_mlp", "padded_gpt")  # the fastest models: their units run first
REPLICA_MODELS = FIRST + ("llama",)  # the default's tp replicas units (bucketed_mlp: many small buckets)
BLOCKED_MODELS = ("nanogpt", "clip_tiny", "gpt2", "gpt2_v96")
"""Models with a fused projection (one weight holding q, k and v) that tp splits in blocks: their
checkpoints take the blocked-piece path (gathered whole on its axis when saved, cut when loaded)."""
SEQUENCE_MODELS = ("llama",)
"""The built-in models the context-parallel policies (:data:`~verify.names.SEQUENCE_POLICIES`) train under: a
causal language model with rotary positions, whose sequence every cp scheme splits (the others have none to split,
or one too short)."""
ZOO = ("vit", "albert", "distilbert", "t5", "bart", "wav2vec2", "hubert", "swin", "resnet", "gpt_bigcode",
       "olmo2", "olmoe")  # --full's zoo:<model_type> units (verify.models.zoo), over the kinds bench/studies/zoo.py sweeps
ZOO_DEFAULT = ("vit",)  # the default's: one cheap non-language model
ROOT = Path(__file__).resolve().parents[2]
PLANS = Path(__file__).resolve().parents[1] / "plans"  # the plans bench/calibration/autodist.py prints (`--save verify/plans`)
DEFAULT_PLANS = ("llama3-70b-64",)  # the default sample's: one cheap plan (dp x ZeRO-3 reduced to W=2)
TWO_D_POLICIES = ("hybrid", "random2d")  # their mesh is 2-D at W=4 (1-D at W=2)
NO_RESUME_STEPS = 2
"""Steps of the default's model units that do not resume: AdamW's first step (no moments yet) and one
with moments, each judged in full; a third takes the same paths as the second. A unit that resumes
keeps the matrix's 3 (its checkpoint carries them), and ``--full`` trains 3 everywhere, so each of
the default's units is the first steps of the matching ``--full`` unit."""


@dataclass(frozen=True)
class Unit:
    """One piece of the sweep. ``kind``: ``op`` (``name`` a registered operator), ``model`` (a model
    case; ``replicas`` above 1 plans on W/replicas ranks), ``torchpar`` (``name`` a built-in case),
    ``plan`` (``name`` a saved cluster plan file, relative to the checkout, run reduced as ``verify plan``)."""

    kind: str
    name: str
    policy: str = ""
    world_sizes: tuple[int, ...] = ()
    seeds: tuple[int, ...] = ()
    microbatches: int = 1
    replicas: int = 1
    checkpoint: bool = True
    recipe: bool = False
    steps: int = 3  # AdamW steps a model unit trains (the matrix's 3; see NO_RESUME_STEPS)

    @property
    def label(self) -> str:
        """What the progress line and the cache call it (``model:nanogpt tp mb4 W=2 seed 1 resume``):
        its registered kind's (``label``, ``verify/kinds/``)."""
        return kind_class(self.kind).label(self)


def _model(name, policy, w, seed, microbatches=1, replicas=1, checkpoint=True, recipe=False) -> Unit:
    return Unit("model", name, policy, (w,), (seed,), microbatches, replicas, checkpoint, recipe)


def full_units(ops: Sequence[str], models: Sequence[str], policies: Sequence[str], world_sizes: Sequence[int],
               seeds: Sequence[int], random_seeds: Sequence[int], microbatches: Sequence[int],
               torch_cases: Sequence, recipes: bool, zoo: Sequence[str] = (),
               plans: Sequence[str | Path] = (), kinds: bool = True) -> list[Unit]:
    """Today's whole matrix, one unit per model case: every model x policy x world size x seed (the
    seeded policies x every random seed), the micro-batch sweep, the pipelines, the replicas, the
    recipes, torch's own parallelizations, the ``zoo`` architectures (:func:`zoo_units`) and the saved
    cluster ``plans`` (:func:`plan_units`, and :func:`wide_plan_units` on gangs of their own), and the units of
    any other registered kind (:func:`kind_units`; not with ``kinds=False``). Pipeline units that cannot run (too few layers, a world size
    they need not met) are left out here, not skipped later."""
    def seeds_of(p):
        return random_seeds if p in SEEDED_POLICIES else seeds

    sequence = [p for p in policies if p in SEQUENCE_POLICIES]  # on the models with a sequence to split
    policies = [p for p in policies if p not in SEQUENCE_POLICIES]
    out = [Unit("op", n, world_sizes=tuple(world_sizes), seeds=tuple(seeds)) for n in ops]
    out += [_model(m, p, w, s) for m in models for p in policies for s in seeds_of(p) for w in world_sizes]
    sequence += [p for p in PIPELINE_POLICIES if p in SEQUENCE_POLICIES] if sequence else []  # and their pipelines
    out += [_model(m, p, w, s, pipeline_microbatches(p, 1)) for m in models if m in SEQUENCE_MODELS
            for p in sequence for s in seeds for w in world_sizes if pipeline_applies(p, w, m, 0)]
    out += [_model(m, p, w, s, k) for k in dict.fromkeys(microbatches) if k > 1 for m in models
            for p in MICROBATCH_POLICIES for s in seeds for w in world_sizes]
    out += [_model(m, p, w, s, PIPELINE_MICROBATCHES) for m in models if m in PIPELINE_MODELS for p in SWEPT
            for s in seeds_of(p) for w in world_sizes if pipeline_applies(p, w, m, 0)]  # layers: any seed
    big = replica_world_sizes(world_sizes)
    out += [_model(m, p, w, s, PIPELINE_MICROBATCHES if p == "pp" else 1, ALL_REPLICAS, checkpoint=False)
            for m in models for p in ("tp", "pp") if p == "tp" or m in PIPELINE_MODELS
            for s in seeds for w in big if pipeline_applies(p, w // ALL_REPLICAS, m, 0)]
    if recipes:
        out += recipe_units(models, seeds, world_sizes)
    out += [Unit("torchpar", c.name, world_sizes=(c.world_size,), seeds=tuple(seeds[:1])) for c in torch_cases]
    return out + zoo_units(zoo, world_sizes, seeds) + plan_units(plans, world_sizes, seeds) \
        + wide_plan_units(plans, world_sizes, seeds) + (kind_units(world_sizes, seeds) if kinds else [])


MATRIX_KINDS = ("op", "model", "torchpar", "plan")
"""The kinds of the built-in matrix; every other registered kind's units are its own (:func:`kind_units`)."""


def kind_units(world_sizes: Sequence[int], seeds: Sequence[int]) -> list[Unit]:
    """The units each registered kind outside the matrix asks for (``units``, ``verify/kinds/registry.py``)."""
    return [Unit(name, **d) for name, cls in KINDS.items() if name not in MATRIX_KINDS
            for d in cls.units(tuple(world_sizes), tuple(seeds))]


def zoo_units(archs: Sequence[str], world_sizes: Sequence[int], seeds: Sequence[int]) -> list[Unit]:
    """``zoo:<model_type>`` of each of ``archs`` under dp and tp at the smallest world size and the first
    seed, training without the checkpoint phase: as ``bench/studies/zoo.py`` runs them."""
    return [_model(f"zoo:{a}", p, min(world_sizes), seeds[0], checkpoint=False) for a in archs for p in ("dp", "tp")]


def default_zoo(full: Sequence[Unit]) -> list[Unit]:
    """The zoo units of ``full`` the default sample keeps: those of :data:`ZOO_DEFAULT`."""
    names = {f"zoo:{a}" for a in ZOO_DEFAULT}
    return [u for u in full if u.kind == "model" and u.name in names]


def saved_plans(directory: Path = PLANS) -> list[Path]:
    """The committed plan files (``bench/calibration/autodist.py --save verify/plans``)."""
    return sorted(directory.glob("*.json"))


def plan_units(plans: Sequence[str | Path], world_sizes: Sequence[int], seeds: Sequence[int]) -> list[Unit]:
    """One unit per saved plan file, at the world size ``verify plan`` reduces it to (2 per parallel axis),
    under the first seed; a plan whose reduced world size is not among ``world_sizes`` is left out (the
    gang has no group for it). ``name``: the file relative to the checkout where it lies inside it."""
    from nnscaler.cluster.plan import load  # noqa: PLC0415 (only a sweep with plans reads them)
    from verify.models.saved_plan import reduce_parallel  # noqa: PLC0415
    out = []
    for p in map(Path, plans):
        w = reduce_parallel(load(p).parallel).world
        if w in world_sizes:
            p = p.resolve()
            name = str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
            out.append(Unit("plan", name, world_sizes=(w,), seeds=tuple(seeds[:1])))
    return out


def wide_plan_units(plans: Sequence[str | Path], world_sizes: Sequence[int], seeds: Sequence[int],
                    most: int | None = None) -> list[Unit]:
    """The saved plans that reduce to more ranks than the sweep's largest world size and at most ``most``
    (default: what this machine runs, :func:`~verify.runner.limits.max_ranks`): a plan with tp, pp and dp
    all above 1 keeps its three axes only at 8 ranks. Each runs on a gang of its own
    (:func:`verify.sweep.drive.run_plan_unit`), so ``--full`` verifies every printed plan."""
    from verify.runner.limits import max_ranks  # noqa: PLC0415
    most = max_ranks() if most is None else most
    bigger = tuple(range(max(world_sizes) + 1, most + 1))
    return plan_units(plans, bigger, seeds) if bigger else []


def default_plans(full: Sequence[Unit], names: Sequence[str] = DEFAULT_PLANS) -> list[Unit]:
    """The default sample's plan units: those of ``full`` whose file is named in ``names`` (cheap ones)."""
    return [u for u in full if u.kind == "plan" and Path(u.name).stem in names]


def recipe_units(models: Sequence[str], seeds: Sequence[int], world_sizes: Sequence[int]) -> list[Unit]:
    """The combined recipe (:data:`RECIPE`) on every model of ``models``: ``dp`` at each world size,
    ``hybrid`` at W >= 4, ``tp`` x 2 replicas at even W >= 4 (zero 3 over the replica axis) and, on the
    pipeline models, ``pp2_dp`` at even W >= 4 (two stages, each data parallel: zero 3 on a pipeline). A model
    that cannot run it fails its row with the reason; the default sample draws only on
    :data:`RECIPE_MODELS` (see :func:`default_units`)."""
    out = []
    for m in models:
        out += [_model(m, "dp", w, s, recipe=True) for s in seeds for w in world_sizes]
        out += [_model(m, "hybrid", w, s, recipe=True) for s in seeds for w in world_sizes if w >= 4]
        out += [_model(m, "tp", w, s, replicas=2, checkpoint=False, recipe=True) for s in seeds
                for w in world_sizes if w >= 4 and w % 2 == 0]
        if m in PIPELINE_MODELS:
            out += [_model(m, "pp2_dp", w, s, PIPELINE_MICROBATCHES, recipe=True) for s in seeds
                    for w in world_sizes if w >= 4 and w % 2 == 0]
    return out


def default_units(full: Sequence[Unit], models: Sequence[str], policies: Sequence[str],
                  world_sizes: Sequence[int], random_seeds: Sequence[int]) -> list[Unit]:
    """The default sample of ``full`` (a subset of its units, fastest and most telling first):

    * every operator unit and every torch-parallelization unit, as in ``full``;
    * each model under each policy once, at a world size that alternates over policies on the fast
      models and is the largest for two policies of each other model (:func:`_world`; so each policy
      runs at every world size on some models), the seeded policies under the seed
      ``random_seeds[i % n]`` for the i-th model (each seed draws plans on some models);
    * a checkpoint resume in the first case of each model and of each (policy, world size); the
      rest train without the reload and resume phase; the resumes into a 2-D plan (dp and tp at
      W=4, :data:`~verify.names.TWO_D_RESUME`) include one on a model of :data:`BLOCKED_MODELS`
      each, so a piece split in blocks is loaded on a 2 x 2 mesh;
    * the micro-batch sweep: each model once, under dp or tp by turns (the fast models at each world
      size, the others at the smallest);
    * each pipeline schedule once, on the pipeline models by turns, and each world size where it runs;
    * each context-parallel policy once on :data:`SEQUENCE_MODELS` (as the policies above; its pipelines at
      the world sizes they run at);
    * replicas: tp replicas on :data:`REPLICA_MODELS`, the pp replicas on one pipeline model;
    * each recipe unit kind (dp at each world size, hybrid, tp replicas) once, :data:`RECIPE_MODELS` by
      turns (``full`` has them on every model);
    * the zoo units of :data:`ZOO_DEFAULT` (:func:`default_zoo`);
    * the saved cluster plans of :data:`DEFAULT_PLANS` (:func:`default_plans`);
    * every unit of a kind outside the matrix (:func:`kind_units`).
    """
    W = list(world_sizes)
    sequence = [p for p in policies if p in SEQUENCE_POLICIES]
    policies = [p for p in policies if p not in SEQUENCE_POLICIES]
    models = sorted(models, key=lambda m: (m not in FIRST, FIRST.index(m) if m in FIRST else 0))
    ok = {_same(u) for u in full}
    pick: list[Unit] = []

    def take(u: Unit | None) -> bool:
        if u is not None and _same(u) in ok and _same(u) not in {_same(v) for v in pick}:
            pick.append(u)
            return True
        return False

    chosen: list[Unit] = []
    for i, m in enumerate(models):
        for j, p in enumerate(policies):
            w = _world(i, j, m, policies, W)
            seed = random_seeds[i % len(random_seeds)] if p in SEEDED_POLICIES else None
            cands = [u for u in full if u.kind == "model" and u.name == m and u.policy == p and u.microbatches == 1
                     and u.replicas == 1 and not u.recipe and (seed is None or u.seeds == (seed,))]
            cands.sort(key=lambda u: (u.world_sizes != (w,), u.seeds))
            if cands:
                resume = p == _resume_policy(i, m, policies, W)  # each model resumes under one policy, by turns
                chosen.append(_variant(cands[0], resume))
    for j, p in enumerate(sequence):  # a mesh of two axes at the largest W, the others alternating
        w = max(W) if ("tp" in p or "hybrid" in p) else W[j % len(W)]
        cands = [u for u in full if u.kind == "model" and u.policy == p and u.microbatches == 1]
        cands.sort(key=lambda u: (u.world_sizes != (w,), u.seeds))
        if cands:
            chosen.append(_variant(cands[0], j % 2 == 0))
    resumed = {(u.policy, u.world_sizes) for u in chosen if u.checkpoint}
    for k, u in enumerate(chosen):  # and each (policy, world size) resumes somewhere
        if (u.policy, u.world_sizes) not in resumed:
            chosen[k] = _variant(u, True)
            resumed.add((u.policy, u.world_sizes))
    if 4 in W:  # a blocked piece loaded on a 2 x 2 mesh: the 2-D resumes on a fused-projection model
        for p in (p for p in TWO_D_RESUME if p in policies):
            if any(u.policy == p and u.world_sizes == (4,) and u.checkpoint and u.name in BLOCKED_MODELS
                   for u in chosen):
                continue
            m = next((m for m in models if m in BLOCKED_MODELS), None)
            at = next((k for k, u in enumerate(chosen)  # a unit of the sample there already resumes
                       if u.name in BLOCKED_MODELS and u.policy == p and u.world_sizes == (4,)), None)
            if at is not None:
                chosen[at] = _variant(chosen[at], True)
            elif m is not None:
                seed = min(u.seeds[0] for u in full if u.kind == "model" and u.name == m)
                chosen.append(_model(m, p, 4, seed))
    for u in chosen:
        take(u)
    for i, m in enumerate(models):  # the fast models at each world size, the others at the cheaper W
        p = MICROBATCH_POLICIES[i % len(MICROBATCH_POLICIES)]
        w = W[(i // len(MICROBATCH_POLICIES)) % len(W)] if m in FIRST else min(W)
        cands = [u for u in full if u.kind == "model" and u.name == m and u.policy == p and u.microbatches > 1
                 and u.replicas == 1 and not u.recipe]
        cands.sort(key=lambda u: (u.world_sizes != (w,), u.seeds))
        if cands:
            take(_variant(cands[0], False))
    pipes = [m for m in PIPELINE_MODELS if m in models]
    for k, p in enumerate(SWEPT):
        seen: set = set()
        for shift in range(len(pipes)):
            m = pipes[(k + shift) % len(pipes)] if pipes else None
            for u in full:
                if u.kind == "model" and u.name == m and u.policy == p and u.replicas == 1 \
                        and u.world_sizes not in seen and (p not in SEEDED_POLICIES or u.seeds[0] == random_seeds[k % len(random_seeds)]):
                    take(_variant(u, not seen))  # one resume per schedule
                    seen.add(u.world_sizes)
    for u in full:  # the context-parallel pipelines (their micro-batches are the pipeline's), each resuming once
        if u.kind == "model" and u.policy in SEQUENCE_POLICIES and u.microbatches > 1:
            take(_variant(u, not any(v.policy == u.policy for v in pick)))
    reps = [u for u in full if u.kind == "model" and u.replicas > 1 and not u.recipe]
    for m in REPLICA_MODELS:  # replica sync is the models' own code path: the fast ones, and one HF model
        take(next((u for u in reps if u.name == m and u.policy == "tp"), None))
    take(next((u for u in reps if u.policy == "pp"), None))
    recipe = [u for u in full if u.recipe and u.name in RECIPE_MODELS]  # cheap: --full runs every model's
    kinds: dict = {}
    for u in recipe:
        kinds.setdefault((u.policy, u.replicas, u.world_sizes), []).append(u)
    for k, (_, us) in enumerate(sorted(kinds.items())):
        take(us[k % len(us)])
    pick += [u for u in full if u.kind in ("op", "torchpar") or u.kind not in MATRIX_KINDS] + default_zoo(full)
    pick += default_plans(full)
    return sorted(pick, key=_order)


def _world(i: int, j: int, model: str, policies: Sequence[str], W: Sequence[int]) -> int:
    """The world size of the ``i``-th model's unit under the ``j``-th policy. The fast models
    (:data:`FIRST`) alternate world sizes over policies; every other model runs at the smallest but
    for two units at the largest: one of the 2-D policies (:data:`TWO_D_POLICIES`, whose mesh is 2-D
    only there) and one of the others, each by turns over the models. On this machine a rank of W=4
    gets half a core, so a case there costs about three at W=2; each policy still runs at each world
    size on several models."""
    if model in FIRST or len(W) == 1:
        return W[(i + j) % len(W)]
    two_d = [p for p in policies if p in TWO_D_POLICIES]
    one_d = [p for p in policies if p not in TWO_D_POLICIES]
    wide = {two_d[i % len(two_d)] if two_d else None, one_d[i % len(one_d)] if one_d else None}
    return max(W) if policies[j] in wide else min(W)


def _resume_policy(i: int, model: str, policies: Sequence[str], W: Sequence[int]) -> str:
    """The policy the ``i``-th model resumes from its checkpoint under, by turns over the policies:
    any on the fast models, on the others one of those it runs at the smallest world size (a resume
    compiles and trains twice more; the fast models resume at the largest too)."""
    if model in FIRST:
        return policies[i % len(policies)]
    small = [p for j, p in enumerate(policies) if _world(i, j, model, policies, W) == min(W)] or list(policies)
    return small[i % len(small)]


def _variant(u: Unit, checkpoint: bool) -> Unit:
    """``u`` resuming from its checkpoint or not; the default's no-resume units train
    :data:`NO_RESUME_STEPS` steps."""
    return Unit(**{**u.__dict__, "checkpoint": checkpoint,
                   "steps": Unit.steps if checkpoint else NO_RESUME_STEPS})


def _order(u: Unit) -> tuple:
    """Fastest, most telling first: the small models' cases, then the operators, then the rest."""
    if u.kind == "model" and u.name in FIRST:
        return (0, FIRST.index(u.name))
    return (1 if u.kind == "op" else 2, 0)


def full_order(full: Sequence[Unit], default: Sequence[Unit]) -> list[Unit]:
    """``--full``'s order: the default sample first, each unit as the matrix has it (with its
    checkpoint resume and all its steps: the same training, continued, and more checks), so a mutant
    the default kills dies as soon; then the rest of the matrix."""
    whole = {_same(u): u for u in full}
    first = [whole.get(_same(u), u) for u in default]
    keys = {_same(u) for u in first}
    return first + [u for u in full if _same(u) not in keys]


def _same(u: Unit) -> tuple:
    """A unit and its no-resume variant run the same training (the variant's first steps of it): the
    matrix counts them as one."""
    return tuple(v for k, v in u.__dict__.items() if k not in ("checkpoint", "steps"))
