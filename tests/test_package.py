"""The built wheel holds the `jaxamp` package alone, typed, and nothing else.

The experiments run from the repository root (``python -m experiments.cifar``)
and must not be installed: a top-level ``experiments`` package in
site-packages would shadow or collide with a user's own.
"""

import email.parser
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import jaxamp

REPO = pathlib.Path(__file__).resolve().parent.parent
# Build outputs, caches and data: never part of a source checkout's packaging.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "venv", ".jax_cache", ".hypothesis", ".pytest_cache", "__pycache__",
    "*.egg-info", "build", "dist", "mutants", "checkpoints", "results",
)  # fmt: skip


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory):
    """The wheel `pip wheel` builds from a copy of the checkout, offline."""
    source = tmp_path_factory.mktemp("source") / "jaxamp"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
        "--wheel-dir", str(out), str(source),
    ]  # fmt: skip
    result = subprocess.run(command, check=False, cwd=source, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        "pip wheel failed; the test group provides setuptools>=77 and wheel "
        f"(pip install -e . --group test):\n{result.stdout}\n{result.stderr}"
    )
    (path,) = out.glob("jaxamp-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel(wheel_path):
    """The names of the wheel's files."""
    with zipfile.ZipFile(wheel_path) as archive:
        return archive.namelist()


@pytest.fixture(scope="module")
def wheel_metadata(wheel_path):
    """The wheel's core metadata (METADATA), parsed as the email-header format it is."""
    with zipfile.ZipFile(wheel_path) as archive:
        text = archive.read(f"jaxamp-{jaxamp.__version__}.dist-info/METADATA").decode()
    return email.parser.Parser().parsestr(text)


def test_the_wheel_holds_jaxamp_and_its_metadata_only(wheel):
    top_level = {name.split("/", 1)[0] for name in wheel}
    assert top_level == {"jaxamp", f"jaxamp-{jaxamp.__version__}.dist-info"}


def test_the_wheel_holds_every_module_of_the_package_and_the_py_typed_marker(wheel):
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "jaxamp").rglob("*.py")}
    assert modules <= set(wheel)
    assert "jaxamp/py.typed" in wheel
    assert "jaxamp/__init__.py" in modules


def test_the_wheel_carries_the_apache_license_the_metadata_names(wheel, wheel_path):
    """Fails where the repository has no LICENSE file (it had none)."""
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    (packaged,) = [name for name in wheel if name.endswith("/LICENSE")]
    with zipfile.ZipFile(wheel_path) as archive:
        assert archive.read(packaged).decode() == license_text


def test_the_wheel_advertises_only_extras_the_library_honours(wheel_metadata):
    """The experiments and tests are not in the wheel, so their dependencies are
    dependency groups of pyproject.toml, not extras. Fails where an
    `experiments` (or `test`) extra is advertised (it was)."""
    assert set(wheel_metadata.get_all("Provides-Extra")) == {"cuda", "gpu-aot"}
    assert wheel_metadata["License-Expression"] == "Apache-2.0"
