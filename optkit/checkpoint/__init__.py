"""Checkpoint loading: HF directory, GGUF file, hub id, or the embedded default model."""

from optkit.checkpoint.loader import LoadedCheckpoint, load_checkpoint

__all__ = ["LoadedCheckpoint", "load_checkpoint"]
