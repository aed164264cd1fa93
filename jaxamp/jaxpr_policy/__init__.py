"""jaxamp's engine: `autocast`, mixed precision for any JAX function.

It works on the primitives of a traced function, not on layers, so it needs
no framework; `jaxamp.apply_policy` runs Flax models through it
(`jaxamp.linen_policy`, `jaxamp.nnx_policy`), adding params created in
their dtype and policy scopes per module class. One module per job:

* `transform`: the public `autocast` and its options;
* `arguments`: a call split into traced arrays and static values, NNX
  modules split and written back;
* `interpreter`: the jaxpr interpreter and the per-signature cache;
* `context`: `Rewrite`, what every rule receives;
* `registry`: JAX's registry of primitives, the one place it is read;
* `rules`: the dtype rule of each first-order primitive, in a table
  keyed by the primitives;
* `reduction_inputs`: the elementwise chains that feed only a float32
  reduction, which run in float32 whatever their rule;
* `fp8_rules`: the matmul and convolution rules of a policy with FP8
  matmuls (``"mixed_float8"``), with their named fallbacks;
* `higher_order`: the rules that rewrite nested jaxprs (jit, checkpoint,
  scan, while, cond, custom_jvp, custom_vjp, shard_map);
* `table`: both tables, with the primitives of optional JAX modules;
* `scope`: `float32_scope`, the opt-out, and the policy scopes that
  `apply_policy` opens around a layer class's calls.
"""

from jaxamp.jaxpr_policy.scope import float32_scope
from jaxamp.jaxpr_policy.transform import autocast

__all__ = ["autocast", "float32_scope"]
