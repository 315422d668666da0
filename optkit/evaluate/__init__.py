"""Model quality: perplexity on held-out text and drift from a reference model."""

from optkit.evaluate.quality import QualityResult, ReferenceLogits, evaluate, load_text_tokens, make_windows

__all__ = ["QualityResult", "ReferenceLogits", "evaluate", "load_text_tokens", "make_windows"]
