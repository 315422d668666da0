"""The scheduler: which tokens of which requests to compute in each step.

One rule (vLLM v1 ``core/sched/scheduler.py``): every step has a token budget, and each request
is caught up from its computed tokens towards its total (prompt + outputs so far). A decode is
the 1-token case, a long prompt spread over several steps is chunked prefill, a prefix-cache hit
simply starts the request with computed tokens, and a preempted request recomputes from 0 the
same way. The scheduler never touches tensors: it hands the runner a :class:`SchedulerOutput`
and reads back a :class:`RunnerOutput`.

Preemption is by recomputation: when the pool cannot supply a running request's next block, the
newest running request gives all of its blocks back and waits at the front of the queue; its
prompt and outputs so far are recomputed later (cheaply, when its blocks are still cached).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from optkit.errors import UserError
from optkit.serve.kv_cache import KVCacheManager
from optkit.serve.request import (
    InvalidRequestError,
    Request,
    RequestStatus,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    """Context limit in tokens (prompt + output); a request stops with ``length`` when it gets there."""
    max_num_batched_tokens: int = 2048
    """Token budget per step, shared by decodes and (chunked) prefills."""
    max_num_seqs: int = 64
    """Running requests at most (each holds KV blocks and a row of the decode batch)."""
    enable_prefix_caching: bool = True
    """Look up each newly admitted request's prompt in the prefix cache."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"SchedulerConfig.{name}={value!r} is invalid; allowed: an integer >= 1")


class Scheduler:
    """FCFS admission, a per-step token budget, chunked prefill and preemption by recompute.

    ``waiting``: requests not running (new, or preempted, which go to the front).
    ``running``: admitted requests in admission order; the last one is the newest, and the
    first to be preempted.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.num_preemptions = 0  # total over the scheduler's life
        self._left_ids: list[str] = []  # finished or aborted since the last schedule()

    # ----------------------------------------------------------------- request lifecycle

    def add_request(self, req: Request) -> None:
        """Queue a request, or raise :class:`InvalidRequestError` naming the limit it breaks."""
        rid = req.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"request_id {rid!r} is already in use by an unfinished request")
        req.sampling.validate()
        n = req.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError(f"request {rid!r} has an empty prompt; at least 1 prompt token is needed")
        limit = self.config.max_model_len
        if n >= limit:
            raise InvalidRequestError(
                f"request {rid!r}: the prompt has {n} tokens but max_model_len={limit} allows at most "
                f"{limit - 1} (one position is kept for the first generated token)"
            )
        # Worst-case KV: the request ends at min(prompt + max_tokens, max_model_len) tokens, and its
        # last sampled token is never fed back, so one position fewer needs a slot. Rejecting
        # what the whole pool cannot hold guarantees progress: a request running alone always fits.
        max_total = min(n + req.sampling.max_tokens, limit)
        need = self.kv.num_blocks_for_tokens(max_total - 1)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"request {rid!r} may need {max_total - 1} KV slots ({n} prompt tokens + up to "
                f"{max_total - n} generated, max_model_len={limit}) = {need} blocks of {self.kv.block_size} "
                f"tokens, but the KV cache holds only {self.kv.num_blocks} blocks",
                hint="lower max_tokens or the prompt length, or give the KV cache more memory",
            )
        req.status = RequestStatus.WAITING
        self.requests[rid] = req
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now (client gone, cancel): its blocks are freed at once. False when the
        id is unknown or already finished."""
        return self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """The engine ends a request itself (e.g. it found a stop string in the detokenized
        text). Frees blocks at once; a no-op for an id that is unknown or already finished."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        self._finish(request_id, status)

    def _finish(self, request_id: str, status: RequestStatus) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:  # WAITING or PREEMPTED
            self.waiting.remove(req)
        self._release(req, status)
        return True

    def _release(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.perf_counter()
        self.kv.free(req)
        self._left_ids.append(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first (in order), then waiting ones (FCFS).

        Advances each scheduled request's ``num_computed_tokens`` by its share: the runner is
        expected to compute exactly what the output says.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, f"running request {req.request_id} has nothing to compute"
            while True:
                block_ids = self.kv.allocate_slots(req, num_new)
                if block_ids is not None:
                    break
                # Out of blocks: the newest running request makes room. It has not been scheduled
                # in this step (it sits at or after index i), so nothing scheduled is undone.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if block_ids is None:  # req was the newest and preempted itself: nothing after it
                break
            scheduled.append(self._schedule_tokens(req, num_new, block_ids))
            budget -= num_new
            i += 1

        # Admitting while preempting would hand the freed blocks straight to a newer request and
        # thrash; as in vLLM, a step that preempted admits nothing.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit_blocks, num_hit = [], 0
            if self.config.enable_prefix_caching and req.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            block_ids = self.kv.allocate_slots(req, num_new, hit_blocks)
            if block_ids is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.perf_counter()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._schedule_tokens(req, num_new, block_ids))
            budget -= num_new

        preempted_ids = [r.request_id for r in preempted]
        left, self._left_ids = self._left_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=preempted_ids,
            finished_ids=left + preempted_ids,
        )

    @staticmethod
    def _schedule_tokens(req: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens = start + num_new
        return ScheduledRequest(req, start, num_new, block_ids, sample=req.num_computed_tokens == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # successive victims are older: they end up in running order

    # ----------------------------------------------------------------- results

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Append the sampled tokens and apply stop rules; returns the requests that got a token
        this step (those that just finished included, with their finish status set).

        A request aborted or finished by the engine between :meth:`schedule` and this call is
        skipped: its token is dropped and its blocks are already free.
        """
        if not len(result.request_ids) == len(result.token_ids) == len(result.logprobs):
            raise ValueError(
                f"RunnerOutput lists differ in length: {len(result.request_ids)} request_ids, "
                f"{len(result.token_ids)} token_ids, {len(result.logprobs)} logprobs"
            )
        sampled = {rid: (tok, lp) for rid, tok, lp in zip(result.request_ids, result.token_ids, result.logprobs, strict=True)}
        now = time.perf_counter()
        produced: list[Request] = []
        any_finished = False
        for sr in out.scheduled:
            req = sr.request
            if not sr.sample or req.status != RequestStatus.RUNNING or self.requests.get(req.request_id) is not req:
                continue
            if req.request_id not in sampled:
                raise ValueError(f"RunnerOutput has no token for request {req.request_id!r}, which was scheduled to sample")
            token, logprob = sampled[req.request_id]
            req.output_token_ids.append(token)
            if logprob is not None:
                req.output_logprobs.append(logprob)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._stop_status(req, token)
            if status is not None:
                del self.requests[req.request_id]
                self._release(req, status)
                any_finished = True
            produced.append(req)
        if any_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return produced

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        """A stop token wins over a length limit reached on the same token: the model did end
        its answer there (vLLM reports ``length`` in that tie)."""
        sp = req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in req.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
