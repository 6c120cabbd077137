"""The pipelined module: this rank's stages (each a generated :class:`ParallelModule` over the stage's
ranks) run by a schedule of :mod:`torch.distributed.pipelining`.

Ranks: pipeline rank ``r`` holds stages ``r, r + pp, ...``; each stage has ``k`` ranks (global ranks
``r * k .. r * k + k - 1``) partitioned by the stage policy. Rank ``local`` of a stage talks to rank
``local`` of the next stage over the pipeline group ``{local + s * k}``: stage inputs and outputs are
whole tensors on every rank of a stage, so each of the ``k`` pipelines carries the same values. With
data-parallel replicas (``runtime_ngpus = R * plan_ngpus``) replica ``r`` runs the same layout on ranks
``r * plan_ngpus ..``; each stage's gradients are averaged over the ranks holding the same plan rank.

Gradients equal single-device gradients of the whole batch's loss, as in
:mod:`nnscaler.runtime.microbatch`: the last stage turns each micro-batch's output into a pair
``(loss_sum, count)`` (``loss_fn(output, *micro_batch_args)``, or the output read as a mean over its
rows), the schedule runs backward on ``loss_sum`` (its own scaling off), and after the last micro-batch
the accumulated gradients are divided by the total count (broadcast from the last stage). The
in-stage gradient sync (data-parallel and tensor-parallel sums) is paused during the schedule and runs
once, after the last micro-batch (with replicas, their average too: each stage's own
:class:`~nnscaler.runtime.grad_sync.GradSync`), and ``(loss_sum, count)`` is summed over replicas
(:class:`~nnscaler.runtime.microbatch.Accumulation`); a parameter used by several stages (tied
embeddings) then gets the sum of its stages' gradients.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from ..ops.rules import TensorMeta
from . import clip
from .grad_steps import after_backward
from .mesh import backend_device
from .program import GuardFailed
from .microbatch import Accumulation, MicroBatchError, batch_rows, check_divisible, loss_terms
from .module import ParallelModule, take
from .schedules import SCHEDULES, canonical_schedule
from .shard_grad import real


@dataclass(frozen=True)
class StageMeta:
    """What the runtime knows of one pipeline stage (the compiler reads it off the stage's traced graph):
    the shape and dtype of each input and output (``None`` for an output that is no tensor), and the
    shapes of the parameters and buffers it holds, by their names in the model."""

    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta | None, ...]
    params: Mapping[str, tuple[int, ...]]
    buffers: Mapping[str, tuple[int, ...]]


def _example(t: TensorMeta) -> torch.Tensor:
    """A tensor like ``t`` for the stage's static metadata (floating ones carry gradients)."""
    return torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.dtype.is_floating_point)


@contextlib.contextmanager
def _deferred_sync(module: ParallelModule):
    """Run backward passes with ``module``'s gradient sync paused (``no_sync``), then sync once: the
    data-parallel and in-plan sums wait for the last micro-batch."""
    with module.no_sync():
        yield
    module._grad_sync.finish()  # launches every bucket (none was launched during the pause) and waits
    if module._zero is not None and module._zero.stage == 2:
        module._zero.finish()  # zero 2: reduce-scatters every bucket's accumulated gradients


class _GradOutputs(torch.nn.Module):
    """A stage module whose outputs are contiguous (gloo's send needs it). Under the zero-bubble
    schedules its floating outputs all take part in backward: the zero-bubble schedules
    differentiate every output (``stage_backward_input``), so an output that carries no gradient (a
    value made from buffers, an input passed through untouched) becomes a fresh leaf whose gradient
    is dropped; and every output is a copy (the schedule detaches outputs in place after the input
    gradients, while the weight gradients may still need the tensors the stage's operators saved)."""

    def __init__(self, module: ParallelModule, zero_bubble: bool, dtypes: tuple = ()):
        super().__init__()
        self.module, self.zero_bubble = module, zero_bubble
        self.dtypes = dtypes  # the traced dtype of each output: what the stage's static metadata says

    def forward(self, *x):
        out = self.module(*x)
        if self.dtypes and self.module.precision == "bf16-mixed":  # a bf16 activation crosses in its traced
            out = self._traced(out)  # dtype (an exact upcast; the next stage casts as autocast would)
        if not (self.zero_bubble and torch.is_grad_enabled()):  # gloo sends contiguous tensors only
            return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()

        def fix(t):  # contiguous copies (clone alone keeps a strided layout, which gloo refuses to send)
            if t.is_floating_point() and not t.requires_grad:
                return t.detach().contiguous().requires_grad_()
            return t.clone(memory_format=torch.contiguous_format)  # the schedule detaches outputs in place
            # after backward, and ops may have saved them
        return tuple(fix(t) for t in out) if isinstance(out, tuple) else fix(out)

    def _traced(self, out):
        def up(t, dt):
            return t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() and dt is not None else t
        if isinstance(out, tuple):
            return tuple(up(t, dt) for t, dt in zip(out, self.dtypes))
        return up(out, self.dtypes[0])


