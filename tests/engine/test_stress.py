"""64 threads, 1,000 mixed requests: completed outputs equal their solo outputs, and
cancelled streams, cancelled tasks and missed deadlines leave nothing behind."""
import asyncio
import contextlib
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lazyllm import LazyLLM, RequestCancelled
from tests.conftest import make_tiny

DOCS = [f"Entry {i}: " + " ".join(f"t{i}x{j}" for j in range(8 + (5 * i) % 17)) for i in range(24)]


def _check_pool_clean(llm):
    s = llm.cache_stats()
    assert s["pinned_entries"] == 0, s
    cached = sum(len(e.pages) for e in llm.store.entries.values())
    assert s["free_pages"] + cached == s["pool_pages"], s  # no request page leaked
    assert not llm.engine.running and not llm.engine.waiting and not llm.engine.decode_state.rows


@pytest.mark.slow
def test_1000_mixed_requests_from_64_threads(tokenizer):
    model = make_tiny("llama", seed=13)
    rng = random.Random(5)
    reqs = []
    for i in range(1000):
        kind = rng.choices(["plain", "stream_cancel", "stream", "async_cancel", "deadline"],
                           weights=[50, 15, 15, 10, 10])[0]
        reqs.append((kind, f"q{i % 97}?", rng.sample(DOCS, rng.randint(1, 4)), rng.randint(2, 9)))
    solo_llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=8 << 20, quality="isolated")
    solo = {}
    for kind, q, c, n in reqs:
        if kind in ("plain", "stream"):
            key = (q, tuple(c), n)
            if key not in solo:
                solo[key] = solo_llm.generate(q, chunks=c, max_new_tokens=n).text
    solo_llm.close()
    # a small pool, so eviction and preemption happen while requests are cancelled
    llm = LazyLLM(model=model, tokenizer=tokenizer, kv_cache_bytes=2 << 20, quality="isolated")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    results = {}

    def run(i):
        kind, q, c, n = reqs[i]
        if kind == "plain":
            results[i] = llm.generate(q, chunks=c, max_new_tokens=n).text
        elif kind == "stream":
            results[i] = "".join(llm.stream(q, chunks=c, max_new_tokens=n))
        elif kind == "stream_cancel":
            it = llm.stream(q, chunks=c, max_new_tokens=200)
            next(it, None)
            it.close()
        elif kind == "async_cancel":
            fut = asyncio.run_coroutine_threadsafe(llm.agenerate(q, chunks=c, max_new_tokens=200), loop)
            fut.cancel()
        else:
            with contextlib.suppress(RequestCancelled):
                llm.generate(q, chunks=c, max_new_tokens=500, timeout=0.001)

    with ThreadPoolExecutor(64) as ex:
        list(ex.map(run, range(len(reqs))))
    # let cancelled async work drain, then check
    llm.generate("final?", chunks=DOCS[:2], max_new_tokens=2)
    for i, text in results.items():
        kind, q, c, n = reqs[i]
        assert text == solo[(q, tuple(c), n)], (i, kind)
    assert len(results) == sum(1 for r in reqs if r[0] in ("plain", "stream"))
    loop.call_soon_threadsafe(loop.stop)
    _check_pool_clean(llm)
    m = llm.engine.metrics
    assert m["cancelled"] > 0
    llm.close()
