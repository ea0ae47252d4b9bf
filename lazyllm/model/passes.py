"""The passes of ``LlamaFamilyModel``'s one layer loop (``LlamaFamilyModel._run_layers``).

A pass is one run of tokens through the layers. It holds what every layer of the run
shares (the RoPE tables of the tokens' positions, the attention backend's step plans) and
says how a layer attends and how its layer is computed:

* ``DensePass``: full causal attention over the tokens themselves, no pages (SDPA; a mask
  for sliding-window layers): what ``probe_keys`` runs.
* ``PagedPass``: over the page pool: each layer writes its K/V at ``meta.slot_mapping``,
  then attends on the kernel the backend's step plan names; optionally sums each layer's
  attention mass per table slot (``attention_mass``). The unfused torch ops per layer.
* ``FusedPass``: ``PagedPass`` on the fused per-layer kernels (``lazyllm.kernels.fused``):
  the RoPE kernel writes K/V, each layer's MLP output is added into the next layer's norm
  (``pending``), and ``logits`` folds the last one into the final norm.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lazyllm.kernels.reference import rope_cos_sin

from .attention import AttentionMetadata


class LayerPass:
    """What one run of the layer loop shares, and the unfused layer: q/k/v with RoPE,
    ``attend``, then the rest of the layer (the model's ``qkv_proj`` and ``finish_layer``).
    ``mass_last``: a layer whose attention ends the run (the rest of it is skipped)."""

    mass_last: int | None = None

    def __init__(self, model, positions: torch.Tensor):
        self.model = model
        self.tables = [rope_cos_sin(positions, f, sc) for f, sc in zip(model.inv_freqs, model.rope_scales)]

    def attend(self, q, k, v, li: int, w: dict) -> torch.Tensor:
        """Layer ``li``'s (weights ``w``) attention output ``(n, heads, head_dim)``."""
        raise NotImplementedError

    def layer(self, h: torch.Tensor, li: int, w: dict) -> torch.Tensor:
        """Hidden states after layer ``li`` (weights ``w``)."""
        m = self.model
        q, k, v = m.qkv_proj(h, w, *self.tables[w["freq"]])
        o = self.attend(q, k, v, li, w)
        if li == self.mass_last:
            return h
        return m.finish_layer(h, o, w)


class DensePass(LayerPass):
    """Full causal attention over ``n`` tokens at positions ``0..n-1``, without pages."""

    def __init__(self, model, n: int, device: torch.device):
        self.pos = torch.arange(n, device=device)
        super().__init__(model, self.pos)

    def attend(self, q, k, v, li, w):
        s, pos = self.model.spec, self.pos
        if w["window"] is None:  # plain causal: SDPA's flash / cuDNN kernels, no (n, n) mask
            mask, causal = None, True
        else:
            mask, causal = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < w["window"]), False
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            is_causal=causal, scale=s.sm_scale, enable_gqa=s.num_heads != s.num_kv_heads)[0].transpose(0, 1)


class PagedPass(LayerPass):
    """Attention over the page pool ``k_cache`` / ``v_cache`` with the step's ``meta``: one
    step plan per RoPE frequency, made once. ``mass``: sum the attention mass each table
    slot gets over layers ``0..mass - 1`` into ``total`` and end the run there (0: none)."""

    def __init__(self, model, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 mass: int = 0):
        super().__init__(model, meta.positions)
        self.meta, self.k_cache, self.v_cache = meta, k_cache, v_cache
        self.plans = [model.attention.plan(meta, f) for f in model.inv_freqs]
        self.mass = mass
        self.mass_last = mass - 1 if mass else None
        self.total: torch.Tensor | None = None

    def attend(self, q, k, v, li, w):
        """Write ``k``/``v`` (``None``: already written) at the step's slots, then attend."""
        m, meta = self.model, self.meta
        kc, vc = self.k_cache[li], self.v_cache[li]
        if k is not None:
            m.write_kv(kc, vc, meta.slot_mapping, k, v)
        fi = w["freq"]
        o = m.attention.run(q, meta, kc, vc, m.inv_freqs[fi], m.spec.sm_scale, self.plans[fi], window=w["window"])
        if self.mass:
            a = m.attention.mass(q, meta, kc, vc, m.inv_freqs[fi], m.spec.sm_scale, window=w["window"],
                                 plan=self.plans[fi])
            self.total = a if self.total is None else self.total + a
        return o


