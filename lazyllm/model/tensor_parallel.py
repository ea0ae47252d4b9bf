"""Tensor parallelism: one Llama-family model sharded over the ranks of a process group.

Megatron-style: the q/k/v and gate/up projections are column-parallel (each rank holds its
attention heads, its KV heads and its slice of the intermediate size), the output and down
projections row-parallel followed by an all-reduce, and the LM head vocabulary-parallel, its
logits gathered on rank 0. Each rank's page pool holds the K/V of its own KV heads only, for
the same pages: the page tables and the deferred-RoPE metadata (positions, deltas) are built
once on rank 0 and broadcast with each forward (``Channel``), never recomputed per rank.

Rank 0 runs the engine; its ``TensorParallelModel`` is the *lead*: each ``forward`` first
broadcasts its inputs, then runs its shard. The other ranks (``lazyllm.engine.running.tp_runner``)
receive and run the same forward. ``LlamaFamilyModel`` itself is untouched: the single-process
path has no branch for any of this.

Not here yet: the fused per-layer kernels and CUDA graphs (the forward is the unfused torch
path on every rank), and the passes of quality recovery that read the model densely
(``probe_keys``, ``attention_mass``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..intmath import cdiv
from ..shapes import tensor_parallel_error
from .attention import AttentionMetadata
from .llama import LlamaFamilyModel, rms_norm
from .passes import PagedPass

# NVLink multicast (NVLS) off in NCCL, PyTorch's symmetric memory and NVSHMEM: set in every
# process that takes part, the library's own workers included.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


_DTYPES = (torch.int64, torch.int32)
FORWARD, COPY, STOP, POOL = 1, 2, 3, 4
_HEADER = 20


class Channel:
    """Commands from rank 0 to the other ranks, over the default process group: a fixed-size
    int64 header, then one packed int64 payload."""

    def __init__(self, device: torch.device):
        self.device = device  # where collectives run: CUDA for NCCL, CPU for gloo

    def _send(self, header: list[int], payload: torch.Tensor | None = None) -> None:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[:len(header)] = torch.tensor(header, dtype=torch.int64)
        dist.broadcast(h.to(self.device), 0)
        if payload is not None:
            dist.broadcast(payload.contiguous(), 0)

    def recv(self) -> list[int]:
        h = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(h, 0)
        return h.tolist()

    def _recv_payload(self, n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(t, 0)
        return t

    # -- a forward: token ids, the attention metadata and the logit rows -----------------
    @staticmethod
    def _fields(ids, meta: AttentionMetadata, rows):
        return [ids, meta.positions, meta.slot_mapping, meta.cu_seqlens_q, meta.block_table, meta.block_pos,
                meta.block_delta, meta.block_len] + ([] if rows is None else [rows])

    def send_forward(self, ids: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor | None) -> None:
        fields = self._fields(ids, meta, rows)
        B, W = meta.block_table.shape
        header = [FORWARD, B, W, int(meta.max_seqlen_q), rows is not None]
        for t in fields[:4] + fields[8:]:
            header.append(t.numel())
        header += [_DTYPES.index(t.dtype) for t in fields]
        payload = torch.cat([t.reshape(-1).to(torch.int64) for t in fields])
        self._send(header, payload)

    def recv_forward(self, header: list[int]):
        """``(ids, meta, rows)`` of the forward whose header is ``header``."""
        _, B, W, max_q, has_rows = header[:5]
        sizes = header[5:9] + ([header[9]] if has_rows else [])
        nf = 8 + bool(has_rows)
        dtypes = [_DTYPES[c] for c in header[5 + len(sizes):5 + len(sizes) + nf]]
        sizes = sizes[:4] + [B * W] * 4 + sizes[4:]
        p = self._recv_payload(sum(sizes))
        parts, o = [], 0
        for n, dt in zip(sizes, dtypes):
            parts.append(p[o:o + n].to(dt))
            o += n
        ids, pos, slots, cu, *tabs = parts
        rows = tabs.pop() if has_rows else None
        tabs = [t.view(B, W) for t in tabs]
        meta = AttentionMetadata(positions=pos, cu_seqlens_q=cu, slot_mapping=slots, block_table=tabs[0],
                                 block_pos=tabs[1], block_delta=tabs[2], block_len=tabs[3], max_seqlen_q=max_q)
        return ids, meta, rows

    # -- re-rotated page copies, the pool's size, the end ----------------------------------
    def send_copy(self, copies: list[tuple[int, int, int]]) -> None:
        self._send([COPY, len(copies)], torch.tensor(copies, dtype=torch.int64, device=self.device).reshape(-1))

    def recv_copy(self, header: list[int]) -> list[tuple[int, int, int]]:
        flat = self._recv_payload(3 * header[1]).tolist()
        return [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]

    def send_pool(self, num_pages: int, page_size: int) -> None:
        self._send([POOL, num_pages, page_size])

    def send_stop(self) -> None:
        self._send([STOP])


class TensorParallelModel(LlamaFamilyModel):
    """Rank ``rank``'s shard of a Llama-family model (of ``world`` ranks), on ``device``.

    ``spec.num_heads`` / ``spec.num_kv_heads`` are this rank's; ``forward`` returns the full
    float32 logits on rank 0 and ``None`` elsewhere. ``lead`` (rank 0): each ``forward``
    first broadcasts its inputs to the other ranks.
    """

    def __init__(self, hf_model, *, rank: int, world: int, device: torch.device, attention=None,
                 batch_invariant: bool = False, lead: bool | None = None):
        super().__init__(hf_model, attention=attention, fuse=False, fused_kernels=False,
                         batch_invariant=batch_invariant)
        s = self.spec
        inter = self.layers[0]["wg"].shape[0]
        err = tensor_parallel_error(world, s.num_heads, s.num_kv_heads, inter)
        if err:
            raise ValueError(err)
        self.rank, self.world = rank, world
        hq, hk, d = s.num_heads // world, s.num_kv_heads // world, s.head_dim
        self.spec = dataclasses.replace(s, num_heads=hq, num_kv_heads=hk)

        def take(t, sl=None, cols=None):
            if t is None:
                return None
            t = t.detach()
            if sl is not None:
                t = t[sl]
            if cols is not None:
                t = t[:, cols]
            return t.to(device, copy=True).contiguous()

        q = slice(rank * hq * d, (rank + 1) * hq * d)
        kv = slice(rank * hk * d, (rank + 1) * hk * d)
        m = slice(rank * inter // world, (rank + 1) * inter // world)
        for w in self.layers:
            w.update(wq=take(w["wq"], q), bq=take(w["bq"], q), wk=take(w["wk"], kv), bk=take(w["bk"], kv),
                     wv=take(w["wv"], kv), bv=take(w["bv"], kv), wo=take(w["wo"], cols=q),
                     bo=take(w["bo"]) if rank == 0 else None,  # added once, before the all-reduce
                     wg=take(w["wg"], m), wu=take(w["wu"], m), wd=take(w["wd"], cols=m))
            for key in ("ln1", "ln2", "qn", "kn", "post_attn", "pre_ff", "post_ff"):
                w[key] = take(w[key])
        # the LM head by vocabulary rows, padded to equal shards for the gather
        V = self.lm_head.shape[0]
        self.vocab_rows = V
        per = cdiv(V, world)
        head = take(self.lm_head, slice(rank * per, min((rank + 1) * per, V)))
        if head.shape[0] < per:
            head = torch.cat([head, head.new_zeros((per - head.shape[0], head.shape[1]))])
        self.lm_head = head
        self.embed, self.final_norm = take(self.embed), take(self.final_norm)
        self.inv_freqs = [f.to(device) for f in self.inv_freqs]
        self.inv_freq = self.inv_freq.to(device)
        self.device = torch.device(device)
        self.channel = Channel(self.device)
        self.lead = rank == 0 if lead is None else lead
        # a forward that failed part way leaves the ranks out of step in their collectives:
        # the group is not used again
        self.broken: str | None = None

    @property
    def graph_capturable(self) -> bool:
        return False  # collectives and the lead's broadcast stay outside CUDA graphs for now

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def finish_layer(self, h: torch.Tensor, o: torch.Tensor, w: dict) -> torch.Tensor:
        """``LlamaFamilyModel.finish_layer`` with the row-parallel output and down
        projections summed over the ranks."""
        s, lin = self.spec, self.linear
        a = self._reduce(lin(o.reshape(h.shape[0], -1), w["wo"], w["bo"]))
        if s.gemma:
            h = h + self._norm(a, w["post_attn"], s.rms_eps)
            x = self._norm(h, w["pre_ff"], s.rms_eps)
            m = self._reduce(lin(F.gelu(lin(x, w["wg"]), approximate="tanh") * lin(x, w["wu"]), w["wd"]))
            return h + self._norm(m, w["post_ff"], s.rms_eps)
        h = h + a
        x = rms_norm(h, w["ln2"], s.rms_eps)
        return h + self._reduce(lin(F.silu(lin(x, w["wg"])) * lin(x, w["wu"]), w["wd"]))

    @torch.inference_mode()
    def forward(self, input_ids, meta: AttentionMetadata, k_cache, v_cache, logits_index=None,
                stop_after_layer=None):
        """As ``LlamaFamilyModel.forward``, over this rank's heads: the lead broadcasts the
        inputs first. Full logits on rank 0, ``None`` on the others."""
        if stop_after_layer is not None:
            raise NotImplementedError("stop_after_layer is not supported with tensor_parallel")
        if self.broken:
            raise RuntimeError(f"the tensor-parallel group is broken ({self.broken}); make a new LazyLLM")
        try:
            if self.lead:
                self.channel.send_forward(input_ids, meta, logits_index)
            return self._shard_forward(input_ids, meta, k_cache, v_cache, logits_index)
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def _shard_forward(self, input_ids, meta, k_cache, v_cache, logits_index):
        s = self.spec
        h = self._run_layers(self._embed(input_ids), PagedPass(self, meta, k_cache, v_cache))  # this rank's heads
        if logits_index is not None:
            h = h[logits_index]
        part = self.linear(self._norm(h, self.final_norm, s.rms_eps), self.lm_head).float().contiguous()
        if self.rank != 0:
            dist.gather(part, None, dst=0)
            return None
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.gather(part, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :self.vocab_rows]

    def probe_keys(self, input_ids, layer):
        raise NotImplementedError("recompute_ratio (key deviation) is not supported with tensor_parallel yet")

    def attention_mass(self, input_ids, meta, k_cache, v_cache, layers=None):
        raise NotImplementedError("recompute_ratio (attention selection) is not supported with tensor_parallel yet")