class PipelineModule(torch.nn.Module):
    """This rank's pipeline stages; :meth:`train_step` runs one training step over micro-batches."""

    def __init__(self, stages: dict[int, ParallelModule], metas: list[StageMeta], config, pp_group, prank: int,
                 local: int, stage_ranks: int, replica_group=None, replicas: int = 1):
        super().__init__()
        self.recipe = config.recipe  # the training recipe (nnscaler.recipe.Recipe): micro-batches, clipping
        num_microbatches = self.recipe.num_microbatches
        self._replica_group, self._replicas = replica_group, replicas  # data-parallel copies of the pipeline
        self.stages = torch.nn.ModuleDict({str(s): m for s, m in stages.items()})
        self.num_microbatches = num_microbatches
        self.schedule_name = canonical_schedule(config.schedule)
        self._metas, self._pp_group, self._prank, self._local, self._k = metas, pp_group, prank, local, stage_ranks
        self._pp = config.pp_size
        self._dtype = next((t.dtype for t in metas[-1].outputs if t is not None), torch.float32)
        self._n = len(metas)
        self.process_group = None
        held: dict[str, list[int]] = {}
        for s, meta in enumerate(metas):
            for name in meta.params:
                held.setdefault(name, []).append(s)
        self.tied = sorted(n for n, ss in held.items() if len(ss) > 1)  # gradients summed across stages
        self._owner = {n: ss[0] for n, ss in held.items()}  # the stage whose copy state_dict reports
        for s, meta in enumerate(metas):
            for name in meta.buffers:
                self._owner.setdefault(name, s)
        self._shapes = {n: tuple(shape) for meta in metas for n, shape in (*meta.params.items(), *meta.buffers.items())}
        zero_bubble = "ZeroBubble" in self.schedule_name
        self._pipe_stages = [
            PipelineStage(_GradOutputs(mod, zero_bubble, tuple(getattr(t, "dtype", None) for t in metas[s].outputs)),
                          s, self._n, backend_device(pp_group),
                          input_args=tuple(_example(t) for t in metas[s].inputs),
                          output_args=tuple(_example(t) for t in metas[s].outputs), group=pp_group)
            for s, mod in sorted(stages.items())]
        self._loss_fn: Callable | None = None
        cls = SCHEDULES[self.schedule_name]
        stage_arg = self._pipe_stages if self.schedule_name.startswith("Interleaved") else self._pipe_stages[0]
        # scale_grads off: the gradients are divided by the whole batch's count at the end (Accumulation)
        self._schedule = cls(stage_arg, num_microbatches, loss_fn=self._micro_loss, scale_grads=False)
        self._batch: tuple = ()
        self._acc: Accumulation | None = None
        self.last_grad_norm: torch.Tensor | None = None
        clip.register(self)

    # -- running ------------------------------------------------------------------------------------
    def _micro_loss(self, output, rows: torch.Tensor):
        """The schedule's loss of one micro-batch (``rows``: its rows of the batch): ``loss_sum``, its
        ``count`` recorded for the division at the end."""
        args = tuple(a[rows] if isinstance(a, torch.Tensor) and a.dim() else a for a in self._batch)
        total, count = loss_terms(output if self._loss_fn is None else self._loss_fn(output, *args), len(rows))
        if self._acc is not None:
            self._acc.add(total, count)
        return total.clone() if total._base is not None else total  # zero-bubble detaches it in place: no view

    @property
    def _has_first(self) -> bool:
        return 0 in self._stage_ids

    @property
    def _has_last(self) -> bool:
        return self._n - 1 in self._stage_ids

    @property
    def _stage_ids(self) -> list[int]:
        return [int(s) for s in self.stages]

    def _run(self, batch: tuple, loss_fn: Callable | None, train: bool) -> torch.Tensor:
        try:
            if train:
                check_divisible(batch, None, self.num_microbatches)
        except MicroBatchError as exc:
            raise MicroBatchError(f"train_step: {exc}") from None
        b = batch_rows(batch)
        self._batch, self._loss_fn = batch, loss_fn
        self._acc = Accumulation.begin(clip.holders(self) if train else (), self._replica_group, self._replicas)
        rows = torch.arange(b)  # the schedule splits it like the batch: each micro-batch's rows
        args = batch if self._has_first else ()
        try:
            if train:
                with contextlib.ExitStack() as stack:
                    for mod in self.stages.values():
                        stack.enter_context(_deferred_sync(mod))
                    self._schedule.step(*args, target=rows, return_outputs=False)
            else:
                with torch.no_grad():
                    self._forward_only(batch)
        except BaseException as exc:
            for p in self._acc.params:  # the gradients as they were before the step
                p.grad = self._acc.stash.get(id(p))
            failed = exc
            while failed is not None and not isinstance(failed, GuardFailed):
                failed = failed.__cause__ or failed.__context__
            if failed is not None:  # a stage's guard, wrapped by the schedule ("[Stage 0] failed to run forward"):
                raise failed from None  # its own line (a stage's program is never respecialised: it names why)
            raise
        finally:
            self._batch, self._loss_fn = (), None
        acc, self._acc = self._acc, None
        totals = torch.stack([acc.loss_sum, acc.count])
        dist.broadcast(totals, group=self._pp_group, group_src=self._pp - 1)  # the last stage knows them
        acc.loss_sum, acc.count = totals[0], totals[1]
        if train:
            self._sum_tied_grads()
        return acc.finish(self._dtype)

    def train_step(self, *batch: Any, loss_fn: Callable | None = None) -> torch.Tensor:
        """One training step: the batch (dim 0) cut into ``num_microbatches`` micro-batches run by the
        schedule; returns the whole batch's loss (detached, on every rank) and leaves every local
        shard's gradient equal to the single-device gradient of that loss (added to what it held).
        ``loss_fn(output, *micro_batch_args)`` gives a micro-batch's loss, a mean or a
        ``(loss_sum, count)`` pair (``None``: the model returns its loss); see
        :mod:`nnscaler.runtime.microbatch`. The optimizer step stays the caller's."""
        loss = self._run(batch, loss_fn, train=True)
        after_backward(self)  # the recipe's steps on the gradients: clipping, ... (nnscaler.runtime.grad_steps)
        return loss

    def build_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        """This rank's optimizer over its stages' parameters, as ``ParallelModule.build_optimizer`` builds
        one: under ``ComputeConfig(zero=1|2)`` one :class:`~nnscaler.runtime.zero.ZeroOptimizer` over
        the slices of every stage this rank runs (each over its stage's data-parallel ranks)."""
        zeros = [mod._zero for _, mod in sorted(self.stages.items()) if mod._zero is not None]
        if not zeros:
            return optimizer_class(self.parameters(), **kwargs)
        from .zero import ZeroOptimizer
        return ZeroOptimizer(zeros, optimizer_class, **kwargs)

    def boundary_dtypes(self) -> set[torch.dtype]:
        """The traced floating dtypes of the tensors crossing between stages (what a transfer carries)."""
        return {t.dtype for meta in self._metas for t in (*meta.inputs, *meta.outputs)
                if t is not None and t.dtype.is_floating_point}

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter tensors this rank holds (every stage it runs)."""
        return list(self.parameters())

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds now: each parameter's and, under zero 2, each stage's
        reduce-scattered gradient shards."""
        return [t.grad for t in clip.holders(self) if real(t.grad) is not None]  # not zero 2/3's placeholders

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole model over every stage (each piece of each
        gradient counted once; a parameter tied across stages once, in its owner stage; see
        :mod:`nnscaler.runtime.clip`): clips every local gradient and returns the total norm (the same
        on every rank). ``train_step`` calls it when ``ComputeConfig(clip_grad_norm=...)`` sets it."""
        total = self.grad_norm(norm_type)
        clip.clip_(clip.holders(self), max_norm, total, error_if_nonfinite)
        self.last_grad_norm = total
        return total

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm over every stage (each piece once), the same on every rank."""
        grads, first = [], clip.is_first_replica(self._replica_group)
        for s, mod in self.stages.items():
            grads += clip.counted_grads(mod, skip=[n for n in self.tied if self._owner[n] != int(s)], first_replica=first)
        return clip.total_norm(clip.local_sum(grads, norm_type), norm_type, self.process_group,
                               clip.grad_dtype(clip.holders(self)))

    def forward(self, *batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (any number of micro-batches of the compiled size), forward only: on
        every rank, the mean over the batch (``(loss_sum, count)`` weighting), no gradients."""
        return self._run(batch, None, train=False)

    def _forward_only(self, batch: tuple) -> None:
        """Each micro-batch through the stages in order, activations sent point to point over the
        pipeline group. Our own loop: the library's ``eval()`` runs its schedule's fixed number of
        micro-batches, and re-sizing a stage for another count breaks the training schedule's buffers."""
        micro = self._metas[0].inputs[0].shape[0]
        if batch_rows(batch) % micro:
            raise MicroBatchError(f"forward: the batch's {batch_rows(batch)} rows are not a multiple of the compiled "
                                  f"micro-batch ({micro} rows)")
        held = {int(s): mod for s, mod in self.stages.items()}
        peer = lambda s: dist.get_global_rank(self._pp_group, s % self._pp)  # noqa: E731
        for i in range(batch_rows(batch) // micro):
            x = tuple(a[i * micro:(i + 1) * micro] if isinstance(a, torch.Tensor) and a.dim() else a for a in batch)
            for s in range(self._n):
                if s not in held:
                    continue
                if s > 0 and s - 1 not in held:
                    x = tuple(_example(t).detach() for t in self._metas[s].inputs)
                    for t in x:
                        dist.recv(t, src=peer(s - 1), group=self._pp_group)
                out = held[s](*x)
                x = out if isinstance(out, tuple) else (out,)
                x = tuple(t.to(o.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and hasattr(o, "dtype")
                          else t for t, o in zip(x, self._metas[s].outputs))  # bf16-mixed: in the traced dtype
                if s == self._n - 1:
                    self._micro_loss(x[0], torch.arange(i * micro, (i + 1) * micro))
                elif s + 1 not in held:
                    for t in x:
                        dist.send(t.contiguous(), dst=peer(s + 1), group=self._pp_group)

    def _sum_tied_grads(self) -> None:
        """Every copy of a parameter used by several stages gets the sum of their gradients."""
        for name in self.tied:
            total = torch.zeros(self._shapes[name])
            copies = []
            for s, mod in self.stages.items():
                key = name.replace(".", "__")
                if key in mod._names and isinstance(getattr(mod, key), torch.nn.Parameter):
                    p = getattr(mod, key)
                    copies.append((mod, p))
                    if p.grad is not None:
                        total += mod._whole(name, p.grad.detach())
            dist.all_reduce(total, group=self._pp_group)
            for mod, p in copies:
                piece = take(total, mod._program.STATE[name][2]).to(p.dtype)
                p.grad = piece.clone() if p.grad is None else p.grad.copy_(piece)

    # -- whole-model state --------------------------------------------------------------------------
    def _persistent(self) -> frozenset[str] | None:
        """The names the model's own ``state_dict`` lists (every stage was built from the one model)."""
        return next(iter(self.stages.values()))._persistent

    def _merged(self, per_stage: Callable[[ParallelModule], Mapping[str, Any]]) -> dict[str, Any]:
        mine = {}
        for s, mod in self.stages.items():
            for n, v in per_stage(mod).items():
                if self._owner.get(n) == int(s):
                    mine[n] = v
        parts: list[dict | None] = [None] * self._pp
        dist.all_gather_object(parts, mine, group=self._pp_group)
        out = {}
        for p in parts:
            out.update(p)
        return out

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # noqa: D401
        """Whole tensors under the single-device model's names, merged across stages."""
        return self._merged(lambda mod: mod.state_dict())

    def whole_state(self) -> dict[str, torch.Tensor]:
        """Every tensor the stages hold (non-persistent buffers included), merged across stages."""
        return self._merged(lambda mod: mod.whole_state())

    def whole_grads(self) -> dict[str, torch.Tensor | None]:
        """Whole gradients of the trainable parameters, merged across stages."""
        return self._merged(lambda mod: mod.whole_grads())

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load whole tensors into every stage (each takes the names it holds); ``strict`` asks for
        what :meth:`state_dict` lists (no non-persistent buffer)."""
        names = set(self._shapes)
        persistent = self._persistent()
        missing = sorted(n for n in names if n not in state_dict and (persistent is None or n in persistent))
        unexpected = sorted(n for n in state_dict if n not in names)
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing {missing}, unexpected {unexpected}")
        for mod in self.stages.values():
            mod.load_state_dict({n: v for n, v in state_dict.items() if n in set(mod._names.values())}, strict=False)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
