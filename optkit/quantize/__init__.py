"""Quantization: schemes, pure primitives, algorithms, quantized modules, layer plans."""

from optkit.quantize.scheme import QuantScheme

__all__ = ["QuantScheme"]
