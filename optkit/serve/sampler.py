"""Token sampling for a batch of rows that each carry their own :class:`SamplingParams`.

Filters match transformers' ``generate`` logits processors, in the same order, so results are
comparable with a Hugging Face reference:

1. repetition penalty (CTRL, ``RepetitionPenaltyLogitsProcessor``): for tokens already in the
   row's prompt or output, ``s < 0 -> s * penalty`` else ``s / penalty``;
2. temperature (``TemperatureLogitsWarper``): ``s / T``; ``T == 0`` means greedy for that row;
3. top-k (``TopKLogitsWarper``): drop ``s < kth largest s`` (ties with the k-th are kept);
4. top-p (``TopPLogitsWarper``): sort ascending, drop tokens whose cumulative probability
   ``<= 1 - top_p``; the top token is always kept;
5. min-p (``MinPLogitsWarper``): drop ``p < min_p * max p``;

then sample by the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks token ``i``
with probability ``p_i / sum p`` (the minimum of independent ``Exp(p_i)`` variables lands on
``i`` with that probability), needs no normalisation and no ``torch.multinomial``.

No host synchronisation (DESIGN rule 9): ``sample()`` never calls ``.item()``, ``.tolist()``,
``.cpu()``, ``torch.nonzero``, boolean-mask indexing (data-dependent shapes) or a Python ``if``
on a tensor value. Every branch is on host-side ``SamplingParams``; per-row parameters become
small tensors built on the host and copied to the device without blocking (pinned memory on
CUDA), so a decode step can be queued ahead of the GPU. ``tests/serve/test_sampler.py`` checks
this on CPU by making ``item``/``tolist``/``__bool__``/... raise, and on a GPU with
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from optkit.serve.request import SamplingParams

_NEUTRAL = SamplingParams(temperature=1.0)  # stands in for greedy rows in the sampling path


@dataclass
class SamplerResult:
    """``token_ids``: (B,) int64 on the logits' device. ``logprobs``: (B,) float32,
    ``log_softmax(raw logits)[token]`` (before penalty and temperature), or None when no row
    asked for logprobs (then the log-softmax pass is skipped)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A per-request generator for ``seed`` (None for unseeded requests).

    The runner keeps it for the request's lifetime, so a seeded request draws the same
    sequence of random numbers whatever else is in the batch.
    """
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


class Sampler:
    """Samples one token per row of a ``(B, V)`` logits tensor, rows with mixed parameters.

    ``seed`` seeds the sampler's own generator, used for rows without a per-request
    generator; None draws it from torch's global RNG once, so a ``torch.manual_seed`` at
    startup makes unseeded sampling reproducible too.
    """

    def __init__(self, device: torch.device | str, seed: int | None = None):
        self.device = torch.device(device)
        if seed is None:  # once at construction, on the host: not in the per-token loop
            seed = int(torch.randint(0, 2**62, (1,)))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        history: Sequence[Sequence[int]] | None = None,
    ) -> SamplerResult:
        """Pick one token per row.

        ``logits``: (B, V) float32. ``params``/``generators``: one per row. ``history``: per
        row, the prompt + output token ids so far; needed only when some row has
        ``repetition_penalty != 1``.
        """
        B, V = logits.shape
        if len(params) != B or len(generators) != B:
            raise ValueError(f"logits have {B} rows but got {len(params)} params and {len(generators)} generators")
        greedy = [p.greedy for p in params]

        x = logits
        if any(p.repetition_penalty != 1.0 for p in params):
            if history is None or len(history) != B:
                raise ValueError("history (one token list per row) is required when a row has repetition_penalty != 1")
            x = self._repetition_penalty(x, params, history)

        if all(greedy):  # fast path: no random numbers, no softmax, no sort
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample_filtered(x, params, generators, greedy)

        logprobs = None
        if any(p.logprobs for p in params):
            # log p under the model's own distribution (raw logits); float32 for the reduction
            logprobs = logits.float().log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)  # (B,)
        return SamplerResult(token_ids=tokens, logprobs=logprobs)

    # --- pieces ---------------------------------------------------------------------------

    def _sample_filtered(
        self,
        x: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race; greedy rows take the
        argmax of ``x`` (temperature and the filters cannot change it)."""
        B, V = x.shape
        dev = x.device
        # Greedy rows go through with neutral parameters (T = 1, never a division by 0, no
        # filters); their sampled token is replaced by the argmax below.
        rows = [_NEUTRAL if g else p for p, g in zip(params, greedy, strict=True)]
        temp = self._row_tensor([p.temperature for p in rows], torch.float32, dev)
        scores = x.float() / temp[:, None]  # (B, V)

        use_top_k = any(p.top_k > 0 for p in rows)
        use_top_p = any(p.top_p < 1.0 for p in rows)
        if use_top_k or use_top_p:
            scores = self._top_k_top_p(scores, rows, use_top_k, use_top_p)

        probs = scores.softmax(dim=-1)  # (B, V); masked tokens have p == 0
        if any(p.min_p > 0.0 for p in rows):
            min_p = self._row_tensor([p.min_p for p in rows], torch.float32, dev)
            threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (B, 1)
            probs = probs.masked_fill(probs < threshold, 0.0)  # top token survives: min_p <= 1

        q = self._exponential(B, V, dev, generators, greedy)  # (B, V), q ~ Exp(1)
        sampled = (probs / q).argmax(dim=-1)  # (B,)  exponential race; p == 0 never wins
        if any(greedy):
            mask = self._row_tensor(greedy, torch.bool, dev)
            sampled = torch.where(mask, x.argmax(dim=-1), sampled)
        return sampled

    def _top_k_top_p(self, scores: torch.Tensor, rows: Sequence[SamplingParams], use_top_k: bool, use_top_p: bool) -> torch.Tensor:
        """Top-k then top-p with one ascending sort, as ``TopKLogitsWarper`` then
        ``TopPLogitsWarper`` compute them; returns ``scores`` with dropped tokens at -inf."""
        B, V = scores.shape
        dev = scores.device
        sorted_scores, sorted_idx = scores.sort(dim=-1, descending=False)  # (B, V) ascending
        remove = torch.zeros_like(sorted_scores, dtype=torch.bool)  # (B, V) in sorted order
        if use_top_k:
            # k == 0 (off) or k >= V keeps all: the "k-th largest" is then the smallest score
            ks = [min(p.top_k, V) if p.top_k > 0 else V for p in rows]
            kth_pos = V - self._row_tensor(ks, torch.int64, dev)  # (B,) ascending position of the k-th largest
            kth = sorted_scores.gather(1, kth_pos[:, None])  # (B, 1)
            remove = sorted_scores < kth  # ties with the k-th value are kept, as in transformers
            sorted_scores = sorted_scores.masked_fill(remove, float("-inf"))
        if use_top_p:
            top_p = self._row_tensor([p.top_p for p in rows], torch.float32, dev)
            cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # (B, V) ascending cumulative probability
            remove = remove | (cum <= (1.0 - top_p)[:, None])
            remove[:, -1] = False  # always keep the top token (min_tokens_to_keep=1)
        remove_vocab = torch.empty_like(remove).scatter_(1, sorted_idx, remove)  # back to vocab order
        return scores.masked_fill(remove_vocab, float("-inf"))

    def _repetition_penalty(self, x: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[Sequence[int]]) -> torch.Tensor:
        """CTRL penalty (Keskar et al. 2019, eq. 3 as transformers implements it) on tokens
        seen in each row's history; rows with penalty 1 get an empty history (exact no-op)."""
        B, V = x.shape
        dev = x.device
        rows = [list(h) if p.repetition_penalty != 1.0 else [] for p, h in zip(params, history, strict=True)]
        width = max(1, max(len(r) for r in rows))
        # pad with V: scattered into a spare column that is dropped (no data-dependent shapes)
        ids = self._row_tensor([r + [V] * (width - len(r)) for r in rows], torch.int64, dev)  # (B, L)
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :V]  # (B, V)
        pen = self._row_tensor([p.repetition_penalty for p in params], x.dtype, dev)[:, None]  # (B, 1)
        penalised = torch.where(x < 0, x * pen, x / pen)
        return torch.where(seen, penalised, x)

    def _exponential(
        self, B: int, V: int, dev: torch.device, generators: Sequence[torch.Generator | None], greedy: list[bool]
    ) -> torch.Tensor:
        """``q ~ Exp(1)``, shape (B, V). A row with its own generator draws its whole row from
        it (so its tokens do not depend on the rest of the batch); other rows share the
        sampler's generator. Greedy rows draw nothing from their own generator."""
        q = torch.empty(B, V, device=dev, dtype=torch.float32)
        own = [g is not None and not gr for g, gr in zip(generators, greedy, strict=True)]
        if not all(own):
            q.exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if own[i]:
                q[i].exponential_(generator=g)
        # Exp(1) can round to 0 in float32; 0/0 would be NaN and win the argmax.
        return q.clamp_(min=torch.finfo(torch.float32).tiny)

    @staticmethod
    def _row_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Host list -> device tensor without a blocking copy (pinned + non_blocking on CUDA;
        a pageable copy would synchronise the stream)."""
        t = torch.tensor(data, dtype=dtype)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)
