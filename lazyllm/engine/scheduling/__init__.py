"""Scheduling: which requests run in each step and what each step does with them.

Owns the waiting and running queues, admission under the step's token budget and batch
size, preemption, escalation (``Scheduler``), and, with ``mixed_steps`` on, the steps that
carry decode rows and prefill pieces in one forward (``MixedSteps``). It asks the KV planner
for pages and the decode state for rows; it runs no forward itself.
"""
from .mixed import MixedSteps
from .scheduler import Scheduler

__all__ = ["MixedSteps", "Scheduler"]
