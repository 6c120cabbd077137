"""One rank's pipeline stage of a cluster plan, built at its real widths on fake tensors and driven through whole
training steps under torch's memory tracker: what ``bench/calibration/real_memory.py`` compares with the planner's
estimate (issue #38 item 4).

Rank 0 of a pipeline stage is compiled by ``nnscaler`` at its real widths on fake tensors (``FakeTensorMode``: shapes,
no storage) and a fake process group (``torch.distributed`` backend ``"fake"``) of the stage's ``tp x cp x dp`` ranks,
then run through two whole training steps of its recipe (precision, ZeRO over dp, recompute, sequence parallelism;
AdamW) under ``torch.distributed._tools.mem_tracker.MemTracker``:

- the model is the one the plan's shape was traced from (``bench/calibration/llama_models.py``: a Llama config of
  ``SHAPES``, or ``verify.models.nanogpt``'s GPT of ``GPT_SHAPES``), cut into chunks (:func:`model_chunk`);
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
  cut to ``pp + 1`` (``2 pp`` interleaved): the in-flight peak is reached by then (:func:`microbatches_run`);
- called with a cp plan, :func:`measure_stage` compiles the stage's cp policy itself (on fake tensors the ring's test
  of a masked-out block is the causal rule by positions: fake masks hold no values);
- depth: every chunk at its real block count; ``extrapolate`` compiles it at 2 and 4 blocks and
  extrapolates linearly (exact here: Llama-3 8B at 2, 3, 4, 8 blocks grows by the same bytes a block, and
  the 32-block run gives the same figures; at 1 block the peak falls elsewhere, in the head's backward).

Measured (bytes of rank 0): parameters (ZeRO 3: the shards), gradients (after the last backward) and
optimizer state (after the step) from the live storages; saved activations in flight: the storages autograd
keeps for backward (``nnscaler.runtime.recompute.SavedActivations``, parameters and the pipeline's receive buffers
left out: those are held whatever autograd saves), summed over the
micro-batches whose backward has not run, at most; peak: the tracker's peak over both steps; ``held``: peak
minus the state, i.e. everything else alive at the peak (saved activations, intermediates still referenced,
gradient buffers of a step in progress).
"""
from __future__ import annotations

import gc
import tempfile
import warnings
from unittest import mock

import torch

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


