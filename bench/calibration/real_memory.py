"""Memory per rank measured at real width on fake tensors, against the cluster planner's estimate (issue #38 item 4).

For each cluster plan ``bench/calibration/autodist.py`` prints (Llama-3 8B and 70B at seq 4096, and the search
on every published row, 8B-405B on 8-16,384 GPUs), rank 0 of a pipeline stage is compiled by ``nnscaler`` at its
real widths on fake tensors (``FakeTensorMode``: shapes, no storage) and a fake process group
(``torch.distributed`` backend ``"fake"``) of the stage's ``tp x dp`` ranks, then run through two whole
training steps of its recipe (precision, ZeRO over dp, recompute, sequence parallelism; AdamW) under
``torch.distributed._tools.mem_tracker.MemTracker``:

- the stages measured are the first, the last and the fullest middle stage (:func:`stages_measured`);
- the stage is built directly from the plan's layer split: its ``v`` chunks (interleaved 1F1B) of the
  stage's blocks, the first stage's first chunk with the embedding, the last stage's last chunk with the
  final norm, the vocabulary head and the loss (``pp`` 1: the whole model); each chunk is one compiled
  program (policy ``tp``, ``dp`` replicas over the data-parallel ranks, as ``nnscaler.cluster.plan.lower``
  gives inside a stage);
- the pipeline schedule is driven here, not by ``torch.distributed.pipelining`` (whose sends need a real
  group): the rank's forwards and backwards in the order of torch's ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``
  (a warm-up of ``2 (pp - 1 - s) + (v - 1) pp`` chunk forwards; ``tests/compiler/test_pipeline_memory.py`` holds
  the order to torch's), with what torch's ``PipelineStage`` holds: a receive buffer of each chunk's input (not the
  model's first chunk) and of its output's gradient (not the last) for every micro-batch, for the whole run, each
  input's gradient kept on its buffer until the next step, each output until its backward; micro-batches per step
  cut to ``pp + 1`` (``2 pp`` interleaved): the in-flight peak is reached by then (the estimate compared is taken at
  the same count, :func:`estimated`);
- a plan with context parallelism is measured as the best plan without it (:func:`without_cp`); called with a
  cp plan, :func:`measure_stage` compiles the stage's cp policy itself (on fake tensors the ring's test of a
  masked-out block is the causal rule by positions: fake masks hold no values);
- depth: every chunk at its real block count; ``--extrapolate`` compiles it at 2 and 4 blocks and
  extrapolates linearly (exact here: Llama-3 8B at 2, 3, 4, 8 blocks grows by the same bytes a block, and
  the 32-block run gives the same figures; at 1 block the peak falls elsewhere, in the head's backward).

Measured (bytes of rank 0): parameters (ZeRO 3: the shards), gradients (after the last backward) and
optimizer state (after the step) from the live storages; saved activations in flight: the storages autograd
keeps for backward (``nnscaler.runtime.recompute.SavedActivations``, parameters and the pipeline's receive buffers
left out: those are held whatever autograd saves), summed over the
micro-batches whose backward has not run, at most; peak: the tracker's peak over both steps; ``held``: peak
minus the state, i.e. everything else alive at the peak (saved activations, intermediates still referenced,
gradient buffers of a step in progress). Estimate: :func:`nnscaler.cluster.cost.estimate` as the planner
reports it (each term the larger of the first and the last stage). Goal: every ratio within 10%. A plan
whose measured peak exceeds the usable part of its device's memory is flagged in the table (``over the device``),
whatever budget the search was given (:func:`device_bytes`).

    python bench/calibration/real_memory.py [--plans llama3-8b-8 ...] [--skip-published] [--extrapolate] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KEYS = ("params", "grads", "optimizer", "activations", "peak")
# blocks per chunk measured when extrapolating: at 1 block the peak falls in the head's backward, from 2 on
# at the end of the forward (Llama-3 8B, tp 1: 1 -> 2 blocks "grows" 2.9 GiB a block, 2 -> 4 the real slope)
LOW, HIGH = 2, 4
GiB = 2 ** 30


# -- the stage's programs ---------------------------------------------------------------------------------------
class Chunk(torch.nn.Module):
    """``blocks`` decoder layers of a Llama config; ``first``: takes token ids through the embedding;
    ``last``: ends in the final norm, the vocabulary head and the loss (else returns the hidden states)."""

    def __init__(self, config, first: bool, last: bool):
        super().__init__()
        from transformers import LlamaForCausalLM, LlamaModel
        self.first, self.last = first, last
        if last:
            self.lm = LlamaForCausalLM(config)
            body = self.lm.model
        else:
            self.lm = body = LlamaModel(config)
            body.norm = torch.nn.Identity()
        if not first:
            body.embed_tokens = None

    def forward(self, x, labels):
        kw = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            return self.lm(**kw, labels=labels).loss
        return self.lm(**kw).last_hidden_state


def llama_config(name: str, seq: int, blocks: int, width_scale: int = 1):
    """The Llama config of ``name`` with ``blocks`` layers (``width_scale`` > 1 divides every width: tests)."""
    from transformers import LlamaConfig

    from bench.calibration.llama_models import SHAPES
    hidden, ffn, _, heads, kv, vocab = SHAPES[name] if name in SHAPES else name
    w = width_scale
    return LlamaConfig(vocab_size=vocab // w, hidden_size=hidden // w, intermediate_size=ffn // w,
                       num_hidden_layers=blocks, num_attention_heads=max(1, heads // w),
                       num_key_value_heads=max(1, min(kv, heads // w)), max_position_embeddings=seq,
                       attn_implementation="sdpa", use_cache=False)


def tracker_class():
    """``MemTracker`` that does not count ZeRO 2/3's ``.grad`` placeholders (``ShardGrad``: a wrapper of the
    parameter's shape with no data, ``nnscaler/runtime/shard_grad.py``): torch's tracker takes their storage's
    nominal size for gradient bytes (measured: the whole model's fp32 gradients again, 30 GiB on Llama-3 8B), which
    no device allocates."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from nnscaler.runtime.shard_grad import is_placeholder

    class Tracker(MemTracker):
        def _track(self, reftype, t):
            if not is_placeholder(t):
                super()._track(reftype, t)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            return set() if is_placeholder(t) else super()._update_and_maybe_create_winfos(t, reftype, update_existing)
    return Tracker


def _storages(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (fake tensors too: by storage object, not address)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def _saved_counter():
    """A :class:`~nnscaler.runtime.recompute.SavedActivations` that tells fake storages apart (a fake
    storage has no address: by the storage object instead)."""
    from nnscaler.runtime.recompute import SavedActivations

    class Saved(SavedActivations):
        def __init__(self, exclude):
            super().__init__(())
            self.skip = {t.untyped_storage()._cdata for t in exclude}
            self.seen: dict[int, int] = {}

        def add(self, t: torch.Tensor) -> None:
            st = t.untyped_storage()
            if st._cdata not in self.skip:
                self.seen[st._cdata] = st.nbytes()

        @property
        def bytes(self) -> int:
            return sum(self.seen.values())
    return Saved


def schedule(pp: int, stage: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """The ``("F" | "B", chunk, micro-batch)`` order of one rank under 1F1B (``v`` 1) or Megatron-LM's
    interleaved 1F1B (``v`` chunks; ``m`` a multiple of ``pp``)."""
    total = m * v
    warm = min(total, (pp - stage - 1) + (0 if v == 1 else (pp - stage - 1) + (v - 1) * pp))

    def at(k: int, backward: bool) -> tuple[int, int]:
        if v == 1:
            return 0, k
        c = (k // pp) % v
        return (v - 1 - c if backward else c), (k // (pp * v)) * pp + k % pp
    ops: list[tuple[str, int, int]] = [("F", *at(k, False)) for k in range(warm)]
    f, b = warm, 0
    while b < total:
        if f < total:
            ops.append(("F", *at(f, False)))
            f += 1
        ops.append(("B", *at(b, True)))
        b += 1
    return ops


def measure_stage(name, par, precision: str, seq: int, stage: int, blocks: int | list[int], m_eff: int,
                  width_scale: int = 1, fake: bool = True, tracker=None) -> dict:
    """Rank 0 of pipeline stage ``stage`` of ``par`` with ``blocks`` layers per chunk (or each chunk's), compiled on fake tensors
    (``fake=False``: real ones, to check the fake measurement at a small size) and run through two training
    steps of ``m_eff`` micro-batches: measured bytes (``KEYS``)."""
    import contextlib
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import opzoo  # noqa: F401  (the operator annotations)
    from nnscaler import ComputeConfig
    from nnscaler.compile.parallelize import parallelize
    from nnscaler.compile.precision import apply_precision
    from nnscaler.cost.saved import saved_per_op
    from nnscaler.trace.build import trace

    tp, dp, pp, v, mbs = par.tp, par.dp, par.pp, par.virtual_stages, par.micro_batch_size
    cp = getattr(par, "cp", 1)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp * dp)
    per_chunk = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks] * v
    cfg = llama_config(name, seq, per_chunk[0], width_scale)
    fm = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    kinds = [(stage == 0 and c == 0, stage == pp - 1 and c == v - 1) for c in range(v)]
    with fm:
        ids = torch.zeros(mbs, seq, dtype=torch.long)
        hidden = torch.zeros(mbs, seq, cfg.hidden_size)
    # a cp plan: the stage's policy as the lowering runs it (``nnscaler.cluster.plan.stage_policy``: dp x cp x tp), one
    # copy of the plan on the stage's tp x cp ranks, ZeRO over the dp replicas
    extra = {"cp_size": cp} if cp > 1 else {}
    config = ComputeConfig(tp * cp, runtime_ngpus=tp * cp * dp, tp_size=tp, sequence_parallel=par.sequence_parallel and tp > 1,
                           recompute=par.recompute, zero=par.zero if dp > 1 else 0, precision=precision, **extra)
    if cp > 1:
        from nnscaler.cluster.plan import stage_policy
        policy = stage_policy(par)
    else:
        policy = "tp" if tp > 1 else "dp"
    graphs: dict = {}
    tracker = tracker if tracker is not None else tracker_class()()  # or a labelling subclass of it (tags each storage with its operator and step)
    modules, opts = [], []
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        for c, kind in enumerate(kinds):
            with fm:
                model = Chunk(llama_config(name, seq, per_chunk[c], width_scale), *kind)
            args = (ids if kind[0] else hidden, ids)
            kind = (*kind, per_chunk[c])
            if kind not in graphs:  # traced outside the fake mode (export makes its own), the casts and saved
                g = trace(model, args)  # tensors of bf16-mixed found once per kind, before the program is built
                apply_precision(g, precision)
                saved_per_op(g)
                if cp > 1:  # a cp policy rewrites its graph (the ring's attention, casts): its saved tensors found here
                    from nnscaler.compile.plan import choose_plan
                    planned = g.copy()
                    choose_plan(planned, policy, config)
                    apply_precision(planned, precision)  # as parallelize does: after the policy
                    saved_per_op(planned)
                graphs[kind] = g
            with fm, tracker:  # the rank's state is built under the tracker: every byte it allocates is seen
                pm = parallelize(model, args, policy, config, gen_savedir=f"{d}/c{c}", verify=False,
                                 tracer=lambda *a, _g=graphs[kind], **k: _g.copy())
                opts.append(pm.build_optimizer(torch.optim.AdamW, lr=1e-5))
            modules.append(pm)
            del model
        gc.collect()
        if cp > 1 and fake:  # the ring skips a block its masks hide by reading them, which fake tensors cannot say:
            import nnscaler.runtime.ring as ring  # the causal mask's rule by positions instead (the same blocks)
            stack.enter_context(mock.patch.object(ring, "hidden", _causal_hidden))
        with fm, tracker:
            tracker.track_external(*modules)
            ops = schedule(pp, stage, v, m_eff)
            grads = acts = 0
            flight: dict = {}  # saved bytes of each forward whose backward has not run
            Saved = _saved_counter()
            # torch's PipelineStage (nnscaler/runtime/pipeline.py) allocates, for every micro-batch of the step and
            # for the whole run, a receive buffer of each chunk's input (a leaf that requires grad, whole, at the
            # residual stream's dtype) unless the chunk is the model's first, and of its output's gradient unless it
            # is the model's last; the input's gradient accumulates on its buffer until the next step clears it
            dtype = hidden.dtype  # what the chunk was traced with: the residual stream's dtype (fp32 under bf16-mixed)
            with fm:
                recv = {(c, mb): torch.zeros(mbs, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
                        for c in range(v) if not kinds[c][0] for mb in range(m_eff)}
                recv_grad = {(c, mb): torch.zeros(mbs, seq, cfg.hidden_size, dtype=dtype)
                             for c in range(v) if not kinds[c][1] for mb in range(m_eff)}
            for _step in range(2):
                outs: dict = {}
                for x in recv.values():  # the stage's clear_runtime_states at the start of a step
                    x.grad = None
                for kind_, c, mb in ops:
                    pm = modules[c]
                    tracker.phase = f"{kind_}{c}.{mb}"  # what the tracker is running (read by a labelling tracker)
                    if kind_ == "F":
                        tracker.memory_tracking.pop(pm, None)  # a chunk called again: a new micro-batch, not a new iteration
                        x = ids if kinds[c][0] else recv[(c, mb)]
                        with Saved([*pm.param_tensors(), *recv.values()]) as saved:  # the received inputs: buffers
                            outs[(c, mb)] = pm(x, ids)
                        flight[(c, mb)] = saved.bytes
                        acts = max(acts, sum(flight.values()))
                    else:
                        flight.pop((c, mb))
                        out = outs.pop((c, mb))
                        out.backward(torch.ones_like(out) if out.dim() == 0 else recv_grad[(c, mb)])
                        del out
                    x = None
                grads = sum(_storages(pm.grad_tensors()) for pm in modules)
                tracker.phase = "step"
                for o in opts:
                    o.step()
                    o.zero_grad(set_to_none=True)
            from verify.cases.memory import optimizer_tensors
            got = {"params": sum(_storages(pm.param_tensors()) for pm in modules), "grads": grads,
                   "optimizer": sum(_storages(optimizer_tensors(o)) for o in opts), "activations": acts}
        snap = max(tracker.get_tracker_snapshot("peak").values(), key=lambda s: s["Total"])
    peak = got["peak"] = snap["Total"]
    got["at_peak"] = {str(k.value if hasattr(k, "value") else k): v for k, v in snap.items()}  # the tracker's kinds
    got["held"] = peak - got["params"] - got["grads"] - got["optimizer"]  # everything else at the peak
    del modules, opts, recv, recv_grad
    gc.collect()
    dist.destroy_process_group()
    return got


def _causal_hidden(mods, masks, qpos, kpos, row) -> bool:
    """``nnscaler.runtime.ring.hidden`` for a causal model on fake tensors: a block wholly above the diagonal."""
    return kpos[0] > qpos[0] + qpos[1] - 1


def _counts(plan) -> list[int]:
    """Blocks per chunk of the plan's ``pp x v`` split, as the estimate made it (``cost.layer_split``)."""
    from nnscaler.cluster.cost import estimate
    from nnscaler.profiles import get_profile
    memo: dict = {}
    estimate(plan.shape, plan.parallel, get_profile(plan.profile), plan.precision, plan.global_batch, memo=memo)
    return next(iter(memo.values()))["split"][plan.parallel.pp * plan.parallel.virtual_stages][0]


def microbatches_run(par) -> int:
    """Micro-batches a step runs in the measurement: the plan's, cut to ``pp + 1`` (``2 pp`` interleaved), by when
    the in-flight peak is reached (every micro-batch when there are fewer)."""
    return min(par.num_microbatches, 2 * par.pp if par.virtual_stages > 1 else par.pp + 1)


def measure_plan(plan, stage: int, extrapolate: bool = False, width_scale: int = 1, name=None) -> dict:
    """Stage ``stage`` of cluster plan ``plan`` measured (bytes per ``KEYS`` and ``held``): at its real block
    count, or (``extrapolate``) at ``LOW`` and ``HIGH`` blocks per chunk, extrapolated linearly."""
    par = plan.parallel
    counts = _counts(plan)
    v = par.virtual_stages
    chunks = [counts[c * par.pp + stage] for c in range(v)]  # chunk c of stage s: model chunk c pp + s
    m_eff = microbatches_run(par)
    model, seq = name or plan.model, plan.shape.seq
    if not extrapolate or max(chunks) <= LOW + 1:
        return measure_stage(model, par, plan.precision, seq, stage, chunks, m_eff, width_scale)
    low = measure_stage(model, par, plan.precision, seq, stage, LOW, m_eff, width_scale)
    high = measure_stage(model, par, plan.precision, seq, stage, HIGH, m_eff, width_scale)
    extra = (sum(chunks) - v * LOW) / (v * (HIGH - LOW))  # the rank's blocks beyond LOW per chunk, in steps
    return {k: low[k] + extra * (high[k] - low[k]) for k in KEYS + ("held",)}


def stages_measured(plan) -> list[int]:
    """The stages the estimate takes its maxima from (:func:`stages_of`, on the plan's layer split)."""
    pp = plan.parallel.pp
    return [0] if pp == 1 else stages_of(_counts(plan), pp, plan.parallel.virtual_stages)


def stages_of(counts: list[int], pp: int, v: int) -> list[int]:
    """Of a ``pp x v`` split (``counts[c pp + s]`` blocks in chunk ``c`` of stage ``s``): the first stage and,
    pipelined, the last (each moment's saved tensors and buffers are the larger of the two), and a middle stage
    holding more blocks than both where one does (the parameters, gradients and optimizer state are the most any stage
    holds, ``memory.rank_memory``: Llama-3 405B over pp 16 puts 8 blocks on the middle stages, 7 on the first and
    the last)."""
    if pp == 1:
        return [0]
    blocks = [sum(counts[c * pp + s] for c in range(v)) for s in range(pp)]
    fullest = max(range(1, pp - 1), key=lambda s: blocks[s], default=0)
    return [0, pp - 1] + ([fullest] if blocks[fullest] > max(blocks[0], blocks[-1]) else [])


def measured(plan, extrapolate: bool = False, width_scale: int = 1, name=None) -> dict:
    """Per ``KEYS``, the most over the stages the estimate takes its maxima from (:func:`stages_measured`)."""
    stages = stages_measured(plan)
    got = [measure_plan(plan, s, extrapolate, width_scale, name) for s in stages]
    return {k: max(g[k] for g in got) for k in KEYS + ("held",)}


def estimated(plan) -> dict:
    """The planner's bytes per ``KEYS`` for the program measured, nnscaler's. A published row's plan was searched
    with that stack's profile (``bench/calibration/calibrate.py`` ``row_profile``: bf16 weights, so no bf16 copies of
    fp32 weights kept for backward, and every saved tensor at 2 bytes), while the program compiled here keeps fp32
    master weights under autocast: its configuration is estimated again with the device's own profile (what
    ``plan_cluster`` uses; the same figures for a plan searched with it). Without this, Llama-3 8B at seq 8192
    (``search-tt-a100-llama3-8b``) read 51.2 GiB of saved activations against 88.2 measured.
    Pipelined, at the micro-batches the measurement runs (:func:`microbatches_run`): the runtime's receive buffers
    grow with the step's micro-batches (``nnscaler.cluster.memory.stage_boundaries``), and the figures are compared on
    the same step; the planner's own peak at the plan's micro-batches is ``plan.best.memory["peak"]``."""
    import dataclasses

    from nnscaler.cluster.cost import estimate
    from nnscaler.profiles import get_profile
    par = plan.parallel
    if par.pp > 1:
        par = dataclasses.replace(par, num_microbatches=microbatches_run(par))
    e = estimate(plan.shape, par, get_profile(plan.profile), plan.precision, plan.global_batch)
    return {k: e.memory[k] for k in KEYS}


def compare(got: dict, est: dict) -> dict:
    """``{key: estimate / measured}``."""
    return {k: est[k] / got[k] if got[k] else float("nan") for k in KEYS}


def _short(p) -> str:
    return (f"tp{p.tp}{'+sp' if p.sequence_parallel else ''}{f' cp{p.cp}' if p.cp > 1 else ''} pp{p.pp} "
            f"v{p.virtual_stages} dp{p.dp} "
            f"mbs{p.micro_batch_size} x{p.num_microbatches} zero{p.zero} {p.recompute}")


def without_cp(plan, search_again):
    """``plan``, or where it takes context parallelism the best plan without (``search_again(constraints)``): the
    measurement compiles each chunk without a cp split (``measure_stage`` reads no ``cp``), so a cp plan measured as
    it is would be another program (twice the tokens per rank at cp 2; its ZeRO shards over dp only)."""
    return plan if plan.parallel.cp == 1 else search_again({"cp": 1})


def plans(skip_published: bool = False, only: list[str] | None = None):
    """``(label, ClusterPlan, device GiB or None)`` for every plan ``bench/calibration/autodist.py`` prints (a cp plan:
    the best one without cp, :func:`without_cp`; the device's memory: a published row's, None for the profile's)."""
    from bench.calibration.llama_models import CLUSTER_RUNS
    from bench.calibration.llama_models import llama_shape
    from nnscaler import ComputeConfig
    from nnscaler.cluster.search import search
    for name, worlds in CLUSTER_RUNS:
        shape = None
        for w in worlds:
            label = f"{name}-{w}"
            if only and label not in only:
                continue
            shape = shape or llama_shape(name, 4096)
            cfg = ComputeConfig(w, profile="h100", precision="bf16-mixed", global_batch=2 * w)
            yield label, without_cp(search(shape, cfg, name),
                                    lambda cons: search(shape, dataclasses.replace(cfg, constraints=cons), name)), None
    if skip_published:
        return
    from bench.calibration.calibrate import load_rows, row_search, shapes_for
    rows = [r for r in load_rows() if not only or f"search-{r['name']}" in only]
    shapes = shapes_for(rows)
    for r in rows:
        shape = shapes[(r["model"], int(r["seq"]))]  # the rows' plans as bench/calibration/autodist.py prints them
        yield f"search-{r['name']}", without_cp(row_search(r, shape)[1],
                                                lambda cons: row_search(r, shape, cons=cons)[1]), float(r["memory_gib"])


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def worst(got: dict, est: dict) -> float:
    """The largest ``|estimate / measured - 1|`` over ``KEYS``."""
    return max(abs(r - 1) for r in compare(got, est).values())


def device_bytes(plan, memory_gib: float | None = None) -> float:
    """What a plan may fill on its device: the profile's ``usable`` part of the device's memory (``memory_gib``: a
    published row's own device, e.g. 96 GiB H100s), whatever memory budget the search was given. A published row's
    search is allowed the memory our estimate says that run took (``calibrate.row_search``), which can be above the
    device (Llama 3 405B: 124 GiB): judged against that budget such a plan would always "fit"."""
    from nnscaler.profiles import get_profile
    prof = get_profile(plan.profile) if isinstance(plan.profile, str) else plan.profile
    return prof.cluster.usable * (memory_gib * GiB if memory_gib else prof.memory)


def over_device(plan, got: dict, memory_gib: float | None = None) -> bool:
    """Whether the measured peak exceeds what the plan's device holds (:func:`device_bytes`)."""
    return got["peak"] > device_bytes(plan, memory_gib)


def device_line(plan, got: dict, memory_gib: float | None = None) -> str:
    """One line on the measured peak against the estimate and the device (``OVER THE DEVICE`` when over)."""
    head = (f"measured peak {_gib(got['peak'])} GiB/rank (estimate {_gib(plan.best.memory['peak'])}, "
            f"device {_gib(device_bytes(plan, memory_gib))}, search budget {_gib(plan.best.budget)})")
    return (f"{head}: OVER THE DEVICE, this plan does not fit" if over_device(plan, got, memory_gib)
            else f"{head}: fits")


def row(label: str, plan, got: dict, est: dict, memory_gib: float | None = None) -> str:
    ratio = compare(got, est)
    cells = " | ".join(f"{_gib(got[k])} / {_gib(est[k])} = {ratio[k]:.2f}" for k in KEYS)
    over = (f" **over the device** ({_gib(device_bytes(plan, memory_gib))} GiB usable)"
            if over_device(plan, got, memory_gib) else "")
    return (f"| {label} | {_short(plan.parallel)} | {cells} | {_gib(got['held'])} | "
            f"{100 * worst(got, est):.0f}%{over} |")


HEADER = ("| plan | configuration | params | grads | optimizer | saved activations in flight | peak | "
          "held at the peak beyond state | worst |\n|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="*", help="labels to measure (e.g. llama3-8b-8 search-tt-h100-llama3-8b)")
    ap.add_argument("--skip-published", action="store_true")
    ap.add_argument("--extrapolate", action="store_true",
                    help=f"compile each chunk at {LOW} and {HIGH} blocks and extrapolate linearly (faster)")
    ap.add_argument("--out", help="also write the table to this Markdown file")
    ap.add_argument("--json", help="also write each plan's configuration, measured and estimated bytes to this file")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    lines = ["GiB per rank, measured (rank 0 of the first and, pipelined, the last and the fullest middle stage: the largest) / estimated "
             "(`nnscaler.cluster.cost.estimate`) = ratio; "
             f"{f'{LOW} and {HIGH} blocks per chunk, extrapolated' if args.extrapolate else 'every stage at its real depth'}"
             "; over the device: measured peak above the usable part of the device's memory (`device_bytes`)", "", HEADER]
    print("\n".join(lines), flush=True)
    worst_all, n = 0.0, 0
    rows: dict = {}
    for label, plan, memory_gib in plans(args.skip_published, args.plans):
        t0 = time.perf_counter()
        try:
            got = measured(plan, args.extrapolate)
        except Exception as exc:  # noqa: BLE001  (one plan that cannot be built is reported, the rest go on)
            line = f"| {label} | {_short(plan.parallel)} | error: {type(exc).__name__}: {str(exc)[:160]} | | | | | | |"
        else:
            est = estimated(plan)
            rows[label] = {"parallel": plan.parallel.as_dict(), "measured": got, "estimated": est,
                           "budget": plan.best.budget, "device": device_bytes(plan, memory_gib)}
            if args.json:
                import json
                Path(args.json).write_text(json.dumps(rows, indent=1))
            line = row(label, plan, got, est, memory_gib)
            worst_all = max(worst_all, worst(got, est))
            n += 1
        print(line + f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
        lines.append(line)
    tail = f"\nWorst |estimate / measured - 1| over {n} plans: {100 * worst_all:.0f}% (goal 10%)"
    print(tail)
    if args.out:
        Path(args.out).write_text("\n".join(lines + [tail]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
