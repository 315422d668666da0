"""Calibration data: text sources -> seeded, fingerprinted token windows."""

from optkit.calibration.data import CalibrationSet, build_calibration, builtin_dir

__all__ = ["CalibrationSet", "build_calibration", "builtin_dir"]
