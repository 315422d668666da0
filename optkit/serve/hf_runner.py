"""Fallback runner for architectures the native executor does not cover.

It runs the transformers model with its own ``DynamicCache``, one request at a time within a
step: correct but slower (no paged KV, no batched matmuls, no prefix caching). The engine and
``optkit bench`` say so whenever it is used. An optkit artifact is dequantized to the compute
dtype by optkit's reference reader, since transformers' own modules need float weights.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from optkit.serve.loader import ModelSource
from optkit.serve.request import RunnerOutput, SchedulerOutput
from optkit.serve.runner import StepTiming
from optkit.serve.sampler import Sampler, make_generator


def _model(source: ModelSource, device: torch.device, dtype: torch.dtype) -> Any:
    if source.kind == "artifact":
        from optkit.export.reader import load_dequantized_model

        return load_dequantized_model(source.path, dtype).to(device)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(source.config, dtype=dtype)
    missing, unexpected = model.load_state_dict(source.weights, strict=False)
    if getattr(source.config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if "lm_head" not in k]
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    source.weights.clear()
    return model.to(device=device, dtype=dtype).eval()


class TransformersRunner:
    def __init__(self, source: ModelSource, device: torch.device, dtype: torch.dtype, sampler: Sampler):
        self.model = _model(source, device, dtype)
        self.device = device
        self.sampler = sampler
        self.caches: dict[str, Any] = {}
        self.generators: dict[str, torch.Generator | None] = {}
        self.timing = StepTiming()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        from transformers import DynamicCache

        for rid in out.finished_ids:
            self.caches.pop(rid, None)
            if rid not in out.preempted_ids:
                self.generators.pop(rid, None)
        t0 = time.perf_counter()
        rows, sampled = [], []
        for s in out.scheduled:
            rid = s.request.request_id
            if s.start == 0 or rid not in self.caches:  # new, or recomputing after a preemption
                self.caches[rid] = DynamicCache(config=self.model.config)
            ids = torch.tensor([s.token_ids], dtype=torch.int64, device=self.device)  # (1, n)
            pos = torch.arange(s.start, s.start + s.num_tokens, device=self.device)
            logits = self.model(
                input_ids=ids, position_ids=pos[None], cache_position=pos, past_key_values=self.caches[rid],
                use_cache=True, logits_to_keep=1,
            ).logits[0, -1]  # (V,)
            if s.sample:
                rows.append(logits.float())
                sampled.append(s)
                if rid not in self.generators:
                    self.generators[rid] = make_generator(s.request.sampling.seed, self.device)
        t1 = time.perf_counter()
        self.timing.history.append((0.0, t1 - t0, 0.0, sum(s.num_tokens for s in out.scheduled), 0))
        if not sampled:
            return RunnerOutput([], [], [])
        params = [s.request.sampling for s in sampled]
        history = [s.request.all_token_ids for s in sampled] if any(p.repetition_penalty != 1 for p in params) else None
        result = self.sampler.sample(
            torch.stack(rows), params, [self.generators[s.request.request_id] for s in sampled], history
        )
        tokens = result.token_ids.tolist()
        lps: list[float | None] = [None] * len(tokens)
        if result.logprobs is not None:
            lp = result.logprobs.tolist()
            lps = [lp[i] if p.logprobs else None for i, p in enumerate(params)]
        return RunnerOutput([s.request.request_id for s in sampled], tokens, lps)
