"""Greedy samples: the same prompts answered by each variant, for a side-by-side reading.

Greedy decoding (``do_sample=False``, one beam) makes every sample a function of the weights
alone, so two runs of one model give the same text and the differences between variants are
the quantization's. Prompts run one at a time: batching would pad them, and padding changes
the float rounding of a row (and thus, now and then, a greedy token) with its neighbours.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from optkit.errors import UserError

CHAT_TEMPLATE_MODES = ("auto", "always", "never")


def _use_chat_template(tokenizer: Any, mode: str) -> bool:
    if mode not in CHAT_TEMPLATE_MODES:
        raise UserError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "always" and not has_template:
        raise UserError(
            "chat_template is 'always' but the tokenizer has no chat template",
            hint="use 'auto' (apply it when there is one) or 'never'",
        )
    return has_template and mode != "never"


def prompt_ids(tokenizer: Any, prompt: str, chat_template: str = "auto") -> list[int]:
    """Token ids fed to the model for ``prompt``: with the chat template, one user turn and the
    assistant's generation prompt (the template writes any BOS itself, so none is added);
    without it, the text as the tokenizer encodes it by default."""
    if _use_chat_template(tokenizer, chat_template):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _greedy_config(model: Any, tokenizer: Any, max_new_tokens: int) -> Any:
    """The model's generation config with sampling switched off (its temperature / top-p /
    top-k would otherwise only warn) and a pad id, so generate() does not warn about it."""
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    gen = copy.deepcopy(base) if base is not None else GenerationConfig()
    gen.do_sample = False
    gen.num_beams = 1
    gen.temperature = None
    gen.top_p = None
    gen.top_k = None
    gen.max_new_tokens = max_new_tokens
    gen.max_length = None
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else gen.eos_token_id
    return gen


def greedy_samples(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 48,
    chat_template: str = "auto",
) -> list[dict[str, str]]:
    """``[{"prompt": prompt, "text": completion}]``, one per prompt, in order.

    ``chat_template``: ``"auto"`` applies the tokenizer's chat template when it has one,
    ``"always"`` requires one, ``"never"`` feeds the raw prompt. ``text`` is the decoded new
    tokens (special tokens dropped), stopping at the model's EOS or after ``max_new_tokens``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if model.training:
        raise ValueError("the model is in training mode; call model.eval() before sampling from it")
    device = next(model.parameters()).device
    gen = _greedy_config(model, tokenizer, max_new_tokens)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, prompt, chat_template)], device=device)  # (1, T)
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)  # (1, T + N)
            text = tokenizer.decode(seq[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
            out.append({"prompt": prompt, "text": text})
    return out
