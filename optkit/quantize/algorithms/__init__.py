"""Quantization algorithms as pure functions on tensors (no hooks, no I/O).

The layer-by-layer driver that feeds them calibration statistics is
:mod:`optkit.calibration.sequential`.
"""
