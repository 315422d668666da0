"""Artifact export (atomic writer) and reading/verification (version-checked reader)."""

from optkit.export.reader import load_dequantized_model, load_quantized_weights, read_manifest, verify_artifact
from optkit.export.writer import ArtifactInfo, write_artifact

__all__ = [
    "ArtifactInfo",
    "load_dequantized_model",
    "load_quantized_weights",
    "read_manifest",
    "verify_artifact",
    "write_artifact",
]
