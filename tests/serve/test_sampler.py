from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from optkit.serve.request import SamplingParams
from optkit.serve.sampler import Sampler, make_generator

CPU = torch.device("cpu")


def _logits(B: int, V: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def _sampler() -> Sampler:
    return Sampler(CPU, seed=1234)


def test_greedy_equals_argmax_and_top_k_1_equals_greedy():
    logits = _logits(6, 50)
    s = _sampler()
    greedy = s.sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert torch.equal(greedy.token_ids, logits.argmax(-1))
    assert greedy.logprobs is None
    assert greedy.token_ids.dtype == torch.int64
    for _ in range(5):
        topk1 = s.sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 6, [None] * 6)
        assert torch.equal(topk1.token_ids, greedy.token_ids)


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(4, 40)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, logprobs=True),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
    ]
    out = _sampler().sample(logits, params, [None] * 4, history=[[1, 2], [3], [], [logits[3].argmax().item()]])
    expected = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected)
    # the penalised greedy row moved off the raw argmax it was penalised for
    assert out.token_ids[3] != logits[3].argmax()


def test_seeded_row_is_independent_of_the_batch():
    V = 64
    logits = _logits(1, V, seed=3)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)

    def run_alone():
        s, g = _sampler(), make_generator(42, CPU)
        return [int(s.sample(logits, [p], [g]).token_ids[0]) for _ in range(20)]

    def run_in_batch(sampler_seed):
        s, g = Sampler(CPU, seed=sampler_seed), make_generator(42, CPU)
        others = _logits(3, V, seed=9)
        batch = torch.cat([others[:1], logits, others[1:]])
        params = [SamplingParams(temperature=0.0), p, SamplingParams(temperature=2.0, top_k=3), SamplingParams(min_p=0.2)]
        gens = [None, g, make_generator(7, CPU), None]
        return [int(s.sample(batch, params, gens).token_ids[1]) for _ in range(20)]

    alone = run_alone()
    assert alone == run_alone()
    assert alone == run_in_batch(1) == run_in_batch(2)
    assert len(set(alone)) > 1  # actually sampling, not stuck on one token


def test_different_seeds_differ():
    logits = _logits(1, 100, seed=5) * 0  # uniform: any two seeds agree 1% of the time per draw
    p = SamplingParams(temperature=1.0)
    s = _sampler()
    g1, g2 = make_generator(1, CPU), make_generator(2, CPU)
    a = [int(s.sample(logits, [p], [g1]).token_ids[0]) for _ in range(10)]
    b = [int(s.sample(logits, [p], [g2]).token_ids[0]) for _ in range(10)]
    assert a != b
    assert make_generator(None, CPU) is None


def test_empirical_distribution_matches_softmax():
    V, N = 6, 20000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    logits = row.expand(N, V).contiguous()  # N independent draws in one batched call
    out = _sampler().sample(logits, [SamplingParams(temperature=1.0)] * N, [None] * N)
    counts = torch.bincount(out.token_ids, minlength=V).double()
    expected = row.double().softmax(-1) * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # 5 degrees of freedom: p(chi2 > 25) ~ 1e-4


def _allowed_by_transformers(logits, warper):
    return torch.isfinite(warper(torch.zeros(1, 1, dtype=torch.long), logits.clone()))


def _allowed_by_sampler(logits, p: SamplingParams, draws: int = 4000):
    """Tokens the sampler can return, found by sampling many times (every allowed token in
    these cases has probability >= ~1%, so 4000 draws find all of them)."""
    out = _sampler().sample(logits.expand(draws, -1).contiguous(), [p] * draws, [None] * draws)
    allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
    allowed[out.token_ids] = True
    return allowed


def test_top_p_and_min_p_against_hand_computation():
    # probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04 (sum 1)
    probs = torch.tensor([0.1, 0.4, 0.04, 0.25, 0.06, 0.15])
    logits = probs.log()[None]
    # top_p=0.7: 0.4 + 0.25 = 0.65 < 0.7, + 0.15 = 0.8 >= 0.7 -> {1, 3, 5}
    allowed = _allowed_by_sampler(logits, SamplingParams(top_p=0.7))
    assert allowed.nonzero().flatten().tolist() == [1, 3, 5]
    # min_p=0.3: threshold 0.3 * 0.4 = 0.12 -> {0.4, 0.25, 0.15} = {1, 3, 5}; min_p=0.2: 0.08 adds token 0
    assert _allowed_by_sampler(logits, SamplingParams(min_p=0.3)).nonzero().flatten().tolist() == [1, 3, 5]
    assert _allowed_by_sampler(logits, SamplingParams(min_p=0.2)).nonzero().flatten().tolist() == [0, 1, 3, 5]
    # a tiny top_p still keeps the top token
    assert _allowed_by_sampler(logits, SamplingParams(top_p=0.01)).nonzero().flatten().tolist() == [1]


