"""The warm-up (lazyllm.engine.warmup.driver): Triton's cache folder, the counter of kernels compiled
after ready (fed with Triton's hook events directly: nothing compiles on CPU), and the
warm-up's synthetic requests through a real engine on CPU, which must leave no trace."""
from __future__ import annotations

import ast
import inspect
import logging
import os
from pathlib import Path

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.engine.warmup import compiles as cw
from lazyllm.engine.warmup import driver as wu
from lazyllm.engine.warmup.shapes import RunnerShapes
from tests.conftest import make_tiny


class _Fn:  # what Triton passes as ``fn`` (its JitFunctionInfo): module and name
    module, name = "lazyllm.kernels.triton.decode", "_paged_decode_fwd"


# Triton 3.6's ``repr`` of a specialization: cut after the first argument (it zips the
# parameters with one character of the cache key)
_REPR = "_paged_decode_fwd[num_warps=4, num_ctas=1](Q: ()"
# and its ``compile`` record: 60 aligned pointers, two constexprs, then the argument whose
# alignment was new
_SIGNATURE = {**{f"A{i}": "*bf16" for i in range(60)}, "BLOCK_N": "constexpr", "IDX64": "constexpr", "BLen": "*i32"}
_COMPILE = {"key": "k", "signature": _SIGNATURE, "constants": {(60,): 64, (61,): False},
            "configs": [{(i,): [["tt.divisibility", 16]] for i in range(60)}]}


def _compile_event(watch, **kw):
    """One call of Triton's post-compile hook (``watch.hook``, or a hook itself), as
    ``JITFunction._call_hook`` makes it."""
    hook = watch.hook if isinstance(watch, cw.CompileWatch) else watch
    return hook(key="k", repr=_REPR, fn=_Fn(),
                compile=_COMPILE, is_manual_warmup=False, already_compiled=False, **kw)


def test_compiles_count_as_late_only_after_ready_and_outside_warm_ups(caplog):
    w = cw.CompileWatch()
    _compile_event(w)  # no engine ready yet: a load-time compile
    assert (w.compiled, w.after_ready) == (1, 0)
    mark = w.mark_ready()
    with w.warming():
        _compile_event(w)  # another engine's warm-up
    assert (w.compiled, w.after_ready) == (2, 0)
    with caplog.at_level(logging.WARNING, logger="lazyllm"):
        _compile_event(w)
    assert w.after_ready - mark == 1
    late = [r for r in caplog.records if "after the engine was ready" in r.getMessage()]
    assert len(late) == 1 and "lazyllm.kernels.triton.decode._paged_decode_fwd" in late[0].getMessage()
    # the whole specialization on one line, from the compile record: every argument, the
    # constexprs' values, and the alignment each pointer was specialized on
    msg = late[0].getMessage()
    assert "\n" not in msg and "A0:*bf16[tt.divisibility=16]" in msg and "A59:*bf16[tt.divisibility=16]" in msg
    assert "BLOCK_N=64, IDX64=False" in msg and msg.endswith("BLen:*i32")
    w.mark_closed()
    _compile_event(w)  # no engine ready any more
    assert w.after_ready - mark == 1


def test_install_chains_the_hook_the_user_had():
    knobs = pytest.importorskip("triton").knobs
    seen = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        w = cw.CompileWatch()
        assert w.install() and w.install()  # once; the second call changes nothing
        assert knobs.runtime.jit_post_compile_hook == w.hook
        _compile_event(knobs.runtime.jit_post_compile_hook)
        assert seen == ["_paged_decode_fwd"] and w.compiled == 1
    finally:
        knobs.runtime.jit_post_compile_hook = before


def test_triton_cache_defaults_to_lazyllm_cache_folder_unless_set(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert cw.default_triton_cache() == str(tmp_path / "triton") == os.environ["TRITON_CACHE_DIR"]
    ro = tmp_path / "read-only"
    ro.write_text("a file where the cache folder would go")
    monkeypatch.setenv("LAZYLLM_CACHE", str(ro))
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert cw.default_triton_cache() is None and "TRITON_CACHE_DIR" not in os.environ
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert cw.default_triton_cache() == str(tmp_path / "mine")
    triton = pytest.importorskip("triton")
    assert triton.knobs.cache.dir == str(tmp_path / "mine")  # Triton reads the variable at each compile


@pytest.fixture(scope="module")
def llm(tokenizer):
    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=1 << 21, quality="isolated")
    yield llm
    llm.close()


def test_cpu_skips_warm_up_and_is_ready(llm):
    report = llm.warmup()
    assert report["skipped"] == "cpu" and report["requests"] == 0 and llm.ready
    assert llm.warmup() == report  # once


