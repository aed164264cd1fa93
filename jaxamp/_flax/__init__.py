"""Flax models, unedited: `jaxamp.apply_policy` for linen and NNX.

`jaxamp.autocast` plus what only a Flax model has: params created in their
layer's param dtype and a policy per module class. One module per job:

* `apply`: `apply_policy`, which chooses the route by the model's kind;
* `layers`: which policy each layer runs under (overrides by class, the
  normalization layers), shared by both routes;
* `linen`: the wrapper around a linen model;
* `nnx`: the converted copy of an NNX model.
"""
