"""Pipeline parallelism: the traced graph cut into stages (:mod:`.cut`), each stage partitioned by any
policy over its own ranks and generated like a whole model, run by the schedules of
``torch.distributed.pipelining`` (:mod:`.runtime`). Pipeline policies by name: :mod:`.policies`."""
from .build import parallelize_pipeline
from .checks import check_config, check_model, cut_units
from .policies import PIPELINE_POLICIES, is_pipeline_policy
from .runtime import PipelineModule
from .schedules import SCHEDULES

__all__ = ["parallelize_pipeline", "check_config", "check_model", "cut_units", "PIPELINE_POLICIES",
           "is_pipeline_policy", "PipelineModule", "SCHEDULES"]
