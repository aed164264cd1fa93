"""The project's side-by-side benchmark: speed, memory and distance to the hardware.

    python -m experiments.benchmark --quick                 # a reduced set, < 5 min on a 2-core CPU
    python -m experiments.benchmark --budget 300            # the full set, most important first
    python -m experiments.benchmark --target h200           # compiled for an H200, on this machine

One process, one run, on whatever device JAX has. Every timed region ends in
``block_until_ready``; compilation is timed apart and excluded; each
measurement warms up first, then takes the median over rounds that
interleave the variants compared (so drift on a shared machine hits all of
them alike). Data are synthetic and device-resident, of CIFAR-10's shapes.

Sections, in order of importance (``--budget`` runs them in this order and
lists what it skipped):

1. ``throughput`` (`experiments.benchmark.throughput`): train and eval
   images/s per model x precision, ratios to ``fp32`` and ``tf32``; each
   compiled step's ``memory_analysis()``; on a GPU, the peak bytes in use;
   FLOPs per image, achieved TFLOP/s, share of peak and the roofline bound.
2. ``loss_scale`` (`experiments.benchmark.loss_scale`): what loss scaling
   costs, against flax's, jmp's and optax's own recipes.
3. ``attribution`` (`experiments.benchmark.attribution`): what overflow
   attribution costs (the gradient leaves a train state keeps, and the
   per-layer record of ``record_overflow=True``): step time here and, for
   each ``--target``, bytes moved by the compiled step.
4. ``pipeline`` (`experiments.benchmark.pipeline`): the on-device input
   pipeline's share of a train step.
5. ``torch`` (`experiments.benchmark.torch_amp`): PyTorch AMP on the same
   device, same models and batch, when ``torch`` is importable.
6. ``targets`` (`experiments.benchmark.targets`): the train step compiled
   for GPU targets without a GPU (needs the CUDA PJRT plugin): memory,
   bytes moved, dtypes of every convolution and matmul, compile time,
   roofline bound; each half precision by both routes a policy can take
   (``apply_policy`` and ``autocast``).

Results go to a new run directory, ``runs/benchmark-<quick|full|targets-...>-<time>/``
(or ``--out-dir``; the published runs live in ``results/<device>/benchmark/``):
``results.json`` rewritten after every measurement, ``table.md``, PNG plots.

Exit status: 0 when the benchmark ran, whatever it measured (a missed
target is marked in the table and named in the log); 2 for a bad flag;
``--check`` (for CI and scripts) makes a missed target exit 1.
"""
