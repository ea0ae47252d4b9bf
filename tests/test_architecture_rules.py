"""Rules of docs/architecture.md that import contracts cannot say (its "Rules the layout
keeps"): the engine uses the chunk store only through its methods, no behaviour switch is an
environment variable, mixed steps use the engine only through their StepHost, only the KV
planner and the plan itself write a request's plan and only the engine loop its decoding
position; and the names and files the document cites exist."""
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


# the modules that write a request's plan (``PrefillPlan``): the KV planner that makes it, and
# the plan's own methods (``recomputed``, ``prefilled``)
PLAN_WRITERS = {"lazyllm/engine/kv/planner.py", "lazyllm/engine/request.py"}
# the one module that writes a request's decoding position (``RequestState.next_pos``)
POSITION_WRITERS = {"lazyllm/engine/engine.py"}
# list and dict edits that change a field in place
IN_PLACE = {"append", "extend", "insert", "remove", "pop", "clear", "update", "__setitem__", "__setattr__"}


def _named(node: ast.AST, name: str) -> bool:
    """Whether ``node`` is ``<x>.name`` (not ``self.name``: an object's own field) or a local
    called ``name``."""
    if isinstance(node, ast.Attribute):
        return node.attr == name and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    return isinstance(node, ast.Name) and node.id == name


def _writes(tree: ast.AST, owner: str, fields: set[str] | None = None) -> list[tuple[int, str]]:
    """Where ``tree`` writes a field of ``owner`` (``<x>.owner``, or a local called
    ``owner``): an assignment, augmented or not, a deletion, an item of it, an in-place edit
    or ``setattr``; ``fields``: only those fields. Where ``owner`` is ``"plan"``, assigning
    ``<x>.plan`` itself counts too."""
    out = []
    for node in ast.walk(tree):
        field = None  # the ``<owner>.<field>`` written
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if owner == "plan" and _named(node, "plan"):
                out.append((node.lineno, ast.unparse(node)))  # the request's plan itself
            field = node
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            field = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in IN_PLACE:
            field = node.func.value
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) > 1:
            name = node.args[1]  # a field named by a string, or any field
            field = ast.Attribute(node.args[0], name.value if isinstance(name, ast.Constant) else "*")
        if isinstance(field, ast.Attribute) and _named(field.value, owner) and \
                (fields is None or field.attr in fields or field.attr == "*"):
            out.append((node.lineno, ast.unparse(node)))
    return out


def _package_writes(owner: str, allowed: set[str], fields: set[str] | None = None) -> list[str]:
    found = []
    for p in _sources("lazyllm"):
        rel = p.relative_to(ROOT).as_posix()
        if rel not in allowed:
            found += [f"{rel}:{line}: {code}" for line, code in _writes(ast.parse(p.read_text()), owner, fields)]
    return found


def test_the_writes_of_a_plan_are_found():
    """What the two rules below look for, on a sample (an object's own field, ``self.x``, is
    not another part's)."""
    src = """
plan = r.plan
plan.cached_tokens -= 3
plan.copies = plan.copies + copies
r.plan.job = job
r.plan.copies.append(c)
r.plan.copies[0] = c
setattr(r.plan, "job", job)
setattr(state, "row", 1)
setattr(state, name, 1)
r.plan = None
plan.spans, plan.own = [], []
self.plan = x
r.state.next_pos += 1
self.state.next_pos = 4
state.row = 2
n = r.plan.next_pos + plan.job.start_pos
"""
    tree = ast.parse(src)
    assert sorted(line for line, _ in _writes(tree, "plan")) == [3, 4, 5, 6, 7, 8, 11, 12, 12]
    assert sorted(line for line, _ in _writes(tree, "state", {"next_pos"})) == [10, 14]


def test_only_the_planner_and_the_plan_write_a_plan():
    """A request's ``PrefillPlan`` is the KV planner's decision: every other part reads it
    and decides in values of its own (quality recovery's ``Recomputation``, the step's
    ``PrefillBatch``); the plan's counts move only through its own methods."""
    found = _package_writes("plan", PLAN_WRITERS)
    assert not found, found


def test_only_the_engine_loop_moves_a_decoding_position():
    """``RequestState.next_pos`` is the engine's: it starts a request decoding at its plan's
    ``next_pos`` and moves it by each token handed out; the planner only plans it."""
    found = _package_writes("state", POSITION_WRITERS, {"next_pos"})
    assert not found, found
