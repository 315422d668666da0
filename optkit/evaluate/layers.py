"""Per-layer quantization error, to find the layers that lose the most.

Two views:

* :func:`per_layer_sqnr` (weights): each quantized layer's dequantized weight, read back from
  the artifact, against the float weight of the unquantized model:
  ``SQNR = 10 log10(|W|^2 / |W - deq(Q)|^2)`` dB.
* :func:`output_sqnr` (activations): every Linear's output in the quantized model against the
  same Linear's output in the reference model, on the same tokens. Each model runs on its own
  hidden states, so a layer's figure includes the error carried in from the layers before it:
  the series shows where the error grows.

AWQ and SmoothQuant fold a per-channel scale ``s`` into the weights before rounding
(``W -> W diag(s)``, the producer of the input divided by ``s``; see
:mod:`optkit.quantize.mappings`). The model's function is unchanged, but the stored weights of
those layers (and, where the producer is a Linear, that Linear's output) are no longer
comparable with the float model's. The artifact's manifest records which mappings were
applied; :func:`rescaled_layers` lists the layers concerned, :func:`per_layer_sqnr` leaves them
out of its result, and :func:`output_sqnr` takes them as ``skip``. Callers report how many were
left out (``len(rescaled_layers(path).weights & quantized)``).

Results are sorted worst (lowest dB) first; ``inf`` means the layer is exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping

import torch
from torch import nn

from optkit.errors import ArtifactError, UserError
from optkit.export.reader import load_quantized_weights, read_manifest
from optkit.quantize.primitives import sqnr_db


@dataclass(frozen=True)
class RescaledLayers:
    """Modules of an artifact changed by AWQ / SmoothQuant scale folding (full module names).

    Attributes:
        weights: modules whose stored weight is the float weight rescaled per channel (the
            linears reading a rescaled input, and a Linear producing it).
        outputs: modules whose output is rescaled per channel (a Linear producing a rescaled
            input; norms too, which :func:`output_sqnr` never measures).
    """

    weights: frozenset[str]
    outputs: frozenset[str]


def rescaled_layers(artifact_path: str | Path) -> RescaledLayers:
    """The modules whose weights or outputs AWQ / SmoothQuant rescaled, from the manifest's
    ``calibrated.transforms`` (block index -> ``"prev -> linear,linear"`` -> details)."""
    p = Path(artifact_path)
    manifest = read_manifest(p)
    transforms = (manifest.get("calibrated") or {}).get("transforms") or {}
    if not any(transforms.values()):
        return RescaledLayers(frozenset(), frozenset())
    from optkit.quantize.mappings import ARCH_SPECS

    try:
        archs = json.loads((p / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, json.JSONDecodeError) as err:
        raise ArtifactError(f"{p}: cannot read config.json to place the recorded scale transforms: {err}") from None
    spec = next((ARCH_SPECS[a] for a in archs if a in ARCH_SPECS), None)
    if spec is None:
        raise ArtifactError(
            f"{p}: the manifest records scale transforms, but architecture {archs} has no layer spec in optkit",
            hint="register it in optkit.quantize.mappings",
        )
    weights, outputs = set(), set()
    for block, mappings in transforms.items():
        prefix = f"{spec.blocks}.{block}."
        for key in mappings:
            prev, sep, linears = key.partition(" -> ")
            if not sep:
                raise ArtifactError(f"{p}: unreadable transform {key!r} in the manifest (expected 'prev -> linear,...')")
            weights.update(prefix + name for name in linears.split(","))
            weights.add(prefix + prev)
            outputs.add(prefix + prev)
    return RescaledLayers(frozenset(weights), frozenset(outputs))


def _worst_first(values: dict[str, float]) -> dict[str, float]:
    return dict(sorted(values.items(), key=lambda kv: (kv[1], kv[0])))


def per_layer_sqnr(reference_state: Mapping[str, torch.Tensor], artifact_path: str | Path) -> dict[str, float]:
    """Module name -> SQNR (dB) of the artifact's dequantized weight against
    ``reference_state[name + ".weight"]`` (the unquantized model's ``state_dict()``), for every
    quantized layer except those listed by :func:`rescaled_layers`; worst first."""
    quantized = load_quantized_weights(artifact_path)
    skip = rescaled_layers(artifact_path).weights
    out = {}
    for name, qw in quantized.items():
        if name in skip:
            continue
        key = f"{name}.weight"
        if key not in reference_state:
            raise UserError(
                f"the reference weights have no {key!r}, a quantized layer of {artifact_path}",
                hint="pass the state_dict() of the unquantized model the artifact was made from",
            )
        ref = reference_state[key]
        approx = qw.dequantize(torch.float32)
        if tuple(ref.shape) != tuple(approx.shape):
            raise UserError(
                f"{key}: reference shape {tuple(ref.shape)} differs from the artifact's {tuple(approx.shape)}",
                hint="pass the state_dict() of the unquantized model the artifact was made from",
            )
        out[name] = sqnr_db(ref, approx.to(ref.device))
    return _worst_first(out)


def output_sqnr(
    model_ref: nn.Module,
    model_q: nn.Module,
    tokens: torch.Tensor,
    skip: Collection[str] = (),
) -> dict[str, float]:
    """Linear name -> SQNR (dB) of its output in ``model_q`` against ``model_ref``, summed over
    ``tokens`` (W, L) (or one window (L,)); worst first.

    Every ``nn.Linear`` of ``model_ref`` (the output head included) is measured at the module of
    the same name in ``model_q`` (which may be a quantized module), except the names in ``skip``
    (pass ``rescaled_layers(path).outputs`` for an AWQ / SmoothQuant artifact). Windows run one
    at a time, so only one window's reference outputs are held. A Linear that the forward pass
    never calls is absent from the result.
    """
    for m, label in ((model_ref, "model_ref"), (model_q, "model_q")):
        if m.training:
            raise ValueError(f"{label} is in training mode; call .eval() first")
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise ValueError(f"tokens must be (W, L) or (L,) token ids, got shape {tuple(tokens.shape)}")
    names = [n for n, m in model_ref.named_modules() if isinstance(m, nn.Linear) and n not in skip]
    q_modules = dict(model_q.named_modules())
    missing = [n for n in names if n not in q_modules]
    if missing:
        raise ValueError(f"model_q has no module(s) {missing[:5]} that model_ref has; are they the same architecture?")
    signal = dict.fromkeys(names, 0.0)
    noise = dict.fromkeys(names, 0.0)
    calls = dict.fromkeys(names, 0)
    ref_out: dict[str, list[torch.Tensor]] = {n: [] for n in names}  # outputs in call order

    def keep(name):
        def hook(_mod, _inp, y):
            ref_out[name].append(y.detach().float())  # (1, L, out)
        return hook

    def compare(name):
        def hook(_mod, _inp, y):
            if not ref_out[name]:
                raise ValueError(f"{name} ran more often in model_q than in model_ref")
            ref = ref_out[name].pop(0)
            diff = ref - y.detach().float().to(ref.device)
            signal[name] += float(ref.double().pow(2).sum())
            noise[name] += float(diff.double().pow(2).sum())
            calls[name] += 1
        return hook

    handles = [model_ref.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    handles += [q_modules[n].register_forward_hook(compare(n)) for n in names]
    dev_ref = next(model_ref.parameters()).device
    dev_q = next(model_q.parameters()).device
    try:
        with torch.inference_mode():
            for window in tokens:
                ids = window.unsqueeze(0)  # (1, L)
                model_ref(input_ids=ids.to(dev_ref), use_cache=False)
                model_q(input_ids=ids.to(dev_q), use_cache=False)
                left = [n for n in names if ref_out[n]]
                if left:
                    raise ValueError(f"{left[:5]} ran in model_ref but not (as often) in model_q")
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n in names:
        if calls[n] == 0:  # e.g. a head skipped by the model's forward: nothing was measured
            continue
        if noise[n] == 0.0:
            out[n] = math.inf
        elif signal[n] == 0.0:
            out[n] = -math.inf
        else:
            out[n] = 10 * math.log10(signal[n] / noise[n])
    return _worst_first(out)
