"""The distribution: built, checked, installed, and holding the `jaxamp` package alone.

The distribution is ``jax-mixed-precision`` (the name ``jaxamp`` on PyPI belongs
to an unrelated project); the import name is ``jaxamp``. The experiments run
from the repository root (``python -m experiments.cifar``) and must not be
installed: a top-level ``experiments`` package in site-packages would shadow
or collide with a user's own.
"""

import email.parser
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import jaxamp

REPO = pathlib.Path(__file__).resolve().parent.parent
# Build outputs, caches and data: never part of a source checkout's packaging.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "venv", ".jax_cache", ".hypothesis", ".pytest_cache", "__pycache__",
    "*.egg-info", "build", "dist", "mutants", "checkpoints", "results",
)  # fmt: skip


DISTRIBUTION = "jax_mixed_precision"  # the distribution's name as file names spell it


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist and the wheel `python -m build` makes from a copy of the checkout, offline."""
    source = tmp_path_factory.mktemp("source") / "jaxamp"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)]
    result = subprocess.run(command, check=False, cwd=source, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        "python -m build failed; the test group provides build, setuptools>=77 and wheel "
        f"(pip install -e . --group test):\n{result.stdout}\n{result.stderr}"
    )
    return out


@pytest.fixture(scope="module")
def wheel_path(built):
    (path,) = built.glob(f"{DISTRIBUTION}-*.whl")
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
        text = archive.read(f"{DISTRIBUTION}-{jaxamp.__version__}.dist-info/METADATA").decode()
    return email.parser.Parser().parsestr(text)


def test_the_wheel_holds_jaxamp_and_its_metadata_only(wheel):
    top_level = {name.split("/", 1)[0] for name in wheel}
    assert top_level == {"jaxamp", f"{DISTRIBUTION}-{jaxamp.__version__}.dist-info"}


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


def test_the_distribution_is_not_named_jaxamp_which_is_another_project_on_pypi(wheel_metadata):
    assert wheel_metadata["Name"] == "jax-mixed-precision"


def test_twine_finds_the_sdist_and_the_wheel_fit_to_upload(built):
    """The metadata is complete and the README renders as PyPI's long description."""
    paths = sorted(str(path) for path in built.iterdir())
    assert sorted(pathlib.Path(path).suffix for path in paths) == [".gz", ".whl"]
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *paths],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_sdist_holds_the_library_its_readme_and_license_and_no_results(built):
    import tarfile

    (sdist,) = built.glob(f"{DISTRIBUTION}-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"jaxamp/__init__.py", "pyproject.toml", "README.md", "LICENSE"} <= names
    assert not any(name.startswith(("results/", ".venv/")) for name in names)


def test_the_wheel_installed_into_a_fresh_venv_imports_every_public_namespace(wheel_path, tmp_path):
    """A new virtual environment gets the wheel alone (no network: its dependencies, jax, flax,
    optax and jmp, are read from this environment's site-packages through a path file, whose own
    path files, this checkout's editable install among them, are not run). Fails where a module
    is missing from the wheel or a namespace imports something only the checkout has."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
               "--quiet", str(wheel_path)]  # fmt: skip
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    pathlib.Path(site_packages, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    check = """
import importlib, importlib.metadata, pathlib, sys
import jaxamp
assert pathlib.Path(jaxamp.__file__).is_relative_to(sys.prefix), jaxamp.__file__
for namespace in ("jaxamp", "jaxamp.diagnostics", "jaxamp.fsdp", "jaxamp.fp8"):
    module = importlib.import_module(namespace)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, (namespace, missing)
print(importlib.metadata.version("jax-mixed-precision"), len(jaxamp.__all__))
"""
    result = subprocess.run(
        [str(python), "-c", check], check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [jaxamp.__version__, str(len(jaxamp.__all__))]

