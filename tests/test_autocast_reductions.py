"""`jaxamp.autocast`: values that feed only a float32 reduction are computed in float32.

Each program below reduces float16 activations ``h = x @ w`` (a matmul
output, float16 under autocast). With ``w`` the identity, ``h`` is ``x``
rounded once to float16, so the float32 program on the same ``x`` is the
reference. At magnitude 4 every program is fine either way; at magnitude 400
``h * h`` (160000) is beyond float16's 65504, so a square computed in float16
overflows before the float32 sum sees it.

Tolerance: ``rtol = 2**-9``, four units of float16 rounding (``2**-11``). The
reference differs from autocast by the one rounding of ``h`` to float16,
which a square doubles; the sums themselves run in float32 on both sides.

Negative controls, run against the code before this rule (where each
``mul`` followed its float16 inputs): 8 of these tests failed there. The
magnitude-400 norm and squared-error loss came back ``inf`` and the RMS norm
0 (``rsqrt(inf)``); the gradients of the norm and the RMS norm, both ways,
were all zero (through ``1 / inf``); the float32 ``mul`` check found float16. The others passed
there too, and say why in their docstrings: ``jnp.var`` is built from
``square`` (float32) of a difference that the float32 mean already made
float32; the squared error's gradient is ``2 * error``, which never forms the
square; the remaining tests pin what must not change (a non-reduction reader
keeps the float16 ``mul``), each failing under the mutation it names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._autocast.lineage import _reduction_inputs_disabled as _disabled
from tests.test_autocast import _equation_dtypes

RTOL = 2.0**-9  # four units of float16 rounding; see the module docstring
FEATURES = 16


def _activations(magnitude):
    """``(x, w)`` with ``x @ w`` equal to ``x``: normal values scaled to `magnitude`."""
    x = jax.random.normal(jax.random.key(0), (4, FEATURES)) * magnitude
    return x, jnp.eye(FEATURES)


def norm(x, w):
    return jnp.linalg.norm(x @ w, axis=-1)


def variance(x, w):
    return jnp.var(x @ w, axis=-1)


def rms_norm(x, w):
    h = x @ w
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def squared_error(x, w):
    """A distillation-style loss between two float16 outputs: their difference, squared by hand."""
    error = x @ w - x[::-1] @ w
    return jnp.mean(error * error)


PROGRAMS = [norm, variance, rms_norm, squared_error]


@pytest.mark.parametrize("magnitude", [4.0, 400.0])
@pytest.mark.parametrize("program", PROGRAMS, ids=lambda program: program.__name__)
def test_a_reduction_of_float16_activations_is_finite_and_matches_float32(program, magnitude):
    x, w = _activations(magnitude)
    result = jaxamp.autocast(program)(x, w)
    assert bool(jnp.all(jnp.isfinite(result))), result
    np.testing.assert_allclose(result, program(x, w), rtol=RTOL)


@pytest.mark.parametrize("program", [norm, rms_norm, squared_error], ids=lambda program: program.__name__)
def test_the_square_before_the_sum_ran_in_float16_without_the_rule(program):
    """The negative control, in this code base: the same program with the rule turned off is wrong.

    ``_disabled`` is the private switch that ``experiments.measure.reduction_cost``
    measures the rule with; this keeps that switch honest.
    """
    x, w = _activations(400.0)
    with _disabled():
        result = jaxamp.autocast(program)(x, w)
    assert not np.allclose(result, program(x, w), rtol=RTOL)


def _scalar_loss(program):
    return lambda x, w: jnp.sum(program(x, w))


@pytest.mark.parametrize("program", [norm, rms_norm, squared_error], ids=lambda program: program.__name__)
@pytest.mark.parametrize("order", ["grad_of_autocast", "autocast_of_grad"])
def test_gradients_through_a_reduction_of_large_activations_are_finite(program, order):
    """The gradient with respect to the activations' input, through the reduction.

    On the code before this rule, the norm's and the RMS norm's gradients
    through the overflowed square were all zero, far from float32's; the
    squared error's (``2 * error``, no square formed) was fine, and stays a
    guard. (The weight gradient of the squared error at this magnitude,
    ``x.T @ error``, is beyond float16's range in the backward matmul itself:
    that is the loss scale's job, not this rule's.)
    """
    x, w = _activations(400.0)
    loss = _scalar_loss(program)
    if order == "grad_of_autocast":
        grad = jax.grad(jaxamp.autocast(loss))
    else:
        grad = jaxamp.autocast(jax.grad(loss))
    half, full = grad(x, w), jax.grad(loss)(x, w)
    assert bool(jnp.all(jnp.isfinite(half)))
    # The cotangents pass through float16 matmuls: compared as a whole, relative to the gradient's size.
    assert float(jnp.linalg.norm(half - full) / jnp.linalg.norm(full)) < 2.0**-7


def test_a_square_fed_only_to_a_sum_runs_in_float32():
    x, w = _activations(4.0)
    sum_of_squares = jaxamp.autocast(lambda x, w: jnp.sum((x @ w) * (x @ w)))
    assert _equation_dtypes(sum_of_squares, x, w, primitive="mul") == [jnp.float32]


@pytest.mark.parametrize(
    "other_reader",
    [
        pytest.param(lambda square, w: (jnp.sum(square), square), id="returned"),
        pytest.param(lambda square, w: jnp.sum(square @ w), id="matmul"),
        pytest.param(lambda square, w: jnp.sum(square) + jnp.sum(jnp.tanh(square)), id="tanh"),
        pytest.param(lambda square, w: jnp.sum(jnp.sqrt(square)), id="float32_elementwise"),
        pytest.param(lambda square, w: jnp.sum(square.astype(jnp.bfloat16)), id="users_cast_to_bfloat16"),
        pytest.param(lambda square, w: jnp.sum(jax.jit(lambda s: s)(square)), id="jit_body_input"),
    ],
)
def test_a_square_with_any_other_reader_keeps_following_its_float16_inputs(other_reader):
    """What the README documents for ``x * x``: a non-reduction reader keeps the float16 ``mul``.

    Fails if the sweep ignored readers that are not reductions, took any
    float32 op (``sqrt``) for a reduction, widened through the user's cast to
    a half dtype, or looked through a ``jit`` boundary.
    """
    x, w = _activations(4.0)

    def program(x, w):
        h = x @ w
        return other_reader(h * h, w)

    assert _equation_dtypes(jaxamp.autocast(program), x, w, primitive="mul") == [jnp.float16]


def test_a_square_read_by_two_reductions_keeps_following_its_inputs():
    """A value with two readers may be written to memory: widened, it would take twice the bytes.

    Fails if the sweep accepted several reduction readers (seen compiling a
    LayerNorm block's backward for an H200 target: the cotangent read by the
    scale's and the bias's sums was then written in float32).
    """
    x, w = _activations(4.0)

    def program(x, w):
        square = (x @ w) * (x @ w)
        return jnp.sum(square) + jnp.max(square)

    assert _equation_dtypes(jaxamp.autocast(program), x, w, primitive="mul") == [jnp.float16]


def test_a_sum_of_half_precision_cotangents_stays_in_half_precision():
    """``add_any`` (the backward pass's sum of cotangents) is left out of the float32 chain.

    Here a broadcast row feeds two matmuls: its two cotangents, outputs of
    float16 backward matmuls, meet in an ``add_any`` whose only reader is the
    row gradient's ``reduce_sum``. Fails if ``add_any`` joined the chain
    (which, compiled for an H200 target, changed the fusion of a norm's
    backward: python -m experiments.measure reduction-cost).
    """
    x, w = _activations(4.0)

    def loss(row, w):
        rows = jnp.broadcast_to(row, (4, FEATURES))
        return jnp.sum(jnp.tanh(rows @ w)) + jnp.sum(jnp.tanh(rows @ w.T))

    gradient = jaxamp.autocast(jax.grad(loss))
    # The last add_any sums the matmul cotangents (the others, in tanh's derivative, are float32).
    assert _equation_dtypes(gradient, x[0], w, primitive="add_any")[-1] == jnp.float16


def test_a_square_returned_from_a_jit_body_keeps_following_its_inputs():
    """A body's output counts as a non-reduction reader: the sweep stays inside each jaxpr."""
    x, w = _activations(4.0)
    square = jax.jit(lambda h: h * h)
    assert _equation_dtypes(
        jaxamp.autocast(lambda x, w: jnp.sum(square(x @ w))), x, w, primitive="mul"
    ) == [jnp.float16]


def test_a_reduction_overridden_to_follow_or_under_the_float32_scope_widens_nothing():
    x, w = _activations(4.0)

    def scoped(x, w):
        h = x @ w
        with jaxamp.float32_scope():
            return jnp.sum(h * h)

    follow = jaxamp.autocast(lambda x, w: jnp.sum((x @ w) * (x @ w)), overrides={"reduce_sum": "follow"})
    assert _equation_dtypes(follow, x, w, primitive="mul") == [jnp.float16]
    # In the scope the mul runs as traced (float32 in, float32 out), not by this rule.
    assert _equation_dtypes(jaxamp.autocast(scoped), x, w, primitive="mul") == [jnp.float32]


def _block(params, x):
    """A pre-norm transformer block (RMSNorm, attention, MLP), loss = mean of squared outputs."""

    def rms(h, scale):
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * scale

    h = rms(x, params["norm1"])
    q, k, v = h @ params["wq"], h @ params["wk"], h @ params["wv"]
    weights = jax.nn.softmax(q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]), axis=-1)
    x = x + (weights @ v) @ params["wo"]
    h = rms(x, params["norm2"])
    x = x + jax.nn.gelu(h @ params["w1"]) @ params["w2"]
    return jnp.mean(x * x)


def test_matmul_flops_stay_all_half_in_a_transformer_block_forward_and_backward():
    keys = jax.random.split(jax.random.key(2), 7)
    d = 8
    params = {
        "norm1": jnp.ones(d),
        "norm2": jnp.ones(d),
        **{
            name: jax.random.normal(key, (d, d)) / np.sqrt(d)
            for name, key in zip(("wq", "wk", "wv", "wo"), keys)
        },
        "w1": jax.random.normal(keys[4], (d, 2 * d)) / np.sqrt(d),
        "w2": jax.random.normal(keys[5], (2 * d, d)) / np.sqrt(2 * d),
    }
    x = jax.random.normal(keys[6], (2, 4, d))
    transforms = (
        jaxamp.autocast,
        lambda f: jax.grad(jaxamp.autocast(f)),
        lambda f: jaxamp.autocast(jax.grad(f)),
    )
    for transform in transforms:
        report = jaxamp.precision_report(transform(_block), params, x)
        assert report.fraction(jnp.float16) == 1.0, str(report)
