"""The garbage collector's view of a ready engine: what is alive once an engine has warmed up
(the model, the imported libraries, the captured graphs: hundreds of thousands of objects)
lives as long as the engine, yet every full collection would walk it again, a pause of tens
to hundreds of milliseconds on the engine thread in the middle of serving. Once a warm-up
ends, those objects are moved to the collector's permanent generation (``gc.freeze``), which
collections skip; objects made afterwards are collected as before. Closing the last engine
that froze the heap gives the objects back to the collector, so a closed engine's reference
cycles can be freed."""
from __future__ import annotations

import gc
import logging
import threading
import weakref

log = logging.getLogger("lazyllm")

_lock = threading.Lock()
_holders: weakref.WeakSet = weakref.WeakSet()  # engines whose warm-up froze the heap, not closed yet


def freeze(engine) -> int:
    """``engine`` has warmed up: collect, then freeze what is left (once per engine); returns
    how many objects the permanent generation holds."""
    with _lock:
        if engine not in _holders:
            gc.collect()  # garbage frozen now would never be freed
            gc.freeze()
            _holders.add(engine)
        n = gc.get_freeze_count()
    log.debug("heap frozen after warm-up: %d objects the collector now skips", n)
    return n


def release(engine) -> None:
    """``engine`` is closed; the last engine that froze the heap gives the frozen objects back
    to the collector (and collects, so a closed engine's cycles are freed now)."""
    with _lock:
        if engine not in _holders:
            return
        _holders.discard(engine)
        if not _holders:
            gc.unfreeze()
            gc.collect()


def holds(engine) -> bool:
    """Whether ``engine``'s warm-up froze the heap and it is not closed yet."""
    return engine in _holders
