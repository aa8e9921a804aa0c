"""The wheel carries what an installed pressroom needs: built from this tree and installed into a fresh venv,
`pressroom bench gpu --help` runs and a model shape resolves by name, from a directory outside the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = """
import pressroom
from pressroom.benchmarks.shapes import resolve_shape
from pressroom.entrypoints.cli import build_parser
from pressroom.model.loader import load_hf_config
print(pressroom.__file__)
print(build_parser().parse_args(["bench", "gpu", "--model", "qwen3-8b"]).model)
print(load_hf_config(str(resolve_shape("llama-3.1-8b"))).hidden_size)
"""


def _run(cmd: list, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing points back at the checkout
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{cmd}: {done.stderr[-3000:]}"
    return done.stdout


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the tree (the build's build/ and egg-info stay out of the checkout), with the
    installed setuptools: no index is reached."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "pressroom", src / "pressroom", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index",
          "-w", tmp_path / "dist", src], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("pressroom-*.whl")
    return wheel


def _fresh_venv_with(wheel: Path, root: Path) -> Path:
    """A venv holding the wheel's pressroom alone; the test venv's packages (torch, transformers, ...) seen after
    its own through a path line, which runs none of that directory's .pth files: the test venv's editable
    pressroom stays out of sight."""
    _run([sys.executable, "-m", "venv", "--without-pip", root], root.parent)
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
         root.parent)
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root.parent).strip()
    Path(site, "zz-test-venv-packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


@pytest.mark.slow  # builds and installs a wheel: 7 s
def test_an_installed_wheel_benches_shipped_model_shapes(tmp_path):
    python = _fresh_venv_with(_build_wheel(tmp_path), tmp_path / "venv")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert "llama-3.1-8b" in _run([python.parent / "pressroom", "bench", "gpu", "--help"], outside)
    package_file, named, hidden_size = _run([python, "-c", CHECK], outside).split()
    installed = tmp_path / "venv" / "lib"
    assert Path(package_file).is_relative_to(installed)  # the wheel's pressroom, not the checkout's
    assert Path(named).is_relative_to(installed) and Path(named).name == "qwen3-8b"
    assert hidden_size == "4096"
