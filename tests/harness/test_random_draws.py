"""Random draws judged, never absorbed: the float64 reference draws what the run in the dtype under
test drew (``verify/judge/draw_record.py``), so a bound never widens because of a draw, and models
that draw (DropPath, a VAE, diffusion noise, Gumbel-softmax: ``tests/fixtures/stochastic_models.py``)
MISMATCH with a wrong annotation, localised to the operator, and MATCH with the right one."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from verify.config import RunConfig
from verify.cases.draws import check_draws, same_draws
from verify.judge.compare import Float64Fallback, check_tensor
from verify.judge.verdict import MATCH, MISMATCH, UNVERIFIABLE, Unverifiable
from verify.runner.gang import Gang
from verify.rows.run import run_model
from verify.runner.worker import load_modules

STOCH = str(Path(__file__).parents[1] / "fixtures" / "stochastic_models.py")


def _both(fn, x: torch.Tensor, seed: int = 0):
    """``fn`` in float32 (recorded) and in float64 under the float64 reference's mode, from one state."""
    fallback = Float64Fallback(torch.float32)
    with same_draws(seed, 0), fallback.draws.recording():
        y32 = fn(x)
    with fallback, same_draws(seed, 0):
        y64 = fn(x.double())
    return y32, y64, fallback


DRAWS = {
    "randn_like": lambda x: x + torch.randn_like(x),
    "rand_like": lambda x: x * torch.rand_like(x),
    "randn factory": lambda x: x + torch.randn(x.shape),
    "normal_": lambda x: x + torch.empty_like(x).normal_(0.0, 2.0),
    "uniform_": lambda x: x + torch.empty_like(x).uniform_(-1, 1),
    "bernoulli_ (DropPath)": lambda x: x * x.new_empty(x.shape[0], 1).bernoulli_(0.7) / 0.7,
    "bernoulli of probabilities": lambda x: x * torch.bernoulli(torch.sigmoid(x).detach()),
    "exponential_ (Gumbel)": lambda x: F.gumbel_softmax(x, tau=0.5),
    "randint and randperm": lambda x: x[torch.randperm(x.shape[0])] + torch.randint(0, 5, x.shape),
    "multinomial": lambda x: x[:, torch.multinomial(torch.softmax(x[0].detach(), 0), 3)],
    "dropout": lambda x: F.dropout(x, 0.3, True),
    "several in a row": lambda x: torch.randn_like(x) * torch.rand_like(x) + torch.randn(x.shape),
}


@pytest.mark.parametrize("name", list(DRAWS))
def test_the_float64_reference_draws_the_numbers_the_float32_run_drew(name):
    x = torch.randn(32, 24, generator=torch.Generator().manual_seed(1))
    y32, y64, fallback = _both(DRAWS[name], x)
    assert y64.dtype == torch.float64 and not fallback.draws.problems
    # the same draws: only the float32 rounding of the arithmetic differs
    assert float((y32.double() - y64).abs().max()) <= 1e-5 * (1 + float(y64.abs().max())), name


def test_without_the_record_float64_draws_other_numbers():
    """What the record fixes: from one state, ``randn`` in float64 is another sample than in float32."""
    x = torch.randn(64)
    with same_draws(0, 0):
        a = torch.randn_like(x)
    with same_draws(0, 0):
        b = torch.randn_like(x.double())
    assert float((a.double() - b).abs().max()) > 0.5


