"""Tiny models and helpers shared by tests and benchmarks (no hub, no downloads)."""
