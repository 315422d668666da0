"""The engine end to end on tiny models built in code: greedy tokens equal transformers'
``generate`` exactly, and stay equal under batching, chunked prefill, prefix hits and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from optkit.errors import UserError
from optkit.serve.engine import EngineConfig, LLMEngine
from optkit.serve.loader import source_from_model
from optkit.serve.request import InvalidRequestError, SamplingParams
from optkit.testing.tiny import tiny_llama, tiny_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(model, tok, **cfg) -> LLMEngine:
    base = {"device": "cpu", "dtype": "float32", "kv_cache_memory": "64MiB", "block_size": 4, "max_model_len": 256}
    return LLMEngine(source_from_model(model, tok), EngineConfig(**(base | cfg)))


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def llama(tok):
    return tiny_llama(len(tok), hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)


def test_greedy_equals_transformers_generate(llama, tok):
    prompts = _prompts(5, len(tok))
    eng = _engine(llama, tok)
    assert eng.native and eng.model.kernel_names() == {"dense": 8, "dense (head)": 1}
    outs = eng.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _hf_greedy(llama, p, GREEDY.max_tokens)


def _tiny(arch: str, tok, **extra):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    config = cls(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, **extra,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize(
    "arch,extra",
    [("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8})],
    ids=["qwen2-qkv-bias", "qwen3-qk-norm", "mistral-sliding-window"],
)
def test_other_llama_family_members_match_transformers(tok, arch, extra):
    model = _tiny(arch, tok, **extra)
    prompts = _prompts(3, len(tok), seed=3, lo=5, hi=30)
    eng = _engine(model, tok)
    assert eng.native
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _hf_greedy(model, p, 16)


def test_batch_of_16_gives_each_request_its_solo_tokens(llama, tok):
    prompts = _prompts(16, len(tok), seed=1, lo=2, hi=90)
    solo = [_engine(llama, tok).generate([p], GREEDY)[0].token_ids for p in prompts[:3]]
    batched = _engine(llama, tok).generate(prompts, GREEDY)
    assert [o.token_ids for o in batched[:3]] == solo


def test_chunked_prefill_and_preemption_keep_tokens(llama, tok):
    prompts = _prompts(6, len(tok), seed=2, lo=20, hi=70)
    ref = [o.token_ids for o in _engine(llama, tok).generate(prompts, GREEDY)]
    chunked = _engine(llama, tok, max_num_batched_tokens=16)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == ref
    # a pool of 40 blocks x 4 tokens cannot hold 6 requests of up to 94 tokens: the newest get preempted
    tight = LLMEngine(
        source_from_model(llama, tok),
        EngineConfig(device="cpu", dtype="float32", block_size=4, max_model_len=256,
                     kv_cache_memory=40 * 4 * _engine(llama, tok).kv_bytes_per_token),
    )
    assert tight.kv.num_blocks == 40
    assert [o.token_ids for o in tight.generate(prompts, GREEDY)] == ref
    assert tight.scheduler.num_preemptions > 0
    assert tight.kv.num_free_blocks == tight.kv.num_blocks


def test_prefix_cache_hit_gives_cold_tokens(llama, tok):
    shared = _prompts(1, len(tok), seed=4, lo=40, hi=40)[0]
    tails = _prompts(3, len(tok), seed=5, lo=1, hi=9)
    prompts = [shared + t for t in tails]
    cold = [o.token_ids for o in _engine(llama, tok, enable_prefix_caching=False).generate(prompts, GREEDY)]
    eng = _engine(llama, tok)
    first = eng.generate(prompts[:1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    rest = eng.generate(prompts[1:], GREEDY)
    assert all(o.num_cached_tokens == 40 for o in rest)  # 10 full blocks of 4 shared tokens
    assert [first.token_ids] + [o.token_ids for o in rest] == cold


def test_transformers_fallback_for_other_architectures(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=256,
                                       bos_token_id=1, eos_token_id=2)).eval()
    eng = _engine(model, tok)
    assert not eng.native and "GPT2LMHeadModel" in eng.fallback_reason
    prompts = _prompts(3, len(tok), seed=6, lo=4, hi=20)
    for p, o in zip(prompts, eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0)), strict=True):
        assert o.token_ids == _hf_greedy(model, p, 12)
    from optkit.serve.bench import BenchSettings, run_bench

    r = run_bench(eng, BenchSettings(prompt_lens=(8,), batch_sizes=(2,), decode_tokens=3, offline_requests=2,
                                     repeats=1, warmup=0, probe_bandwidth=False))
    assert r["engine"] == "transformers-fallback" and "GPT2LMHeadModel" in r["fallback_reason"]
    assert r["decode"][0]["tok_s"]["median"] > 0


def test_stop_strings_and_text(llama, tok):
    eng = _engine(llama, tok)
    full = eng.generate(["hello world"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[5:8]
    assert stop and stop not in full.text[:5]
    cut = eng.generate(["hello world"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    tid = full.token_ids[4]
    at = full.token_ids.index(tid)
    by_id = eng.generate(["hello world"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(tid,)))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[: at + 1]
    assert by_id.text == tok.decode(full.token_ids[:at], skip_special_tokens=True)  # the stop token's text is not output
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_streamed_deltas_reassemble_and_seeded_sampling_repeats(llama, tok):
    eng = _engine(llama, tok)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=True)
    rid = eng.add_request("abc", params)
    deltas, final = [], None
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == rid
            deltas.append(o.new_text)
            final = o
    assert "".join(deltas) == final.text and len(final.logprobs) == 16
    again = eng.generate(["abc"], params)[0]
    assert again.token_ids == final.token_ids


def test_bad_requests_are_rejected_and_leak_no_blocks(llama, tok):
    eng = _engine(llama, tok, max_model_len=64)
    total = eng.kv.num_blocks
    for bad in (
        SamplingParams(max_tokens=0), SamplingParams(max_tokens=-3), SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5), SamplingParams(temperature=-1.0),
    ):
        with pytest.raises(InvalidRequestError):
            eng.add_request([5, 6, 7], bad)
    with pytest.raises(InvalidRequestError, match="64"):
        eng.add_request(list(range(3, 70)), SamplingParams())
    with pytest.raises(InvalidRequestError):
        eng.add_request([], SamplingParams())
    assert eng.kv.num_free_blocks == total and not eng.has_unfinished()
    # a running request that reaches the context limit finishes with "length"
    o = eng.generate([list(range(3, 60))], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 64 - 57
    assert eng.kv.num_free_blocks == total


def test_abort_frees_blocks_at_once(llama, tok):
    eng = _engine(llama, tok)
    total = eng.kv.num_blocks
    ids = [eng.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in _prompts(4, len(tok), seed=8)]
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks < total
    for rid in ids:
        assert eng.abort(rid)
    assert eng.kv.num_free_blocks == total and not eng.has_unfinished()
    assert eng.step() == [] and not eng.abort(ids[0])  # an empty step after aborts; a second abort is a no-op


def test_kv_budget_is_respected_and_unusable_budget_is_an_error(llama, tok):
    eng = _engine(llama, tok, kv_cache_memory="1MiB")
    assert eng.cache.nbytes <= 1 << 20
    assert eng.cache.nbytes > (1 << 20) - eng.kv_bytes_per_token * eng.config.block_size
    with pytest.raises(UserError, match="holds no block"):
        _engine(llama, tok, kv_cache_memory=100)
    with pytest.raises(UserError, match="not understood"):
        _engine(llama, tok, kv_cache_memory="lots")


def test_compiled_decode_step_gives_eager_tokens(llama, tok):
    prompts = _prompts(3, len(tok), seed=9, lo=3, hi=40)
    eager = [o.token_ids for o in _engine(llama, tok).generate(prompts, GREEDY)]
    eng = _engine(llama, tok, compile=True)
    assert eng.model.compiled
    eng.warmup()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks  # the warm-up leaves nothing behind
    assert [o.token_ids for o in eng.generate(prompts[:1], GREEDY)] == eager[:1]  # batch 1 graph
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == eager  # batch >= 2 graph


def test_decode_attention_backends_give_the_same_tokens(llama, tok):
    prompts = _prompts(3, len(tok), seed=10, lo=3, hi=40)
    auto = _engine(llama, tok)
    assert auto.decode_attention == "gather-sdpa"  # CPU: the gather measured fastest
    ref = [o.token_ids for o in auto.generate(prompts, GREEDY)]
    flex = _engine(llama, tok, decode_attention="flex")
    assert [o.token_ids for o in flex.generate(prompts, GREEDY)] == ref
    with pytest.raises(UserError, match="flash-attn.*cannot run here"):
        _engine(llama, tok, decode_attention="flash-attn")
    with pytest.raises(UserError, match="unknown"):
        _engine(llama, tok, decode_attention="paged-magic")
