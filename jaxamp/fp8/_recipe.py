"""The NVFP4 recipe's options: which of its tools a trace uses.

One job: `block_recipe`, a context read when `jaxamp.autocast` traces a
function under ``mixed_nvfp4`` (or when `jaxamp.fp8.block_scaled_dot_general`
is traced), the switches TransformerEngine's ``NVFP4BlockScaling`` recipe
has (``disable_rht``, ``disable_stochastic_rounding``,
``disable_2d_quantization``), on by default as there. For ablations: the
recipe without one of its tools.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class BlockRecipe:
    """The NVFP4 recipe's tools, each on or off.

    Attributes:
        hadamard: the random Hadamard transform on the wgrad GEMM's inputs.
        stochastic_gradients: stochastic rounding of the gradients
            (nearest rounding when off).
        two_d_weights: one scale per 16 x 16 tile of the weight (1 x 16
            blocks, quantized twice, when off).
    """

    hadamard: bool = True
    stochastic_gradients: bool = True
    two_d_weights: bool = True


_RECIPE: contextvars.ContextVar = contextvars.ContextVar("jaxamp_block_recipe", default=BlockRecipe())


def current_block_recipe() -> BlockRecipe:
    """The recipe of the innermost `block_recipe` block, else the full recipe."""
    return _RECIPE.get()


@contextlib.contextmanager
def block_recipe(
    *, hadamard: bool = True, stochastic_gradients: bool = True, two_d_weights: bool = True
) -> Iterator[BlockRecipe]:
    """The NVFP4 recipe that matmuls traced inside the block use.

    Read when a function is traced: put the block around the first call (or
    the ``jax.jit(...).lower``). It is part of the key under which an
    autocast function keeps its rewrite, so the same function traced under
    another recipe is rewritten again. `jax.jit`'s own cache does not see
    it: a Python function `jax.jit` has traced keeps its first recipe, even
    through a new ``jax.jit(f)``; trace a new function under each recipe
    (``jax.jit(lambda *args: f(*args))``) or call `jax.clear_caches` first.
    MXFP8 has no options: it ignores this.

    Examples:
        >>> with jaxamp.fp8.block_recipe(hadamard=False):   # NVFP4 without the Hadamard transform
        ...     loss = jaxamp.autocast(loss_fn, "mixed_nvfp4")(params, batch)

    Args:
        hadamard: the random Hadamard transform on the wgrad GEMM's inputs.
        stochastic_gradients: stochastic rounding of gradients (else nearest).
        two_d_weights: 16 x 16 blocks for the weight (else 1 x 16).

    Raises:
        TypeError: an option is not a bool.
    """
    options = {"hadamard": hadamard, "stochastic_gradients": stochastic_gradients, "two_d_weights": two_d_weights}
    for name, value in options.items():
        if not isinstance(value, bool):
            raise TypeError(f"block_recipe's {name} must be True or False; got {value!r}.")
    recipe = BlockRecipe(**options)
    token = _RECIPE.set(recipe)
    try:
        yield recipe
    finally:
        _RECIPE.reset(token)
