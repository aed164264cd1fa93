"""python -m experiments.measure NAME [--out DIR] [flags]: run one measurement into a new folder.

    python -m experiments.measure --help           # the measurements, one line each
    python -m experiments.measure NAME --help      # what NAME measures, and its flags
    python -m experiments.measure NAME             # writes runs/measure-NAME-YYYYMMDD-HHMMSS/
    python -m experiments.measure NAME --out DIR   # writes DIR (made if missing), e.g. results/<question>/...

NAME is checked before anything loads, so a mistyped one is answered at once
with the nearest name (exit status 2). The measurement's module is then
imported (JAX loads with it) and parses its own flags before any work
starts; a bad flag also exits 2. The folder gets the measurement's files,
each written atomically, and once it has finished a ``COMMAND`` file with
the command, the commit it ran on and the date (`run_folder`). A
measurement that cannot run here (an optional package or the CUDA plugin
missing) stops with one line saying what to install (exit status 1).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys

from experiments import interrupts, outputs
from experiments.flags import ArgumentParser, HelpFormatter, output_directory, unknown_name
from experiments.measure import MEASUREMENTS
from experiments.measure.run_folder import RunFolder

PROG = "python -m experiments.measure"


def measurement_names() -> dict[str, str]:
    """Each measurement's NAME and its module's name."""
    return {module.replace("_", "-"): module for module in MEASUREMENTS}


def summary(module: str) -> str:
    """The first line of a measurement module's docstring, read without importing it (nor JAX)."""
    spec = importlib.util.find_spec(f"experiments.measure.{module}")
    with open(spec.origin, encoding="utf-8") as source:
        docstring = ast.get_docstring(ast.parse(source.read())) or ""
    return docstring.splitlines()[0] if docstring else ""


def listing() -> str:
    """The measurements, one line each: NAME and what it measures."""
    names = measurement_names()
    width = max(map(len, names))
    return "\n".join(f"  {name:<{width}}  {summary(module)}" for name, module in names.items())


class _DescribedHelp(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """A measurement's ``--help``: its docstring as written, then its flags with their defaults."""


def _top_parser() -> argparse.ArgumentParser:
    return ArgumentParser(
        prog=PROG,
        usage=f"{PROG} NAME [--out DIR] [flags]",
        description=(
            "Run one measurement. Each writes its files into a new folder runs/measure-NAME-<time>/ "
            "(or --out DIR), with a COMMAND file: the command, the commit it ran on, the date."
        ),
        epilog=f"measurements:\n{listing()}\n\n{PROG} NAME --help shows what NAME measures and its flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _measurement_parser(name: str, module) -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=f"{PROG} {name}", description=module.__doc__, formatter_class=_DescribedHelp
    )
    parser.add_argument(
        "--out",
        type=output_directory,
        default=None,
        help=(
            f"the folder to write into, made if missing (default: a new runs/measure-{name}-<time>/; "
            "name a folder under results/ to publish)"
        ),
    )
    module.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, *, entry_point: bool = False) -> int:
    """Runs one measurement with `argv` (default: the command line); returns the exit status.

    Args:
        argv: NAME and its flags.
        entry_point: run as ``python -m experiments.measure``: an interrupted
            measurement ends the process at once (`experiments.interrupts.exit_status`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if argv[:1] in (["-h"], ["--help"]):
        top.print_help()
        return 0
    names = measurement_names()
    if not argv or argv[0].startswith("-"):
        top.error(f"name a measurement first, one of: {', '.join(names)}")
    name = argv[0]
    if name not in names:
        top.error(unknown_name("measurement", name, list(names)))
    import jaxamp  # pylint: disable=import-outside-toplevel  # loads JAX (starts no backend)

    # Before any backend starts: a CUDA plugin without a GPU registers quietly, for the GPU targets.
    jaxamp.diagnostics.allow_compiling_without_gpu()
    module = importlib.import_module(f"experiments.measure.{names[name]}")
    args = _measurement_parser(name, module).parse_args(argv[1:])
    out = None
    try:
        # The folder (and the folders made above it) is removed again if the measurement fails leaving it empty.
        with interrupts.watched(), outputs.removed_if_left_empty(args.out or outputs.RUNS_ROOT) as made:
            out = RunFolder.create(name, args.out, argv)
            made.append(out.path)
            print(f"{name}: writing {out.path}", flush=True)
            module.run(args, out)
    except KeyboardInterrupt:
        kept = (
            f"the files written so far ({', '.join(out.written)}) are in {out.path}, without a COMMAND file"
            if out is not None and out.written
            else "nothing was written"
        )
        print(f"{name}: interrupted; {kept}. Run the command again to measure afresh.", file=sys.stderr)
        return interrupts.exit_status(entry_point)
    out.finish()
    print(f"{name}: wrote {', '.join(out.written)} in {out.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(entry_point=True))
