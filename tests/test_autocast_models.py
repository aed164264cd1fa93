"""`jaxamp.autocast` on every model family: half-precision FLOPs, dtypes, values.

Each family's float32 loss is transformed three ways: ``autocast(f)``,
``jax.grad(autocast(f))`` and ``autocast(jax.grad(f))``. The FLOP shares come
from `jaxamp.precision_report` (tracing only); values come from one jitted
run per family and policy.

Tolerance: float16 rounds each value to 11 significant bits (relative error
4.9e-4). These models chain at most four matmuls of at most 8x8 with float32
reductions in between, so a loss within 2% and gradients within 5% of the
largest gradient are what rounding alone produces, while a wrong dtype rule
(an overflow, a dropped cast, a float16 softmax) is far outside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.autocast_models import FAMILIES


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, *FAMILIES[request.param]()


def _dtypes(tree):
    return jax.tree.map(lambda leaf: leaf.dtype, tree)


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda f: jaxamp.autocast(f), id="autocast(f)"),
        pytest.param(lambda f: jax.grad(jaxamp.autocast(f)), id="grad(autocast(f))"),
        pytest.param(lambda f: jaxamp.autocast(jax.grad(f)), id="autocast(grad(f))"),
    ],
)
def test_every_matmul_and_convolution_runs_in_float16(family, transform):
    _, loss_fn, params, batch = family
    report = jaxamp.precision_report(transform(loss_fn), params, *batch)
    assert report.ops, "the model has matmuls to report"
    assert report.fraction(jnp.float16) == 1.0, str(report)


def test_loss_and_gradients_match_float32_in_value_and_dtype(family):
    name, loss_fn, params, batch = family
    loss32, grads32 = jax.jit(jax.value_and_grad(loss_fn))(params, *batch)
    loss16, grads16 = jax.jit(jax.value_and_grad(jaxamp.autocast(loss_fn)))(params, *batch)
    assert loss16.dtype == loss32.dtype == jnp.float32
    assert _dtypes(grads16) == _dtypes(grads32)
    np.testing.assert_allclose(loss16, loss32, rtol=2e-2, err_msg=name)
    scale = max(float(jnp.abs(leaf).max()) for leaf in jax.tree.leaves(grads32))
    for g16, g32 in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads32)):
        np.testing.assert_allclose(g16, g32, rtol=5e-2, atol=5e-2 * scale, err_msg=name)
