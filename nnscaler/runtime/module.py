"""The module ``parallelize`` returns: this rank's shards of the model's state, run by the generated
program; ``state_dict`` merges shards back to the single-device model's names and shapes."""
from __future__ import annotations

import types
import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from ..dimops.layout import Shard, take_piece
from . import clip
from .grad_steps import after_backward
from ..recipe import Recipe
from .grad_sync import GradSync
from .precision import GRAD_REDUCE_DTYPES, PrecisionError, autocast_message, autocast_on
from .mesh import RankMesh
from .merge import gather_joined
from .microbatch import accumulate
from .program import REPLICAS, GuardFailed
from .zero import guard_hand_zero
from .shard_grad import real
from .zero3 import GatheredParams, saved_hooks


def _parse_layout(text: Sequence[str]) -> list:
    return [Shard.parse(q) if q.startswith("D") else None for q in text]


MAX_PROGRAMS = 8  # the most programs one module holds, one per branch its state took (torch.compile's cache_size_limit is 8)
GATHER_BUCKET_BYTES = 64 << 20  # the most one state_dict all_gather sends per rank


def take(full: torch.Tensor, slices: Sequence[tuple]) -> torch.Tensor:
    """The piece of ``full`` at ``slices`` (``(start, stop)`` per dim, ``(start, stop, blocks)``
    for a dim split in blocks)."""
    return take_piece(full, slices)


