"""The engine: one worker thread that owns the model and the KV pool (``engine.Engine``).

Grouped by role, one package per room, each saying in its docstring what it owns:
``scheduling`` (queues, admission, preemption, escalation, mixed steps), ``kv`` (the reuse
policies, the planner, page tables), ``running`` (the model runner, decode state, CUDA
graphs, sampler, tensor parallelism), ``recovery`` (what a request recomputes, and
recomputing it), ``warmup`` (readiness). Shared by all: ``request`` (a request and the
page-table vocabulary), ``step`` (what the scheduler decides), ``metrics``, ``pinned``.
The import contract in ``pyproject.toml`` keeps the rooms' order (docs/architecture.md).
"""
