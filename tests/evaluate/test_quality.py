import copy
import math

import pytest
import torch
import torch.nn.functional as F
from tokenizers import processors

from optkit.errors import CalibrationError
from optkit.evaluate import ReferenceLogits, evaluate, load_text_tokens, make_windows
from optkit.testing.tiny import tiny_llama, tiny_tokenizer

VOCAB = 259  # the tiny byte tokenizer: 3 specials + 256 bytes


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB)


@pytest.fixture(scope="module")
def windows():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (5, 24), generator=g)  # (W, L): 5 windows, batch 2 leaves a partial batch


@pytest.fixture(scope="module")
def perturbed(model):
    noisy = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return noisy


def _full_logp(model, windows):
    """Independent reference: one forward over all windows, float32 log-softmax of the
    logits that predict tokens 1..L-1."""
    with torch.no_grad():
        logits = model(input_ids=windows).logits.float()  # (W, L, V)
    return torch.log_softmax(logits[:, :-1], dim=-1)  # (W, L-1, V)


def test_perplexity_is_exp_cross_entropy(model, windows):
    with torch.no_grad():
        logits = model(input_ids=windows).logits.float()  # (W, L, V)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), windows[:, 1:].reshape(-1))
    res = evaluate(model, windows, batch_size=2)
    assert res.tokens_scored == 5 * 23
    assert res.windows == 5 and res.seq_len == 24
    assert res.nll == pytest.approx(ce.item(), rel=1e-5)
    assert res.perplexity == pytest.approx(math.exp(ce.item()), rel=1e-5)
    assert res.kl_divergence is None and res.top1_agreement is None
    assert res.to_json()["perplexity"] == res.perplexity


def test_model_against_itself(model, windows, tmp_path):
    with ReferenceLogits.compute(model, windows, directory=tmp_path, batch_size=3) as ref:
        assert ref.path.is_file() and ref.path.parent.parent == tmp_path
        assert ref.logprobs.shape == (5, 23, VOCAB)
        res = evaluate(model, windows, reference=ref, batch_size=2)
        assert abs(res.kl_divergence) < 1e-5  # second order in the float16 rounding once renormalized
        assert res.top1_agreement == 1.0
        assert res.nll == pytest.approx(ref.result.nll, rel=1e-6)
    assert not ref.path.exists()  # close() deletes the memmap file


def test_perturbed_model_kl_and_top1(model, perturbed, windows, tmp_path):
    ref_logp = _full_logp(model, windows)  # (W, L-1, V)
    q_logp = _full_logp(perturbed, windows)  # (W, L-1, V)
    kl = (ref_logp.exp() * (ref_logp - q_logp)).sum(-1).mean().item()
    top1 = (ref_logp.argmax(-1) == q_logp.argmax(-1)).double().mean().item()
    assert kl > 0.01 and top1 < 1.0  # the perturbation is big enough to test anything

    with ReferenceLogits.compute(model, windows, directory=tmp_path) as ref:
        res = evaluate(perturbed, windows, reference=ref, batch_size=2)
    assert res.kl_divergence == pytest.approx(kl, rel=2e-3)
    assert res.top1_agreement == pytest.approx(top1, abs=1e-9)
    assert res.top1_agreement < 1.0


def test_reference_on_other_windows_is_refused(model, windows, tmp_path):
    with ReferenceLogits.compute(model, windows[:2], directory=tmp_path) as ref:
        with pytest.raises(ValueError, match="other windows"):
            evaluate(model, windows, reference=ref)


def test_make_windows_cuts_and_drops_tail():
    ids = torch.arange(100)
    w = make_windows(ids, seq_len=32)
    assert w.shape == (3, 32)
    assert torch.equal(w, torch.arange(96).reshape(3, 32))  # tokens 96..99 (the tail) dropped
    assert make_windows(ids, seq_len=32, max_windows=2).shape == (2, 32)
    assert torch.equal(make_windows(ids, seq_len=32, max_windows=10), w)
    assert make_windows(torch.arange(32), seq_len=32).shape == (1, 32)
    with pytest.raises(CalibrationError, match="fewer than one window"):
        make_windows(torch.arange(31), seq_len=32)


def test_load_text_tokens_adds_no_bos(tmp_path):
    tok = tiny_tokenizer()
    bos = tok.convert_tokens_to_ids(tok.bos_token)
    # make this tokenizer add a BOS by default, as many real ones do
    tok._tokenizer.post_processor = processors.TemplateProcessing(single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)])
    text = "The quick brown fox.\n = Heading = \nnaïve café"
    assert tok(text)["input_ids"][0] == bos  # the default call does add it
    path = tmp_path / "text.raw"
    path.write_text(text, encoding="utf-8")
    ids = load_text_tokens(path, tok)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0].item() != bos


def test_load_text_tokens_missing_file(tmp_path, tokenizer):
    with pytest.raises(CalibrationError, match="not found"):
        load_text_tokens(tmp_path / "nope.raw", tokenizer)


def test_strided_windows_score_each_token_once_with_more_context(model, perturbed, tmp_path):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (70,), generator=g)
    L, s = 24, 8
    w = make_windows(ids, L, stride=s)
    assert w.shape == (1 + (70 - L) // s, L) and torch.equal(w[1], ids[s : s + L])
    # independent: a plain loop over windows, each token scored from the window that first covers it
    nll, count, seen = 0.0, 0, []
    with torch.no_grad():
        for i in range(w.shape[0]):
            logp = torch.log_softmax(model(input_ids=w[i : i + 1]).logits[0].float(), -1)  # (L, V)
            first = 1 if i == 0 else L - s
            for t in range(first, L):
                nll -= logp[t - 1, w[i, t]].item()
                count += 1
                seen.append(i * s + t)
    assert seen == list(range(1, len(seen) + 1))  # every position once, in order
    res = evaluate(model, w, batch_size=2, stride=s)
    assert res.tokens_scored == count and res.nll == pytest.approx(nll / count, rel=1e-5)
    with ReferenceLogits.compute(model, w, directory=tmp_path) as ref:
        same = evaluate(model, w, reference=ref, stride=s)
        other = evaluate(perturbed, w, reference=ref, stride=s)
    assert abs(same.kl_divergence) < 1e-5 and same.top1_agreement == 1.0
    assert other.kl_divergence > 0 and other.tokens_scored == count
    with pytest.raises(ValueError, match="stride"):
        make_windows(ids, L, stride=L + 1)
