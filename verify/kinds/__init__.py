"""Every case kind a rank answers, registered on import (DTensor's ``_ops/__init__.py``): an operator's
partitions and one partition (:mod:`.op`), a layout conversion (:mod:`.conversion`), a whole model under
a policy, its replicas or pipeline (:mod:`.model`), micro-batch accumulation (:mod:`.accumulation`) and a
torch parallelization (:mod:`.torchpar`) and a saved cluster plan (:mod:`.plan`). A new kind is one module
here, imported below."""
from verify.kinds import accumulation, conversion, model, op, plan, torchpar  # noqa: F401  (each registers its kind)
from verify.kinds.registry import KINDS, CaseKind, UnknownKind, case_kind, kind_class, kind_of  # noqa: F401
