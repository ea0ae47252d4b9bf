"""Quality recovery: which reused chunk tokens a request recomputes, and recomputing them.

Owns the token selections (deviation, attention, two-stage and the registered ones), the
batched selection of an admission round (``rounds``), the chunk index its kernels read
(``chunk_index``), the recomputation itself and adaptive recompute's escalation decisions
(``Recovery``). It plans pages through the KV planner and runs forwards through the model
runner.
"""
from .recompute import Recovery

__all__ = ["Recovery"]
