"""Measurements behind one command: ``python -m experiments.measure NAME [--out DIR] [flags]``.

Each measurement is one module of this package with the same shape:

* its docstring: the first line says what it measures (``--help`` lists
  them), the rest how (``NAME --help`` shows it with the flags);
* ``add_arguments(parser)``: its own flags;
* ``run(args, out)``: the measurement; it prints its progress and writes
  its files through ``out``, a `run_folder.RunFolder`.

What they share lives beside them: `run_folder` (the new folder under
``runs/``, files written atomically, the command and commit beside them),
`gpu_target` (a program compiled for a GPU without one), `markdown` (a
table), `lm_runs` (the language model's runs the parity measurements make)
and `experiments.benchmark.timing` (steps timed in interleaved rounds). A
new measurement is a module with that shape and one entry in
`MEASUREMENTS`.
"""

# The measurements' modules; a measurement's NAME is its module's name with dashes.
MEASUREMENTS = (
    "autocast_cost",
    "trace_cost",
    "first_step",
    "reduction_cost",
    "gemma_float16",
    "overflow_attribution_cost",
    "communication_bytes",
    "optimizer_parity",
    "nnx_parity",
    "optimizer_lm_parity",
    "optimizer_lm_cost",
    "quantized_optimizer_cost",
    "optimizer_first_step",
    "fp8_proof",
    "fp8_scaling_cost",
    "fp8_layer",
    "fp8_payoff",
    "fp8_parity",
    "fp8_gather_parity",
    "lm_traffic",
    "mxfp8_b200",
    "blackwell_gemms",
    "blackwell_parity",
    "blackwell_recipe",
)