def block_of(name: str) -> str:
    """The model block a parameter belongs to: its name up to the first numbered module (``h.0``,
    ``layers.3``), else the module that holds it (``model.embed_tokens``, ``model.norm``, ``lm_head``): zero 3
    gathers a block at a time. Not the first module: Llama's embedding and final norm (both under ``model``)
    then shared a bucket, so the final norm regathered the whole embedding in forward and again in backward
    (measured: 2 GiB a rank on Llama-3 8B, ``bench/results/real_memory.md``)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def _rng_state() -> tuple:
    """The random generators' states (CPU, and the current accelerator's if it is in use)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class ParallelModule(torch.nn.Module):
    """One rank's part of a parallelized model.

    ``program`` is the generated module (``forward(p, g, *inputs)``, ``STATE``); parameters are
    registered under their model names with dots replaced by ``__`` (``named_parameters`` and
    optimizers see the local shards); ``state_dict``/``load_state_dict`` speak whole tensors under
    the original names. ``forward`` runs one micro-batch; :meth:`train_step` a whole batch of
    ``num_microbatches`` of them with gradient accumulation. ``recipe``: the training recipe
    (:class:`~nnscaler.recipe.Recipe`: precision, micro-batches, buckets, clipping); ``zero``: this rank's
    ZeRO layout (:class:`~nnscaler.compile.zero.ZeroSpec`), made from ``recipe.zero`` and the plan.
    A guard of the program on the model's state that fails (a branch on a buffer that flips during
    training) switches it to the program of the other branch, on the same parameters (:meth:`_next_program`).
    """

    def __init__(self, program: types.ModuleType, full_state: Mapping[str, torch.Tensor], mesh: RankMesh,
                 trainable: set[str], replica_group=None, replicas: int = 1, recipe: Recipe | None = None,
                 zero=None, persistent: frozenset[str] | None = None):
        super().__init__()
        self.recipe = recipe = recipe or Recipe()
        precision, bucket_bytes = recipe.precision, recipe.bucket_bytes
        self.precision = precision  # nnscaler.runtime.precision: bf16-true holds its state in bf16
        self.num_microbatches = recipe.num_microbatches
        self._program = program
        # a program per branch of the model's state (see _next_program): what parallelize sets to make one,
        # why none is made where it sets nothing, and (program name, guard failed) -> (program, plan, graph)
        self.respecialise: Callable | None = None
        self.no_respecialise = "a pipeline stage's program is traced once (compile without pipeline stages)"
        self._branches: dict[tuple[str, str], tuple] = {}
        self._mesh = mesh
        self._replica_group, self._replicas = replica_group, replicas
        self.process_group = None  # the group of every rank running this module (None: the default group)
        self._names: dict[str, str] = {}
        # the names the model's own state_dict lists (None: every tensor held): non-persistent buffers
        # (RoPE tables) and traced constants stay out of state_dict, as in torch
        self._persistent = persistent
        synced, trainables = [], []
        for name, (shape, layout, slices, sync_axis) in program.STATE.items():
            if name not in full_state:
                raise KeyError(f"the generated program needs {name!r}, which the model does not have")
            full = full_state[name]
            if tuple(full.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {tuple(full.shape)} but the plan was made for {tuple(shape)}")
            local = take(full.detach(), slices).clone()
            if precision == "bf16-true" and local.is_floating_point():
                local = local.to(torch.bfloat16)
            key = name.replace(".", "__")
            self._names[key] = name
            if name in trainable:  # (a parameter no output reads gets no gradient: nothing to sync or step)
                param = torch.nn.Parameter(local, requires_grad=full.requires_grad and name not in getattr(program, "NO_GRAD", ()))
                self.register_parameter(key, param)
                if param.requires_grad:
                    trainables.append(param)
                if sync_axis is not None and mesh.groups[sync_axis] is not None and param.requires_grad:
                    synced.append((param, mesh.groups[sync_axis]))
            else:
                self.register_buffer(key, local)
        guard_hand_zero()  # a ZeroRedundancyOptimizer over split parameters is refused at its first step
        self._zero = None  # ZeroShards under ComputeConfig(zero >= 1) (nnscaler.runtime.zero)
        if zero is not None:
            synced, trainables = self._zero_setup(zero, synced, trainables, program, bucket_bytes)
        self._grad_sync = GradSync.build(synced, bucket_bytes, replicas=trainables, replica_group=replica_group,
                                         n_replicas=replicas, reduce_dtype=GRAD_REDUCE_DTYPES.get(
                                             recipe.grad_reduce_dtype or "fp32") if precision == "bf16-mixed" else None)
        self._grad_sync.attach()
        self.last_grad_norm: torch.Tensor | None = None  # the total norm the last clip_grad_norm_ found
        clip.register(self)  # while alive, torch.nn.utils.clip_grad_norm_(self.parameters()) gets the whole model's norm

    def _zero_setup(self, zero, synced, trainables, program, bucket_bytes):
        """Tag every parameter with the ranks holding the same piece (``zero.ranks``); with a stage
        above 0 pack the trainable ones into :class:`~nnscaler.runtime.zero.ZeroShards` and return the
        gradient syncs left to :class:`GradSync` (zero 2 reduce-scatters the rest itself)."""
        from .grad_sync import BUCKET_BYTES
        from .zero import ZeroShards
        names = {id(p): k for k, p in self.named_parameters()}
        replica_ranks = dist.get_process_group_ranks(self._replica_group) if self._replica_group is not None \
            else [dist.get_rank()]
        own = {}  # split along the data-parallel axis (an expert): the same piece on the replicas only
        for p in self.parameters():
            layout = program.STATE[self._names[names[id(p)]]][1]
            if zero.dp_axis is not None and str(layout[zero.dp_axis]).startswith("D"):
                own[id(p)] = (self._replica_group, replica_ranks)
            p._nnscaler_same_ranks = frozenset(own[id(p)][1] if id(p) in own else zero.ranks)
            p._nnscaler_zero_stage = zero.stage  # an optimizer by hand finds no gradients from stage 2 on
        if zero.stage == 0:
            return synced, trainables
        axis_of = {name.replace(".", "__"): entry[3] for name, entry in program.STATE.items()}  # sync axis by key
        d = self._mesh.shape[zero.dp_axis] if zero.dp_axis is not None else 1
        outside, scales, tied = {}, {}, set()
        for p in trainables:
            ax = axis_of[names[id(p)]]
            if ax is not None and self._mesh.groups[ax] is not None and ax != zero.dp_axis:
                outside[id(p)] = self._mesh.groups[ax]  # also summed over a non-data-parallel axis: all-reduced first
            if self._names[names[id(p)]] in zero.unscattered:
                tied.add(id(p))  # summed across pipeline stages after backward: all-reduced, then sliced
            # reduce-scatter sums over the zero group: a gradient partial over the dp axis is summed there,
            # a complete one is counted d times; replicas are averaged
            scales[id(p)] = 1.0 / (self._replicas * (1 if ax == zero.dp_axis or id(p) in own else d))
        blocks = {id(p): block_of(self._names[names[id(p)]]) for p in trainables}
        self._zero = ZeroShards(trainables, zero.stage, zero.group, zero.ranks, outside, scales,
                                BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
                                blocks if zero.stage >= 3 else None, zero.dp_axis, frozenset(tied), own)
        if zero.stage < 2:
            return synced, trainables
        if zero.stage >= 3:  # the program reads each parameter from its gathered bucket (nnscaler.runtime.zero3)
            self._gathered_at = {self._names[names[id(p)]]: (b, i) for b in self._zero.buckets if b.scatter
                                 for i, p in enumerate(b.params)}
        else:
            self._zero.attach()
        mine = {id(p) for b in self._zero.buckets if b.scatter for p in b.params}
        return [(p, g) for p, g in synced if id(p) not in mine], [p for p in trainables if id(p) not in mine]

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter tensors this rank holds now: the parameters and, under zero 3, their shards
        (the parameters themselves then hold no storage outside the forward)."""
        out = list(self.parameters())
        if self._zero is not None and self._zero.stage >= 3:
            out += [b.shard for b in self._zero.buckets]
        return out

    def materialized(self, writeback: bool = False):
        """A context in which every parameter holds its whole local piece (zero 3 gathers its shards;
        ``writeback``: what was written into them is then sharded again); otherwise nothing."""
        return self._zero.materialized(writeback) if self._zero is not None else nullcontext()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds now: each parameter's ``.grad`` and, under zero 2,
        the reduce-scattered gradient shards."""
        out = [p.grad for p in self.parameters() if real(p.grad) is not None]  # not zero 2/3's placeholders
        if self._zero is not None:
            out += [b.shard.grad for b in self._zero.buckets if b.shard.grad is not None]
        return out

    def build_optimizer(self, optimizer_class: type = torch.optim.AdamW, **kwargs):
        """``optimizer_class(self.parameters(), **kwargs)``; under ``ComputeConfig(zero >= 1)`` the same
        optimizer run on this rank's slices of the parameters over the data-parallel ranks (a
        :class:`~nnscaler.runtime.zero.ZeroOptimizer`, state ``1/n`` of the plain one's)."""
        if self._zero is None:
            return optimizer_class(self.parameters(), **kwargs)
        from .zero import ZeroOptimizer
        return ZeroOptimizer(self._zero, optimizer_class, **kwargs)

    def _local(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, key) for key, name in self._names.items()}

    @property
    def mesh(self) -> RankMesh:
        """This rank's mesh: its process group per plan axis (None where the axis is 1) and its offset."""
        return self._mesh

    def forward(self, *inputs: Any) -> Any:
        refused = autocast_message(self.precision)
        if refused:
            raise PrecisionError(refused)
        if self.precision == "bf16-true":
            inputs = tuple(x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                           for x in inputs)
        off = torch.autocast(autocast_on(), enabled=False) if self.precision == "bf16-mixed" and autocast_on() \
            else nullcontext()  # bf16-mixed: the program casts as autocast would, so autocast is off inside
        tried: set = set()
        draws = _rng_state() if self.respecialise is not None else None  # the rerun draws what the first run drew
        while True:
            try:
                return self._run(off, inputs)
            except GuardFailed as failed:  # on the model's state: another program for that branch, and again
                self._next_program(failed, inputs, tried)
                _set_rng_state(draws)

    def _run(self, off, inputs: tuple) -> Any:
        replicas = REPLICAS.set(self._replica_group if self._replicas > 1 else None)  # data guards, batch writes
        try:
            if self._zero is None or self._zero.stage < 3:
                with off:
                    return self._program.forward(self._local(), self._mesh.groups, *inputs)
            params = GatheredParams(self._zero, self._local(), self._gathered_at)
            try:
                with off, saved_hooks(self._zero):
                    return self._program.forward(params, self._mesh.groups, *inputs)
            finally:
                params.close()
        finally:
            REPLICAS.reset(replicas)

    def _next_program(self, failed: GuardFailed, inputs: tuple, tried: set) -> None:
        """Switch to the program of the branch the model's state now takes, after ``failed`` (a guard
        on the state alone: I-BERT's ``if self.x_min.min() > -1.1e-5 ...`` holds at the first step, on
        zero buffers, and never after), as torch.compile recompiles on a failed guard: the program
        this one's failure of that guard led to before, or a new one from :attr:`respecialise` (the
        model traced again on its current state and ``inputs``, planned alike); the parameters, and
        with them the optimizer's state, stay this module's. Raises ``failed`` (one line naming the
        model's line) for a guard on the input, where no respecialisation is wired (a pipeline
        stage), or when the new program fails it too. A micro-batch of :meth:`train_step` is one forward
        like any other (a buffer one writes, the next reads, as on one device)."""
        if not failed.on_state:
            raise failed
        if self.respecialise is None:
            raise GuardFailed(f"{failed} (this module's program is not respecialised on the model's state: "
                              f"{self.no_respecialise})", failed.name, failed.where, failed.text, True) from None
        key = (self._program.__name__, failed.name)
        if key in tried:
            raise GuardFailed(f"{failed} (and so does the program traced again for it)", failed.name, failed.where,
                              failed.text, True) from None
        tried.add(key)
        nxt = self._branches.get(key)
        if nxt is None:
            if len({id(p) for p, _, _ in self._branches.values()} | {id(self._program)}) >= MAX_PROGRAMS:
                raise GuardFailed(f"{failed}: this module holds {MAX_PROGRAMS} programs already, one per branch "
                                  f"its state took (MAX_PROGRAMS)", failed.name, failed.where, failed.text,
                                  True) from None
            nxt = self.respecialise(self, failed, inputs)
            self._same_state(nxt[0], failed)
            self._branches[key] = nxt
        self._program, self.plan, self.graph = nxt

    def _same_state(self, program: types.ModuleType, failed: GuardFailed) -> None:
        """The respecialised ``program`` holds this module's parameters and buffers exactly as the
        current one does (names, shapes, layouts, pieces): else it cannot take them over, and says so."""
        old, new = self._program.STATE, program.STATE
        differs = next((n for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)), None)
        if differs is None and set(getattr(self._program, "NO_GRAD", ())) == set(getattr(program, "NO_GRAD", ())):
            return
        raise GuardFailed(f"{failed}; the program traced again for the branch the state now takes holds "
                          f"{differs or 'the gradients'} otherwise ({new.get(differs)} against {old.get(differs)}), "
                          f"so it cannot take over this module's state", failed.name, failed.where, failed.text, True)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients on this rank without synchronising them (as
        ``DistributedDataParallel.no_sync``); the first backward after it syncs the accumulated sum
        (within the plan and over data-parallel replicas). Without it every backward syncs: the same
        gradients, only more communication (see :mod:`nnscaler.runtime.grad_sync`)."""
        zero = self._zero
        before = zero.paused if zero is not None else False
        if zero is not None:
            zero.paused = True
        try:
            with self._grad_sync.paused():
                yield
        finally:
            if zero is not None:
                zero.paused = before

    def train_step(self, *batch: Any, loss_fn: Callable[..., Any] | None = None, **batch_kwargs: Any) -> torch.Tensor:
        """Forward and backward of one whole batch as ``num_microbatches`` micro-batches (every tensor
        argument with a dim 0 is split along it), gradients synced once, after the last; return the
        whole batch's loss (a detached scalar, the same on every rank, over all data-parallel
        replicas). The local shards' ``.grad`` then hold the single-device gradient of that loss
        (added to any gradient they held before); the optimizer step stays the caller's.

        The loss of a micro-batch is ``loss_fn(output, *args, **kwargs)`` of its output and arguments,
        or the output itself: a scalar mean (micro-batches weighted by their rows), or a pair
        ``(loss_sum, count)`` when the number of elements averaged varies (padded targets with
        ``ignore_index``): the whole batch's loss is then ``sum(loss_sum) / sum(count)``, exactly
        (see :mod:`nnscaler.runtime.microbatch`). Raises ``MicroBatchError`` (a ``ValueError``) for a
        batch not divisible by ``num_microbatches`` or a loss that is neither."""
        params = list(self.parameters())
        if self._zero is not None:  # zero 2/3's gradient shards are set aside, scaled and restored like the .grad
            params += [b.shard for b in self._zero.buckets if b.scatter]
        loss = accumulate(self, batch, batch_kwargs, self.num_microbatches, loss_fn, params,
                          self.no_sync, self._replica_group, self._replicas)
        after_backward(self)  # the recipe's steps on the gradients: clipping, ... (nnscaler.runtime.grad_steps)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole model: the norm of every parameter's whole
        gradient, each piece counted once (split pieces summed across ranks, replicated ones and
        data-parallel replicas counted once; see :mod:`nnscaler.runtime.clip`); every rank scales its
        shards' gradients by ``max_norm / (norm + 1e-6)`` where that is below 1 and returns the total
        norm (the same on every rank). Call it after backward (``train_step`` does, when
        ``ComputeConfig(clip_grad_norm=...)`` sets it). ``torch.nn.utils.clip_grad_norm_(pm.parameters())``
        alone would see this rank's shards only; it is routed here (see :mod:`nnscaler.runtime.clip`)."""
        total = self.grad_norm(norm_type)
        clip.clip_(clip.holders(self), max_norm, total, error_if_nonfinite)
        self.last_grad_norm = total
        return total

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm (each piece counted once), the same on every rank; every
        rank of the module must call it. ``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)`` gets
        it too (see :mod:`nnscaler.runtime.clip`)."""
        counted = clip.local_sum(clip.counted_grads(self, first_replica=clip.is_first_replica(self._replica_group)),
                                 norm_type)
        return clip.total_norm(counted, norm_type, self.process_group, clip.grad_dtype(clip.holders(self)))

    def sync_replica_grads(self) -> None:
        """Deprecated, does nothing: gradients are averaged over replicas during backward."""
        warnings.warn("sync_replica_grads() is no longer needed and does nothing: gradients are averaged over "
                      "data-parallel replicas during backward; remove the call", DeprecationWarning, stacklevel=2)

    # -- whole-model state ---------------------------------------------------------------------------
    def _whole(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Gather this rank's piece of ``name`` (or of its gradient) into the whole tensor
        (:meth:`_whole_many` of one piece)."""
        return self._whole_many({name: x})[name]

    def _whole_many(self, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole tensor of each rank's piece, by name, in the order given: highest mesh axis
        first, since a higher axis splits the chunk a lower one gave (the nesting convention of
        :mod:`nnscaler.comm.conversion`, which ``shard_slices`` follows when the state is laid out).
        Per axis, one ``all_gather`` of all the pieces split on it, flattened and joined per dtype (in buckets
        of at most :data:`GATHER_BUCKET_BYTES`), where one collective per tensor cost a round trip
        each (a model's state is hundreds of small tensors). Every rank of the module must call it
        with the same names in the same order."""
        out = dict(pieces)
        layouts = {n: _parse_layout(self._program.STATE[n][1]) for n in out}
        for axis in reversed(range(max((len(q) for q in layouts.values()), default=0))):
            group = self._mesh.groups[axis]
            split = [n for n in out if axis < len(layouts[n]) and layouts[n][axis] is not None]
            if group is None or not split:
                continue
            whole = gather_joined([out[n] for n in split], [(layouts[n][axis].dim, layouts[n][axis].blocks) for n in split],
                                  group, GATHER_BUCKET_BYTES)
            out.update(zip(split, whole))
        return out

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # noqa: D401
        """Whole tensors under the single-device model's names (gathered from every rank), what the
        model's own ``state_dict`` lists: its non-persistent buffers are left out, as torch does, so a
        plain model's ``load_state_dict(strict=True)`` takes it (:meth:`whole_state` holds them too)."""
        state = self.whole_state()
        return state if self._persistent is None else {n: t for n, t in state.items() if n in self._persistent}

    def whole_state(self) -> dict[str, torch.Tensor]:
        """Every tensor the program holds, whole, by model name: :meth:`state_dict` and the model's
        non-persistent buffers and traced constants (every rank of the module must call it)."""
        with self.materialized():
            local = {name: getattr(self, key).detach() for key, name in self._names.items()}
            return {name: x.clone() for name, x in self._whole_many(local).items()}

    def whole_grads(self) -> dict[str, torch.Tensor | None]:
        """Whole gradients of the trainable parameters, under the model's names."""
        grads = {}
        for key, name in self._names.items():
            p = getattr(self, key)
            if isinstance(p, torch.nn.Parameter):
                g = p.grad if self._zero is None or self._zero.stage < 2 else self._zero.full_grad(p)  # zero 2/3: shards
                grads[name] = None if g is None else g.detach()
        whole = self._whole_many({n: g for n, g in grads.items() if g is not None})
        return {n: None if g is None else whole[n].clone() for n, g in grads.items()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load whole tensors (from the single-device model, or from ``state_dict`` under any plan);
        ``strict`` asks for what :meth:`state_dict` lists (a non-persistent buffer may be given too)."""
        held = set(self._names.values())
        missing = [n for n in self._names.values() if n not in state_dict
                   and (self._persistent is None or n in self._persistent)]
        unexpected = [n for n in state_dict if n not in held]
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing {missing}, unexpected {unexpected}")
        with torch.no_grad(), self.materialized(writeback=True):
            for key, name in self._names.items():
                if name in state_dict:
                    shape, _, slices, _ = self._program.STATE[name]
                    full = state_dict[name]
                    if tuple(full.shape) != tuple(shape):
                        raise RuntimeError(f"load_state_dict: {name} has shape {tuple(full.shape)}, expected {tuple(shape)}")
                    getattr(self, key).copy_(take(full, slices))
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

