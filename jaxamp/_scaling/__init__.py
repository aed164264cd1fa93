"""Loss scaling and the skipped step: everything between the loss and the update.

One module per job:

* `loss_scale`: the loss scales (`NoOpLossScale`, `StaticLossScale`,
  `DynamicLossScale`), jmp's protocol as pytrees, and the one count of
  skipped steps;
* `grads`: `scaled_value_and_grad`, gradients through a loss scale;
* `loss_scaling`: `loss_scaling`, the whole-step skip as an optax
  transformation, and the readers of its state;
* `train_state`: `TrainState`, Flax's train state with the loss scale and
  the skip;
* `half_params`: half params refused where their optimizer would compute
  its update in half;
* `guard`: `OverflowGuard`, which stops a run whose loss scale is stuck;
* why a step was skipped: `nonfinite` (the gradient leaves that were not
  finite) and `overflow` (the first matmul or convolution that overflowed,
  and the session that records it, a client of the probe, `jaxamp._probe`).
"""
