"""Per-architecture layer specs, as data: where the decoder blocks are, and which module
produces the input of which linears (for AWQ and SmoothQuant scale folding).

A mapping ``prev -> linears`` (names relative to one decoder block) says that the output of
``prev`` (an RMSNorm/LayerNorm with a per-channel ``weight``, or a Linear) is the input of
every linear listed, and of nothing else. Dividing ``prev``'s output channels by ``s`` and
multiplying the linears' input columns by ``s`` therefore leaves the model's function
unchanged. A mapping whose ``prev`` is a Linear is used only when the shapes line up
(``v_proj -> o_proj`` does not under grouped-query attention: o_proj reads every query
head, v_proj writes one per key/value group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from optkit.errors import QuantizationError


@dataclass(frozen=True)
class Mapping:
    prev: str
    linears: tuple[str, ...]


@dataclass(frozen=True)
class ArchSpec:
    """``blocks``: dotted path of the ModuleList of decoder blocks; ``final_norm``: the norm between
    the last block and the output head; ``mappings``: scale folding."""

    blocks: str
    final_norm: str
    mappings: tuple[Mapping, ...]


_LLAMA_LIKE = ArchSpec(
    blocks="model.layers",
    final_norm="model.norm",
    mappings=(
        Mapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Mapping("self_attn.v_proj", ("self_attn.o_proj",)),
        Mapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        Mapping("mlp.up_proj", ("mlp.down_proj",)),
    ),
)

ARCH_SPECS: dict[str, ArchSpec] = {}


def register_arch(name: str, spec: ArchSpec) -> None:
    if name in ARCH_SPECS:
        raise ValueError(f"architecture {name!r} is already registered")
    ARCH_SPECS[name] = spec


for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    register_arch(_arch, _LLAMA_LIKE)


def arch_spec(model: nn.Module, purpose: str) -> ArchSpec:
    """The registered spec of ``model``'s architecture; ``purpose`` names what needs it in the error."""
    name = arch_name(model)
    if name not in ARCH_SPECS:
        raise QuantizationError(
            f"{purpose} needs the layer spec of architecture {name}, which optkit does not have; "
            f"known: {', '.join(sorted(ARCH_SPECS))}",
            hint="register an ArchSpec for it in optkit.quantize.mappings",
        )
    return ARCH_SPECS[name]


def arch_name(model: nn.Module) -> str:
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    return archs[0] if archs[0] in ARCH_SPECS else type(model).__name__


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks, from the spec when the architecture is known, else the usual paths."""
    spec = ARCH_SPECS.get(arch_name(model))
    paths = [spec.blocks] if spec else ["model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"]
    for path in paths:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            return blocks
    raise QuantizationError(
        f"cannot find the decoder blocks of {type(model).__name__} (looked at {', '.join(paths)})",
        hint="layer-by-layer calibration needs a ModuleList of decoder blocks; "
        "register the architecture in optkit.quantize.mappings",
    )


def block_mappings(model: nn.Module, block: nn.Module, purpose: str) -> list[Mapping]:
    """The mappings that apply to ``block`` (shape-checked); ``purpose`` names the algorithm
    in the error raised for an architecture without mappings."""
    name = arch_name(model)
    spec = ARCH_SPECS.get(name)
    if spec is None or not spec.mappings:
        raise QuantizationError(
            f"{purpose} needs to know which norm or linear feeds which linears, and architecture {name} "
            f"has no mappings; known: {', '.join(sorted(ARCH_SPECS))}",
            hint="add an ArchSpec for it in optkit.quantize.mappings (prev module -> the linears reading its "
            "output), or use algorithm gptq / rtn, which need no mappings",
        )
    usable = []
    for m in spec.mappings:
        try:
            prev = block.get_submodule(m.prev)
            lins = [block.get_submodule(n) for n in m.linears]
        except AttributeError as err:
            raise QuantizationError(f"{purpose}: mapping {m.prev} -> {', '.join(m.linears)} does not fit {name}: {err}") from None
        width = lins[0].in_features
        if any(lin.in_features != width for lin in lins):
            raise QuantizationError(f"{purpose}: linears {', '.join(m.linears)} of {name} do not share an input width")
        out = prev.out_features if isinstance(prev, nn.Linear) else getattr(prev, "weight", None).shape[0]
        if out == width:
            usable.append(m)
    return usable


def fold_scales(prev: nn.Module, linears: list[nn.Linear], s) -> None:
    """In place: ``prev``'s output channels divided by ``s`` (in,), the linears' input columns
    multiplied by it. Function-preserving: ``(h / s) (W diag(s))^T = h W^T``."""
    s = s.to(torch.float32)
    if isinstance(prev, nn.Linear):
        prev.weight.data = (prev.weight.data.float() / s.unsqueeze(1)).to(prev.weight.dtype)  # rows: (out, in)
    else:  # a norm with a per-channel affine weight: y = weight * normalized(x)
        prev.weight.data = (prev.weight.data.float() / s).to(prev.weight.dtype)
    if getattr(prev, "bias", None) is not None:
        prev.bias.data = (prev.bias.data.float() / s).to(prev.bias.dtype)
    for lin in linears:
        lin.weight.data = (lin.weight.data.float() * s.unsqueeze(0)).to(lin.weight.dtype)  # columns
