"""The kernel registry and the one entry point, :func:`build_linear`.

``KERNELS`` maps a name to a :class:`LinearKernel` class; its order is the preference order
``auto`` walks (fast packed kernels first, ``dense`` and the ``dequant`` fallback last). Each
kernel answers "can you run (scheme, device, dtype, shape), and if not why" before anything is
built, so an explicit choice that cannot run fails with the reason instead of running slowly.
"""

from __future__ import annotations

import logging

import torch

from optkit.kernels.base import KernelUnavailableError, LinearKernel, dtype_label, scheme_label
from optkit.kernels.cpu import CpuInt4Pack, CpuInt8Pack
from optkit.kernels.cuda import CudaInt4Tinygemm, CudaInt8WeightOnly
from optkit.kernels.intmm import CpuW8A8IntMM, CudaW8A8IntMM
from optkit.kernels.reference import DenseLinear, DequantLinear
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

log = logging.getLogger("optkit.kernels")

#: name -> kernel class, in preference order.
KERNELS: dict[str, type[LinearKernel]] = {}


def register_kernel(cls: type[LinearKernel]) -> type[LinearKernel]:
    """Add ``cls`` after the kernels already registered (so below them in preference)."""
    if not (isinstance(cls, type) and issubclass(cls, LinearKernel)) or not cls.name:
        raise TypeError(f"{cls!r} is not a LinearKernel subclass with a name")
    if cls.name in KERNELS:
        raise ValueError(f"kernel {cls.name!r} is already registered (by {KERNELS[cls.name].__qualname__})")
    KERNELS[cls.name] = cls
    return cls


for _cls in (
    CudaW8A8IntMM,
    CudaInt4Tinygemm,
    CudaInt8WeightOnly,
    CpuW8A8IntMM,
    CpuInt4Pack,
    CpuInt8Pack,
    DenseLinear,
    DequantLinear,  # last: runs everything, slowly
):
    register_kernel(_cls)


def kernel_candidates(
    scheme: QuantScheme | None,
    device: torch.device | str,
    dtype: torch.dtype,
    shape: tuple[int, int] | None = None,
) -> list[tuple[str, str | None]]:
    """Every registered kernel in preference order with the reason it cannot run this
    ``scheme`` (``None`` = float weight) on ``device`` in ``dtype`` (``None`` if it can).
    ``shape`` ``(out, in)``, when given, adds the kernels' shape constraints."""
    device = torch.device(device)
    return [(name, cls.unavailable_reason(scheme, device, dtype, shape)) for name, cls in KERNELS.items()]


def _situation(scheme: QuantScheme | None, device: torch.device, dtype: torch.dtype, shape) -> str:
    return f"{scheme_label(scheme)} weight {tuple(shape)} on {device} in {dtype_label(dtype)}"


def build_linear(
    qw: QuantizedWeight | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    device: torch.device | str,
    dtype: torch.dtype,
    kernel: str = "auto",
) -> LinearKernel:
    """A :class:`LinearKernel` computing ``x @ W^T + bias`` in ``dtype`` on ``device``.

    Exactly one of ``qw`` (integer codes, scales, zero points and scheme) or ``weight`` (float
    ``(out, in)``) is given. ``kernel="auto"`` takes the first registered kernel that can run
    it; a name runs that kernel or raises :class:`KernelUnavailableError` with its reason.
    When ``auto`` finds only the ``dequant`` fallback it logs a warning (``optkit.kernels``)
    and the kernel has ``slow_path=True``.
    """
    if (qw is None) == (weight is None):
        raise ValueError("build_linear takes exactly one of qw (quantized) or weight (float)")
    device = torch.device(device)
    scheme = None if qw is None else qw.scheme
    shape = tuple((weight if qw is None else qw.q).shape)
    if len(shape) != 2:
        raise ValueError(f"a linear weight is 2-D (out, in), got shape {shape}")
    if bias is not None and tuple(bias.shape) != (shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match out_features {shape[0]}")
    candidates = kernel_candidates(scheme, device, dtype, shape)
    situation = _situation(scheme, device, dtype, shape)
    runnable = [name for name, reason in candidates if reason is None]

    if kernel == "auto":
        if not runnable:
            reasons = "; ".join(f"{n}: {r}" for n, r in candidates)
            raise KernelUnavailableError(f"no kernel can run a {situation} ({reasons})")
        name = runnable[0]
    elif kernel not in KERNELS:
        raise KernelUnavailableError(f"unknown kernel {kernel!r}; valid names: auto, {', '.join(KERNELS)}")
    else:
        reason = dict(candidates)[kernel]
        if reason is not None:
            raise KernelUnavailableError(
                f"kernel {kernel!r} cannot run a {situation}: {reason}",
                hint=f"kernels that can: {', '.join(runnable) or 'none'} (or kernel='auto')",
            )
        name = kernel

    built = KERNELS[name].build(qw, weight, bias, device, dtype)
    if kernel == "auto" and built.slow_path:
        why = "; ".join(f"{n}: {r}" for n, r in candidates if r is not None and n.startswith(f"{device.type}-"))
        log.warning(
            "no fast kernel for %s on %s (%s): using the slow dequantize path, which rebuilds the float weight on every call (%s)",
            scheme_label(scheme),
            device,
            dtype_label(dtype),
            why or "none registered for this device",
        )
    return built
