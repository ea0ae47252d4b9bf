"""The Triton kernels of ``lazyllm.kernels`` and their launchers (imports Triton).

Load it through ``lazyllm.kernels.loader.triton_kernels(interpret)``: compiled for CUDA, or a
private copy of this whole package run in Triton's interpreter (CPU). Each launcher computes
the same function as its ``*_ref`` twin in ``lazyllm.kernels.reference`` (the specification;
see its module docstring for the conventions: page layout, ``block_pos`` / ``block_delta`` /
``block_len``, rotate-half RoPE on the first ``2 * len(inv_freq)`` dims, masking by position).

Modules: ``_common`` (interpreter shim, shared ``@triton.jit`` helpers), ``prefill`` (the
key-tile loops and ``_paged_attn_fwd``; its docstring explains the deferred rotation),
``decode`` (the per-page decode kernel, the split-K merge), ``grouped`` (shared-chunk
attention: one pass over a page for every query that holds it), ``rope`` (cos/sin and run
tables), ``copy_kv`` (re-rotating page copy, KV write), ``configs`` (launch
configurations), ``launcher`` (``paged_attention_triton``), ``mass`` (the attention mass
each key slot receives, ``paged_attention_mass_triton``), ``gluon_prefill`` (Hopper only,
imported by the launcher on first use).
"""
from . import _common, configs, copy_kv, decode, grouped, launcher, mass, prefill, rope  # noqa: F401
from ._common import compiled_kernels
from .copy_kv import rerotate_copy_triton, write_kv_triton
from .grouped import grouped_attention_triton
from .launcher import paged_attention_triton
from .mass import paged_attention_mass_triton
from .rope import delta_runs, rope_table

__all__ = [
    "paged_attention_triton",
    "paged_attention_mass_triton",
    "grouped_attention_triton",
    "rerotate_copy_triton",
    "write_kv_triton",
    "rope_table",
    "delta_runs",
    "compiled_kernels",
]