@pytest.mark.parametrize(
    "p, warpers",
    [
        (SamplingParams(temperature=0.7, top_k=4), [TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)]),
        (SamplingParams(temperature=1.3, top_p=0.6), [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.6)]),
        (SamplingParams(temperature=0.5, min_p=0.05), [TemperatureLogitsWarper(0.5), MinPLogitsWarper(0.05)]),
        (
            SamplingParams(temperature=2.0, top_k=6, top_p=0.8, min_p=0.1),
            [TemperatureLogitsWarper(2.0), TopKLogitsWarper(6), TopPLogitsWarper(0.8), MinPLogitsWarper(0.1)],
        ),
    ],
)
def test_allowed_sets_match_transformers_warpers(p, warpers):
    logits = torch.tensor([[2.0, 1.6, 1.5, 1.2, 1.0, 0.9, 0.5, 0.0, -0.5, -1.0, -3.0, -6.0]])
    expected = logits.clone()
    for w in warpers:
        expected = w(torch.zeros(1, 1, dtype=torch.long), expected)
    expected_allowed = torch.isfinite(expected)[0]
    # a hard-to-reach token at T=2 still has p >= 1% among the allowed ones here
    assert torch.equal(_allowed_by_sampler(logits, p, draws=6000), expected_allowed)
    # and the same on the processed scores directly (no sampling noise)
    s = _sampler()
    scores = s._top_k_top_p(logits / p.temperature, [p], p.top_k > 0, p.top_p < 1.0)
    probs = scores.softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), 0)
    assert torch.equal(probs[0] > 0, expected_allowed)


def test_mixed_batch_rows_stay_in_their_own_allowed_sets():
    row = torch.tensor([2.0, 1.6, 1.5, 1.2, 1.0, 0.9, 0.5, 0.0, -0.5, -1.0, -3.0, -6.0])
    cases = [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=0.7, top_k=2), [TemperatureLogitsWarper(0.7), TopKLogitsWarper(2)]),
        (SamplingParams(temperature=1.3, top_p=0.6), [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.6)]),
        (SamplingParams(temperature=0.5, min_p=0.3), [TemperatureLogitsWarper(0.5), MinPLogitsWarper(0.3)]),
        (SamplingParams(temperature=1.0), []),
    ]
    reps = 500
    params = [p for p, _ in cases] * reps
    out = _sampler().sample(row.expand(len(params), -1).contiguous(), params, [None] * len(params))
    tokens = out.token_ids.view(reps, len(cases))  # (reps, rows)
    for j, (_, warpers) in enumerate(cases):
        seen = torch.zeros(row.numel(), dtype=torch.bool)
        seen[tokens[:, j]] = True
        if warpers is None:
            assert seen.nonzero().flatten().tolist() == [0]
            continue
        expected = row[None].clone()
        for w in warpers:
            expected = w(None, expected)
        allowed = torch.isfinite(expected)[0]
        assert not (seen & ~allowed).any(), f"row {j} sampled outside its allowed set"
        if warpers:
            assert torch.equal(seen, allowed)  # these sets have p >= ~5%: 500 draws find them all


def test_repetition_penalty_matches_transformers():
    B, V = 3, 30
    logits = _logits(B, V, seed=11)
    history = [[1, 2, 2, 5, 29], [0, 7], [3, 4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(repetition_penalty=0.7), SamplingParams()]
    ours = _sampler()._repetition_penalty(logits, params, history)
    for i, (p, h) in enumerate(zip(params, history, strict=True)):
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([h]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref, rtol=0, atol=0)
    # greedy with penalty picks the argmax of the penalised scores
    out = _sampler().sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.5)] * B, [None] * B, history)
    penalised = _sampler()._repetition_penalty(logits, [params[0]] * B, history)
    assert torch.equal(out.token_ids, penalised.argmax(-1))
    with pytest.raises(ValueError, match="history"):
        _sampler().sample(logits, params, [None] * B)


def test_no_host_sync_in_sample(monkeypatch):
    logits = _logits(4, 32)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
    ]
    gens = [None, make_generator(3, CPU), None, None]
    s = _sampler()

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation in Sampler.sample")

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "nonzero", forbidden)
    out = s.sample(logits, params, gens, history=[[1], [2, 3], [], [4]])
    greedy_only = s.sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    monkeypatch.undo()
    assert out.token_ids.shape == (4,) and out.logprobs is not None
    assert greedy_only.logprobs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_on_cuda():
    dev = torch.device("cuda")
    s = Sampler(dev, seed=0)
    logits = _logits(4, 1000).to(dev)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
    ]
    gens = [None, make_generator(3, dev), None, None]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = s.sample(logits, params, gens, history=[[1], [2, 3], [], [4]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.device.type == "cuda" and out.token_ids.shape == (4,)
