"""Our own forward pass for the Llama family over a paged KV pool.

Covers Llama 2/3/3.1/3.2 (any RoPE scaling), SmolLM2, Mistral, Qwen2/2.5 (qkv bias), Qwen3
(per-head q/k RMSNorm) and Gemma 3 text models ((1 + w) and sandwich norms, gelu-tanh, local
sliding-window layers with their own RoPE base). On CUDA every family runs the same fast
path: fused per-layer kernels, the Triton attention kernels (sliding windows included), CUDA
graphs; a model that leaves it logs one warning naming why. The weights are the tensors of a loaded transformers model,
referenced, not copied, so ``LazyLLM(model=hf_model)`` costs no extra memory.

RoPE is an ``inv_freq`` vector plus an attention scale, read off the transformers rotary
module, so every scaling type the model's config names works the same way.

One ``forward`` serves every step: a varlen batch of new tokens (chunk prefill, suffix
prefill or one decode token per sequence), their positions, where to write their K/V
(``slot_mapping``) and the page tables to attend over (``AttentionMetadata``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lazyllm.kernels.reference import apply_rope, write_kv_ref

from ..errors import UnsupportedModelError
from .attention import AttentionBackend, AttentionMetadata, TorchAttention
from .linear import linear_rows
from .passes import DensePass, FusedPass, LayerPass, PagedPass

__all__ = ["LlamaFamilyModel", "ModelSpec"]

log = logging.getLogger("lazyllm")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass
class ModelSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    rms_eps: float
    sm_scale: float
    qk_norm: bool
    gemma: bool = False  # Gemma 3: (1 + w) norms around attention and MLP, gelu-tanh, scaled embeddings


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers' Gemma3RMSNorm: (x * (1 + w)) in fp32, then x.dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers' LlamaRMSNorm: normalise in fp32, scale in x.dtype.
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _check_supported(cfg) -> tuple[str, bool]:
    """The config's model type and whether it is Gemma 3; raises ``UnsupportedModelError``
    for what the forward does not implement."""
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {mt!r} is not supported; lazyllm supports {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(Llama 2/3/3.1/3.2, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 3 text models)"
        )
    gemma = mt == "gemma3_text"
    act = getattr(cfg, "hidden_activation", None) if gemma else getattr(cfg, "hidden_act", "silu")
    if act not in (("gelu_pytorch_tanh",) if gemma else ("silu", "swish")):
        raise UnsupportedModelError(f"hidden activation {act!r} is not supported for {mt}")
    if getattr(cfg, "use_bidirectional_attention", False) or getattr(cfg, "attn_logit_softcapping", None):
        raise UnsupportedModelError("bidirectional attention and attention logit soft-capping are not supported")
    return mt, gemma


class LlamaFamilyModel:
    """Inference-only forward of a Llama-family causal LM over paged KV."""

    def __init__(self, hf_model, attention: AttentionBackend | None = None, fuse: bool | None = None,
                 fused_kernels: bool | None = None, batch_invariant: bool = False):
        cfg = hf_model.config
        mt, gemma = _check_supported(cfg)
        base = hf_model.model
        types, freq_of = self._read_rope(cfg, base.rotary_emb)
        window = getattr(cfg, "sliding_window", None)
        if mt == "mistral" and window and "layer_types" not in cfg.to_dict():
            types = ["sliding_attention"] * cfg.num_hidden_layers
        self.windows = [int(window) if (t == "sliding_attention" and window) else None for t in types]
        self.freq_index = [freq_of.get(t, 0) for t in types]
        # the global layers' RoPE: what the engine uses for single-frequency operations
        self.global_freq = freq_of.get("full_attention", 0)
        self.inv_freq = self.inv_freqs[self.global_freq]
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        attn0 = base.layers[0].self_attn
        self.spec = ModelSpec(
            model_type=mt,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=n_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            max_context=int(getattr(cfg, "max_position_embeddings", 2048)),
            rms_eps=float(cfg.rms_norm_eps),
            sm_scale=float(getattr(attn0, "scaling", head_dim ** -0.5)),
            qk_norm=hasattr(attn0, "q_norm"),
            gemma=gemma,
        )
        self._norm = _gemma_norm if gemma else rms_norm
        self.embed_scale = float(cfg.hidden_size ** 0.5) if gemma else None
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = self._layer_weights(base, gemma)
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        # batch_invariant: every projection in fixed-size row blocks (``linear_rows``), so a
        # token's logits do not depend on what else shares its step
        self.batch_invariant = bool(batch_invariant)
        self.linear = linear_rows if self.batch_invariant else F.linear
        self.inv_freqs = [f.to(self.device) for f in self.inv_freqs]
        self.inv_freq = self.inv_freqs[self.freq_index[0]] if len(self.inv_freqs) == 1 else \
            self.inv_freq.to(self.device)
        # the attention backend: plan() once per forward and RoPE frequency (it chooses every
        # layer's kernel), run() per layer
        self.attention = attention or TorchAttention()
        self.write_kv = write_kv_ref
        self._setup_fusion(fuse, fused_kernels, mt)

    def _read_rope(self, cfg, rot) -> tuple[list[str], dict[str, int]]:
        """RoPE per layer: an inv_freq vector and a cos/sin scale, read off the transformers
        rotary module ``rot`` (one per layer type for Gemma 3: local and global layers
        differ) into ``inv_freqs`` / ``rope_scales``. Returns the layer types and each type's
        index in them."""
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        self.inv_freqs, self.rope_scales, freq_of = [], [], {}
        for t in types:
            if t in freq_of:
                continue
            if hasattr(rot, f"{t}_inv_freq"):
                inv, sc, rtype = (getattr(rot, f"{t}_inv_freq"), getattr(rot, f"{t}_attention_scaling", 1.0),
                                  getattr(rot, "rope_type", {}).get(t, "default"))
            else:
                inv, sc = rot.inv_freq, getattr(rot, "attention_scaling", 1.0)
                rtype = getattr(rot, "rope_type", "default")
            if rtype == "dynamic":
                raise UnsupportedModelError("dynamic NTK RoPE changes with sequence length and cannot be deferred")
            freq_of[t] = len(self.inv_freqs)
            self.inv_freqs.append(inv.detach().to(torch.float32).clone())
            self.rope_scales.append(float(sc))
        return types, freq_of

    def _layer_weights(self, base, gemma: bool) -> list[dict]:
        """Each decoder layer's weights (the transformers tensors themselves, not copies), its
        sliding window and its RoPE frequency index."""
        layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(
                dict(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    wq=a.q_proj.weight, bq=a.q_proj.bias,
                    wk=a.k_proj.weight, bk=a.k_proj.bias,
                    wv=a.v_proj.weight, bv=a.v_proj.bias,
                    wo=a.o_proj.weight, bo=a.o_proj.bias,
                    qn=a.q_norm.weight if self.spec.qk_norm else None,
                    kn=a.k_norm.weight if self.spec.qk_norm else None,
                    wg=m.gate_proj.weight, wu=m.up_proj.weight, wd=m.down_proj.weight,
                    post_attn=layer.post_attention_layernorm.weight if gemma else None,
                    pre_ff=layer.pre_feedforward_layernorm.weight if gemma else None,
                    post_ff=layer.post_feedforward_layernorm.weight if gemma else None,
                    window=self.windows[len(layers)], freq=self.freq_index[len(layers)],
                )
            )
        return layers

    def _setup_fusion(self, fuse: bool | None, fused_kernels, mt: str) -> None:
        """Fused q/k/v and gate/up projections (``fuse``; None: on CUDA) and the fused
        per-layer kernels (``fused_kernels``)."""
        if fuse if fuse is not None else self.device.type == "cuda":
            self._fuse_projections()
        # Fused Triton elementwise kernels (kernels/fused.py: RMSNorm with the residual add,
        # RoPE + K/V write, SiLU * up) on CUDA for the plain Llama layer; the same arithmetic
        # as the torch code they replace.
        # ``fused_kernels``: None (on for CUDA), a bool, or a module with the same functions
        # (tests pass an interpreted copy).
        self.fused = None
        want = fused_kernels if fused_kernels is not None else self.device.type == "cuda"
        if want and "wqkv" in self.layers[0]:
            if want is True:
                from lazyllm.kernels import fused as want
            self.fused = want
        elif want:
            log.warning("%s: unfused q/k/v projections are not in the fused per-layer kernels; its layers run as "
                        "separate torch ops (slower per token)", mt)

    def _fuse_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up. The fused tensor becomes the storage
        and the transformers parameters are re-pointed at views of it, so no memory is
        added and the transformers model keeps working. A second engine over the same
        model finds its parameters fused already and shares that storage (no second copy)."""
        for w in self.layers:
            for fused, parts in (("wqkv", ("wq", "wk", "wv")), ("wgu", ("wg", "wu"))):
                ts = [w[p] for p in parts]
                cat = _adjacent_rows([t.data for t in ts])
                if cat is not None:
                    w[fused] = cat
                    continue
                cat = torch.cat([t.data for t in ts], dim=0)
                off = 0
                for t in ts:
                    n = t.shape[0]
                    t.data = cat[off:off + n]
                    off += n
                w[fused] = cat
            bs = [w["bq"], w["bk"], w["bv"]]
            w["bqkv"] = torch.cat([b.data for b in bs]) if all(b is not None for b in bs) else None

    def qkv_proj(self, h: torch.Tensor, w: dict, cos: torch.Tensor, sin: torch.Tensor):
        """q ``(n, heads, d)``, k and v ``(n, kv_heads, d)`` of one layer, RoPE applied."""
        s = self.spec
        n = h.shape[0]
        nq, nk = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        x = self._norm(h, w["ln1"], s.rms_eps)
        if "wqkv" in w:
            qkv = self.linear(x, w["wqkv"], w["bqkv"])
            q = qkv[:, :nq].view(n, s.num_heads, s.head_dim)
            k = qkv[:, nq:nq + nk].view(n, s.num_kv_heads, s.head_dim)
            v = qkv[:, nq + nk:].view(n, s.num_kv_heads, s.head_dim)
        else:
            q = self.linear(x, w["wq"], w["bq"]).view(n, s.num_heads, s.head_dim)
            k = self.linear(x, w["wk"], w["bk"]).view(n, s.num_kv_heads, s.head_dim)
            v = self.linear(x, w["wv"], w["bv"]).view(n, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = self._norm(q, w["qn"], s.rms_eps)
            k = self._norm(k, w["kn"], s.rms_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish_layer(self, h: torch.Tensor, o: torch.Tensor, w: dict) -> torch.Tensor:
        """Output projection, residual and MLP of one layer."""
        s = self.spec
        if s.gemma:  # sandwich norms around attention and MLP, gelu-tanh
            h = h + self._norm(self.linear(o.reshape(h.shape[0], -1), w["wo"], w["bo"]), w["post_attn"], s.rms_eps)
            x = self._norm(h, w["pre_ff"], s.rms_eps)
            if "wgu" in w:
                g, u = self.linear(x, w["wgu"]).chunk(2, dim=-1)
            else:
                g, u = self.linear(x, w["wg"]), self.linear(x, w["wu"])
            m = self.linear(F.gelu(g, approximate="tanh") * u, w["wd"])
            return h + self._norm(m, w["post_ff"], s.rms_eps)
        h = h + self.linear(o.reshape(h.shape[0], -1), w["wo"], w["bo"])
        x = rms_norm(h, w["ln2"], s.rms_eps)
        if "wgu" in w:
            g, u = self.linear(x, w["wgu"]).chunk(2, dim=-1)
            return h + self.linear(F.silu(g) * u, w["wd"])
        return h + self.linear(F.silu(self.linear(x, w["wg"])) * self.linear(x, w["wu"]), w["wd"])

    @property
    def graph_capturable(self) -> bool:
        """Whether a forward can be captured in a CUDA graph: no layer runs the torch reference
        attention, which reads the batch layout on the host."""
        return self.attention.graph_capturable

    def _run_layers(self, h: torch.Tensor, p: LayerPass, layers: int | None = None) -> torch.Tensor:
        """The layer loop of every pass: hidden states ``h`` through the first ``layers``
        layers (``None``: all), each computed and attended as the pass ``p`` says
        (``lazyllm.model.passes``: dense, paged, fused)."""
        step = p.layer
        for li, w in enumerate(self.layers if layers is None else self.layers[:layers]):
            h = step(h, li, w)
        return h

    @torch.inference_mode()
    def probe_keys(self, input_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Keys of ``layer`` for a token sequence under full causal attention, computed
        densely (no pages): what CacheBlend compares with cached keys to find the tokens
        whose KV deviates most. ``input_ids`` ``(n,)`` at positions ``0..n-1``; returns
        ``(n, num_kv_heads, head_dim)`` rotated at those positions."""
        p = DensePass(self, input_ids.shape[0], input_ids.device)
        h = self._run_layers(self._embed(input_ids), p, layer)
        w = self.layers[layer]
        return self.qkv_proj(h, w, *p.tables[w["freq"]])[1]

    @torch.inference_mode()
    def probe_keys_paged(self, input_ids: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, layer: int) -> torch.Tensor:
        """``probe_keys`` for some tokens of a sequence whose K/V below ``layer`` are in the
        pool: the layers below ``layer`` run on ``input_ids`` alone (at ``meta.positions``)
        over the cached K/V that ``meta``'s table lists, causal by position, writing their
        own K/V at ``meta.slot_mapping`` (a scratch slot); returns their keys of ``layer``,
        ``(n, num_kv_heads, head_dim)`` rotated at their positions. Equal to ``probe_keys``'s
        rows where the cached K/V of the layers below are full attention's: for ``layer``
        1, always (layer 0's K/V depend on the token and its position only)."""
        p = PagedPass(self, meta, k_cache, v_cache)
        h = self._run_layers(self._embed(input_ids), p, layer)
        w = self.layers[layer]
        return self.qkv_proj(h, w, *p.tables[w["freq"]])[1]

    @torch.inference_mode()
    def attention_mass(self, input_ids: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, layers: int | None = None) -> torch.Tensor:
        """Run new tokens (a question) through the first ``layers`` layers (``None``: every
        layer) like ``forward``, writing their K/V at ``meta.slot_mapping``, and return the
        attention mass each table slot gets from them: softmax probabilities summed over
        those layers, heads and queries,
        ``(batch, max_blocks, page_size)`` float32 (``paged_attention_mass_ref``): what
        attention-guided recompute selection reads. Attention and mass run on the kernels the
        backend's step plan names (``AttentionBackend.mass``: the Triton kernel on the Triton
        backend), with the forward's own fused kernels where it has them; the rest of the
        last of those layers is skipped."""
        n_layers = len(self.layers)
        layers = n_layers if layers is None else layers
        if not 1 <= layers <= n_layers:
            raise ValueError(f"layers must be in [1, {n_layers}], got {layers}")
        p = (FusedPass if self.fused is not None else PagedPass)(self, meta, k_cache, v_cache, mass=layers)
        self._run_layers(self._embed(input_ids), p, layers)
        return p.total

    def set_packets(self, rows: torch.Tensor | None) -> None:
        """Packet embeddings (``lazyllm.model.packets``): ``(k, hidden)`` rows that the virtual
        token ids ``embed_rows .. embed_rows + k - 1`` look up, or ``None`` for none."""
        self.embed_rows = int(self.embed.shape[0])
        self.packet_rows = None if rows is None else rows.to(self.device, self.dtype).contiguous()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = getattr(self, "packet_rows", None)
        if rows is None:
            h = F.embedding(input_ids, self.embed)
        else:  # ids past the table are packet rows; one gather each and a select: graph-capturable
            base = self.embed_rows
            virtual = (input_ids >= base)[:, None]
            h = torch.where(virtual, F.embedding((input_ids - base).clamp(0, rows.shape[0] - 1), rows),
                            F.embedding(input_ids.clamp(max=base - 1), self.embed))
        if self.embed_scale is not None:  # Gemma: scaled by sqrt(hidden), in the weights' dtype
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        logits_index: torch.Tensor | None = None,
        stop_after_layer: int | None = None,
    ) -> torch.Tensor:
        """Run new tokens through the model, writing their K/V into the pool.

        Parameters
        ----------
        input_ids : ``(total_tokens,)``.
        meta : attention metadata of this step.
        k_cache, v_cache : ``(num_layers, num_pages, page_size, num_kv_heads, head_dim)``.
        logits_index : rows of the token batch whose logits are wanted (``None``: all).

        Returns
        -------
        ``(len(logits_index), vocab)`` float32 logits.
        """
        s = self.spec
        h = self._embed(input_ids)
        if self.fused is not None and stop_after_layer is None:
            p = FusedPass(self, meta, k_cache, v_cache)
            return p.logits(self._run_layers(h, p), logits_index)
        stop = stop_after_layer in range(len(self.layers))
        h = self._run_layers(h, PagedPass(self, meta, k_cache, v_cache), stop_after_layer + 1 if stop else None)
        if stop:  # stopped there: its hidden states
            return h
        if logits_index is not None:
            h = h[logits_index]
        h = self._norm(h, self.final_norm, s.rms_eps)
        return self.linear(h, self.lm_head).float()


def _adjacent_rows(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over the rows of ``ts`` when they already lie one after another in one
    storage, each contiguous (projections fused by an earlier engine): a view, no copy;
    else None."""
    first = ts[0]
    if not all(t.is_contiguous() and t.dim() == 2 and t.shape[1] == first.shape[1] and t.dtype == first.dtype
               and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in ts):
        return None
    off = first.storage_offset()
    for t in ts:
        if t.storage_offset() != off:
            return None
        off += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]))
