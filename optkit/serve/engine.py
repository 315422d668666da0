"""The engine: requests in, tokens and text out, one scheduler step at a time.

``LLMEngine.step()`` = ``scheduler.schedule()`` -> ``runner.execute()`` -> ``scheduler.update()``,
then incremental detokenization and stop strings. Everything the HTTP server needs (add, abort,
step, stats) is here; ``generate()`` drives it to completion for offline use and benchmarks.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from optkit.attention.paged import PagedKVCache
from optkit.errors import UserError
from optkit.hardware import resolve_compute_dtype
from optkit.serve.detokenize import IncrementalDetokenizer
from optkit.serve.kv_cache import KVCacheManager
from optkit.serve.loader import ModelSource, load_source
from optkit.serve.model import SUPPORTED_ARCHITECTURES, LlamaExecutor
from optkit.serve.request import InvalidRequestError, Request, RequestStatus, SamplingParams
from optkit.serve.runner import ModelRunner
from optkit.serve.sampler import Sampler
from optkit.serve.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("optkit.serve")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: str | int | float, available: int) -> int:
    """``"2GiB"``, ``"512MB"``, ``123456`` (bytes) or a fraction in (0, 1] of ``available``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if 0 < value <= 1 and isinstance(value, float):
            return int(value * available)
        if value >= 1:
            return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            num = float(m.group(1))
            if not m.group(2) and 0 < num <= 1 and "." in m.group(1):
                return int(num * available)
            if num > 0:
                return int(num * _UNITS[m.group(2).lower()])
    raise UserError(
        f"KV cache memory {value!r} is not understood",
        hint="give bytes with a unit (e.g. 512MiB, 2GiB) or a fraction of free memory (e.g. 0.3)",
    )


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def _decode_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """The paged decode-attention kernel: ``auto`` asks what this device can run; an explicit
    name that cannot run is an error naming why."""
    from optkit.attention.flex import DECODE_BACKENDS, _flash_attn_refusal, select_decode_backend

    if config.decode_attention == "auto":
        return select_decode_backend(device, dtype, head_dim, config.block_size)
    if config.decode_attention not in DECODE_BACKENDS:
        raise UserError(f"decode attention {config.decode_attention!r} is unknown", hint=f"one of: auto, {', '.join(DECODE_BACKENDS)}")
    if config.decode_attention == "flash-attn":
        why = _flash_attn_refusal(device, dtype, head_dim, config.block_size)
        if why is not None:
            raise UserError(f"decode attention 'flash-attn' cannot run here: {why}", hint="use auto, flex or gather-sdpa")
    return config.decode_attention, "chosen explicitly"


class _NoText:
    """Stands in for the detokenizer when a model has no tokenizer (synthetic weights)."""

    text = ""
    stopped = False

    def push(self, token_id: int) -> str:
        return ""

    def finish(self) -> str:
        return ""


