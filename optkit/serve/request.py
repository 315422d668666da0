"""Requests, sampling parameters and the data-only messages between scheduler and runner."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from optkit.errors import UserError


class InvalidRequestError(UserError):
    """A request's prompt or sampling parameters are invalid (HTTP 400 in the server)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen for one request.

    ``temperature == 0`` is greedy (argmax). Filters apply in this order, as in
    transformers' ``generate``: repetition penalty, temperature, top-k, top-p, min-p.
    ``logprobs``: return the log-probability of each chosen token under the model's own
    distribution (raw logits, before penalties and temperature).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off; >1 discourages tokens already in prompt or output
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        # Frozen, but callers pass lists: normalise to tuples so params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the bad value and the allowed range."""

        def bad(name: str, value: object, allowed: str) -> None:
            raise InvalidRequestError(f"{name}={value!r} is invalid; allowed: {allowed}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "a number in [0, 1]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", self.seed, "an integer or null")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", list(self.stop_token_ids), "non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", list(self.stop), "non-empty strings")


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits at the front of the queue to recompute
    FINISHED_STOPPED = "stop"  # a stop token id, EOS or a stop string
    FINISHED_LENGTH = "length"  # max_tokens, or the model's context is full
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One generation request; its token lists grow as it runs.

    ``num_computed_tokens``: tokens whose KV is in the cache (the scheduler advances it when
    it schedules them; a preemption resets it to 0). ``block_hashes``: chained hashes of the
    request's full blocks, filled by the KV cache manager and kept across preemptions.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit (tokens) at first scheduling; -1 before
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)
    # timestamps (time.perf_counter) for metrics; None until they happen
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens ``[start, start + num_tokens)``.

    ``block_ids``: the request's whole block table after this step's allocation.
    ``sample``: the step reaches the end of the known tokens, so a token is sampled.
    """

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]


@dataclass
class SchedulerOutput:
    """What to compute in one step. ``scheduled`` lists running requests first (in their
    order), then newly admitted ones. ``finished_ids``: requests that left since the last
    step (finished, aborted or preempted), so the runner can drop per-request state."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """Sampled tokens, one entry per scheduled request with ``sample=True``, in order."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float | None]