def test_late_compiles_reach_cache_stats(llm, caplog):
    before = llm.cache_stats()["kernels_compiled_after_ready"]
    with caplog.at_level(logging.WARNING, logger="lazyllm"):
        _compile_event(cw.COMPILES)
    assert llm.cache_stats()["kernels_compiled_after_ready"] == before + 1
    assert any("_paged_decode_fwd" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kw", [dict(quality="isolated"), dict(quality="isolated", reuse="block"), dict()],
                         ids=["lazy", "block", "balanced (default)"])
def test_warm_up_requests_leave_no_trace(tokenizer, tmp_path, kw, caplog):
    """The synthetic requests run through the engine (on CPU when asked), every step of them
    without failing, and leave the cache, its counters, the engine's metrics, the disk tier
    and later answers as they were."""
    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=1 << 23, kv_disk_dir=tmp_path, **kw)
    try:
        docs = ["The lamp is in room 7.", "The chair is in room 3."]
        first = llm.generate("Where is the lamp?", chunks=docs, max_new_tokens=6)
        llm.engine.flush_disk()
        files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
        # read between engine steps (the step that answered adds its time after the answer)
        stats, metrics = llm.engine.call(lambda: (llm.cache_stats(), dict(llm.engine.metrics)))
        with caplog.at_level("WARNING", logger="lazyllm"):
            report = wu.warm_up(llm.engine, llm.inputs.synthetic, progress=False, on_cpu=True)
        assert report["skipped"] is None and report["requests"] > 20
        assert not [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
        llm.engine.flush_disk()
        assert llm.cache_stats() == stats and llm.engine.metrics == metrics
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == files
        again = llm.generate("Where is the lamp?", chunks=docs, max_new_tokens=6)
        # the same answer, its documents still cached (the warm-up dropped only its own entries)
        assert again.token_ids == first.token_ids and again.usage.cached_tokens > first.usage.cached_tokens
    finally:
        llm.close()


def test_prefill_lengths_cover_every_launch_plan_of_a_dense_sweep(tokenizer):
    """The chunk lengths the runner gives the warm-up reach every launch plan (constexprs and
    integer and pointer specializations, from the launcher's own ``plan_launch``) that any
    length up to the longest does."""
    from lazyllm.intmath import cdiv
    from lazyllm.kernels.triton.launcher import launch_variants

    model = make_tiny("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=1 << 26, attention_backend="triton", page_size=64,
                  quality="isolated")
    try:
        r = llm.engine.runner

        def keys(n):
            return launch_variants(r.model, r.pool.k, r.pool.v, 1, n, cdiv(n, 64), cdiv(n, 64))

        shapes = RunnerShapes(r).warm_shapes(3064)  # the longest prefill: 3000 tokens
        lengths = shapes.prefill_lengths
        reached = set().union(*(keys(n) for n in lengths))
        assert max(lengths) <= 3000 and len(lengths) < 40
        assert reached == set().union(*(keys(n) for n in range(2, 3001)))
        assert shapes.questions and all(b * n <= r.max_batch_tokens for b, n, _ in shapes.questions)
    finally:
        llm.close()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_steps_leave_answers_unchanged(tokenizer, backend):
    """The warm-up's decode steps with every row padding (captured in CUDA graphs on a GPU)
    write only the scratch slot: a request after them gets the same tokens as before."""
    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=1 << 22, attention_backend=backend,
                  quality="isolated")
    try:
        before = llm.generate("Where?", chunks=["The lamp is in room 7."], max_new_tokens=5).token_ids
        e = llm.engine
        for B, W in ((1, 16), (4, 32), (16, 16)):
            e.call(lambda B=B, W=W: e.runner.dummy_decode(B, W))
        assert llm.generate("Where?", chunks=["The lamp is in room 7."], max_new_tokens=5).token_ids == before
    finally:
        llm.close()


def test_every_compiled_launch_choice_is_in_the_launch_specialization():
    """The warm-up tells launch plans apart by ``launcher.specialization``: a choice added to
    ``LaunchPlan`` counts there unless it is listed as compiling nothing, so none escapes it."""
    from dataclasses import fields, replace

    from lazyllm.kernels.options import KeyLoop
    from lazyllm.kernels.triton.launcher import _NOT_COMPILED, LaunchPlan, specialization

    base = LaunchPlan(loop=KeyLoop.PER_TILE, decode_kernel=False, short=False, block_m=64, block_n=64, num_warps=4,
                      num_stages=2, ppt=1, q_tiles=3, num_splits=1, cs_per_page=False, prefetch=False,
                      from_delta=False, lookahead=False, packed_rot=False, gluon=False, gluon_key=(), loop_key=(),
                      config=None)
    key = specialization(base, 8, 8, 64)
    for f in fields(LaunchPlan):
        v = getattr(base, f.name)
        other = KeyLoop.PER_RUN if f.name == "loop" else (not v) if isinstance(v, bool) else \
            v * 2 + 1 if isinstance(v, int) else ("x",) if isinstance(v, tuple) else (1,)
        changed = specialization(replace(base, **{f.name: other}), 8, 8, 64) != key
        assert changed == (f.name not in _NOT_COMPILED or f.name == "num_splits"), f.name
    assert specialization(base, 16, 8, 64) != key and specialization(base, 8, 8, 66) != key


