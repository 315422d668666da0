"""Per-layer sensitivity: how much each Linear alone, quantized, moves the model's next-token
distribution (KL divergence from the unquantized model), measured, not estimated.

Measuring 200 layers x 2 precisions naively means 400 full forward passes. Two things make
it cheap enough to run by default:

* every block's input on the sensitivity tokens is captured once; quantizing a layer of
  block ``b`` only re-runs blocks ``b..N-1`` (half the model on average) from that input;
* the layer's weight is swapped in place for its round-to-nearest dequantized copy and put
  back afterwards: no module surgery;
* with ``measure="lowest"`` only each layer's lowest-bit option is run through the model; a
  higher-bit option's KL is that measurement scaled by the ratio of the two options' weight
  error energies ``||W - W'||^2`` (KL is quadratic in a small perturbation). 8-bit errors are
  ~250x smaller than 4-bit ones, so this estimate decides nothing by itself; ``"all"``
  measures every option.

Everything runs in float32: the perturbations measured are small, and on CPUs the many
element-wise operations of a short forward are slower in bfloat16 than in float32.

Each row of the table is ``KL(P_float || P_layer-quantized)``, the mean over the tokens
scored; their sum predicts the KL of a plan that quantizes several layers (first-order
additivity, checked against the measured KL in the quality benchmark).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from optkit.calibration.capture import capture_first_inputs, run_block
from optkit.quantize.mappings import arch_spec, decoder_blocks
from optkit.quantize.observers import Observer
from optkit.quantize.primitives import dequantize, quantize
from optkit.quantize.scheme import QuantScheme


@dataclass(frozen=True)
class SensitivityTable:
    """``kl[layer][label]``: measured KL divergence with only ``layer`` quantized at ``label``;
    ``params[layer]``: its weight count; ``tokens``: positions scored per measurement."""

    kl: dict[str, dict[str, float]]
    params: dict[str, int]
    tokens: int
    measured: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "layers": {
                n: {"params": self.params[n], "kl": self.kl[n], "measured": self.measured.get(n, sorted(self.kl[n]))}
                for n in self.kl
            },
        }

    @classmethod
    def from_json(cls, data: dict) -> SensitivityTable:
        layers = data["layers"]
        return cls(
            {n: dict(v["kl"]) for n, v in layers.items()},
            {n: int(v["params"]) for n, v in layers.items()},
            int(data["tokens"]),
            {n: list(v.get("measured", v["kl"])) for n, v in layers.items()},
        )


def _kl(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(P_ref || P): ref_logp, logits (T, V)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


@torch.inference_mode()
def measure_sensitivity(
    model: nn.Module,
    input_ids: torch.Tensor,
    candidates: dict[str, dict[str, QuantScheme]],
    observer: Observer,
    scale_dtype: torch.dtype,
    on_layer: Callable[[str], None] | None = None,
    measure: str = "lowest",
) -> SensitivityTable:
    """KL divergence for each layer in ``candidates`` (name -> {label: scheme}) quantized alone,
    on ``input_ids`` (N, L)."""
    spec = arch_spec(model, "sensitivity analysis (mixed precision)")
    blocks = decoder_blocks(model)
    blocks_name = next(n for n, m in model.named_modules() if m is blocks)
    first = capture_first_inputs(model, blocks, input_ids, batch_size=input_ids.shape[0])
    h0, kw = first.hidden(0), first.kwargs[0]  # (N, L, d): all windows as one batch
    final_norm = model.get_submodule(spec.final_norm)
    head = model.get_output_embeddings()
    modules = dict(model.named_modules())

    block_inputs = [h0]
    h = h0
    for block in blocks:
        h = run_block(block, h, kw)
        block_inputs.append(h)

    def logits_from(b: int) -> torch.Tensor:  # run blocks b.. and the head: (N*L, V)
        x = block_inputs[b]
        for block in blocks[b:]:
            x = run_block(block, x, kw)
        return head(final_norm(x)).reshape(-1, head.out_features)

    ref_logp = F.log_softmax(head(final_norm(block_inputs[-1])).reshape(-1, head.out_features).float(), dim=-1)
    kl: dict[str, dict[str, float]] = {}
    params: dict[str, int] = {}
    measured: dict[str, list[str]] = {}
    for name, options in candidates.items():
        if not name.startswith(blocks_name + "."):
            raise ValueError(f"{name} is not inside the decoder blocks {blocks_name}")
        b = int(name[len(blocks_name) + 1 :].split(".")[0])
        lin = modules[name]
        original = lin.weight.data
        params[name] = original.numel()
        kl[name] = {}
        w = original.float()
        deq, energy = {}, {}
        for label, scheme in options.items():
            s, z = observer(w, scheme, scale_dtype, None)
            deq[label] = dequantize(quantize(w, s, z, scheme), s, z, scheme)
            energy[label] = float((deq[label] - w).pow(2).sum())
        lowest = min(options, key=lambda lbl: options[lbl].bits)
        run = list(options) if measure == "all" else [lowest]
        measured[name] = run
        try:
            for label in run:
                lin.weight.data = deq[label].to(original.dtype)
                kl[name][label] = max(0.0, _kl(ref_logp, logits_from(b)))
        finally:
            lin.weight.data = original
        for label in options:
            if label not in kl[name]:
                ratio = energy[label] / energy[lowest] if energy[lowest] > 0 else 0.0
                kl[name][label] = kl[name][lowest] * ratio
        if on_layer is not None:
            on_layer(name)
    return SensitivityTable(kl, params, int(input_ids.numel()), measured)
