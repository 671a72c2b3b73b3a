"""A wheel built from pyproject.toml + setup.py, installed in a fresh virtual environment with the source
tree off the path, holds every module: each one imports, and `dapo-megatron --help` runs.

An editable install (what the README's commands and CI use) finds any folder of the checkout, so it
cannot see a subpackage the build leaves out; a cluster venv or a container installs the wheel. On
966f1da the wheel had no dapo_megatron/dataplane and `train` failed on import.
The fresh venv reaches the dependencies (torch, megatron-core, ...) through a .pth line naming this
environment's site-packages: only the project comes from the wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# every module of both import packages, imported one by one; prints the ones that fail with their error
IMPORT_ALL = r"""
import importlib, pkgutil, sys, traceback
failed, imported = [], 0
for top in ("dapo_megatron", "dapo_kernels"):
    pkg = importlib.import_module(top)
    assert "site-packages" in pkg.__file__ and "{root}" not in pkg.__file__, pkg.__file__
    names = [top] + [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".")]
    for name in names:
        try:
            importlib.import_module(name)
            imported += 1
        except Exception:
            failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("imported", imported)
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _source_modules() -> set[str]:
    """Every .py module of the source tree, by import name."""
    out = set()
    for top, folder in (("dapo_megatron", ROOT / "dapo_megatron"), ("dapo_kernels", ROOT / "kernels")):
        for path in folder.rglob("*.py"):
            if not (path.parent / "__init__.py").exists():
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            out.add(".".join((top, *parts)).removesuffix(".__init__"))
    return out


def test_every_subpackage_is_in_the_wheel_and_imports_from_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("dapo_megatron-*.whl")
    in_wheel = {
        name.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for name in zipfile.ZipFile(wheel).namelist()
        if name.endswith(".py")
    }
    missing = sorted(_source_modules() - in_wheel)
    assert not missing, f"modules of the source tree missing from {wheel.name}: {missing}"

    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    fresh_site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # the dependencies from this environment; a .pth line adds a folder without processing the .pth files
    # inside it, so this environment's editable install of the checkout does not come along
    deps = sysconfig.get_paths()["purelib"]
    Path(fresh_site, "_dependencies.pth").write_text(deps + "\n")
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    run = subprocess.run(
        [str(py), "-c", IMPORT_ALL.replace("{root}", str(ROOT))],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"imports from the installed wheel failed:\n{run.stdout[-4000:]}\n{run.stderr[-3000:]}"
    assert f"imported {len(_source_modules())}" in run.stdout, run.stdout[
        -2000:
    ]  # dapo_megatron's and dapo_kernels' modules

    cli = subprocess.run(
        [str(venv / "bin" / "dapo-megatron"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "train" in cli.stdout and "serve-rollout" in cli.stdout


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
