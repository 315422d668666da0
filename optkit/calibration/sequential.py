"""The layer-by-layer driver: calibration statistics in, quantized blocks out.

For each decoder block, in order:

1. (AWQ / SmoothQuant) one pass collects the statistics of every linear input on the float
   block; scales are searched and folded into the producers (function-preserving);
2. the block's linears are quantized: GPTQ in true-sequential order (each group of linears
   that share an input is calibrated on inputs that already went through the quantized
   groups before it), or round-to-nearest with the chosen observer / AWQ clipping;
3. the quantized block runs on its inputs: its outputs are the next block's inputs, so each
   block is calibrated on what the quantized model really feeds it (error propagation);
4. the finished block and the next inputs are checkpointed (resume).

The algorithms themselves are pure functions in :mod:`optkit.quantize.algorithms`; this
module only moves tensors between them and the model.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from optkit.calibration.capture import (
    BlockInputs,
    InputStats,
    capture_first_inputs,
    collect_pair_stats,
    collect_stats,
    execution_groups,
    propagate,
)
from optkit.calibration.resume import ResumeStore
from optkit.errors import CalibrationError
from optkit.quantize.algorithms.awq import search_clip, search_scales
from optkit.quantize.algorithms.gptq import correct_for_input_error, gptq_quantize, output_error, refine_scales
from optkit.quantize.algorithms.smoothquant import smooth_scales
from optkit.quantize.mappings import block_mappings, decoder_blocks, fold_scales
from optkit.quantize.modules import QuantizedLinear
from optkit.quantize.observers import get_observer
from optkit.quantize.primitives import compute_qparams, dequantize, quantize
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme
from optkit.recipe import QuantizationConfig


@dataclass
class SequentialReport:
    """What the calibrated pass did, for the summary and the manifest.

    ``layers``: module name -> {output_error, output_error_rtn, tokens, damp, ...};
    ``transforms``: block index -> mapping -> {alpha | max scale}; ``warnings``: things the
    user must know (Cholesky retries); ``resumed_from``: first block computed in this run.
    """

    layers: dict[str, dict] = field(default_factory=dict)
    transforms: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    resumed_from: int = 0
    blocks: int = 0


def _check_tokens(name: str, st: InputStats, in_features: int, needs_hessian: bool) -> None:
    need = in_features if needs_hessian else 1
    if st.n < need:
        why = f"at least {need} (its input width, for a full-rank Hessian)" if needs_hessian else "at least 1"
        raise CalibrationError(
            f"layer {name} saw {st.n} calibration tokens; it needs {why}",
            hint="raise calibration.num_samples or calibration.seq_len",
        )


def _replace(block: nn.Module, local: str, qw: QuantizedWeight) -> None:
    parent_name, _, child = local.rpartition(".")
    parent = block.get_submodule(parent_name) if parent_name else block
    old = getattr(parent, child)
    setattr(parent, child, QuantizedLinear(qw, old.bias))


def _rtn_weight(W: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> torch.Tensor:
    s, z = compute_qparams(W, scheme, scale_dtype)
    return dequantize(quantize(W, s, z, scheme), s, z, scheme)


class BlockQuantizer:
    """Quantizes one block at a time with the recipe's algorithm (see the module docstring)."""

    def __init__(self, model: nn.Module, q: QuantizationConfig, scale_dtype: torch.dtype, report: SequentialReport):
        self.model = model
        self.q = q
        self.scale_dtype = scale_dtype
        self.report = report
        self.observer = get_observer(q.resolved_observer())
        self._groups: dict[tuple[str, ...], list[list[str]]] = {}

    def _transform(self, i: int, block: nn.Module, groups: list[list[str]], stats: dict[str, InputStats],
                   schemes: dict[str, QuantScheme], prefix: str) -> None:
        q = self.q
        purpose = "AWQ" if q.algorithm == "awq" else "SmoothQuant"
        key_of = {n: g[0] for g in groups for n in g}
        done = {}
        for m in block_mappings(self.model, block, purpose):
            planned = [n for n in m.linears if n in schemes]
            if not planned or m.linears[0] not in key_of:
                continue
            st = stats[key_of[m.linears[0]]]
            lins = [block.get_submodule(n) for n in m.linears]
            _check_tokens(prefix + m.linears[0], st, lins[0].in_features, needs_hessian=q.algorithm == "awq")
            if q.algorithm == "awq":
                res = search_scales([block.get_submodule(n).weight.data for n in planned], st.H, st.mean_abs(),
                                    schemes[planned[0]], self.scale_dtype, grid=q.awq.grid)
                s = res.scales
                done[f"{m.prev} -> {','.join(m.linears)}"] = {
                    "alpha": res.alpha,
                    "error_reduction": 1 - res.error / res.error_unscaled if res.error_unscaled > 0 else 0.0,
                }
            else:
                s = smooth_scales(st.absmax, [lin.weight.data for lin in lins], q.smoothquant.alpha)
                done[f"{m.prev} -> {','.join(m.linears)}"] = {
                    "alpha": q.smoothquant.alpha,
                    "absmax_before": float(st.absmax.max()),
                    "absmax_after": float((st.absmax / s).max()),
                }
            fold_scales(block.get_submodule(m.prev), lins, s)
            st.rescale(s)
        self.report.transforms[str(i)] = done

    def quantize_block(self, i: int, block: nn.Module, inputs: BlockInputs, schemes: dict[str, QuantScheme], prefix: str,
                       float_block: nn.Module | None = None, float_inputs: BlockInputs | None = None) -> None:
        """Quantize the linears ``schemes`` (names relative to the block) of block ``i`` in place.
        With ``float_block`` / ``float_inputs`` (error correction) each group is fitted to the
        float model's outputs."""
        q = self.q
        all_linears = tuple(n for n, m in block.named_modules() if isinstance(m, nn.Linear))
        if all_linears not in self._groups:  # blocks of one model share their structure: trace it once
            self._groups[all_linears] = execution_groups(block, list(all_linears), inputs)
        groups = self._groups[all_linears]
        needs_h = q.algorithm in ("gptq", "awq") or q.resolved_importance()
        stats: dict[str, InputStats] | None = None
        if q.algorithm == "awq" or q.smoothquant is not None:
            # the Hessian also gives every layer's output error for the report, whatever the algorithm
            stats = collect_stats(block, groups, inputs, hessian=True, absolute=True)
            self._transform(i, block, groups, stats, schemes, prefix)
        planned_groups = [[n for n in g if n in schemes] for g in groups]
        planned_groups = [g for g, pg in zip(groups, planned_groups, strict=False) if pg]
        if q.algorithm == "gptq" and float_block is not None:
            for g in planned_groups:
                pair = collect_pair_stats(block, float_block, g[0], inputs, float_inputs)
                self._quantize_group(block, g, pair.stats, schemes, prefix, D=pair.D)
            return
        if q.algorithm == "gptq" and q.gptq.true_sequential:
            for g in planned_groups:
                st = collect_stats(block, [g], inputs, hessian=True)[g[0]]
                self._quantize_group(block, g, st, schemes, prefix)
            return
        if stats is None and needs_h:
            stats = collect_stats(block, groups, inputs, hessian=True)
        for g in planned_groups:
            self._quantize_group(block, g, stats[g[0]] if stats else None, schemes, prefix)

    def _quantize_group(self, block: nn.Module, group: list[str], st: InputStats | None,
                        schemes: dict[str, QuantScheme], prefix: str, D: torch.Tensor | None = None) -> None:
        q = self.q
        for local in group:
            if local not in schemes:
                continue
            name = prefix + local
            lin = block.get_submodule(local)
            W = lin.weight.data.float()
            scheme = schemes[local]
            info: dict = {"scheme": scheme.label()}
            if st is not None:
                _check_tokens(name, st, lin.in_features, needs_hessian=st.H is not None)
                info["tokens"] = st.n
            importance = st.energy() if (q.resolved_importance() and st is not None) else None
            W_float = W
            if q.algorithm == "gptq":
                if D is not None:
                    W = correct_for_input_error(W, st.H, D, q.gptq.error_correction, q.gptq.damp)
                res = gptq_quantize(W, st.H, scheme, self.scale_dtype, damp=q.gptq.damp, block_size=q.gptq.block_size,
                                    act_order=q.gptq.act_order, observer=self.observer, importance=importance)
                qw = res.weight
                if q.gptq.refine_scales:
                    qw = refine_scales(W, qw, st.H)
                info["damp"] = res.damp
                if res.retries:
                    self.report.warnings.append(
                        f"{name}: Cholesky factorization failed at dampening {q.gptq.damp:g}; "
                        f"succeeded after {res.retries} retr{'y' if res.retries == 1 else 'ies'} at {res.damp:g}"
                    )
            elif q.algorithm == "awq" and q.awq.clip:
                s, z = search_clip(W, st.H, scheme, self.scale_dtype, grid=q.awq.clip_grid, max_shrink=q.awq.max_shrink)
                qw = QuantizedWeight(quantize(W, s, z, scheme), s, z, scheme)
            else:
                s, z = self.observer(W, scheme, self.scale_dtype, importance)
                qw = QuantizedWeight(quantize(W, s, z, scheme), s, z, scheme)
            if st is not None and st.H is not None:
                info["output_error"] = output_error(W, qw.dequantize(), st.H)
                info["output_error_rtn"] = output_error(W_float, _rtn_weight(W_float, scheme, self.scale_dtype), st.H)
            self.report.layers[name] = info
            _replace(block, local, qw)


