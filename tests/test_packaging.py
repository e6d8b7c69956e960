"""The wheel ships every package and imports from a fresh venv; the CPU install route; `make gpu-test` on a CPU."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

import boundary

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("boundary", "cute_kernels")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SKIP_COPY = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".device",
    ".whl",
    "results",
    "reports",
)


def clean_env() -> dict[str, str]:
    """The environment without the PYTHONPATH that conftest points at the source tree."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def source_modules() -> set[str]:
    """Every module of the shipped packages, as the source tree has them."""
    names = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built from a copy of the working tree (so that no build output lands in it), and the build log."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP_COPY)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=clean_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = (tmp / "dist").glob("mhc_boundary-*.whl")
    return built, out.stdout + out.stderr


def test_wheel_ships_every_package_and_nothing_else(wheel: tuple[Path, str]) -> None:
    names = zipfile.ZipFile(wheel[0]).namelist()
    modules = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}
    assert modules == source_modules()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PACKAGES)


def test_wheel_metadata_uses_the_current_license_form(wheel: tuple[Path, str]) -> None:
    built, log = wheel
    meta = next(n for n in zipfile.ZipFile(built).namelist() if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(built).read(meta).decode().splitlines()
    assert "project.license" not in log, "setuptools warned about the license field"


def test_installed_wheel_imports_every_public_name(wheel: tuple[Path, str], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True, env=clean_env()
        ).strip()
    )
    # The fresh venv sees this environment's packages (torch, the CuTe DSL, ...), but not the editable install.
    test_sites = [Path(p) for p in site.getsitepackages() + [sysconfig.get_path("purelib")]]
    test_sites = list(dict.fromkeys(p for p in test_sites if p.is_dir()))
    (purelib / "00-test-env.pth").write_text("".join(f"{p}\n" for p in test_sites))
    for pth in (p for d in test_sites for p in sorted(d.glob("*.pth"))):
        text = pth.read_text()
        if not pth.name.startswith("__editable__") and str(ROOT) not in text:
            (purelib / pth.name).write_text(text)
    install = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        str(wheel[0]),
    ]
    out = subprocess.run(install, capture_output=True, text=True, env=clean_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    probe = f"""
import importlib, json, sys, boundary
from boundary.toy import ToyConfig, ToyModel, compare, decode_step, decode_step_plain, random_tokens
names = [n for n in boundary.__all__ if hasattr(boundary, n)]
for m in {sorted(source_modules())!r}:
    importlib.import_module(m)
model = ToyModel(ToyConfig(hidden_size=512, num_layers=2, vocab=64))
ar = boundary.BoundaryAllReduce(512, max_rows=4, device="cpu")
tokens = random_tokens(model, 3, 0)
step = decode_step(model, boundary.Boundaries(ar), tokens, boundary.DecodeStep.for_rows(3))
from cute_kernels import native  # its C source ships in the wheel and builds from there
built = native.available() and native.library_path().exists()
files = {{m: getattr(mod, "__file__", None) for m, mod in sys.modules.items() if m.split(".")[0] in {PACKAGES!r}}}
files["launch.c"] = str(native.SOURCE)
bitwise = compare(step, decode_step_plain(model, tokens))["bitwise"]
print(json.dumps(dict(names=names, files=files, bitwise=bitwise, native=built)))
"""
    env = {**clean_env(), "MHC_BOUNDARY_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["names"] == list(boundary.__all__)
    assert set(got["files"]) >= source_modules()
    outside = {m: f for m, f in got["files"].items() if not Path(f).resolve().is_relative_to(purelib.resolve())}
    assert not outside, f"imported from outside the fresh venv: {outside}"
    assert got["bitwise"] and got["native"]


def make_dry_run(*args: str) -> str:
    """The commands `make install` would run for a fresh venv, with the given variable settings."""
    out = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "install", "VENV=/nonexistent/venv", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_install_takes_torch_from_the_cpu_index_by_default() -> None:
    torch_lines = [line for line in make_dry_run().splitlines() if '"torch==2.13.0"' in line]
    assert len(torch_lines) == 2
    first, deps = torch_lines
    assert "--no-deps" in first and f"--index-url {CPU_INDEX}" in first
    assert "--index-url" not in deps and "--no-deps" not in deps
    assert "--index-url" not in make_dry_run("TORCH_INDEX=")


def test_readme_documents_the_cpu_route() -> None:
    text = (ROOT / "README.md").read_text()
    assert f"pip install torch==2.13.0 --index-url {CPU_INDEX}" in text
    assert "TORCH_INDEX" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the GPU tests")
def test_make_gpu_test_without_a_gpu_fails_saying_nothing_ran() -> None:
    out = subprocess.run(
        ["make", "-C", str(ROOT), "gpu-test", f"PYTHON={sys.executable}", "DEPS="],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode != 0
    assert "no GPU test ran" in out.stdout + out.stderr
