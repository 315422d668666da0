"""Scheduler: token budget, chunked prefill, preemption by recompute, aborts and stop rules,
driven by a fake runner that checks every step against an emulated paged KV cache."""

from __future__ import annotations

import random

import pytest

from optkit.serve.kv_cache import KVCacheManager
from optkit.serve.request import InvalidRequestError, Request, RequestStatus, RunnerOutput, SamplingParams
from optkit.serve.scheduler import Scheduler, SchedulerConfig


class FakeRunner:
    """Writes each scheduled token id into its (block, slot) and, before "attention", checks
    that the request's whole context reads back from its block table. The sampled token is a
    function of the context only, so preemption or caching can never change the outputs."""

    def __init__(self, kv: KVCacheManager, fixed: dict[str, list[int]] | None = None):
        self.bs = kv.block_size
        self.slots = [[None] * kv.block_size for _ in range(kv.num_blocks)]
        self.fixed = fixed or {}  # request id -> tokens to return in order (else from the context)
        self.log: list[tuple[str, int, int, bool]] = []  # (id, start, num_tokens, sample) per step entry

    def execute(self, out) -> RunnerOutput:
        for sr in out.scheduled:  # all KV writes of the step land before any read (per layer)
            for pos, tok in enumerate(sr.token_ids, sr.start):
                self.slots[sr.block_ids[pos // self.bs]][pos % self.bs] = tok
        ids, toks = [], []
        for sr in out.scheduled:
            self.log.append((sr.request.request_id, sr.start, sr.num_tokens, sr.sample))
            end = sr.start + sr.num_tokens
            ctx = [self.slots[sr.block_ids[p // self.bs]][p % self.bs] for p in range(end)]
            assert ctx == sr.request.all_token_ids[:end], f"KV of {sr.request.request_id} is corrupt"
            if sr.sample:
                rid = sr.request.request_id
                fixed = self.fixed.get(rid)
                ids.append(rid)
                toks.append(fixed[len(sr.request.output_token_ids)] if fixed else (sum(ctx) * 31 + end) % 97 + 3)
        return RunnerOutput(ids, toks, [-0.5] * len(ids))


def make(num_blocks=16, block_size=4, caching=True, **cfg):
    cfg.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(enable_prefix_caching=caching, **cfg), kv)
    return sched, FakeRunner(kv)


def req(rid, tokens, max_tokens=4, eos=(), **sp):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids=tuple(eos))


def step(sched, runner):
    out = sched.schedule()
    return out, sched.update(out, runner.execute(out))


def run_all(sched, runner, max_steps=500):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched, runner)
    raise AssertionError("scheduler made no progress")


def entries(out):
    return [(s.request.request_id, s.start, s.num_tokens, s.block_ids, s.sample) for s in out.scheduled]


def test_chunked_prefill_across_steps_then_decode():
    sched, runner = make(max_num_batched_tokens=4)
    a = req("a", range(1, 11), max_tokens=2)
    sched.add_request(a)
    out, got = step(sched, runner)
    assert entries(out) == [("a", 0, 4, [0], False)] and got == [] and a.first_scheduled_time is not None
    out, got = step(sched, runner)
    assert entries(out) == [("a", 4, 4, [0, 1], False)] and got == []
    out, got = step(sched, runner)
    assert entries(out) == [("a", 8, 2, [0, 1, 2], True)] and got == [a]
    assert len(a.output_token_ids) == 1 and a.output_logprobs == [-0.5] and a.first_token_time is not None
    out, got = step(sched, runner)
    assert entries(out) == [("a", 10, 1, [0, 1, 2], True)] and out.num_batched_tokens == 1
    assert got == [a] and a.status == RequestStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert sched.kv.num_free_blocks == 16 and not sched.has_unfinished()
    assert sched.schedule().finished_ids == ["a"]
    assert sched.schedule().finished_ids == []  # reported once


def test_decodes_and_a_new_chunked_prefill_share_a_step():
    sched, runner = make(max_num_batched_tokens=8)
    sched.add_request(req("a", range(1, 6), max_tokens=8))
    out, _ = step(sched, runner)
    assert entries(out) == [("a", 0, 5, [0, 1], True)]
    sched.add_request(req("b", range(20, 30)))
    out, _ = step(sched, runner)
    assert entries(out) == [("a", 5, 1, [0, 1], True), ("b", 0, 7, [2, 3], False)]
    assert out.num_batched_tokens == 8
    out, _ = step(sched, runner)
    assert entries(out) == [("a", 6, 1, [0, 1], True), ("b", 7, 3, [2, 3, 4], True)]


def test_max_num_seqs_limits_running_requests():
    sched, runner = make(max_num_seqs=2)
    for rid, n in (("a", 1), ("b", 3), ("c", 3)):
        sched.add_request(req(rid, range(10, 15), max_tokens=n))
    out, _ = step(sched, runner)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert sched.num_running == 1 and sched.num_waiting == 1  # a finished after 1 token
    out, _ = step(sched, runner)
    assert [s.request.request_id for s in out.scheduled] == ["b", "c"]
    assert out.finished_ids == ["a"]
    # c shares a's and b's prompt: its first block (4 of 5 tokens) comes from the cache
    assert sched.requests["c"].num_cached_tokens == 4 and out.scheduled[1].block_ids[0] == 0


def test_shared_prefix_gets_the_same_block_ids():
    sched, runner = make(max_num_batched_tokens=64)
    sched.add_request(req("a", range(1, 11)))
    step(sched, runner)
    sched.add_request(req("b", list(range(1, 9)) + [77, 78]))
    out, _ = step(sched, runner)
    assert entries(out) == [("a", 10, 1, [0, 1, 2], True), ("b", 8, 2, [0, 1, 3], True)]
    b = out.scheduled[1].request
    assert b.num_cached_tokens == 8 and sched.kv.prefix_cache_stats.hits == 8


def test_preempts_the_newest_and_resumes_by_recompute():
    # block_size 2, 4 blocks: a and b (3-token prompts) fill the pool after one decode each
    sched, runner = make(num_blocks=4, block_size=2, caching=False, max_model_len=16)
    a, b = req("a", [1, 2, 3]), req("b", [11, 12, 13])
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert entries(out) == [("a", 0, 3, [0, 1], True), ("b", 0, 3, [2, 3], True)]
    out, _ = step(sched, runner)
    assert entries(out) == [("a", 3, 1, [0, 1], True), ("b", 3, 1, [2, 3], True)]
    b_outputs = list(b.output_token_ids)
    out, _ = step(sched, runner)  # a needs a 3rd block: b (newest) gives its blocks back
    assert entries(out) == [("a", 4, 1, [0, 1, 3], True)]
    assert out.preempted_ids == ["b"] and out.finished_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b] and sched.kv.block_ids("b") == []
    out, _ = step(sched, runner)  # b needs 3 blocks, 1 is free: it waits; a finishes
    assert entries(out) == [("a", 5, 1, [0, 1, 3], True)] and a.status == RequestStatus.FINISHED_LENGTH
    out, _ = step(sched, runner)  # b recomputes its prompt + 2 outputs and samples its 3rd token
    assert entries(out) == [("b", 0, 5, [2, 3, 1], True)] and out.finished_ids == ["a"]
    assert b.output_token_ids[:2] == b_outputs and b.num_cached_tokens == 0
    run_all(sched, runner)
    assert b.status == RequestStatus.FINISHED_LENGTH and len(b.output_token_ids) == 4
    assert sched.kv.num_free_blocks == 4


def test_the_newest_preempts_itself_and_resumes_from_its_cached_blocks():
    sched, runner = make(num_blocks=5, block_size=2, max_model_len=16)
    a, b = req("a", [1, 2, 3]), req("b", [11, 12, 13])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    step(sched, runner)
    out, _ = step(sched, runner)  # a takes the last free block; b, the newest, preempts itself
    assert entries(out) == [("a", 4, 1, [0, 1, 4], True)] and out.preempted_ids == ["b"]
    out, _ = step(sched, runner)  # b's 2 cached blocks plus a new one do not fit yet
    assert [s.request.request_id for s in out.scheduled] == ["a"] and a.is_finished
    out, _ = step(sched, runner)  # b finds its own blocks [2, 3] in the cache: 1 token to compute
    assert entries(out) == [("b", 4, 1, [2, 3, 4], True)]
    run_all(sched, runner)
    assert sched.kv.num_free_blocks == 5 and sched.num_preemptions == 1


def test_abort_frees_blocks_at_once_and_is_reported():
    sched, runner = make()
    a, b, c = req("a", range(1, 10)), req("b", range(20, 26)), req("c", range(40, 45))
    for r in (a, b):
        sched.add_request(r)
    step(sched, runner)
    sched.add_request(c)
    assert sched.kv.num_free_blocks == 16 - 3 - 2
    assert sched.abort_request("a") and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == 16 - 2 and a.finished_time is not None
    assert not sched.abort_request("a") and not sched.abort_request("nope")
    assert sched.abort_request("c") and sched.num_waiting == 0  # waiting requests too
    out = sched.schedule()
    assert out.finished_ids == ["a", "c"] and [s.request.request_id for s in out.scheduled] == ["b"]
    # aborted between schedule() and update(): its token is dropped safely
    result = runner.execute(out)
    sched.finish_request("b", RequestStatus.FINISHED_STOPPED)  # e.g. the engine saw a stop string
    assert sched.update(out, result) == [] and b.output_token_ids == [b.output_token_ids[0]]
    assert b.status == RequestStatus.FINISHED_STOPPED and sched.kv.num_free_blocks == 16
    assert not sched.has_unfinished() and sched.schedule().finished_ids == ["b"]


def test_rejects_invalid_requests_naming_the_numbers():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        sched.add_request(req("e", []))
    with pytest.raises(InvalidRequestError, match="32 tokens but max_model_len=32 allows at most 31"):
        sched.add_request(req("long", range(32)))
    # 14 prompt + up to 4 generated = 17 slots (the last token is never fed back) = 5 blocks > 4
    with pytest.raises(InvalidRequestError, match="17 KV slots.*5 blocks of 4 tokens.*only 4 blocks"):
        sched.add_request(req("big", range(14), max_tokens=4))
    sched.add_request(req("fits", range(13), max_tokens=4))  # 16 slots = 4 blocks
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(req("fits", range(3)))
    with pytest.raises(InvalidRequestError, match="max_tokens=0"):
        sched.add_request(req("zero", range(3), max_tokens=0))
    assert sched.num_waiting == 1


@pytest.mark.parametrize(
    "kwargs, eos, fixed, reason, n_out",
    [
        ({"stop_token_ids": (5,)}, (), [8, 5, 9], RequestStatus.FINISHED_STOPPED, 2),
        ({}, (2,), [8, 2, 9], RequestStatus.FINISHED_STOPPED, 2),
        ({"ignore_eos": True}, (2,), [8, 2, 9, 9, 9], RequestStatus.FINISHED_LENGTH, 4),
        ({"stop_token_ids": (5,)}, (), [8, 8, 8, 5], RequestStatus.FINISHED_STOPPED, 4),  # stop beats length
        ({}, (), [8, 8, 8, 8, 8], RequestStatus.FINISHED_LENGTH, 4),
    ],
)
def test_stop_rules(kwargs, eos, fixed, reason, n_out):
    sched, runner = make()
    r = req("r", [1, 2, 3], max_tokens=4, eos=eos, **kwargs)
    runner.fixed["r"] = fixed
    sched.add_request(r)
    run_all(sched, runner)
    assert r.status == reason and r.output_token_ids == fixed[:n_out]
    assert sched.kv.num_free_blocks == 16


def test_max_model_len_ends_a_request():
    sched, runner = make(max_model_len=7)
    r = req("r", range(1, 6), max_tokens=100)  # 100 would not fit, but the context limit caps it
    sched.add_request(r)
    run_all(sched, runner)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 7 and len(r.output_token_ids) == 2


def test_heavy_preemption_gives_the_same_outputs_and_leaks_no_block():
    rng = random.Random(0)
    shared = [rng.randrange(1, 50) for _ in range(12)]
    specs = []
    for i in range(14):
        prompt = (shared[: rng.randrange(0, 12)] if i % 2 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
        specs.append((f"r{i}", prompt, rng.randrange(1, 12), i % 3))  # (id, prompt, max_tokens, arrival step)

    def run(num_blocks, budget, caching):
        sched, runner = make(
            num_blocks=num_blocks, block_size=4, caching=caching, max_model_len=40, max_num_batched_tokens=budget, max_num_seqs=6
        )
        reqs = {}
        for t in range(500):
            for rid, prompt, max_tokens, arrival in specs:
                if arrival == t:
                    reqs[rid] = req(rid, prompt, max_tokens=max_tokens)
                    sched.add_request(reqs[rid])
            if t > 3 and not sched.has_unfinished():
                break
            step(sched, runner)
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs.values())
        assert sched.kv.num_free_blocks == num_blocks and sched.kv.usage == 0.0
        return {rid: r.output_token_ids for rid, r in reqs.items()}, sched.num_preemptions, sched.kv.prefix_cache_stats

    reference, none, _ = run(num_blocks=200, budget=512, caching=False)
    assert none == 0
    for caching in (False, True):
        outputs, preemptions, stats = run(num_blocks=6, budget=7, caching=caching)
        assert preemptions > 0 and outputs == reference
        assert (stats.hits > 0) == caching  # shared prefixes and resumed requests hit the cache
