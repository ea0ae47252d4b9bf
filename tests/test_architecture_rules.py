"""Rules of docs/architecture.md that import contracts cannot say (its "Rules the layout
keeps"): the engine uses the chunk store only through its methods, no behaviour switch is an
environment variable, mixed steps use the engine only through their StepHost; and the names
and files the document cites exist."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINE = ROOT / "lazyllm" / "engine"
# the chunk store's own state: its entries in LRU order and its counters (tests read them)
STORE_STATE = {"entries", "counters"}
# the environment variables the product reads, none of them a behaviour switch: where things
# are (caches), a credential, the devices present, Hugging Face's own offline mode, and
# Triton's interpreter (set and put back by the kernel loader on CPU)
READ_ENV = {"LAZYLLM_CACHE", "TRITON_CACHE_DIR", "LAZYLLM_API_KEY", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE",
            "TRITON_INTERPRET"}


def _sources(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _ends_in_store(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return "store" in name


def test_the_engine_uses_the_chunk_store_through_its_methods():
    found = []
    for p in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in STORE_STATE and _ends_in_store(node.value):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def _env_reads(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr == "get" and ast.unparse(f.value) == "os.environ") or ast.unparse(f) == "os.getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and \
                ast.unparse(node.value) == "os.environ":
            key = node.slice
        if key is not None:
            out.add(key.value if isinstance(key, ast.Constant) else ast.unparse(key))
    return out


def test_no_behaviour_switch_is_an_environment_variable():
    read = set()
    for p in _sources("lazyllm", "integrations", "kernels"):
        if p.relative_to(ROOT).parts[:2] in (("lazyllm", "kernels"), ("lazyllm", "integrations")):
            continue  # links to the folders above
        read |= _env_reads(ast.parse(p.read_text()))
    assert _env_reads(ast.parse("os.environ.get('A'); os.getenv('B'); os.environ['C']")) == {"A", "B", "C"}
    assert read and read <= READ_ENV, read - READ_ENV


def test_mixed_steps_use_the_engine_only_through_the_step_host():
    """``MixedSteps`` reads of its engine only what ``StepHost`` declares."""
    from lazyllm.engine.scheduling.mixed import StepHost

    declared = set(StepHost.__annotations__) | {n for n in vars(StepHost) if not n.startswith("_")}
    tree = ast.parse((ENGINE / "scheduling" / "mixed.py").read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "e") or ast.unparse(v) == "self.engine":
                used.add(node.attr)
    assert used and used <= declared, used - declared


def _class_members() -> dict[str, set[str]]:
    """Every class of the product, by name: its methods and the attributes it assigns."""
    out: dict[str, set[str]] = {}
    for p in _sources("lazyllm", "integrations", "kernels"):
        if p.relative_to(ROOT).parts[:2] in (("lazyllm", "kernels"), ("lazyllm", "integrations")):
            continue
        for c in ast.walk(ast.parse(p.read_text())):
            if isinstance(c, ast.ClassDef):
                m = out.setdefault(c.name, set())
                for n in ast.walk(c):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        m.add(n.name)
                    elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        m.add(n.id)
                    elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                        m.add(n.attr)
    return out


def test_docs_architecture_names_what_exists():
    """Every ``Class.member`` docs/architecture.md names is a member of a class of the
    product, and every file its diagram names exists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    parts = text.split("```")
    prose, diagram = "".join(parts[0::2]), "".join(parts[1::2])
    members = _class_members()
    named = [p for span in re.findall(r"`([^`]+)`", prose) for p in re.findall(r"(?<![\w.])([A-Z]\w*)\.(\w+)", span)]
    wrong = [f"{c}.{a}" for c, a in named if a not in members.get(c, ())]
    assert len(named) > 10 and not wrong, wrong
    files = re.findall(r"((?:lazyllm|engine|cache|model|inputs|kernels|integrations)/[\w/]+\.py)", diagram)
    missing = [f for f in files if not (ROOT / f).exists() and not (ROOT / "lazyllm" / f).exists()]
    assert len(files) > 10 and not missing, missing
