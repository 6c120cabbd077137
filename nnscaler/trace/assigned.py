"""A buffer a submodule's forward assigns anew (I-BERT's ``QuantAct``: ``self.x_min = self.x_min + x_min``),
carried out like one written in place.

``torch.export`` (non-strict) follows such an assignment on the root module only (torch's
``register_buffer_assignment_hook`` "intercepts buffer assignments on the root module": it copies the
new value into the buffer at the end of the graph, a ``BUFFER_MUTATION`` output); on a submodule the
assignment is traced and dropped, and the compiled program left the buffer as it was (caught by the
harness: ``the compiled program does not write them``). :func:`submodule_assignments` does for every
submodule what torch does for the root: the first assignment of each buffer remembers the tensor the
trace holds for it, and after the root's forward the last value assigned is copied into that tensor
and put back in its place; reads in between see the assigned value, as in eager mode."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def submodule_assignments(model: torch.nn.Module) -> Iterator[None]:
    """Within (around ``torch.export.export(model, ...)``): a buffer of a submodule of ``model`` assigned
    in forward is written by the traced program, as a root module's buffer is by torch."""
    first: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.Tensor]] = {}

    def assigned(module: torch.nn.Module, name: str, value: Any) -> Any:
        if module is not model and name in module._buffers and isinstance(value, torch.Tensor) \
                and isinstance(module._buffers[name], torch.Tensor) and value is not module._buffers[name]:
            first.setdefault((id(module), name), (module, name, module._buffers[name]))
        return None  # (the value assigned stands)

    def written(root: torch.nn.Module, args: Any, output: Any) -> None:
        for module, name, held in first.values():
            new = module._buffers[name]
            if new is not held:
                if tuple(new.shape) != tuple(held.shape) or new.dtype != held.dtype:
                    raise TypeError(f"forward assigns buffer {name} of {type(module).__name__} a tensor of shape "
                                    f"{tuple(new.shape)} and {new.dtype}, where it held {tuple(held.shape)} and "
                                    f"{held.dtype}: a compiled program writes a buffer in place")
                held.copy_(new)  # (torch's own aten.copy_ for the root's: a write of the value the model's line made)
                module._buffers[name] = held
        first.clear()

    hook = torch.nn.modules.module.register_module_buffer_registration_hook(assigned)
    after = model.register_forward_hook(written)
    try:
        yield
    finally:
        hook.remove()
        after.remove()
