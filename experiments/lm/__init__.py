"""A GPT-style language model trained under jaxamp precisions (``python -m experiments.lm``).

One module per job: `model` (the Flax decoder and its sizes), `data` (the
standard-library byte corpus, per-process batch rows), `config` (settings
and their validation), `sharding` (FSDP over a device mesh), `train` (the
recipe), `figures` (FLOPs, memory, MFU of the compiled step), `output`
(JSON, table, plots), `on_paper` (compiled for a GPU without one) and
``__main__`` (the command line).
"""
