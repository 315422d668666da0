"""Attention backends. ``paged``: prefill through SDPA, decode through a paged KV cache."""