class FusedPass(PagedPass):
    """``PagedPass`` on the fused per-layer kernels ``model.fused``: per layer one RMSNorm
    (with the previous layer's MLP output added: ``pending``), the QKV GEMM, one RoPE + K/V
    write (with Qwen3's and Gemma 3's q/k norms), attention, the output GEMM, one add +
    RMSNorm, the gate/up GEMM, one SiLU (Gemma: gelu-tanh) * up, the down GEMM. Gemma's
    sandwich norms are fused into the add + RMSNorm that follows them. For a single token the
    projections are split-K GEMVs whose partial sums the next fused kernel adds up
    (``gemv_parts``), unless the model is ``batch_invariant``."""

    def __init__(self, model, meta, k_cache, v_cache, mass: int = 0):
        super().__init__(model, meta, k_cache, v_cache, mass)
        fk = self.fk = model.fused
        self.proj = model.linear if model.batch_invariant else functools.partial(fk.linear_or_parts,
                                                                                 linear=model.linear)
        s = self.spec = model.spec
        self.g = dict(gemma=True) if s.gemma else {}
        self.pending = self.post_ff = None  # the last layer's MLP output and (Gemma) its norm, not yet added

    def layer(self, h, li, w):
        fk, proj, s = self.fk, self.proj, self.spec
        if self.pending is None:
            x = fk.rms_norm(h, w["ln1"], s.rms_eps, **self.g)
        elif s.gemma:
            h, x = fk.add_rms_norm(h, self.pending, w["ln1"], s.rms_eps, gemma=True, y_weight=self.post_ff)
        else:
            h, x = fk.add_rms_norm(h, self.pending, w["ln1"], s.rms_eps)
        qkv = proj(x, w["wqkv"], w["bqkv"])
        qk = dict(q_norm=w["qn"], k_norm=w["kn"], eps=s.rms_eps, **self.g) if s.qk_norm else {}
        q = fk.rope_qkv_write(qkv, *self.tables[w["freq"]], self.k_cache[li], self.v_cache[li],
                              self.meta.slot_mapping, s.num_heads, s.num_kv_heads, **qk)
        o = self.attend(q, None, None, li, w)
        if li == self.mass_last:
            return h
        y = proj(o.reshape(h.shape[0], -1), w["wo"], w["bo"])
        if s.gemma:  # h + post_attn(y), then pre_ff: one kernel
            h, x = fk.add_rms_norm(h, y, w["pre_ff"], s.rms_eps, gemma=True, y_weight=w["post_attn"])
            self.pending = proj(fk.silu_mul(proj(x, w["wgu"]), h.dtype, gelu_tanh=True), w["wd"])
            self.post_ff = w["post_ff"]
        else:
            h, x = fk.add_rms_norm(h, y, w["ln2"], s.rms_eps)
            self.pending = proj(fk.silu_mul(proj(x, w["wgu"]), h.dtype), w["wd"])
        return h

    def logits(self, h: torch.Tensor, logits_index: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits of rows ``logits_index`` (``None``: all) after the last layer: its
        pending MLP output added in the final norm, then the LM head."""
        m, s, pending = self.model, self.model.spec, self.pending
        if logits_index is not None:
            h = h[logits_index]
            pending = pending[:, logits_index] if pending.dim() == 3 else pending[logits_index]
        if s.gemma:
            _, x = self.fk.add_rms_norm(h, pending, m.final_norm, s.rms_eps, gemma=True, y_weight=self.post_ff)
        else:
            _, x = self.fk.add_rms_norm(h, pending, m.final_norm, s.rms_eps)
        return m.linear(x, m.lm_head).float()


__all__ = ["LayerPass", "DensePass", "PagedPass", "FusedPass"]
