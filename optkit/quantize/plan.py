"""Which layers get which scheme, and swapping them into the model.

A plan is data (names -> schemes, names -> skip reasons) so the summary, the manifest and
the export's ``quantization_config`` all describe exactly what was done.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from optkit.errors import QuantizationError
from optkit.quantize.modules import QuantizedEmbedding, QuantizedLinear
from optkit.quantize.observers import Observer, minmax_observer
from optkit.quantize.primitives import quantize
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import SUPPORTED_GROUP_SIZES, QuantScheme

if TYPE_CHECKING:
    from optkit.recipe import QuantizationConfig

#: lm_head / embeddings at int8 use one scale per output row.
INT8_PER_ROW = QuantScheme(bits=8, group_size=None, symmetric=True)


@dataclass(frozen=True)
class LayerPlan:
    """What the quantizer will do to each layer.

    Attributes:
        linears: Linear module name -> scheme (includes the lm_head when it is quantized).
        embeddings: Embedding module name -> scheme.
        skipped: module name -> reason it stays in 16-bit although it was selected.
        excluded: Linear modules left in 16-bit by the include/exclude patterns (and the lm_head
            when it stays 16-bit).
        untie: the output projection must get its own weight (tied to the embeddings before).
    """

    linears: dict[str, QuantScheme] = field(default_factory=dict)
    embeddings: dict[str, QuantScheme] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()
    untie: bool = False


def module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    """The dotted name of ``module`` inside ``model`` (None if absent)."""
    if module is None:
        return None
    return next((n for n, m in model.named_modules() if m is module), None)


def output_head_name(model: nn.Module) -> str | None:
    """Name of the output projection (``lm_head`` for most causal LMs)."""
    return module_name(model, model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None)


def runtime_notes(plan: LayerPlan) -> list[str]:
    """What standard runtimes cannot load from this plan's artifact (upstream gaps), so users
    learn it at quantization time rather than at deployment."""
    notes = []
    if any(not s.symmetric for s in [*plan.linears.values(), *plan.embeddings.values()]):
        notes.append(
            "asymmetric pack-quantized weights: transformers cannot load their packed zero points yet "
            "(upstream llm-compressor issue #1618); optkit reads them"
        )
    if plan.embeddings:
        notes.append(
            "int8 embeddings: transformers and vLLM do not load quantized embeddings from compressed-tensors; "
            "optkit reads them"
        )
    return notes


def matches(name: str, pattern: str) -> bool:
    """``re:REGEX`` (full match) or a shell glob (``*``, ``?``, ``[...]``)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _check_patterns(patterns: Iterable[str], names: list[str], key: str) -> None:
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as err:
                raise QuantizationError(f"quantization.{key}: invalid regular expression {p!r}: {err}") from None
        if not any(matches(n, p) for n in names):
            raise QuantizationError(
                f"quantization.{key}: pattern {p!r} matches no Linear layer",
                hint=f"layer names look like: {', '.join(names[:3])}",
            )


def _fitting_group_sizes(in_features: int) -> list[str]:
    return [str(g) for g in SUPPORTED_GROUP_SIZES if in_features % g == 0] + ["'channel'"]