def _foreign_private_attributes(tree) -> list[str]:
    """``x._name`` read or written where ``x`` is not ``self`` / ``cls`` (a class's own)."""
    out = []
    for node in ast.walk(tree):
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        if private and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


def test_the_warm_up_driver_reaches_no_private_attribute_of_another_part():
    """The driver only asks the owners (runner, recovery, engine, the front door's request
    maker); it reaches into none of them."""
    src = Path(wu.__file__).read_text()
    assert _foreign_private_attributes(ast.parse(src)) == []
    assert _foreign_private_attributes(ast.parse("e.runner._graphs.run()")) == ["e.runner._graphs (line 1)"]
    assert "plan_launch" not in src and "LaunchPlan" not in src  # the shapes are the runner's and launcher's


def test_the_warm_up_takes_the_engine_and_the_front_doors_request_maker():
    params = list(inspect.signature(wu.warm_up).parameters)
    assert params[:2] == ["engine", "make_request"]


def test_a_warm_up_freezes_the_heap_until_its_engine_closes(tokenizer):
    """After a warm-up the objects alive then sit in the collector's permanent generation (a
    full collection no longer walks the model and the libraries); closing the engine gives
    them back, and garbage made before the freeze is freed then, not kept forever."""
    import gc
    import weakref

    from lazyllm.engine.warmup import heap

    class Cycle:
        pass

    gc.collect()
    base = gc.get_freeze_count()
    llm = LazyLLM(model=make_tiny("llama"), tokenizer=tokenizer, kv_cache_bytes=1 << 23)
    try:
        report = wu.warm_up(llm.engine, llm.inputs.synthetic, progress=False, on_cpu=True, freeze_heap=True)
        assert heap.holds(llm.engine) and report["heap_frozen"] > base + 1000 and gc.get_freeze_count() > base
        b = Cycle()  # made after the freeze: a second warm-up of the same engine freezes nothing more
        b.self = b
        probe_b = weakref.ref(b)
        wu.warm_up(llm.engine, llm.inputs.synthetic, progress=False, on_cpu=True, freeze_heap=True)
        del b
        gc.collect()
        assert probe_b() is None
        # an object frozen while alive and later dropped inside a cycle stays until the close
        a = Cycle()
        a.self = a
        probe = weakref.ref(a)
        gc.collect()
        gc.freeze()  # as a later warm-up would
        del a
        gc.collect()
        assert probe() is not None
    finally:
        llm.close()
    assert not heap.holds(llm.engine) and gc.get_freeze_count() == 0 and probe() is None
    assert wu.warm_up(llm.engine, llm.inputs.synthetic, progress=False)["heap_frozen"] == 0  # CPU: skipped


def _triton_specialization(kernel, **values) -> list:
    """What Triton compiles a launch of ``kernel`` for (its binder's specialization, built on
    the CPU as Triton builds it per device): ``values`` by argument name, every other pointer
    a small int32 tensor, integer 128, float 1.0, constexpr 1."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    t = torch.zeros(64, dtype=torch.int32)
    args = {}
    for p in kernel.params:
        if p.name in values:
            args[p.name] = values[p.name]
        elif p.is_constexpr:
            args[p.name] = 1
        elif p.name in ("qk_scale", "ctx_inv_t"):
            args[p.name] = 1.0
        elif p.name.startswith("stride") or p.name in ("max_blocks", "num_splits"):
            args[p.name] = 128
        else:
            args[p.name] = t
    return binder(**args)[1]


def test_kernels_compile_once_for_integers_no_warm_up_shape_pins_down():
    """Triton makes an integer argument equal to 1 a constant and marks one divisible by 16:
    each class compiles its own kernel. The prefill kernel's table width and row strides
    (a one-entry table) and the mass kernel's split stride (a round's query rows times the
    heads, odd or even) take every value requests bring, so none of them may split the
    kernel: the warm-up could not cover them all (the GPU test's balanced case compiled both
    after ready before)."""
    pytest.importorskip("triton")
    from lazyllm.kernels.triton import mass, prefill

    width = ("stride_btb", "stride_bpb", "stride_blb", "stride_bdb", "max_blocks")
    specs = [_triton_specialization(prefill._paged_attn_fwd, **dict.fromkeys(width, w)) for w in (1, 3, 16, 17)]
    assert all(s == specs[0] for s in specs)
    rows = [_triton_specialization(mass._mass_lse, stride_split=n * 8) for n in (1, 2, 3, 160)]
    assert all(s == rows[0] for s in rows)
    # the split count stays specialized: the warm-up covers its classes (launcher.specialization)
    assert _triton_specialization(prefill._paged_attn_fwd, num_splits=1) != \
        _triton_specialization(prefill._paged_attn_fwd, num_splits=3)
