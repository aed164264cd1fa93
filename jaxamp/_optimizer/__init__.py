"""Low-precision optimizer state: params and optimizer state stored in bfloat16 or 8 bits.

One module per job:

* `low_precision`: `low_precision_optimizer`, the wrapper that runs any
  optax optimizer's update in float32 and lands it on half params by a
  rounding (nearest, stochastic, Kahan), its state stored narrower;
* `storage`: `OptimizerStorage`, the wrapper's storage arguments as one
  value, `split_precision` (a precision name read as a policy and a
  storage) and `optimizer_for_policy`;
* `quantized`: 8-bit state leaves, codes (int8's dynamic code,
  float8_e4m3fn) and a scale per block.

Their stochastic rounding draws from `jaxamp._draws`, which NVFP4's
gradients share.
"""
