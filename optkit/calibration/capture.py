"""Layer-by-layer capture: block inputs, and statistics of linear inputs.

The model is never run whole on the calibration set. The embeddings run once to capture
the first decoder block's inputs (hidden states plus the keyword arguments the model passes
to every block: rotary embeddings, masks); after that each block runs on its own, and its
outputs become the next block's inputs. Only one block's inputs and outputs are alive at a
time (optionally on disk), so peak memory is about one block plus its activations.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from optkit.quantize.algorithms.gptq import accumulate_hessian


class _Stop(Exception):
    """Raised by a hook to end a forward pass once everything needed has been seen."""


@dataclass
class InputStats:
    """Statistics of the inputs ``x`` (..., in) of one or more linears that share them.

    ``H``: ``sum x x^T`` (in, in) when ``hessian``; ``absmax`` / ``abs_sum``: per channel (in,);
    ``n``: tokens seen.
    """

    hessian: bool
    absolute: bool = True
    H: torch.Tensor | None = None
    absmax: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    n: int = 0

    def add(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).float()  # (N, in)
        if self.hessian:
            with torch.autocast(x2.device.type, enabled=False):  # the Hessian is always summed in float32
                self.H = accumulate_hessian(self.H, x2)
        if self.absolute:
            a = x2.abs()
            amax, asum = a.amax(dim=0), a.sum(dim=0)
            self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
            self.abs_sum = asum if self.abs_sum is None else self.abs_sum + asum
        self.n += x2.shape[0]

    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.n, 1)

    def energy(self) -> torch.Tensor:
        """Mean ``x^2`` per channel (the importance matrix), from the Hessian's diagonal."""
        return torch.diag(self.H) / max(self.n, 1)

    def rescale(self, s: torch.Tensor) -> None:
        """The statistics of ``x / s`` (after a scale was folded into the producer of ``x``)."""
        s = s.float()
        if self.H is not None:
            self.H = self.H / s.unsqueeze(0) / s.unsqueeze(1)
        if self.absmax is not None:
            self.absmax = self.absmax / s
            self.abs_sum = self.abs_sum / s


@dataclass
class BlockInputs:
    """Per batch: the block's hidden states (b, L, d) and the keyword arguments it is called with.

    ``compute_dtype``: bfloat16 runs the blocks' matmuls under autocast (weights stay float32,
    statistics are accumulated in float32); float32 runs everything in float32.

    With ``offload_dir`` the hidden states live in safetensors files and are read back one
    batch at a time; the keyword arguments (rotary tables, masks) stay in memory.
    """

    kwargs: list[dict]
    _hidden: list[torch.Tensor] = field(default_factory=list)
    offload_dir: Path | None = None
    compute_dtype: torch.dtype = torch.float32

    def __len__(self) -> int:
        return len(self.kwargs)

    def set_hidden(self, i: int, h: torch.Tensor) -> None:
        h = h.detach().contiguous()
        if self.offload_dir is not None:
            save_file({"h": h}, str(self.offload_dir / f"h{i}.safetensors"))
            h = torch.empty(0)
        if i < len(self._hidden):
            self._hidden[i] = h
        else:
            self._hidden.append(h)

    def hidden(self, i: int) -> torch.Tensor:
        if self.offload_dir is not None:
            return load_file(str(self.offload_dir / f"h{i}.safetensors"))["h"]
        return self._hidden[i]

    def batches(self) -> Iterator[tuple[torch.Tensor, dict]]:
        for i in range(len(self)):
            yield self.hidden(i), self.kwargs[i]

    def all_hidden(self) -> torch.Tensor:
        return torch.cat([self.hidden(i) for i in range(len(self))])


def _block_kwargs(kwargs: dict) -> dict:
    out = dict(kwargs)
    out.pop("hidden_states", None)
    out["use_cache"] = False
    for k in ("past_key_values", "past_key_value", "layer_past"):
        if k in out:
            out[k] = None
    return out


