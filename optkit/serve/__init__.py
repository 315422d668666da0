"""The reference runner: an engine that serves an optkit artifact.

Seams (data-only messages between them):
``Scheduler.schedule() -> SchedulerOutput``; ``ModelRunner.execute(out) -> RunnerOutput``;
``Scheduler.update(out, result) -> list[Request]`` (the requests that got a token).
The scheduler never touches tensors; the runner never decides policy.
"""
