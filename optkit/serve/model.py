"""The Llama-family executor: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM in one file.

RMSNorm, RoPE (with the scaling variants transformers defines), grouped-query attention over a
paged KV cache, SwiGLU, tied embeddings, optional q/k norms (Qwen3), qkv bias (Qwen2), sliding
window (Mistral). Linear layers are :class:`optkit.kernels.LinearKernel` built straight from the
artifact's integer codes: nothing is dequantized to 16 bits on load. q/k/v and gate/up are fused
into one kernel each when they share a scheme, so a decode step launches 4 matmuls per layer.

The forward works on a *flat* batch: ``T`` tokens from any mix of requests (decodes and prefill
chunks), with positions and :class:`~optkit.attention.paged.AttentionMetadata` saying which
request each token belongs to. Matmuls see all ``T`` rows at once; attention splits them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optkit.attention.paged import AttentionMetadata, paged_attention
from optkit.kernels import LinearKernel, build_linear
from optkit.quantize.rtn import QuantizedWeight

#: transformers classes this executor runs natively; anything else uses the transformers fallback.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class ModelSpec:
    """The shapes and switches of a Llama-family model, read from its transformers config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        arch = (getattr(config, "architectures", None) or ["?"])[0]
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        window = getattr(config, "sliding_window", None)
        if arch.startswith("Qwen") and not getattr(config, "use_sliding_window", False):
            window = None  # Qwen configs carry a window size that is off unless use_sliding_window
        attn_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            qkv_bias=attn_bias or arch == "Qwen2ForCausalLM",
            o_bias=attn_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
        )


