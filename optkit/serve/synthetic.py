"""Synthetic models: random weights of a named shape, built directly in the packed format.

Decode and prefill speed depend on shapes, not on weight values, so a synthetic Llama-3-8B
measures what the real one would run at without downloading 16 GB. Everything that reports on
a synthetic model says so (``ModelSource.synthetic``). Weights are generated layer by layer as
the executor asks for them, so peak memory is the packed model, not a 16-bit copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from optkit.errors import UserError
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme
from optkit.serve.loader import ModelSource


@dataclass(frozen=True)
class Shape:
    architecture: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tie: bool
    max_positions: int
    rope: dict
    source: str  # where the numbers come from


#: Shapes from each model's published config.json.
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape(
        "LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, True, 8192,
        {"rope_type": "default", "rope_theta": 100000.0}, "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "llama-3.2-1b": Shape(
        "LlamaForCausalLM", 128256, 2048, 8192, 16, 32, 8, True, 131072,
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "meta-llama/Llama-3.2-1B",
    ),
    "llama-3-8b": Shape(
        "LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, False, 8192,
        {"rope_type": "default", "rope_theta": 500000.0}, "meta-llama/Meta-Llama-3-8B",
    ),
    "qwen2.5-7b": Shape(
        "Qwen2ForCausalLM", 152064, 3584, 18944, 28, 28, 4, False, 32768,
        {"rope_type": "default", "rope_theta": 1000000.0}, "Qwen/Qwen2.5-7B",
    ),
}

#: Weight formats a synthetic model can be built in.
SYNTHETIC_SCHEMES: dict[str, QuantScheme | None] = {
    "bf16": None,
    "w8a16": QuantScheme(bits=8),
    "w4a16": QuantScheme(bits=4, group_size=128),
    "w4a16-g64": QuantScheme(bits=4, group_size=64),
    "w4a16-g32": QuantScheme(bits=4, group_size=32),
    "w8a8": QuantScheme(bits=8, act_bits=8),
}


def _config(shape: Shape) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if shape.architecture == "Qwen2ForCausalLM" else LlamaConfig
    return cls(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions, tie_word_embeddings=shape.tie, rope_parameters=dict(shape.rope),
        rms_norm_eps=1e-5, architectures=[shape.architecture], bos_token_id=1, eos_token_id=2,
    )


class _LazyWeights:
    """The subset of dict the executor uses (``pop``, iteration); each tensor is made on ``pop``."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], bool]], scheme: QuantScheme | None, seed: int):
        self.shapes = shapes  # name -> (shape, quantizable)
        self.scheme = scheme
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.shapes))

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def pop(self, name: str, *default: Any) -> Any:
        if name not in self.shapes:
            if default:
                return default[0]
            raise KeyError(name)
        shape, quantizable = self.shapes.pop(name)
        if len(shape) == 1:  # norms and biases
            return torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else torch.zeros(shape, dtype=torch.bfloat16)
        s = self.scheme
        if s is None or not quantizable:
            return (torch.randn(shape, generator=self.gen) * 0.02).to(torch.bfloat16)
        out, inp = shape
        q = torch.randint(s.qmin, s.qmax + 1, shape, generator=self.gen, dtype=torch.int8)
        groups = 1 if s.group_size is None else inp // s.group_size
        scale = (torch.rand(out, groups, generator=self.gen) * 0.02 / s.qmax + 1e-4).to(torch.bfloat16)
        return QuantizedWeight(q, scale, None, s)


def synthetic_source(name: str, scheme: str = "w4a16", seed: int = 0) -> ModelSource:
    """A :class:`ModelSource` with random weights of a named shape, packed as ``scheme``."""
    key = name.lower()
    if key not in SHAPES:
        raise UserError(f"unknown synthetic model {name!r}", hint=f"one of: {', '.join(SHAPES)}")
    if scheme not in SYNTHETIC_SCHEMES:
        raise UserError(f"unknown synthetic weight format {scheme!r}", hint=f"one of: {', '.join(SYNTHETIC_SCHEMES)}")
    shape = SHAPES[key]
    config = _config(shape)
    d = shape.hidden // shape.heads
    names: dict[str, tuple[tuple[int, ...], bool]] = {"model.embed_tokens.weight": ((shape.vocab, shape.hidden), False)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        names[p + "input_layernorm.weight"] = ((shape.hidden,), False)
        names[p + "post_attention_layernorm.weight"] = ((shape.hidden,), False)
        for proj, out in (("q", shape.heads * d), ("k", shape.kv_heads * d), ("v", shape.kv_heads * d)):
            names[f"{p}self_attn.{proj}_proj.weight"] = ((out, shape.hidden), True)
            if shape.architecture == "Qwen2ForCausalLM":
                names[f"{p}self_attn.{proj}_proj.bias"] = ((out,), False)
        names[p + "self_attn.o_proj.weight"] = ((shape.hidden, shape.heads * d), True)
        names[p + "mlp.gate_proj.weight"] = ((shape.intermediate, shape.hidden), True)
        names[p + "mlp.up_proj.weight"] = ((shape.intermediate, shape.hidden), True)
        names[p + "mlp.down_proj.weight"] = ((shape.hidden, shape.intermediate), True)
    names["model.norm.weight"] = ((shape.hidden,), False)
    if not shape.tie:
        names["lm_head.weight"] = ((shape.vocab, shape.hidden), False)  # the head stays 16-bit, as in our recipes
    weights: Any = _LazyWeights(names, SYNTHETIC_SCHEMES[scheme], seed)
    label = "bf16" if SYNTHETIC_SCHEMES[scheme] is None else SYNTHETIC_SCHEMES[scheme].label()
    return ModelSource(
        config, weights, None, "synthetic", f"synthetic:{key}", {label: 7 * shape.layers}, synthetic=True
    )
