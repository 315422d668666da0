"""The model runner: turns a :class:`SchedulerOutput` into one forward pass and sampled tokens.

It decides no policy (DESIGN rule 7): the scheduler says which tokens to compute; the runner
lays them out as one flat batch (decodes first, then prefill chunks), runs the executor, samples
the rows that need a token, and copies the tokens to the host once per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from optkit.attention.paged import PagedKVCache, build_metadata
from optkit.serve.model import LlamaExecutor
from optkit.serve.request import RunnerOutput, ScheduledRequest, SchedulerOutput
from optkit.serve.sampler import Sampler, make_generator


@dataclass
class StepTiming:
    """Seconds spent in each part of the last step (host time; the forward includes the device)."""

    prepare: float = 0.0  # flat batch + attention metadata built on the host
    forward: float = 0.0  # the executor: embeddings, layers, head
    sample: float = 0.0  # sampler + the one device->host copy of the tokens
    num_tokens: int = 0
    num_decodes: int = 0
    history: list[tuple[float, float, float, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, model: LlamaExecutor, cache: PagedKVCache, sampler: Sampler, record_timing: bool = True,
        decode_backend: str = "gather-sdpa",
    ):
        self.decode_backend = decode_backend
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = model.device
        self.block_size = cache.block_size
        self.generators: dict[str, torch.Generator | None] = {}
        self.timing = StepTiming()
        self.record_timing = record_timing

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        rid = s.request.request_id
        if rid not in self.generators:
            self.generators[rid] = make_generator(s.request.sampling.seed, self.device)
        return self.generators[rid]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        for rid in set(out.finished_ids) - set(out.preempted_ids):  # a preempted request keeps its RNG stream
            self.generators.pop(rid, None)
        if not out.scheduled:
            return RunnerOutput([], [], [])
        decodes = [s for s in out.scheduled if s.num_tokens == 1 and s.start > 0]
        prefills = [s for s in out.scheduled if not (s.num_tokens == 1 and s.start > 0)]
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # flat-batch row whose hidden state gives each sampled token
        sampled: list[ScheduledRequest] = []
        for i, s in enumerate(decodes):
            ids.append(s.request.all_token_ids[s.start])
            positions.append(s.start)
            if s.sample:
                rows.append(i)
                sampled.append(s)
        for s in prefills:
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + s.num_tokens))
            if s.sample:
                rows.append(len(ids) - 1)
                sampled.append(s)
        meta = build_metadata(
            [(s.start + 1, s.block_ids) for s in decodes],
            [(s.start, s.num_tokens, s.block_ids) for s in prefills],
            self.block_size, self.device, self.model.spec.sliding_window, static_decode=self.model.compiled,
            decode_backend=self.decode_backend, num_blocks=self.cache.num_blocks,
        )
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        t1 = time.perf_counter()
        hidden = self.model(ids_t, pos_t, meta, self.cache.k, self.cache.v)  # (T, hidden)
        if not sampled:
            self._record(t0, t1, time.perf_counter(), time.perf_counter(), len(ids), len(decodes))
            return RunnerOutput([], [], [])
        rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows_t))  # (B, V) float32
        if self.device.type == "cuda" and self.record_timing:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        params = [s.request.sampling for s in sampled]
        history = None
        if any(p.repetition_penalty != 1.0 for p in params):
            history = [s.request.all_token_ids for s in sampled]
        result = self.sampler.sample(logits, params, [self._generator(s) for s in sampled], history)
        tokens = result.token_ids.tolist()  # the one device->host sync of the step
        logprobs: list[float | None] = [None] * len(tokens)
        if result.logprobs is not None:
            lp = result.logprobs.tolist()
            logprobs = [lp[i] if p.logprobs else None for i, p in enumerate(params)]
        self._record(t0, t1, t2, time.perf_counter(), len(ids), len(decodes))
        return RunnerOutput([s.request.request_id for s in sampled], tokens, logprobs)

    def _record(self, t0: float, t1: float, t2: float, t3: float, n: int, nd: int) -> None:
        if not self.record_timing:
            return
        tm = self.timing
        tm.prepare, tm.forward, tm.sample, tm.num_tokens, tm.num_decodes = t1 - t0, t2 - t1, t3 - t2, n, nd
        tm.history.append((tm.prepare, tm.forward, tm.sample, n, nd))
        if len(tm.history) > 4096:
            del tm.history[:2048]
