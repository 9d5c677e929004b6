"""``hydra/sweeper=charllm``: Hydra's basic sweeper (the cartesian product of the swept
overrides) made resumable, with a manifest (charllm_nemo/train/sweep_manifest.py, docs/sweeps.md).

For ``charllm train -m +sweep=<name> [hydra/launcher=<preset>] [overrides]``:

1. the matrix is expanded; each configuration gets a stable key from its swept overrides;
2. ``<sweep.dir>/sweep=<name>/sweep.json`` is read (if there) and brought up to date (each
   attempt's ``job.json``, SLURM for jobs that could not say how they ended);
3. a configuration that is done is skipped; one that failed (or ran out of memory) is skipped
   unless ``sweep.retry_failed=true``; a preempted one runs again; one still pending or running
   in SLURM is left alone;
4. each configuration left is validated for the sweep's world size and its memory planned
   (the dry run's figures): one that cannot fit ``sweep.gpu_memory_gib`` is recorded
   ``out_of_memory_predicted``, one that does not validate ``failed``; neither is submitted;
5. the rest are launched as attempt ``n`` (one past the last) through Hydra's launcher; the
   submitit launcher presets report job ids as they submit; states are refreshed when the
   launcher returns, the manifest written and printed as a table.

``dry_run=true`` does 1-4 and prints the verdicts; it writes and submits nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

from charllm_nemo.errors import ConfigError
from charllm_nemo.sweep.plan import plan_configuration
from charllm_nemo.sweep.status import SLURM_ALIVE, refresh, slurm_job_state, status_lines
from charllm_nemo.train.sweep_manifest import (
    DONE,
    EXIT_NOT_DONE,
    FAILED,
    FINAL,
    OUT_OF_MEMORY,
    OUT_OF_MEMORY_PREDICTED,
    PENDING,
    PREEMPTED,
    RUNNING,
    Attempt,
    SweepManifest,
    load_manifest,
)

log = logging.getLogger(__name__)

WAIT_POLL_S = 2.0


@dataclass
class CharllmSweeperConf:
    _target_: str = "hydra_plugins.charllm_sweeps.sweeper.CharllmSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = field(default_factory=dict)


def _world_size(cfg: DictConfig) -> int:
    """The ranks of one job: the submitit preset's nodes x tasks per node, else ``nproc``."""
    launcher = OmegaConf.select(cfg, "hydra.launcher")
    if launcher is not None and "nodes" in launcher and "tasks_per_node" in launcher:
        return int(launcher.nodes) * int(launcher.tasks_per_node)
    return int(OmegaConf.select(cfg, "nproc") or 1)


def _requeued(attempt: Attempt | None) -> bool:
    """Whether ``attempt``'s SLURM job is queued or running again (``scontrol requeue``)."""
    if attempt is None or attempt.scheduler != "slurm" or not attempt.job_id:
        return False
    return slurm_job_state(str(attempt.job_id)) in SLURM_ALIVE


def _is_fixed(override: str) -> bool:
    """Overrides that define every configuration (not placement, launcher or sweep settings)."""
    key = override.split("=", 1)[0].lstrip("+~")
    return not (key.startswith("hydra") or key.startswith("sweep.") or key == "sweep")


