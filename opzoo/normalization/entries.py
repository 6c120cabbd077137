"""Normalisation layers. The normalised dims are frozen (statistics span them); the leading dims
are spatial. ``group_norm`` may also split its groups: the channel dim is ``(g c)`` and
``num_groups`` is ``Size("g")``, so each rank normalises its own groups."""
from __future__ import annotations

import torch.nn.functional as F

from nnscaler import Size, register_op

FAMILY = "normalization"


def _reg(name, annotation, fn, aten, **options):
    register_op(annotation, name, family=FAMILY, aten=aten, **options)(fn)


_H = (Size("h"),)  # normalized_shape
_reg("layer_norm", "* h^, ?, h^, h^ -> * h^", F.layer_norm, "aten.layer_norm.default", args={1: _H})
_reg("layer_norm_noaffine", "* h^, ? -> * h^", F.layer_norm, "aten.layer_norm.default", args={1: _H})
_reg("layer_norm_2d", "* a^ h^, ?, a^ h^, a^ h^ -> * a^ h^", F.layer_norm, "aten.layer_norm.default",
     args={1: Size("a h")})
_reg("rms_norm", "* h^, ?, h^ -> * h^", F.rms_norm, "aten.rms_norm.default", args={1: _H},
     kwargs={"eps": 1e-6})
_reg("rms_norm_noweight", "* h^, ? -> * h^", F.rms_norm, "aten.rms_norm.default", args={1: _H},
     kwargs={"eps": 1e-6})
_reg("group_norm", "n (g c) l^, ?, (g c), (g c) -> n (g c) l^", F.group_norm, "aten.group_norm.default",
     args={1: Size("g")})
_reg("group_norm_noaffine", "n (g c) l^, ? -> n (g c) l^", F.group_norm, "aten.group_norm.default",
     args={1: Size("g")})
