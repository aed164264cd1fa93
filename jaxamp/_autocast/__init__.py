"""The engine: `jaxamp.autocast`, mixed precision for any JAX function.

It works on the primitives of a traced function, not on layers: a function
is traced to a jaxpr (its floating arguments in the compute dtype) and each
equation is evaluated again under a dtype rule keyed by its primitive.
Flax appears in one place only: NNX modules passed as arguments are split
into arrays and written back (`arguments`). `jaxamp.apply_policy` (in
`jaxamp._flax`) runs Flax models through this engine. One module per job:

* `transform`: `autocast` and its options, and the rules table of a policy;
* `arguments`: a call split into traced arrays and static values, NNX
  modules split and written back;
* `interpreter`: the jaxpr interpreter and the per-signature cache;
* `context`: `Rewrite`, what every rule receives;
* `rules`: the dtype rule of each first-order primitive, in a table keyed
  by primitive name;
* `higher_order`: the rules that rewrite nested jaxprs (jit, checkpoint,
  scan, while, cond, custom_jvp, custom_vjp, shard_map);
* `fp8_rules`: the matmul and convolution rules of a policy with FP8
  matmuls (``"mixed_float8"``), with their named fallbacks;
* `reduction_inputs`: the elementwise chains that feed only a float32
  reduction, which run in float32 whatever their rule;
* `table`: both rule tables resolved to the running JAX's primitives;
* `primitives`: JAX's registry of primitives (the one place it is read)
  and the primitives without a rule;
* `scope`: `float32_scope`, the opt-out, and the policy scopes that
  `apply_policy` opens around a layer class's calls;
* `sites`: the matmuls and convolutions a probe's client watches
  (`jaxamp._probe`: the overflow record, FP8 delayed scaling), counted and
  named; the engine knows its clients by the probe's protocol alone.
"""