def plan_layers(model: nn.Module, cfg: QuantizationConfig, tied: bool) -> LayerPlan:
    """Decide every layer's fate from the recipe's ``quantization`` section.

    ``tied``: the output projection shares the input embedding's tensor.
    """
    scheme = cfg.weight_scheme()
    include, exclude = list(cfg.include), list(cfg.exclude)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head_name = module_name(model, out_emb)
    emb_name = module_name(model, in_emb)

    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != head_name]
    if not linear_names:
        raise QuantizationError("the model has no nn.Linear layers to quantize")
    _check_patterns(include, linear_names, "include")
    _check_patterns(exclude, linear_names, "exclude")
    _check_patterns([lp.match for lp in cfg.layers], linear_names, "layers[].match")

    modules = dict(model.named_modules())
    linears: dict[str, QuantScheme] = {}
    skipped: dict[str, str] = {}
    excluded: list[str] = []
    misfits: list[str] = []
    for n in linear_names:
        if not any(matches(n, p) for p in include) or any(matches(n, p) for p in exclude):
            excluded.append(n)
            continue
        layer_scheme = scheme
        override = next((lp for lp in cfg.layers if matches(n, lp.match)), None)
        if override is not None:
            layer_scheme = cfg.precision_scheme(override.precision)
            if layer_scheme is None:  # '16bit'
                excluded.append(n)
                continue
        in_f = modules[n].in_features
        if layer_scheme.fits(in_f):
            linears[n] = layer_scheme
        elif cfg.allow_skip:
            skipped[n] = f"in_features {in_f} is not divisible by group_size {layer_scheme.group_size}"
        else:
            misfits.append(
                f"{n} (group_size {layer_scheme.group_size}, in_features {in_f}; "
                f"group sizes that fit: {', '.join(_fitting_group_sizes(in_f))})"
            )
    if misfits:
        shown = "\n  ".join(misfits[:8]) + (f"\n  ... and {len(misfits) - 8} more" if len(misfits) > 8 else "")
        raise QuantizationError(
            f"the group size does not divide the input width of {len(misfits)} layer(s):\n  {shown}",
            hint="choose a group size that fits, or set quantization.allow_skip: true (--allow-skip) "
            "to keep these layers in 16-bit",
        )

    emb_plan: dict[str, QuantScheme] = {}
    if cfg.lm_head == "int8":
        if head_name is None or not isinstance(out_emb, nn.Linear):
            raise QuantizationError("quantization.lm_head is int8 but the model has no Linear output projection")
        linears[head_name] = INT8_PER_ROW
    elif head_name is not None:
        excluded.append(head_name)
    if cfg.embeddings == "int8":
        if emb_name is None or not isinstance(in_emb, nn.Embedding):
            raise QuantizationError("quantization.embeddings is int8 but the model has no nn.Embedding input layer")
        emb_plan[emb_name] = INT8_PER_ROW
    if not linears and not emb_plan:
        raise QuantizationError(
            "nothing to quantize: the include/exclude patterns leave every layer in 16-bit",
            hint=f"{len(excluded)} Linear layers were excluded; check quantization.include and quantization.exclude",
        )
    # A tied head shares the embedding's tensor: quantizing either one gives them different weights.
    untie = tied and (cfg.lm_head == "int8" or cfg.embeddings == "int8")
    return LayerPlan(linears, emb_plan, skipped, tuple(excluded), untie)


def replan(plan: LayerPlan, choices: dict[str, QuantScheme | None]) -> LayerPlan:
    """``plan`` with the Linear layers in ``choices`` set to a new scheme (None: 16-bit)."""
    linears = dict(plan.linears)
    excluded = list(plan.excluded)
    for name, scheme in choices.items():
        if scheme is None:
            linears.pop(name, None)
            if name not in excluded:
                excluded.append(name)
        else:
            linears[name] = scheme
            if name in excluded:
                excluded.remove(name)
    return LayerPlan(linears, dict(plan.embeddings), dict(plan.skipped), tuple(excluded), plan.untie)


def apply_plan(
    model: nn.Module,
    plan: LayerPlan,
    scale_dtype: torch.dtype,
    on_layer: Callable[[str], None] | None = None,
    observer: Observer = minmax_observer,
) -> None:
    """Replace planned modules in place with their quantized versions (round-to-nearest with
    ``observer``). Modules already quantized (by the layer-by-layer pass) are left alone."""
    if plan.untie:
        head = model.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    for name, scheme in list(plan.linears.items()) + list(plan.embeddings.items()):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):  # done by the layer-by-layer pass
            if on_layer is not None:
                on_layer(name)
            continue
        if isinstance(module, nn.Embedding):
            new = QuantizedEmbedding.from_float(module, scheme, scale_dtype)
        else:
            new = QuantizedLinear.from_float(module, scheme, scale_dtype, algorithm=_rtn_with(observer))
        setattr(parent, child, new)
        if on_layer is not None:
            on_layer(name)


def _rtn_with(observer: Observer):
    def algorithm(w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> QuantizedWeight:
        scale, zp = observer(w, scheme, scale_dtype, None)
        return QuantizedWeight(quantize(w, scale, zp, scheme), scale, zp, scheme)

    return algorithm
