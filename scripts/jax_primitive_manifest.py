"""Writes the names of the primitives the installed JAX registers: one release's manifest.

autocast's rules tables are keyed by JAX's primitive names and resolved
when `jaxamp.autocast` is applied, so a misspelt name would silently give
no rule. The tests check every name in the tables against these manifests
(``tests/jax_primitives/<release>.txt``, one per supported JAX release) and
against the installed JAX. Needs only JAX (not jaxamp): run it in an
environment with the release to record, e.g.

    python3.12 -m venv /tmp/jax-0.12 && /tmp/jax-0.12/bin/pip install 'jax==0.12.0.1'
    /tmp/jax-0.12/bin/python scripts/jax_primitive_manifest.py --out tests/jax_primitives

The registry is JAX's lowering, JVP and transpose tables, read after every
public JAX module that registers primitives of its own is imported
(`JAX_MODULES`; a module a release lacks is skipped). Where Flax is
installed and defines primitives of its own (Flax NNX's variables in flax
0.12.8; later releases replace them), ``--out`` also writes
``flax-<version>.txt`` with their names.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

JAX_MODULES = (
    "jax.numpy", "jax.scipy", "jax.scipy.sparse.linalg", "jax.nn", "jax.random", "jax.lax.linalg",
    "jax.experimental.shard_map", "jax.experimental.checkify", "jax.experimental.pallas",
    "jax.experimental.pallas.tpu", "jax.experimental.pallas.triton",
    "jax.experimental.pallas.mosaic_gpu", "jax.experimental.pallas.fuser", "jax.experimental.rnn",
    "jax.experimental.compute_on", "jax.experimental.multihost_utils",
    "jax.experimental.custom_partitioning", "jax.experimental.sparse", "jax.experimental.xla_metadata",
    "jax.experimental.fused", "jax.experimental.scheduling_groups", "jax.experimental.buffer_callback",
    "jax.experimental.overlap",
)  # fmt: skip


def registered_names(modules: tuple[str, ...] = JAX_MODULES) -> list[str]:
    """The sorted names of every primitive JAX registers once `modules` are imported."""
    import jax  # noqa: F401  (before jax._src)
    from jax._src.interpreters import ad, mlir

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:  # a module this JAX release does not have
            pass
    tables = [mlir._lowerings, *mlir._platform_specific_lowerings.values(), ad.primitive_jvps,
              ad.primitive_transposes]  # fmt: skip
    return sorted({primitive.name for table in tables for primitive in table})


def flax_primitive_names() -> list[str]:
    """The sorted names of the primitives the installed Flax defines (none without Flax)."""
    try:
        from flax.nnx import variablelib
    except ImportError:
        return []
    from jax.extend.core import Primitive

    return sorted({value.name for value in vars(variablelib).values() if isinstance(value, Primitive)})


def _write(folder: str, release: str, names: list[str]) -> None:
    text = f"# Primitives registered by {release} (scripts/jax_primitive_manifest.py)\n"
    text += "".join(f"{name}\n" for name in names)
    path = os.path.join(folder, f"{release.removeprefix('jax ').replace(' ', '-')}.txt")
    with open(path + ".tmp", "w") as file:
        file.write(text)
    os.replace(path + ".tmp", path)
    print(f"{len(names)} primitive names -> {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default=None,
        help="folder to write <jax version>.txt into (default: print the names to stdout)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    import jax

    names = registered_names()
    if args.out is None:
        sys.stdout.write("".join(f"{name}\n" for name in names))
        return 0
    os.makedirs(args.out, exist_ok=True)
    _write(args.out, f"jax {jax.__version__}", names)
    flax_names = flax_primitive_names()
    if flax_names:
        import flax

        _write(args.out, f"flax {flax.__version__}", flax_names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
