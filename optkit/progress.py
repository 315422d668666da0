"""Progress reporting for pipeline stages: rich bars in the CLI, silence in library use."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

Advance = Callable[[], None]


class Reporter:
    """Times each stage under a stable ``key`` (``load``, ``quantize``...); subclasses show the
    human ``label``. ``stage()`` yields an ``advance()`` callable."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextmanager
    def stage(self, key: str, label: str, total: int | None = None) -> Iterator[Advance]:
        t0 = time.perf_counter()
        try:
            yield lambda: None
        finally:
            self.timings[key] = time.perf_counter() - t0


class RichReporter(Reporter):
    """One line per stage: a spinner for open-ended work, a bar when the total is known."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    @contextmanager
    def stage(self, key: str, label: str, total: int | None = None) -> Iterator[Advance]:
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is not None:
            columns += [BarColumn(), MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        # The base class times the stage; this one only draws it.
        with super().stage(key, label, total), Progress(*columns, console=self.console, transient=False) as progress:
            task = progress.add_task(label, total=total)
            yield lambda: progress.advance(task)
            if total is None:
                progress.update(task, total=1, completed=1)
