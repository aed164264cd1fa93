"""`autocast`: mixed precision for any JAX function, as a jaxpr transformation.

The third route to a policy, beside the linen and NNX ones of
`jaxamp.apply_policy`: it works on primitives, not on layers, so it needs no
framework. One module per job:

* `transform`: the public `autocast` and its options;
* `arguments`: a call split into traced arrays and static values, NNX
  modules split and written back;
* `interpreter`: the jaxpr interpreter and the per-signature cache;
* `rules`: the dtype rule of each first-order primitive, in a table;
* `higher_order`: the rules that rewrite nested jaxprs (jit, checkpoint,
  scan, while, cond, custom_jvp, custom_vjp);
* `scope`: `float32_scope`, the opt-out.
"""

from jaxamp.autocast.scope import float32_scope
from jaxamp.autocast.transform import autocast

__all__ = ["autocast", "float32_scope"]