@torch.library.custom_op("nnscaler_test::draws_inside", mutates_args=())
def _draws_inside(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn_like(x)


_draws_inside.register_fake(lambda x: torch.empty_like(x))


def test_a_custom_operator_that_draws_inside_is_drawn_in_the_run_dtype():
    x = torch.randn(8, 32)
    y32, y64, fallback = _both(_draws_inside, x)
    assert float((y32.double() - y64).abs().max()) < 1e-5 and not fallback.draws.problems
    assert "nnscaler_test.draws_inside.default" in fallback.draws.redrawn


def test_draws_that_cannot_be_made_equal_make_the_row_unverifiable_naming_the_line():
    gen = torch.Generator().manual_seed(0)
    _, _, fallback = _both(lambda x: x + torch.randn(x.shape, generator=gen), torch.randn(4, 4))
    with pytest.raises(Unverifiable, match=r"torch.Generator of the model's own.*test_random_draws.py:\d+"):
        check_draws(fallback)
    fallback = Float64Fallback(torch.float32)  # nothing recorded: no run drew from that state
    with fallback, same_draws(0, 0):
        torch.randn(3)
    with pytest.raises(Unverifiable, match="no run in the dtype under test drew"):
        check_draws(fallback)


def _mlp_bounds(noise: bool, seed: int) -> tuple[float, float]:
    """The tolerances of the loss and of the first weight's gradient of a small MLP (with or without a
    ``randn_like`` draw) as a case sets them: float32 run against its float64 reference."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    net64 = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)).double()
    net64.load_state_dict({k: v.double() for k, v in net.state_dict().items()})
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def loss(m, x, y):
        h = m[1](m[0](x))
        if noise:
            h = h + 0.1 * torch.randn_like(h)
        return F.mse_loss(m[2](h), y)
    fallback = Float64Fallback(torch.float32)
    with same_draws(seed, 0), fallback.draws.recording():
        l32 = loss(net, x, y)
    l32.backward()
    with fallback, same_draws(seed, 0):
        l64 = loss(net64, x.double(), y.double())
        l64.backward()
    tol_loss = check_tensor("loss", l32, l32, l64).tol
    g, g64 = net[0].weight.grad, net64[0].weight.grad
    return tol_loss, check_tensor("grad", g, g, g64, scale=float(g64.abs().max())).tol


@pytest.mark.parametrize("seed", range(5))
def test_a_draw_does_not_widen_the_bound(seed):
    """The bound of a model with a draw is the bound of the same model without it, within a small factor
    (before the record: 300x wider on the loss)."""
    for with_draw, without in zip(_mlp_bounds(True, seed), _mlp_bounds(False, seed)):
        assert without / 4 <= with_draw <= 4 * without, (with_draw, without)


# -- whole models on real ranks ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stoch_gang(registry):
    load_modules((STOCH,))  # the parent lists the checks every rank must return, from the model
    with Gang(2, (STOCH,), (2,)) as g:
        yield g


MODELS = ("droppath", "vae", "diffusion", "gumbel")


def _rows(gang, name: str, dtype: str, seeds: tuple[int, ...], **kw):
    with tempfile.TemporaryDirectory() as tmp:
        return list(run_model(gang, name, ("tp",), RunConfig(world_sizes=(2,), seeds=seeds, dtype=dtype,
                                                              modules=(STOCH,), **kw), tmp, steps=2, checkpoint=False))


def _judge(rows, kind: str) -> None:
    for row in rows:
        if kind == "right":
            assert row.status == MATCH, (row.seed, row.detail)
        else:
            assert row.status == MISMATCH and "first divergent operator: stoch_mix_wrong" in row.detail, \
                (row.seed, row.detail)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", ["right", "wrong"])
def test_stochastic_models_wrong_mismatch_right_match(stoch_gang, model, kind, dtype):
    _judge(_rows(stoch_gang, f"stoch_{model}_{kind}", dtype, (0, 1) if kind == "right" else (0,)), kind)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", ["right", "wrong"])
def test_stochastic_models_over_5_seeds(stoch_gang, model, kind, dtype):
    _judge(_rows(stoch_gang, f"stoch_{model}_{kind}", dtype, (0, 1, 2, 3, 4)), kind)


def test_micro_batches_of_a_model_that_draws_are_unverifiable_naming_the_op_and_line(stoch_gang):
    (row,) = _rows(stoch_gang, "stoch_vae_right", "float32", (0,), microbatches=2)
    assert row.status == UNVERIFIABLE and "randn_like" in row.detail and "stochastic_models.py:" in row.detail, row.detail
