"""FSDP2 programs trained as they ship, on gloo: reductions gloo lacks, and a disabled gradient division.

gloo has no ``PREMUL_SUM`` (FSDP2's reduce-scatter under a custom gradient divide factor) nor ``AVG``;
FSDP2's own switch ``set_force_sum_reduction_for_comms`` makes every such reduction a plain sum with
the scaling done apart (torch's own emulation, exact where the factor is 1), so the harness sets it on
gloo (:func:`sum_reductions_on_gloo`).

A program that disables FSDP's division of the summed gradients (torchtitan's
``disable_fsdp_gradient_division``: ``set_gradient_divide_factor(1.0)``) expects its training loop to
scale each rank's loss, as torchtitan's does (the sum over its tokens divided by the global token count):
the harness's step scales each rank's mean loss by ``1 / dp`` before backward (:func:`loss_scale`),
so the summed gradients are those of the mean over the whole batch, and the row says so."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule


def _groups(module: torch.nn.Module):
    """FSDP2's parameter groups of every ``fully_shard``-ed module in ``module``."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            yield from m._get_fsdp_state()._fsdp_param_groups  # torch keeps them here (no public accessor)


def sum_reductions_on_gloo(module: torch.nn.Module) -> str:
    """On a gloo process group, every FSDP2 module of ``module`` reduces by sum with the scaling apart;
    a note that says so (empty where nothing changed)."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return ""
    changed = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in changed:
        m.set_force_sum_reduction_for_comms(True)
    return (f"FSDP2 reductions as sums with the scaling apart on gloo (it has no PREMUL_SUM or AVG; torch's "
            f"set_force_sum_reduction_for_comms on {len(changed)} modules)") if changed else ""


def _dp_size(group) -> int:
    info = group.mesh_info
    return getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1)


def loss_scale(module: torch.nn.Module, degree: int) -> tuple[float, str]:
    """The factor each rank's mean loss is scaled by before backward, and a note (empty at 1): ``1 / degree``
    where FSDP2's gradient division is disabled (``gradient_divide_factor`` 1) in any of its groups, ``degree``
    being the ranks that split the step's tokens (the data and context dimensions): the loop such a program
    expects normalises its loss by the global token count, so the summed gradients of every group (the dense
    ones over dp, experts over their own mesh, fed every rank's tokens) are those of the mean. Any other
    factor is the program's own division, judged as it comes (a wrong one fails its gradients)."""
    if degree == 1 or not any(g.gradient_divide_factor == 1.0 for g in _groups(module)):
        return 1.0, ""
    sizes = sorted({_dp_size(g) for g in _groups(module) if g.gradient_divide_factor == 1.0})
    return 1.0 / degree, (f"FSDP2 gradient division disabled (over dp={', '.join(map(str, sizes))}): each rank's loss "
                          f"scaled by 1/{degree} before backward, the global-token normalisation of the training "
                          f"loop it expects (torchtitan's)")
