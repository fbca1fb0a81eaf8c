"""The suite as a package, built as a wheel and installed in a fresh venv outside this checkout.

From someone else's directory, it runs the whole catalogue against a driver of theirs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGED = [
    "pyproject.toml",
    "README.md",
    "gpuhost",
    "drivers",
    "conformance",
    "workloads",
    "gpu_sandbox",
]
"""What the wheel is built from, copied out of the checkout: pip builds in the source tree's
build/, which another build (another worker, a developer's) may be emptying, and whose leftovers
(modules since moved) would land in the wheel."""

pytestmark = pytest.mark.xdist_group("wheel")
INSTALL_TIMEOUT_S = 600
"""A fresh venv downloads the dependencies (numpy and the engines' clients among them)."""

OUT_OF_TREE_DRIVER = '''
"""A driver of someone else's: the reference driver under another name."""

from drivers.reference import ReferenceDriver


class MyDriver(ReferenceDriver):
    name = "mydriver"
'''


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env},
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv, outside the checkout, with the project's wheel installed: its python."""
    where = tmp_path_factory.mktemp("wheel")
    source = where / "source"
    source.mkdir()
    for name in PACKAGED:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(where), str(source)],
        where,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = where.glob("gpu_sandbox_conformance-*.whl")
    venv = where / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], where)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    pip = _run([str(python), "-m", "pip", "install", "-q", str(wheel)], where)
    assert pip.returncode == 0, pip.stderr
    return python


def test_the_wheel_carries_the_catalogue_and_its_data(installed: Path) -> None:
    code = textwrap.dedent(
        """
        from importlib import resources
        for package, name in [("conformance", "REQUIREMENTS.yaml"), ("gpuhost", "gpu-lease"),
                              ("gpuhost.simulated", "nvidia-smi.awk"),
                              ("workloads", "manifest.yaml"), ("workloads", "payloads/control.py")]:
            assert (resources.files(package) / name).is_file(), (package, name)
        import conformance, drivers
        print(conformance.__file__)
        """
    )
    done = _run([str(installed), "-c", code], installed.parent)
    assert done.returncode == 0, done.stderr
    assert "site-packages" in done.stdout, f"imported from the checkout: {done.stdout}"


def test_the_engine_clients_are_extras_the_wheel_installs_without(installed: Path) -> None:
    """A driver author's venv gets the contract and the catalogue, no engine client."""
    code = "import importlib.util as u; print([m for m in {!r} if u.find_spec(m)])".format(
        ("docker", "podman", "kubernetes", "grpc")
    )
    done = _run([str(installed), "-c", code], installed.parent)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stdout + done.stderr


def test_the_catalogue_runs_against_an_out_of_tree_driver(installed: Path, tmp_path: Path) -> None:
    """`pytest --pyargs conformance` in someone else's repository, with a driver of theirs."""
    repository = tmp_path / "their-repo"
    repository.mkdir()
    (repository / "mydriver.py").write_text(OUT_OF_TREE_DRIVER)
    report = repository / "conformance.json"
    done = _run(
        [
            str(installed), "-m", "pytest", "--pyargs", "conformance", "workloads",
            "--driver=mydriver:MyDriver", "--sim-gpus=4", "-p", "no:cacheprovider",
            f"--conformance-json={report}",
        ],
        repository,
        PYTHONPATH=str(repository),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "mydriver:MyDriver: PASS" in done.stdout, done.stdout[-3000:]
    assert report.is_file()


def test_the_wheel_carries_every_command_of_gpu_sandbox(installed: Path, tmp_path: Path) -> None:
    """The wheel's ``gpu-sandbox``: its entry point and each command's module (a subpackage)."""
    sim = tmp_path / "sim"
    setup = _run([str(installed), "-m", "gpuhost.simulated", "setup", f"--root={sim}"], tmp_path)
    assert setup.returncode == 0, setup.stderr
    command = str(installed.parent / "gpu-sandbox")
    for argv in (["spec", f"--sim-root={sim}", "--gpu"], ["gpus", f"--sim-root={sim}"]):
        done = _run([command, *argv], tmp_path)
        assert done.returncode == 0, done.stderr
    for name in ("run", "spec", "gpus", "reap", "report"):
        done = _run([command, name, "--help"], tmp_path)
        assert (done.returncode, done.stderr) == (0, ""), name
