"""Deferred-RoPE paged attention kernels (Triton) and their plain-torch twins.

Installed as ``lazyllm.kernels``. ``reference`` is the specification and the CPU path.
"""
from .reference import (  # noqa: F401
    apply_rope,
    paged_attention_ref,
    rerotate_copy_ref,
    rope_cos_sin,
    rotate_by_delta,
    write_kv_ref,
)
