"""The repository as a user meets it: no folder or script of it stands in for an installed
package, and the wheel built from the tree holds every module of ``lazyllm``.

A Python started at the repository's root (a notebook, ``python -m``, pytest) has the root
first on ``sys.path``; a script started from ``benchmarks/`` or ``examples/`` has its own folder
first. A regular package or a module there with the name of an installed package hides it
(the top-level ``kernels/`` once hid Hugging Face's ``kernels``, which transformers imports).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWN_DIST = "lazyattention"
# The only regular packages at the root: the product, and the test suite's shared helpers
# (``tests.conftest``, ``tests.hf_reference``), which pytest reaches from the root.
ROOT_PACKAGES = {"lazyllm", "tests"}
# Folders Python puts first on sys.path: the root, and the folder of a script run from it.
SCRIPT_FOLDERS = ["benchmarks", "examples", "scripts"]


def _importable(folder: Path) -> dict[str, Path]:
    """What ``import NAME`` takes from ``folder`` when it is on ``sys.path``: its modules and
    its regular packages (a folder without ``__init__.py`` is a namespace portion, which an
    installed package of that name always wins over)."""
    names = {}
    for p in folder.iterdir():
        if p.is_dir() and (p / "__init__.py").exists():
            names[p.name] = p
        elif p.suffix == ".py":
            names[p.stem] = p
    return names


def _installed() -> dict[str, list[str]]:
    """Top-level import names of the installed distributions, ours left out."""
    return {name: dists for name, dists in packages_distributions().items() if dists != [OWN_DIST]}


def _test_folders() -> list[Path]:
    # pytest puts each test file's folder on sys.path (no __init__.py in them)
    return [p for p in (ROOT / "tests").rglob("*") if p.is_dir() and "__pycache__" not in p.parts]


def test_only_the_product_and_the_tests_are_packages_at_the_root():
    packages = {name for name, p in _importable(ROOT).items() if p.is_dir()}
    assert packages <= ROOT_PACKAGES
    assert not (ROOT / "kernels" / "__init__.py").exists() and not (ROOT / "integrations" / "__init__.py").exists()
    for name in ("kernels", "integrations"):  # reached as lazyllm.kernels / lazyllm.integrations through a link
        link = ROOT / "lazyllm" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), name


@pytest.mark.parametrize("folder", ["."] + SCRIPT_FOLDERS + ["tests/*"])
def test_no_file_shadows_an_installed_or_standard_module(folder):
    folders = _test_folders() + [ROOT / "tests"] if folder == "tests/*" else [ROOT / folder]
    installed = _installed()
    clashes = {}
    for f in folders:
        for name, path in _importable(f).items():
            if name in ROOT_PACKAGES and f == ROOT:
                continue
            if name in installed or name in sys.stdlib_module_names:
                clashes[str(path.relative_to(ROOT))] = installed.get(name, "the standard library")
    assert not clashes, f"rename these, they hide an installed module: {clashes}"


def test_python_started_at_the_root_imports_the_installed_kernels_package():
    """Hugging Face's ``kernels`` (a transformers dependency) where it is installed; without it
    the root's ``kernels/`` is only a namespace portion, which transformers does not take for it."""
    code = ("import importlib.util, sys; s = importlib.util.find_spec('kernels'); "
            "print(s.origin if s and s.origin else 'namespace')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    if "kernels" in packages_distributions():
        assert "site-packages" in origin and not origin.startswith(str(ROOT / "kernels")), origin
    else:
        assert origin == "namespace", origin


def _tree_files() -> set[str]:
    """Every file the wheel must hold: the ``.py`` files under lazyllm/ (through its links to
    kernels/ and integrations/) and the shipped packets."""
    want = set()
    for dirpath, dirnames, filenames in os.walk(ROOT / "lazyllm", followlinks=True):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(ROOT)
        want |= {str(rel / f) for f in filenames if f.endswith(".py")}
    want |= {str(p.relative_to(ROOT)) for p in (ROOT / "lazyllm" / "model" / "packet_files").glob("*.safetensors")}
    return want


def test_the_wheel_holds_every_module_of_the_tree(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "build", "dist", "*.egg-info", ".carry", ".whl", "out", ".*_cache"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lazyattention-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {n for n in names if n.startswith("lazyllm/")}
    want = _tree_files()
    assert want - in_wheel == set(), "missing from the wheel"
    assert {n for n in in_wheel if n.endswith(".py")} - want == set(), "in the wheel but not in the tree"
    for sub in ("lazyllm/inputs/__init__.py", "lazyllm/kernels/triton/__init__.py", "lazyllm/kernels/loader.py",
                "lazyllm/integrations/server/__init__.py"):
        assert sub in in_wheel, sub
