"""Tiny random Llama checkpoints built in code.

The tokenizer is byte-level (256 byte symbols + ChatML specials, no merges), so it needs no
training data and always gives the same ids.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.chat_template = CHATML
    return fast


def tiny_llama(
    vocab_size: int,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = True,
    seed: int = 0,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a wider init than the default 0.02, so quantization error is visible
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def save_tiny_checkpoint(path: str | Path, dtype: torch.dtype = torch.bfloat16, **model_kw) -> Path:
    """A Hugging Face directory (safetensors + tokenizer) holding a tiny random Llama."""
    path = Path(path)
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), **model_kw).to(dtype)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path
