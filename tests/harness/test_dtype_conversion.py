"""The user's model, as written: one dtype conversion (``verify/judge/dtypes.py``) for every run and
reference (real floating to the run's dtype, complex to its complex twin, integer and boolean untouched),
so a complex RoPE cache (torchtitan's Llama) keeps its imaginary part in the float32 runs; and a bound far
over its dtype's rounding is named in the row, with why (``verify/judge/compare.py``)."""
from __future__ import annotations

import tempfile

import pytest
import torch

from verify.config import RunConfig
from verify.judge.compare import WIDE_NOTE, Float64Fallback, check_tensor
from verify.judge.dtypes import convert, convert_state, to_dtype
from verify.judge.verdict import MATCH, WIDENED, judge
from verify.judge.answer import RankAnswer

TENSORS = {"float32": torch.randn(3), "float64": torch.randn(3, dtype=torch.float64),
           "bfloat16": torch.randn(3).bfloat16(), "complex64": torch.randn(3, dtype=torch.complex64),
           "complex128": torch.randn(3, dtype=torch.complex128), "int64": torch.arange(3),
           "int32": torch.arange(3, dtype=torch.int32), "bool": torch.tensor([True, False, True])}
WANT = {  # run dtype -> what each input becomes
    torch.float32: {"float32": torch.float32, "float64": torch.float32, "bfloat16": torch.float32,
                    "complex64": torch.complex64, "complex128": torch.complex64},
    torch.float64: {"float32": torch.float64, "float64": torch.float64, "bfloat16": torch.float64,
                    "complex64": torch.complex128, "complex128": torch.complex128},
    torch.bfloat16: {"float32": torch.bfloat16, "float64": torch.bfloat16, "bfloat16": torch.bfloat16,
                     "complex64": torch.complex64, "complex128": torch.complex64},
}


@pytest.mark.parametrize("dtype", list(WANT))
@pytest.mark.parametrize("name", list(TENSORS))
def test_convert_changes_only_what_it_must(name, dtype):
    x = TENSORS[name]
    y = convert(x, dtype)
    assert y.dtype == WANT[dtype].get(name, x.dtype)
    if x.is_complex():  # the imaginary part survives
        assert torch.allclose(y.imag.double(), x.imag.double(), atol=1e-6)
    if not (x.is_floating_point() or x.is_complex()):
        assert y is x
    assert convert(3.0, dtype) == 3.0 and convert(None, dtype) is None


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        angles = torch.arange(4.0)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(4), angles))
        self.register_buffer("ids", torch.arange(4))
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize("dtype, cdt", [(torch.float32, torch.complex64), (torch.float64, torch.complex128),
                                        (torch.bfloat16, torch.complex64)])
def test_to_dtype_keeps_complex_buffers_complex(dtype, cdt):
    m = _Holder()
    before = m.freqs_cis.clone()
    assert to_dtype(m, dtype) is m
    assert m.w.dtype == dtype and isinstance(m.w, torch.nn.Parameter)
    assert m.freqs_cis.dtype == cdt and torch.allclose(m.freqs_cis.to(torch.complex128), before.to(torch.complex128))
    assert m.ids.dtype == torch.int64 and m.mask.dtype == torch.bool
    state = convert_state(m.state_dict(), torch.float64)
    assert state["freqs_cis"].dtype == torch.complex128 and state["ids"].dtype == torch.int64


def test_what_model_to_float32_did():
    """The fault this fixes: ``Module.to(float32)`` drops a complex buffer's imaginary part."""
    with pytest.warns(UserWarning):
        m = _Holder().to(torch.float32)
    assert not m.freqs_cis.is_complex()


def test_complex_rope_twin_computes_what_the_real_one_does():
    from verify.models.titan_llama import titan_llama, titan_llama_complex
    real, cplx = titan_llama(0), titan_llama_complex(0)
    args = real.batch(0)
    assert cplx.model.model.rope.is_complex()
    assert torch.allclose(real.model(*args), cplx.model(*args), atol=1e-6)
    m64 = to_dtype(titan_llama_complex(0).model, torch.float64)
    assert m64.model.rope.dtype == torch.complex128
    assert abs(float(m64(*args)) - float(real.model(*args))) < 1e-5


def test_a_widened_bound_is_named_with_why():
    ref = torch.randn(64, dtype=torch.float64)
    dev = (ref + 1e-3 * torch.randn(64, dtype=torch.float64)).float()  # far from float64: ~1e4 ulps
    wide = check_tensor("grad w step 0", dev.clone(), dev, ref)
    tight = check_tensor("grad v step 0", ref.float(), ref.float(), ref)
    assert wide.ok and wide.widened > WIDE_NOTE and tight.widened <= WIDE_NOTE
    fallback = Float64Fallback(torch.float32)
    with fallback:  # a reference that held a complex64 tensor (the bug's float64 reference)
        torch.ones(3, dtype=torch.complex128) * torch.ones(3, dtype=torch.complex64)
    notes = fallback.notes("float32", [wide, tight])
    note = next(c.name for c in notes if c.name.startswith(WIDENED))
    assert "grad w step 0" in note and "grad v" not in note and "aten.mul.Tensor" in note, note
    assert not Float64Fallback(torch.float32).notes("float32", [tight])
    # the row says it: a MATCH row's detail carries the note
    checks = [c.__dict__ for c in [wide, tight, *notes]]
    status, detail, _, _ = judge([RankAnswer(0, {"checks": checks})])
    assert status == MATCH and detail.startswith("widened bound") and "grad w step 0" in detail


# -- on ranks: the complex RoPE cache bounded as its real twin ---------------------------------------------
@pytest.mark.parametrize("policy", ["tp"])
def test_complex_rope_bound_equals_the_real_twins(gang, policy):
    from verify.rows.run import run_model
    rows = {}
    for name in ("titan_llama", "titan_llama_complex"):
        with tempfile.TemporaryDirectory() as tmp:
            (row,) = run_model(gang, f"verify/models/titan_llama.py:{name}", (policy,),
                               RunConfig(world_sizes=(2,), seeds=(0,)), tmp, steps=2, checkpoint=False)
        assert row.status == MATCH, (name, row.detail)
        rows[name] = row
    real, cplx = rows["titan_llama"], rows["titan_llama_complex"]
    assert cplx.grad_tol <= 4 * real.grad_tol and cplx.out_tol <= 4 * real.out_tol, (cplx, real)
    assert "widened bound" not in cplx.detail
