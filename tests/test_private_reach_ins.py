"""No part reaches into another's private members.

A module may read or call ``x._name`` only where ``x`` is ``self`` or ``cls``, or where
``_name`` is defined in the same module (an attribute it assigns, a method or function it
defines): a class's private members are its own module's business. Importing an
underscore name from another module (``from a import _f``) is a reach-in too.

Which class ``x`` is cannot be known without running the code; the rule above is the
practical one: a private name that the module does not define itself belongs to a class
defined elsewhere. Python's own underscore conventions (a named tuple's ``_replace``,
``_asdict``, ``_fields``; ``sys._getframe``; ``os._exit``) are not private members; a few
third-party internals are listed with the reason each is read (``THIRD_PARTY``).
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the product's code; kernels/triton holds the Triton kernels, whose launchers speak to
# Triton's own internals
PACKAGES = ("lazyllm", "integrations", "kernels")
SKIP = (("kernels", "triton"),)
# underscore names that are public by convention: a named tuple's, an enum's, sys and os's,
# and IPython's display protocol (``_repr_markdown_``)
PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_field_defaults", "_getframe", "_exit", "_missing_",
          "_value_", "_name_", "_generate_next_value_", "_ignore_", "_repr_markdown_", "_repr_html_"}
# other libraries' internals, each read where the library offers no public way (module,
# name): Ray Serve's router (a handle's running replicas), Triton's sum combine (tl.sum in
# the interpreter), and a transformers config's model name (written when converting a GGUF)
THIRD_PARTY = {("integrations/ray_serve.py", "_router"), ("integrations/ray_serve.py", "_asyncio_router"),
               ("kernels/fused.py", "_sum_combine"), ("lazyllm/model/loader.py", "_name_or_path")}


def _modules():
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).parts
            if any(rel[:len(s)] == s for s in SKIP):
                continue
            if any((ROOT / pathlib.Path(*rel[:i])).is_symlink() for i in range(1, len(rel))):
                continue  # lazyllm/kernels, lazyllm/integrations: links to the folders above
            yield p


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in PUBLIC


def _defined(tree: ast.AST) -> set[str]:
    """The underscore names a module defines: functions, classes, methods, and attributes
    or variables it assigns."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            out.add(node.attr)  # its own attribute (writing another object's is a reach-in)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)  # a field of a class the module makes (dataclass(_x=...)) or declares
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if _private(n)}


def reach_ins(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = _defined(tree)
    rel = str(path.relative_to(ROOT))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if (rel, node.attr) in THIRD_PARTY:
                continue
            out.append(f"{rel}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
            out += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
    return out


def test_checker_sees_a_reach_in(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from .a import _f\nclass A:\n    def g(self, e):\n        self._x = 1\n"
                 "        e._z = 2\n        return e._finish(), e._x, self._y, e._replace()\n")
    found = [s.split(": ", 1)[1] for s in reach_ins_at(p, tmp_path)]
    assert sorted(found) == ["._finish", "._z", "import _f"], found


def reach_ins_at(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return reach_ins(path)
    finally:
        ROOT = saved


def test_no_private_reach_ins():
    found = [v for p in _modules() for v in reach_ins(p)]
    assert list(_modules()) and not found, "\n".join(found)
