"""The size rule of the product and of its benchmark tools: no module over 500 lines outside
``kernels/triton/``, no function body over 60 lines outside ``kernels/`` (a docstring not
counted)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("lazyllm", "integrations", "kernels", "benchmarks")


def _modules():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
        isinstance(body[0].value.value, str)
    if doc and len(body) == 1:
        return 0
    return fn.end_lineno - (body[1] if doc else body[0]).lineno + 1


def test_modules_within_500_lines():
    long = [(str(p.relative_to(ROOT)), n) for p in _modules() if "triton" not in p.relative_to(ROOT).parts
            for n in [len(p.read_text().splitlines())] if n > 500]
    assert list(_modules()) and not long, long


def test_function_bodies_within_60_lines():
    long = []
    for p in _modules():
        if p.relative_to(ROOT).parts[0] == "kernels":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 60:
                long.append((str(p.relative_to(ROOT)), node.name, _body_lines(node)))
    assert not long, long