class GPTChunk(torch.nn.Module):
    """``blocks`` blocks of ``verify.models.nanogpt``'s GPT (the model a GPT row's shape is traced from,
    ``bench/calibration/llama_models.py``); ``first``: takes token ids through the token and position embeddings;
    ``last``: ends in the final norm, the vocabulary head and the loss (else returns the hidden states). The same
    modules and operators as ``GPT.forward``, cut at block boundaries."""

    def __init__(self, config, first: bool, last: bool):
        super().__init__()
        from verify.models.nanogpt import GPT
        self.first, self.last = first, last
        self.gpt = GPT(config)
        if not first:
            del self.gpt.wte, self.gpt.wpe
        if not last:
            del self.gpt.ln_f, self.gpt.lm_head

    def forward(self, x, labels):
        import torch.nn.functional as F
        g = self.gpt
        if self.first:
            x = g.wte(x) + g.wpe(torch.arange(x.shape[1], device=x.device))
        for block in g.h:
            x = block(x)
        if not self.last:
            return x
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def gpt_config(name: str, seq: int, blocks: int, width_scale: int = 1):
    """The nanoGPT config of GPT ``name`` (``GPT_SHAPES``) with ``blocks`` blocks (``width_scale``: as
    :func:`llama_config`)."""
    from bench.calibration.llama_models import GPT_SHAPES
    from verify.models.nanogpt import GPTConfig
    hidden, _, heads, vocab = GPT_SHAPES[name]
    w = width_scale
    return GPTConfig(vocab_size=vocab // w, block_size=seq, n_layer=blocks, n_head=max(1, heads // w),
                     n_embd=hidden // w)


def model_chunk(name: str, seq: int, blocks: int, first: bool, last: bool, width_scale: int = 1):
    """``(chunk, hidden width)``: ``blocks`` layers of model ``name`` as :func:`bench.calibration.llama_models.llama_model`
    builds it (a GPT of ``GPT_SHAPES`` or a Llama of ``SHAPES``: the model whose shape the plan was costed on)."""
    from bench.calibration.llama_models import GPT_SHAPES
    if isinstance(name, str) and name in GPT_SHAPES:
        cfg = gpt_config(name, seq, blocks, width_scale)
        return GPTChunk(cfg, first, last), cfg.n_embd
    cfg = llama_config(name, seq, blocks, width_scale)
    return Chunk(cfg, first, last), cfg.hidden_size


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
    with torch.device("meta"):
        width = model_chunk(name, seq, 1, False, False, width_scale)[1]
    fm = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    kinds = [(stage == 0 and c == 0, stage == pp - 1 and c == v - 1) for c in range(v)]
    with fm:
        ids = torch.zeros(mbs, seq, dtype=torch.long)
        hidden = torch.zeros(mbs, seq, width)
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
                model = model_chunk(name, seq, per_chunk[c], *kind, width_scale)[0]
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
                recv = {(c, mb): torch.zeros(mbs, seq, width, dtype=dtype, requires_grad=True)
                        for c in range(v) if not kinds[c][0] for mb in range(m_eff)}
                recv_grad = {(c, mb): torch.zeros(mbs, seq, width, dtype=dtype)
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
    """Stage ``stage`` of cluster plan ``plan`` measured (bytes per ``KEYS`` and ``held``): :func:`measure_chunks` of
    its chunks (``_counts``)."""
    par = plan.parallel
    counts = _counts(plan)
    chunks = [counts[c * par.pp + stage] for c in range(par.virtual_stages)]  # chunk c of stage s: model chunk c pp + s
    return measure_chunks(name or plan.model, par, plan.precision, plan.shape.seq, stage, chunks, extrapolate,
                          width_scale)


def measure_chunks(model, par, precision: str, seq: int, stage: int, chunks: list[int], extrapolate: bool = False,
                   width_scale: int = 1) -> dict:
    """Stage ``stage`` of ``par`` with ``chunks[c]`` blocks in its chunk ``c`` (bytes per ``KEYS`` and ``held``): as it
    is, or (``extrapolate``) at ``LOW`` and ``HIGH`` blocks in its fewest-block chunk, every other chunk as many more
    as it holds (the interleaved warm-up runs some chunks' forwards more often than others': which chunks hold the
    extra blocks matters), extrapolated linearly to ``chunks``."""
    m_eff = microbatches_run(par)
    if not extrapolate or max(chunks) <= LOW + 1:
        return measure_stage(model, par, precision, seq, stage, chunks, m_eff, width_scale)
    fewest = min(chunks)
    low, high = (measure_stage(model, par, precision, seq, stage, [n - fewest + at for n in chunks], m_eff,
                               width_scale) for at in (LOW, HIGH))
    extra = (fewest - LOW) / (HIGH - LOW)  # the rank's blocks beyond LOW per chunk, in steps
    return {k: low[k] + extra * (high[k] - low[k]) for k in KEYS + ("held",)}


def stages_measured(plan) -> list[int]:
    """The stages the estimate takes its maxima from (:func:`stages_of`, on the plan's layer split)."""
    pp = plan.parallel.pp
    return [0] if pp == 1 else stages_of(_counts(plan), pp, plan.parallel.virtual_stages,
                                         microbatches_run(plan.parallel))


def stages_of(counts: list[int], pp: int, v: int, m: int | None = None) -> list[int]:
    """Of a ``pp x v`` split (``counts[c pp + s]`` blocks in chunk ``c`` of stage ``s``): the first stage and,
    pipelined, the last (each moment's saved tensors and buffers are the larger of the two), a middle stage
    holding more blocks than both where one does (the parameters, gradients and optimizer state are the most any stage
    holds, ``memory.rank_memory``: Llama-3 405B over pp 16 puts 8 blocks on the middle stages, 7 on the first and
    the last), and (``m`` micro-batches run) the middle stage whose chunk forwards in flight hold the most blocks where
    it holds more than both (``memory.saved_in_flight``: Megatron-Core's GPT 314B over pp 12 x v 3, 8 blocks a stage
    in chunks of 2 and 3, holds 135 block-forwards on stage 1, 118 on stage 0)."""
    from nnscaler.cluster.memory import saved_in_flight
    if pp == 1:
        return [0]
    blocks = [sum(counts[c * pp + s] for c in range(v)) for s in range(pp)]
    fullest = max(range(1, pp - 1), key=lambda s: blocks[s], default=0)
    out = [0, pp - 1] + ([fullest] if blocks[fullest] > max(blocks[0], blocks[-1]) else [])
    if m is not None and pp > 2:
        held = [saved_in_flight(pp, s, m, v, [counts[c * pp + s] for c in range(v)]) for s in range(pp)]
        most = max(range(1, pp - 1), key=lambda s: held[s])
        if held[most] > max(held[0], held[-1]) and most not in out:
            out.append(most)
    return out


def measured(plan, extrapolate: bool = False, width_scale: int = 1, name=None) -> dict:
    """Per ``KEYS``, the most over the stages the estimate takes its maxima from (:func:`stages_measured`)."""
    stages = stages_measured(plan)
    got = [measure_plan(plan, s, extrapolate, width_scale, name) for s in stages]
    return {k: max(g[k] for g in got) for k in KEYS + ("held",)}

