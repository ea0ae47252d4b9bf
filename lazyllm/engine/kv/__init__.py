"""KV planning: which pages a request reads and writes.

Owns the reuse policies (one per reuse mode), the planner that applies them against the
chunk store (``KVPlanner``: plan, unplan, release, the round's pending entries), and each
request's ``Allocation``, the one writer of its page table. It imports nothing of the
scheduler, the runner or recovery.
"""
from .page_table import Allocation
from .planner import KVPlanner, PendingEntry

__all__ = ["Allocation", "KVPlanner", "PendingEntry"]
