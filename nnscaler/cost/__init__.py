"""The cost model: compute time per operator (from its annotation), collective time (alpha-beta per
group, from a device profile), and memory per rank (parameters, gradients, AdamW states, saved
activations). ``nnscaler.cost.estimate.analyze`` costs a whole plan."""
from .comm import collective_time, spans_nodes
from .compute import op_flops, op_time
from .steps import Collective, step_collectives
from ..profiles import PROFILES, DeviceProfile, ProfileError, get_profile

__all__ = ["collective_time", "spans_nodes", "op_flops", "op_time", "Collective", "step_collectives", "PROFILES", "DeviceProfile", "ProfileError", "get_profile"]
