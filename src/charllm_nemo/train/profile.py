"""PyTorch profiler traces for chosen training steps (``telemetry.profile_steps=[...]``).

Each chosen step is recorded on every rank into the run directory as a chrome-trace JSON file,
``<run>/traces/rank=<r>/step-<NNNNNN>.json`` (outside the ``rank=N`` telemetry folders, which
hold only the store's own files), written to a dot-prefixed temporary name and renamed into
place, so a reader never sees half a trace. ``charllm analyze`` turns them into the kernel
breakdown (analysis/kernels.py, docs/analysis.md).

A profiled step is slower (the profiler records every operator and kernel; on a GPU it also
synchronises at the end of the step to collect the kernels) and the trace is written when the
step ends, before the next begins; pick steps after the warm-up and keep them few."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from charllm_nemo.telemetry.write import make_dir


def trace_path(run_dir: str | os.PathLike[str], rank: int, step: int) -> Path:
    """Where step ``step``'s trace of rank ``rank`` goes."""
    return Path(run_dir) / "traces" / f"rank={rank}" / f"step-{step:06d}.json"


class StepProfiler:
    """Records the steps in ``steps`` (step numbers as the loop counts them, from 0); every
    other step runs untouched (``step()`` is then a no-op context)."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, steps: Iterable[int]) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.steps = frozenset(int(s) for s in steps)
        self.written: list[Path] = []

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap one training step: ``with profiler.step(step): ...``."""
        if step not in self.steps:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            yield
        path = trace_path(self.run_dir, self.rank, step)
        make_dir(path.parent, root=self.run_dir)  # RUN/traces a planted link: refused
        tmp = path.with_name(f".{path.name}.tmp")
        with suppress(FileNotFoundError):  # torch opens it by name: a link planted there goes first
            os.unlink(tmp)
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
        self.written.append(path)