def rope_tables(config: Any, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_positions, head_dim) float32, computed exactly as transformers does
    (``freqs = pos * inv_freq``; ``emb = cat(freqs, freqs)``; times the attention scaling)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE depends on the running length; use the transformers fallback")
    if rope_type == "default":
        heads = config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq.float()[None, :]  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in float32, cast back, then scale (the order matters in bf16).
    # F.rms_norm fuses x * rsqrt(mean(x^2) + eps) into one op (fewer dispatches per layer).
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos, sin: (T, 1, D). ``x * cos + rotate_half(x) * sin`` (RoFormer eq. 34)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _fuse(parts: list[Weight]) -> Weight | None:
    """Concatenate along the output dimension when every part has the same form and scheme."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)
    if all(isinstance(p, QuantizedWeight) for p in parts):
        first = parts[0]
        if all(p.scheme == first.scheme and p.scale.dtype == first.scale.dtype for p in parts):
            zp = None if first.zero_point is None else torch.cat([p.zero_point for p in parts], 0)
            return QuantizedWeight(
                torch.cat([p.q for p in parts], 0), torch.cat([p.scale for p in parts], 0), zp, first.scheme
            )
    return None


class _Linears(nn.Module):
    """One or more kernels whose outputs are concatenated: fused when the schemes allow it."""

    def __init__(self, parts: list[Weight], biases: list[torch.Tensor | None], device, dtype, kernel: str):
        super().__init__()
        fused = _fuse(parts)
        if fused is not None:
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else torch.zeros(_out(p)) for p, b in zip(parts, biases, strict=True)]
            )
            self.kernels = nn.ModuleList([_build(fused, bias, device, dtype, kernel)])
        else:
            self.kernels = nn.ModuleList([_build(p, b, device, dtype, kernel) for p, b in zip(parts, biases, strict=True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.kernels) == 1:
            return self.kernels[0](x)
        return torch.cat([k(x) for k in self.kernels], dim=-1)


def _out(w: Weight) -> int:
    return (w.q if isinstance(w, QuantizedWeight) else w).shape[0]


def _build(w: Weight, bias: torch.Tensor | None, device, dtype, kernel: str) -> LinearKernel:
    if isinstance(w, QuantizedWeight):
        return build_linear(w, None, bias, device, dtype, kernel)
    return build_linear(None, w, bias, device, dtype, "auto")  # float layers: the dense kernel whatever was asked


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, Weight], prefix: str, device, dtype, kernel: str):
        super().__init__()
        self.spec = spec
        w = lambda name: weights.pop(f"{prefix}{name}")  # noqa: E731 - consume as we go (memory)
        wb = lambda name, on: weights.pop(f"{prefix}{name}") if on else None  # noqa: E731
        a, m = "self_attn.", "mlp."
        self.input_norm = _float(w("input_layernorm.weight"), device, dtype)
        self.post_norm = _float(w("post_attention_layernorm.weight"), device, dtype)
        self.qkv = _Linears(
            [w(f"{a}q_proj.weight"), w(f"{a}k_proj.weight"), w(f"{a}v_proj.weight")],
            [wb(f"{a}{n}_proj.bias", spec.qkv_bias) for n in "qkv"], device, dtype, kernel,
        )
        self.o = _Linears([w(f"{a}o_proj.weight")], [wb(f"{a}o_proj.bias", spec.o_bias)], device, dtype, kernel)
        self.gate_up = _Linears(
            [w(f"{m}gate_proj.weight"), w(f"{m}up_proj.weight")],
            [wb(f"{m}gate_proj.bias", spec.mlp_bias), wb(f"{m}up_proj.bias", spec.mlp_bias)], device, dtype, kernel,
        )
        self.down = _Linears([w(f"{m}down_proj.weight")], [wb(f"{m}down_proj.bias", spec.mlp_bias)], device, dtype, kernel)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = _float(w(f"{a}q_norm.weight"), device, dtype)
            self.k_norm = _float(w(f"{a}k_norm.weight"), device, dtype)
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:  # h: (T, hidden)
        s = self.spec
        T = h.shape[0]
        qkv = self.qkv(_rms_norm(h, self.input_norm, s.rms_norm_eps))  # (T, (H_q + 2 H_kv) D)
        heads = qkv.view(T, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        v = heads[:, s.num_heads + s.num_kv_heads :]  # (T, H_kv, D)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head before RoPE
            q = _rotate(_rms_norm(heads[:, : s.num_heads], self.q_norm, s.rms_norm_eps), cos, sin)
            k = _rotate(_rms_norm(heads[:, s.num_heads : s.num_heads + s.num_kv_heads], self.k_norm, s.rms_norm_eps), cos, sin)
        else:  # one rotation for the query and key heads together
            qk = _rotate(heads[:, : s.num_heads + s.num_kv_heads], cos, sin)  # (T, H_q + H_kv, D)
            q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, s.sliding_window)  # (T, H_q D)
        h = h + self.o(attn)
        x = self.gate_up(_rms_norm(h, self.post_norm, s.rms_norm_eps))  # (T, 2 I)
        gate, up = x.chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)  # SwiGLU


def _float(t: torch.Tensor, device, dtype) -> torch.Tensor:
    return t.to(device=device, dtype=dtype)


class Embedding(nn.Module):
    """Token embeddings: a float table, or int8 rows with one scale per row (``embeddings: int8``)."""

    def __init__(self, w: Weight, device, dtype):
        super().__init__()
        self.dtype = dtype
        if isinstance(w, QuantizedWeight):
            self.table = w.q.to(device)
            self.scale = w.scale.to(device)
            self.zero = None if w.zero_point is None else w.zero_point.to(device)
        else:
            self.table = w.to(device=device, dtype=dtype)
            self.scale = self.zero = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        if self.scale is None:
            return self.table[ids]
        q = self.table[ids].float()
        if self.zero is not None:
            q = q - self.zero[ids].float()
        return (q * self.scale[ids].float()).to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.table, self.scale, self.zero) if t is not None)


class LlamaExecutor(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    Built from ``weights``: parameter name (transformers naming) -> float tensor or
    :class:`QuantizedWeight`. The dict is consumed (emptied) as layers are built, so the
    caller's references go away and memory stays at one copy.
    """

    def __init__(
        self, config: Any, weights: dict[str, Weight], device: torch.device, dtype: torch.dtype,
        kernel: str = "auto", max_positions: int | None = None,
    ):
        super().__init__()
        spec = ModelSpec.from_config(config)
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.embed = Embedding(weights.pop("model.embed_tokens.weight"), device, dtype)
        self.layers = nn.ModuleList(
            [DecoderLayer(spec, weights, f"model.layers.{i}.", device, dtype, kernel) for i in range(spec.num_layers)]
        )
        self.norm = _float(weights.pop("model.norm.weight"), device, dtype)
        head = weights.pop("lm_head.weight", None)
        if head is None:
            if not spec.tie_word_embeddings or self.embed.scale is not None:
                raise ValueError("the checkpoint has no lm_head.weight and its embeddings cannot serve as the head")
            self.lm_head = build_linear(None, self.embed.table, None, device, dtype, "auto")  # tied: same tensor
            self.head_shares_embedding = True
        else:
            self.lm_head = _build(head, None, device, dtype, kernel)
            self.head_shares_embedding = False
        leftover = sorted(k for k in weights if not k.endswith("rotary_emb.inv_freq"))
        if leftover:
            raise ValueError(f"weights the executor does not use: {leftover[:5]}")
        self._compiled = None
        self.max_positions = max_positions or spec.max_position_embeddings
        self.cos, self.sin = rope_tables(config, self.max_positions, device)
        self.cos = self.cos.to(dtype)  # transformers casts cos/sin to the activation dtype
        self.sin = self.sin.to(dtype)

    def enable_compile(self, mode: str | None = None) -> None:
        """Compile the decode step with inductor (``torch.compile``, dynamic shapes). Prefill
        chunks stay eager: their matmuls dominate and their shapes vary more. On the dev CPU this
        took decode at batch 1 from 66 to ~100 tokens/s (fewer Python dispatches per layer; see
        README, "Hot path"). ``mode="reduce-overhead"`` adds CUDA graphs on a GPU."""
        self._compiled = torch.compile(self._forward, dynamic=True, mode=mode)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_k: list[torch.Tensor], kv_v: list[torch.Tensor],
    ) -> torch.Tensor:
        """ids, positions: (T,) int64 -> hidden states (T, hidden) before the final norm."""
        if self._compiled is not None and not meta.prefills:
            if meta.num_decodes > 1:  # batch sizes vary step to step: dynamic from the first compile
                torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(meta.decode_block_table, 1)
            torch._dynamo.mark_dynamic(meta.decode_mask, 3)
            return self._compiled(ids, positions, meta, kv_k, kv_v)
        return self._forward(ids, positions, meta, kv_k, kv_v)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_k: list[torch.Tensor], kv_v: list[torch.Tensor],
    ) -> torch.Tensor:
        h = self.embed(ids)
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, kv_k[i], kv_v[i])
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> (B, vocab) float32 (the sampler works in float32)."""
        return self.lm_head(_rms_norm(hidden, self.norm, self.spec.rms_norm_eps)).float()

    def weight_bytes_per_step(self) -> int:
        """Weight bytes one decode step reads: every linear's packed weight and the head
        (embedding rows read per token are negligible and not counted)."""
        kernels = [k for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down) for k in m.kernels]
        norms = sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.input_norm, layer.post_norm))
        return sum(k.weight_bytes() for k in kernels) + self.lm_head.weight_bytes() + norms

    def matmul_params(self) -> tuple[int, int]:
        """(weights in the decoder layers' linears, weights in the head): 2 FLOPs each per token."""
        layers = sum(k.in_features * k.out_features for layer in self.layers
                     for m in (layer.qkv, layer.o, layer.gate_up, layer.down) for k in m.kernels)
        return layers, self.lm_head.in_features * self.lm_head.out_features

    def kernel_names(self) -> dict[str, int]:
        """Which kernel runs how many matmuls (the head included)."""
        names: dict[str, int] = {}
        for layer in self.layers:
            for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
                for k in m.kernels:
                    names[k.name] = names.get(k.name, 0) + 1
        names[f"{self.lm_head.name} (head)"] = 1
        return names

    def slow_paths(self) -> list[str]:
        ks = [k for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down) for k in m.kernels]
        return sorted({k.name for k in ks + [self.lm_head] if k.slow_path})