def autocast(dtype: torch.dtype, device: torch.device):
    """Mixed-precision context for the calibration forwards (a no-op for float32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def capture_first_inputs(
    model: nn.Module,
    blocks: nn.ModuleList,
    input_ids: torch.Tensor,
    batch_size: int,
    offload: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> BlockInputs:
    """Run the model up to the first block on every batch of ``input_ids`` (N, L)."""
    kwargs_list: list[dict] = []
    hidden_list: list[torch.Tensor] = []

    def pre_hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden_list.append(hidden.detach())
        kwargs_list.append(_block_kwargs(kwargs))
        raise _Stop

    handle = blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        for batch in input_ids.split(batch_size):
            try:
                model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    offload_dir = Path(tempfile.mkdtemp(prefix="optkit-offload-")) if offload else None
    inputs = BlockInputs(kwargs_list, offload_dir=offload_dir, compute_dtype=compute_dtype)
    for i, h in enumerate(hidden_list):
        inputs.set_hidden(i, h)
    return inputs


def run_block(block: nn.Module, hidden: torch.Tensor, kwargs: dict, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with autocast(compute_dtype, hidden.device):
        out = block(hidden, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return out.to(hidden.dtype)


def execution_groups(block: nn.Module, names: list[str], inputs: BlockInputs) -> list[list[str]]:
    """The linears ``names`` (relative to ``block``) in execution order, grouped by shared input
    (q/k/v read one tensor, gate/up another), from one batch through the block."""
    # Keep the input tensors themselves alive for the whole pass: comparing addresses alone would
    # group two linears whose inputs merely reused the same freed memory.
    order: list[tuple[str, torch.Tensor]] = []
    handles = []
    for n in names:
        def pre(_m, args, n=n):
            order.append((n, args[0]))
        handles.append(block.get_submodule(n).register_forward_pre_hook(pre))
    try:
        h, kw = next(inputs.batches())
        run_block(block, h, kw, inputs.compute_dtype)
    finally:
        for hd in handles:
            hd.remove()
    groups: list[list[str]] = []
    last_input = None
    seen = set()
    for n, x in order:
        if n in seen:
            continue
        seen.add(n)
        if groups and x is last_input:
            groups[-1].append(n)
        else:
            groups.append([n])
        last_input = x
    order.clear()
    missing = [n for n in names if n not in seen]
    if missing:
        groups.append(missing)  # never called on calibration data; the token check reports them
    return groups


def collect_stats(
    block: nn.Module, groups: list[list[str]], inputs: BlockInputs, hessian: bool, absolute: bool = False
) -> dict[str, InputStats]:
    """One pass over every batch; statistics per group of linears sharing an input (keyed by the
    group's first name). The pass stops after the last group's linears have read their input."""
    stats = {g[0]: InputStats(hessian=hessian, absolute=absolute) for g in groups}
    stop_at = groups[-1][0]
    handles = []
    for g in groups:
        def pre(_m, args, key=g[0]):
            stats[key].add(args[0])
            if key == stop_at:
                raise _Stop  # nothing after this input is needed
        handles.append(block.get_submodule(g[0]).register_forward_pre_hook(pre))
    try:
        for h, kw in inputs.batches():
            try:
                run_block(block, h, kw, inputs.compute_dtype)
            except _Stop:
                pass
    finally:
        for hd in handles:
            hd.remove()
    return stats


def propagate(block: nn.Module, inputs: BlockInputs) -> BlockInputs:
    """The block's outputs on every batch: the next block's inputs (same keyword arguments)."""
    out = BlockInputs(inputs.kwargs, offload_dir=inputs.offload_dir, compute_dtype=inputs.compute_dtype)
    for i, (h, kw) in enumerate(inputs.batches()):
        out.set_hidden(i, run_block(block, h, kw, inputs.compute_dtype))
    return out


@dataclass
class PairStats:
    """Statistics of a linear's input in the quantized model ``x'`` and the float model ``x``
    on the same tokens: ``H = sum x'^T x'`` and ``D = sum (x - x')^T x'`` (both (in, in))."""

    stats: InputStats
    D: torch.Tensor | None = None


def collect_pair_stats(
    block: nn.Module, float_block: nn.Module, name: str, inputs: BlockInputs, float_inputs: BlockInputs
) -> PairStats:
    """One pass over every batch through both the (partially quantized) block and the float
    block, stopping each at ``name``'s input."""
    st = InputStats(hessian=True, absolute=False)
    pair = PairStats(st)
    seen: dict[str, torch.Tensor] = {}

    def grab(key):
        def pre(_m, args):
            seen[key] = args[0].detach()
            raise _Stop
        return pre

    h1 = block.get_submodule(name).register_forward_pre_hook(grab("q"))
    h2 = float_block.get_submodule(name).register_forward_pre_hook(grab("f"))
    try:
        for (h, kw), (hf, kwf) in zip(inputs.batches(), float_inputs.batches(), strict=False):
            for blk, hh, kk in ((block, h, kw), (float_block, hf, kwf)):
                try:
                    run_block(blk, hh, kk, inputs.compute_dtype)
                except _Stop:
                    pass
            xq = seen["q"].reshape(-1, seen["q"].shape[-1]).float()  # (N, in)
            xf = seen["f"].reshape(-1, seen["f"].shape[-1]).float()
            st.add(xq)
            with torch.autocast(xq.device.type, enabled=False):
                if pair.D is None:
                    pair.D = torch.zeros(xq.shape[1], xq.shape[1])
                pair.D.addmm_((xf - xq).T, xq)
    finally:
        h1.remove()
        h2.remove()
    return pair