@dataclass
class EngineConfig:
    """One frozen set of engine settings (recorded in bench output)."""

    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 where matmuls are fast in it, else float32
    block_size: int = 16
    kv_cache_memory: str | int | float = "0.2"  # bytes or a fraction of free memory
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    kernel: str = "auto"
    threads: int | None = None
    compile: bool = False  # compile the decode step (torch.compile); see LlamaExecutor.enable_compile
    compile_mode: str | None = None  # e.g. "reduce-overhead" for CUDA graphs on a GPU
    decode_attention: str = "auto"  # auto | gather-sdpa | flex | flash-attn (see optkit.attention.flex)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class RequestOutput:
    """What one step produced for one request (``new_*``) and everything so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None


class LLMEngine:
    def __init__(self, source: ModelSource, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = config.torch_device()
        self.dtype = resolve_compute_dtype(config.dtype, self.device)
        self.source = source
        self.tokenizer = source.tokenizer
        arch = (getattr(source.config, "architectures", None) or ["?"])[0]
        self.native = arch in SUPPORTED_ARCHITECTURES
        max_len = config.max_model_len or source.config.max_position_embeddings
        self.max_model_len = max_len
        spec_layers = source.config.num_hidden_layers
        kv_heads = getattr(source.config, "num_key_value_heads", None) or source.config.num_attention_heads
        head_dim = getattr(source.config, "head_dim", None) or source.config.hidden_size // source.config.num_attention_heads
        self.kv_bytes_per_token = PagedKVCache.bytes_per_token(spec_layers, kv_heads, head_dim, self.dtype)
        budget = parse_memory(config.kv_cache_memory, available_memory(self.device))
        num_blocks = budget // (self.kv_bytes_per_token * config.block_size)
        if num_blocks < 1:
            raise UserError(
                f"KV cache budget {budget} bytes holds no block of {config.block_size} tokens "
                f"({self.kv_bytes_per_token * config.block_size} bytes)",
                hint="raise kv_cache_memory",
            )
        self.kv_budget_bytes = budget
        self.sampler = Sampler(self.device)
        if self.native:
            self.model = LlamaExecutor(source.config, source.weights, self.device, self.dtype, config.kernel, max_len)
            self.cache = PagedKVCache(spec_layers, num_blocks, config.block_size, kv_heads, head_dim, self.dtype, self.device)
            if config.compile:
                self.model.enable_compile(config.compile_mode)
            self.decode_attention, self.decode_attention_reason = _decode_backend(config, self.device, self.dtype, head_dim)
            self.runner: Any = ModelRunner(self.model, self.cache, self.sampler, decode_backend=self.decode_attention)
            caching = config.enable_prefix_caching
            slow = self.model.slow_paths()
            self.fallback_reason = None
            if slow:
                log.warning("slow dequantize kernels in use: %s", ", ".join(slow))
        else:
            from optkit.serve.hf_runner import TransformersRunner

            self.fallback_reason = f"{arch} is not in the native executor ({', '.join(SUPPORTED_ARCHITECTURES)})"
            log.warning(
                "%s: running the transformers model with its own cache (slower; no paged KV, no prefix caching)",
                self.fallback_reason,
            )
            self.model = None
            self.cache = None
            self.decode_attention, self.decode_attention_reason = "transformers", "the fallback runs the model's own attention"
            self.runner = TransformersRunner(source, self.device, self.dtype, self.sampler)
            caching = False
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_len, max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs, enable_prefix_caching=caching,
            ),
            self.kv,
        )
        self._detok: dict[str, IncrementalDetokenizer | _NoText] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        eos = getattr(source.config, "eos_token_id", None)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        ids = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = tuple(sorted({i for i in [*ids, tok_eos] if isinstance(i, int)}))

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None, trust_remote_code: bool = False) -> LLMEngine:
        return cls(load_source(path, trust_remote_code), config)

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer (synthetic weights): give token ids")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        vocab = self.source.config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} (prompt + output), "
                "so the prompt must be shorter"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already running")
        req = Request(rid, ids, params, self.eos_token_ids, arrival_time or time.perf_counter())
        self.scheduler.add_request(req)  # may reject (too big for the KV pool): nothing allocated yet
        self._requests[rid] = req
        if self.tokenizer is None:
            if params.stop:
                raise InvalidRequestError("stop strings need a tokenizer; this model has none (synthetic weights)")
            self._detok[rid] = _NoText()
        else:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks are freed before this returns."""
        found = self.scheduler.abort_request(request_id)
        self._requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        return found

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            if out.finished_ids:
                self.runner.execute(out)  # lets the runner drop state of requests that left
            return []
        result = self.runner.execute(out)
        updated = self.scheduler.update(out, result)
        outputs = []
        for req in updated:  # each got exactly one token this step
            rid = req.request_id
            detok = self._detok.get(rid)
            if detok is None:
                continue
            new_ids = req.output_token_ids[-1:]
            new_text = ""
            # a stop token (EOS or stop_token_ids) ends the request; its text is not output
            if not (req.status is RequestStatus.FINISHED_STOPPED and new_ids[0] in self._stop_ids(req)):
                new_text += detok.push(new_ids[0])
            if detok.stopped and not req.is_finished:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                new_text += detok.finish()
                self._requests.pop(rid, None)
                self._detok.pop(rid, None)
            outputs.append(self._output(req, detok, new_ids, new_text))
        return outputs

    @staticmethod
    def _stop_ids(req: Request) -> set[int]:
        ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            ids.update(req.eos_token_ids)
        return ids

    def _output(self, req: Request, detok: IncrementalDetokenizer | _NoText, new_ids: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
            text=detok.text, new_token_ids=list(new_ids), new_text=new_text, finished=req.is_finished,
            finish_reason=req.finish_reason, logprobs=list(req.output_logprobs),
            num_cached_tokens=max(req.num_cached_tokens, 0), arrival_time=req.arrival_time,
            first_token_time=req.first_token_time, finished_time=req.finished_time,
        )

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    def warmup(self) -> float:
        """Run throw-away requests (a 96-token prefill, decodes at batch 1 and 2) so that
        compilation happens now, not inside the first user request: the decode graphs when
        ``compile`` is on, and the kernels' compiled weight rebuild for large batches (always).
        Returns the seconds it took."""
        t = time.perf_counter()
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        long = min(96, self.max_model_len - 8)
        for batch, length in ((1, long), (1, self.config.block_size + 2), (2, self.config.block_size + 2)):
            ids = [self.add_request([1 + i] * length, greedy, f"__warmup-{batch}-{length}-{i}") for i in range(batch)]
            while any(r in self._requests for r in ids):
                self.step()
        self.kv.reset_prefix_cache()
        self.kv.reset_stats()
        return time.perf_counter() - t

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        pc = self.kv.prefix_cache_stats
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_usage": self.kv.usage,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache": pc,
        }
