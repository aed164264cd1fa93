"""Shared test settings: quick compiles, a compilation cache, hypothesis limits, fresh processes started early."""

import gc
import os
import pathlib
import socket

import fresh_processes
import hypothesis
import jax
import pytest

# Before JAX starts its CPU backend: see fresh_processes.SUITE_XLA_FLAGS.
os.environ["XLA_FLAGS"] = fresh_processes.xla_flags(os.environ.get("XLA_FLAGS", ""))

# Reruns of the suite load compiled XLA programs from disk instead of
# recompiling them; the directory is git-ignored.
jax.config.update(
    "jax_compilation_cache_dir",
    str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# JAX's first dispatch of a new shape compiles, which would trip hypothesis's
# per-example deadline; a few dozen examples per property keep the suite fast.
hypothesis.settings.register_profile("jaxamp", deadline=None, max_examples=30)
hypothesis.settings.load_profile("jaxamp")


def _under_xdist(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_collection_finish(session):
    """Starts the commands the selected tests need a fresh process for (tests/fresh_processes.py).

    They run in the background, one at a time, while this process runs the
    other tests: on two cores the suite takes the longer of the two, not their sum.
    Under pytest-xdist each worker collects every test but runs only the files
    it is handed (``--dist loadfile``), so a worker starts a file's commands
    when it begins that file (`pytest_runtest_protocol`) instead.
    """
    if not session.config.option.collectonly and not _under_xdist(session.config):
        fresh_processes.start_needed(session.items)


_FILES_BEGUN: set[str] = set()


def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist: the first test of a file starts the file's fresh processes in the background."""
    del nextitem
    if _under_xdist(item.config) and item.fspath.strpath not in _FILES_BEGUN:
        _FILES_BEGUN.add(item.fspath.strpath)
        fresh_processes.start_needed(
            [other for other in item.session.items if other.fspath.strpath == item.fspath.strpath]
        )


def pytest_sessionfinish(session):
    """Kills a fresh process no test waited for (a run stopped early, -x) and removes its folder.

    Under pytest-xdist it also collects the worker's garbage and freezes what
    survives (`gc.freeze`), before the worker reports that it has finished
    (this hook runs inside xdist's wrapper, which reports after it). Once all
    workers have reported, execnet gives each 5 s to end and then sends it
    SIGINT; pytest's own full collections at unconfigure, on the heap of a
    worker that ran a quarter of the suite, could take longer on a loaded
    machine, and the interrupt landed in JAX's `gc.callbacks` entry: a passing
    suite printed a KeyboardInterrupt traceback from `_xla_gc_callback`
    (PytestUnraisableExceptionWarning). With the survivors frozen those
    collections have almost nothing to visit.
    """
    fresh_processes.stop_all()
    if _under_xdist(session.config):
        gc.collect()
        gc.freeze()


@pytest.fixture
def offline(monkeypatch):
    """Switches the network off: every host name fails to resolve, as offline.

    Proxies are cleared too, so nothing can route around the failure.
    """

    def no_network(*args, **kwargs):
        del args, kwargs
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (test is offline)")

    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)


@pytest.fixture
def needs_tensorflow_datasets():
    """Skips a test that prepares CIFAR-10 where tensorflow-datasets is absent.

    It comes with the experiments' dependency group, which CI installs; a GPU machine
    carrying only JAX, Flax and optax has none.
    """
    return pytest.importorskip("tensorflow_datasets", reason="preparing CIFAR-10 needs the experiments group")


@pytest.fixture
def needs_tensorflow(needs_tensorflow_datasets):
    """Skips a test of TFDS preparing CIFAR-10 where TensorFlow, which TFDS needs for it, is absent.

    It comes with the optional `tensorflow` dependency group, which CI installs; without it
    CIFAR-10 is read from its archive (tests/test_data_without_tensorflow.py).
    """
    pytest.importorskip(
        "tensorflow", reason="TFDS prepares CIFAR-10 with TensorFlow: pip install --group tensorflow"
    )
    return needs_tensorflow_datasets