def quantize_sequential(
    model: nn.Module,
    input_ids: torch.Tensor,
    schemes: dict[str, QuantScheme],
    q: QuantizationConfig,
    scale_dtype: torch.dtype,
    *,
    batch_size: int,
    offload: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    resume: ResumeStore | None = None,
    on_block: Callable[[int, int], None] | None = None,
) -> SequentialReport:
    """Quantize every planned linear inside the decoder blocks (``schemes``: full module name ->
    scheme; names outside the blocks are ignored: the caller rounds those). ``on_block(i, n)``
    is called after block ``i`` of ``n`` is finished and checkpointed."""
    blocks = decoder_blocks(model)
    blocks_name = next(n for n, m in model.named_modules() if m is blocks)
    report = SequentialReport(blocks=len(blocks))
    bq = BlockQuantizer(model, q, scale_dtype, report)
    inputs = capture_first_inputs(model, blocks, input_ids, batch_size, offload=offload, compute_dtype=compute_dtype)
    float_inputs = None
    try:
        if q.algorithm == "gptq" and q.gptq.error_correction > 0:
            # A second stream: what the float model feeds each block (the targets of error correction).
            float_inputs = BlockInputs(inputs.kwargs, compute_dtype=compute_dtype,
                                       offload_dir=Path(tempfile.mkdtemp(prefix="optkit-offload-")) if offload else None)
            for j in range(len(inputs)):
                float_inputs.set_hidden(j, inputs.hidden(j).clone())
        start = 0
        if resume is not None:
            start = resume.restore(blocks, blocks_name, inputs, report, float_inputs)
            report.resumed_from = start
        for i in range(start, len(blocks)):
            block = blocks[i]
            prefix = f"{blocks_name}.{i}."
            local = {n[len(prefix):]: s for n, s in schemes.items() if n.startswith(prefix)}
            float_block = copy.deepcopy(block) if float_inputs is not None else None
            if local:
                bq.quantize_block(i, block, inputs, local, prefix, float_block, float_inputs)
            if i < len(blocks) - 1:  # the last block's outputs feed nothing
                inputs = propagate(block, inputs)
                if float_inputs is not None:
                    float_inputs = propagate(float_block, float_inputs)
                if resume is not None:
                    resume.save(i, block, prefix, inputs, report, float_inputs)
            if on_block is not None:
                on_block(i, len(blocks))
    finally:  # offloaded activations are scratch space: never leave them behind
        for stream in (inputs, float_inputs):
            if stream is not None and stream.offload_dir is not None:
                shutil.rmtree(stream.offload_dir, ignore_errors=True)
    return report