class CharllmSweeper(BasicSweeper):
    """See the module's docstring."""

    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None) -> None:
        super().__init__(max_batch_size=None, params=params)

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        settings = OmegaConf.select(self.config, "sweep")
        if settings is None or not settings.get("name"):
            raise ConfigError(
                "hydra/sweeper=charllm needs a sweep recipe: add +sweep=<name> (conf/sweep/, docs/sweeps.md)"
            )
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parsed = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(
            params_conf
        )
        swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
        matrix = {
            o.get_key_element(): [str(v) for v in o.sweep_string_iterator()]
            for o in parsed
            if o.is_sweep_override()
        }
        fixed = sorted(
            f"{o.get_key_element()}={o.get_value_element_as_str()}"
            for o in parsed
            if not o.is_sweep_override() and _is_fixed(o.get_key_element())
        )
        configurations = self.split_arguments(parsed, None)[0]
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        dry = bool(OmegaConf.select(self.config, "launch.dry_run"))
        manifest = self._manifest(sweep_dir, str(settings.name), matrix, fixed, dry)
        world = _world_size(self.config)
        gpu_gib = settings.get("gpu_memory_gib")
        retry = bool(settings.get("retry_failed"))

        batch: list[list[str]] = []
        skipped: dict[str, int] = {}
        hours: list[float] = []
        assume = None
        if settings.get("gpu"):
            from charllm_nemo.sweep.plan import Throughput

            assume = Throughput(
                str(settings.gpu),
                float(settings.get("assumed_mfu") or 0.35),
                float(settings.get("startup_min") or 0),
            )
        for overrides in configurations:
            mine = [o for o in overrides if o.split("=", 1)[0] in swept]
            entry = manifest.entry(mine)
            if (
                entry.state == DONE
                or (entry.state in (FAILED, OUT_OF_MEMORY) and not retry)
                # its job is still queued or running (an earlier command's); without a job id it
                # never reached a scheduler, or ran in a sweep process that is gone: run it again
                or (entry.state in (PENDING, RUNNING) and entry.latest is not None and entry.latest.job_id)
                # preempted, and requeued by submitit: the requeued job is the next attempt
                or (entry.state == PREEMPTED and _requeued(entry.latest))
            ):
                skipped[entry.state] = skipped.get(entry.state, 0) + 1
                continue
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            verdict = self._plan(job_cfg, world, gpu_gib, str(settings.get("layers") or "te"), assume)
            entry.predicted_peak_gib = verdict.peak_gib
            if dry:
                state = verdict.state or "valid"
                if verdict.gpu_hours is not None:
                    hours.append(verdict.gpu_hours)
                    state += f"; {verdict.gpu_hours:,.1f} GPU hours"
                print(
                    f"{entry.key}: {state}; estimated peak {verdict.peak_gib} GiB per rank"
                    + (f"; {verdict.reason}" if verdict.reason else "")
                )
                continue
            if verdict.state is not None:
                entry.state, entry.exit_reason = verdict.state, verdict.reason
                continue
            n = entry.next_attempt()
            entry.attempts.append(Attempt(attempt=n, state=PENDING))
            entry.state, entry.exit_reason = PENDING, None
            batch.append([*overrides, f"sweep.run_key={entry.key}", f"sweep.attempt={n}"])
        if dry:
            if hours and assume is not None:
                print(
                    f"sweep {manifest.name}: about {sum(hours):,.0f} GPU hours for the {len(hours)} "
                    f"configuration(s) that fit ({assume.device} at {assume.mfu:.0%} MFU, "
                    f"{assume.startup_min:g} min start-up a job)"
                )
            print(
                f"sweep {manifest.name}: {len(configurations)} configuration(s) for {world} rank(s); "
                "nothing submitted"
            )
            return []
        manifest.save(sweep_dir)
        if skipped:
            print(
                f"charllm train: sweep {manifest.name}: launching {len(batch)} of {len(configurations)} "
                "configuration(s); left as they are: "
                + ", ".join(f"{n} {state}" for state, n in sorted(skipped.items()))
                + (
                    ""
                    if retry or not skipped.get(FAILED)
                    else " (sweep.retry_failed=true re-runs failed ones)"
                ),
                file=sys.stderr,
            )
        returns: list[JobReturn] = []
        if batch:
            returns = self._launch(batch, manifest, sweep_dir)
        refresh(manifest, sweep_dir)
        manifest.save(sweep_dir)
        for line in status_lines(manifest):
            print(line, file=sys.stderr)
        unfinished = [e.key for e in manifest.runs.values() if e.state not in (DONE, OUT_OF_MEMORY_PREDICTED)]
        if unfinished:
            print(
                f"charllm train: {len(unfinished)} configuration(s) not done "
                f"(charllm sweep status {sweep_dir}); "
                "run the same command again to resume (sweep.retry_failed=true re-runs failed ones)",
                file=sys.stderr,
            )
            raise SystemExit(EXIT_NOT_DONE)
        return returns

    def _manifest(
        self, sweep_dir: Path, name: str, matrix: dict[str, list[str]], fixed: list[str], dry: bool
    ) -> SweepManifest:
        assert self.config is not None
        manifest = load_manifest(sweep_dir)
        if manifest is None:
            try:
                launcher = OmegaConf.to_container(self.config.hydra.launcher, resolve=True)
            except Exception:  # an interpolation only a job can resolve: keep it as written
                launcher = OmegaConf.to_container(self.config.hydra.launcher, resolve=False)
            assert isinstance(launcher, dict)
            return SweepManifest(
                name=name,
                directory=str(sweep_dir),
                matrix=matrix,
                fixed_overrides=fixed,
                launcher={str(k): v for k, v in launcher.items()},
            )
        if manifest.fixed_overrides != fixed:
            raise ConfigError(
                f"{sweep_dir} holds sweep {manifest.name!r} run with {manifest.fixed_overrides}, "
                f"not {fixed}: "
                "give the same overrides to resume it, or another sweep.dir (or sweep.name) for a new sweep"
            )
        manifest.matrix.update(matrix)
        if not dry:
            refresh(manifest, sweep_dir)
        return manifest

    @staticmethod
    def _plan(job_cfg: DictConfig, world: int, gpu_gib: Any, layers: str, assume: Any) -> Any:
        from charllm_nemo.sweep.plan import Verdict
        from charllm_nemo.train.config_io import train_config_from

        try:
            cfg = train_config_from(job_cfg)
        except ConfigError as exc:
            return Verdict(FAILED, None, str(exc))
        gib = float(gpu_gib) if gpu_gib is not None else None
        return plan_configuration(cfg, world, gib, layers, assume)

    def _launch(self, batch: list[list[str]], manifest: SweepManifest, sweep_dir: Path) -> list[JobReturn]:
        """Launch ``batch``; job ids go into the manifest as the launcher reports them. A
        launcher that raises (a job failed or was cancelled) does not stop the sweep: states come
        from the attempts' files and SLURM, after waiting for every job of this batch to end."""
        by_key = {o[-2].split("=", 1)[1]: o for o in batch}

        def submitted(jobs: list[tuple[list[str], str, str]]) -> None:
            for overrides, job_id, scheduler in jobs:
                key = next((o.split("=", 1)[1] for o in overrides if o.startswith("sweep.run_key=")), None)
                entry = manifest.runs.get(key or "")
                if entry is not None and entry.latest is not None:
                    entry.latest.job_id, entry.latest.scheduler = job_id, scheduler
            manifest.save(sweep_dir)

        launcher = self.launcher
        assert launcher is not None
        if hasattr(launcher, "on_submitted"):  # the presets' launchers (launchers.py)
            setattr(launcher, "on_submitted", submitted)  # noqa: B010 - not every Launcher has it
        try:
            return list(launcher.launch(batch, initial_job_idx=0))
        except Exception as exc:  # submitit: a job ended without a result (cancelled, killed)
            log.warning("a job of the sweep did not return (%s): waiting for the others", exc)
            self._wait(manifest, sweep_dir, set(by_key))
            return []

    @staticmethod
    def _wait(manifest: SweepManifest, sweep_dir: Path, keys: set[str]) -> None:
        """Until every attempt of ``keys`` that has a job id is in a final state."""
        while True:
            refresh(manifest, sweep_dir)
            alive = [
                k
                for k in keys
                if (a := manifest.runs[k].latest) is not None and a.job_id and a.state not in FINAL
            ]
            if not alive:
                return
            time.sleep(WAIT_POLL_S)
