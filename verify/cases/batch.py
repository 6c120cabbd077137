"""A model's batch as the cases use it: cast to the case's dtype, and shared out among data-parallel
replicas (equal rows of dim 0, as ``nnscaler`` feeds each replica)."""
from __future__ import annotations

import torch

from verify.judge.dtypes import convert


def cast(args: tuple, dtype: torch.dtype) -> tuple:
    """``args`` with every floating tensor in ``dtype`` and every complex one in its complex twin
    (:func:`verify.judge.dtypes.convert`; indices and non-tensors as they are)."""
    return tuple(convert(a, dtype) for a in args)


def share(args: tuple, replica: int, replicas: int) -> tuple:
    """Replica ``replica``'s rows of every batched tensor argument (dim 0, equal shares); a batch the
    replicas cannot share equally is a ``ValueError`` naming its size."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            if a.shape[0] % replicas:
                raise ValueError(f"a batch of {a.shape[0]} rows cannot be shared by {replicas} replicas")
            a = a.chunk(replicas)[replica]
        out.append(a)
    return tuple(out)
