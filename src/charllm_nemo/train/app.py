"""``charllm train``: the Hydra application that composes conf/, validates, and launches.

    charllm train model=tiny_gpt parallel=tp2 nproc=2 batch.global_batch_size=8
    charllm train -m optim=base,comm_overlap,recompute,recompute_comm_overlap model=... parallel=...
    charllm train --config-dir recipes --config-name paper_optim_sweep     (a recipe)
    charllm train --cfg job                                                (print the config)

Order of events: Hydra composes the config -> it becomes a typed TrainConfig (a wrong type or an
unknown key is an error naming the key) -> the launcher's world size and device are known ->
:func:`charllm_nemo.train.validate.validate` checks everything, before any process group ->
a run directory holding an earlier run is refused (or, with ``telemetry.overwrite``, emptied of
it) -> the run directory ``telemetry.out_dir`` is created and the resolved config written to
``<out_dir>/config.yaml`` -> ranks start (train/launch.py).

The conf/ directory: ``$CHARLLM_CONF_DIR`` if set, else the repository checkout's ``conf/``
(editable installs), else the copy packaged as ``charllm_nemo/conf``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from charllm_nemo.alerts.observer import ALERTS_FILE
from charllm_nemo.errors import CharllmError, ConfigError
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.config_io import (
    CONFIG_NAME,
    compose,
    config_for_ranks,
    find_conf_dir,
    register_resolvers,
    resolved,
    save_train_config,
    train_config_from,
)
from charllm_nemo.train.launch import (
    launch_local,
    local_gpu_count,
    local_gpu_problem,
    resolve_device,
    slurm_rank_env,
    torchrun_rank_env,
)
from charllm_nemo.train.layout import ResolvedLayout
from charllm_nemo.train.report import STEPS_FILE, SUMMARY_FILE
from charllm_nemo.train.validate import validate

EXIT_CONFIG_ERROR = 2


def load(overrides: Sequence[str] = (), **kw: Any) -> TrainConfig:
    """Compose and convert to a typed TrainConfig (interpolations resolved)."""
    return train_config_from(compose(overrides, **kw))


def world_and_env(cfg: TrainConfig, environ: Mapping[str, str]) -> tuple[int, dict[str, str]]:
    """World size for validation, and the rank environment for an in-process launcher."""
    launcher = cfg.launch.launcher
    if launcher == "slurm":
        env = slurm_rank_env(environ, cfg.launch.master_port)
        return int(env["WORLD_SIZE"]), env
    if launcher == "none":
        env = torchrun_rank_env(environ)
        return int(env["WORLD_SIZE"]), env
    return cfg.launch.nproc, {}


RUN_FILES = (STEPS_FILE, SUMMARY_FILE, ALERTS_FILE)
"""What rank 0 writes at the top of a run directory, besides config.yaml (rewritten each run)."""


def previous_run_files(out_dir: Path) -> list[Path]:
    """An earlier run's files in ``out_dir``: its rank folders' store files, steps.jsonl and
    summary.json (nothing else there is this package's)."""
    from charllm_nemo.telemetry.store import rank_files

    found = [out_dir / name for name in RUN_FILES if (out_dir / name).is_file()]
    for folder in sorted(out_dir.glob("rank=*")):
        if folder.is_symlink():
            # A rank folder linked to another run's: the link is in the way (the ranks would
            # write through it into that run), and only the link goes with overwrite, never
            # the files it points at.
            found.append(folder)
            continue
        found += rank_files(folder)
    return found


def check_run_dir(cfg: TrainConfig, removes: bool) -> None:
    """Refuse a run directory that holds an earlier run (ConfigError: its files would mix with
    this run's), unless ``telemetry.overwrite``; then the process that ``removes`` (the launcher,
    or rank 0 of an in-process launcher, before any rank can write) deletes them."""
    from charllm_nemo.telemetry.filecheck import printable
    from charllm_nemo.telemetry.store import describe_files

    out = Path(cfg.telemetry.out_dir)
    old = previous_run_files(out)
    if not old:
        return
    if not cfg.telemetry.overwrite:
        found = printable(describe_files(old, out), 1000)  # file names: anyone's, escaped for a terminal
        raise ConfigError(
            f"telemetry.out_dir={str(out)!r} already holds a run ({found}); give a "
            "new directory (the default, runs/<time>, is new for every run), or telemetry.overwrite=true "
            "to replace that run"
        )
    if removes:
        # Its rank folders go too (an earlier run with more ranks would leave empty ones that
        # read as ranks), and so do the local launcher's per-rank logs.
        old += sorted(out.glob("logs/rank*.log"))
        for path in old:
            path.unlink(missing_ok=True)
        for folder in [*out.glob("rank=*"), out / "logs"]:
            with contextlib.suppress(OSError):  # not empty: something not ours is there
                folder.rmdir()
        print(f"charllm train: replaced the earlier run in {out} ({len(old)} files)", file=sys.stderr)


FRESH_NAME_TRIES = 1000
"""How many ``-2``, ``-3``, ... suffixes a generated run directory name may get before giving up."""


def _say_taken_export_ports(cfg: Any) -> None:
    """telemetry.export=prometheus: a port another job holds is said on the console once, naming
    it, before the ranks start (the rank's own error goes to its log, logs/rank<N>.log)."""
    if cfg.telemetry.export != "prometheus":
        return
    from charllm_nemo.telemetry.export.exporter import taken_ports

    host, port = cfg.telemetry.export_host, cfg.telemetry.export_port
    for local_rank, taken, why in taken_ports(host, port, cfg.launch.nproc):
        print(
            f"charllm: telemetry.export=prometheus: port {taken} on {host} (local rank {local_rank}) "
            f"cannot be listened on ({why}; another job on this node?): that rank exports nothing, "
            f"training goes on; give telemetry.export_port=<free port> (rank L uses it + L)",
            file=sys.stderr,
            flush=True,
        )


def claim_run_dir(out_dir: Path, *, fresh_name: bool) -> Path:
    """Create the run directory and return it (StoreError / ConfigError if it cannot be).

    ``fresh_name``: ``out_dir`` was generated (the default ``runs/<date-time>``, any
    ``telemetry.out_dir`` with a ``${...}`` in it), so this run must get a directory of its
    own: it is made with ``mkdir`` without ``exist_ok`` (atomic: of two launchers that start
    in the same second only one makes it), and a taken name gets ``-2``, ``-3``, ... Else the
    name is the user's: made if missing, and an earlier run in it is :func:`check_run_dir`'s."""
    from charllm_nemo.telemetry.store import check_writable

    if not fresh_name:
        check_writable(out_dir)
        return out_dir
    check_writable(out_dir.parent)
    for n in range(1, FRESH_NAME_TRIES + 1):
        candidate = out_dir if n == 1 else out_dir.with_name(f"{out_dir.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:  # a name too long, say: StoreError naming the directory
            check_writable(candidate)
            raise ConfigError(f"telemetry.out_dir={str(candidate)!r} cannot be made: {exc}") from exc
        check_writable(candidate)
        return candidate
    raise ConfigError(
        f"telemetry.out_dir={str(out_dir)!r} and {FRESH_NAME_TRIES - 1} suffixed names are all taken; "
        "give telemetry.out_dir explicitly"
    )


@contextlib.contextmanager
def run_dir_lock(out_dir: Path) -> Iterator[None]:
    """Hold ``out_dir`` for this run: an exclusive ``flock`` on the directory itself, released
    when the run ends (or its process dies, even by SIGKILL), that nothing is left behind for.
    A second run given the same directory while the first goes on is refused at once
    (ConfigError), before it writes config.yaml or starts a rank. A filesystem that cannot lock
    a directory (some NFS mounts) goes unlocked: the earlier-run check still applies."""
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"telemetry.out_dir={str(out_dir)!r} is in use by another run that is still going; give "
                "another directory (the default, runs/<time>, is new for every run), or wait for it to end"
            ) from None
        except OSError:
            pass  # no directory locks on this filesystem
        yield
    finally:
        os.close(fd)


def _where(out_dir: Path) -> None:
    """The last line of a run (after the launcher's failure report, if any): where its files
    are, and how to look at them."""
    print(f"charllm train: run directory {out_dir} (charllm inspect {out_dir})", file=sys.stderr, flush=True)


def _announce(cfg: TrainConfig, layout: ResolvedLayout) -> None:
    stages = layout.layers_per_stage
    vpp = f" vpp={layout.vpp}" if layout.vpp else ""
    print(
        f"charllm train: model={cfg.model.name} world={layout.world_size} tp={layout.tp} pp={layout.pp}{vpp} "
        f"cp={layout.cp} ep={layout.ep} dp={layout.dp} microbatches={layout.num_microbatches} "
        f"layers/stage={stages} device={cfg.launch.device} -> {cfg.telemetry.out_dir}",
        file=sys.stderr,
        flush=True,
    )


def _validated(cfg: TrainConfig, world: int) -> tuple[TrainConfig, ResolvedLayout]:
    """``cfg`` with its device decided (once, recorded, shared by ranks) and the settings that
    follow it resolved (precision, ...), and its layout for ``world`` ranks (ConfigError)."""
    cfg.launch.device = resolve_device(cfg.launch.device)
    cfg = for_device(cfg, cfg.launch.device)
    return cfg, validate(cfg, world_size=world, device=cfg.launch.device)


def dry_run(cfg: TrainConfig, environ: Mapping[str, str]) -> int:
    """Validate ``cfg`` as :func:`run` would and print the plan (train/plan.py) to stdout;
    start nothing, write nothing. The world size is the launcher's, or ``launch.nproc`` outside
    a SLURM allocation / torchrun (planning from a login node)."""
    from charllm_nemo.train.plan import describe_plan
    from charllm_nemo.train.plan_fit import fit_lines, memory_fit

    try:
        world, _ = world_and_env(cfg, environ)
    except ConfigError:
        # Outside the launcher's job (a login node): plan for nproc ranks. Inside one, its
        # environment is wrong: say so, as the real run would.
        inside = "SLURM_NTASKS" if cfg.launch.launcher == "slurm" else "WORLD_SIZE"
        if cfg.launch.launcher != "local" and inside in environ:
            raise
        world = cfg.launch.nproc
    cfg, layout = _validated(cfg, world)
    fit = memory_fit(cfg, layout)
    if fit is None:
        verdict = "memory fit not checked (no launch.platform with known memory)"
    elif not fit.any_fits:
        verdict = f"NO PLAN FITS {fit.device}'s memory"
    elif not fit.configured_fits:
        verdict = f"as configured it does NOT fit {fit.device}'s memory (other plans do)"
    else:
        verdict = f"fits {fit.device}'s memory"
    if cfg.launch.device == "cpu":
        verdict = "memory checked against this host at launch"
    print(
        f"charllm train: dry run for {world} rank(s) on {cfg.launch.device}: the configuration is "
        f"valid; {verdict}; nothing started"
    )
    for line in describe_plan(cfg, layout) + fit_lines(cfg, fit):
        print(f"  {line}")
    sys.stdout.flush()
    # No plan fits the named device: exit 1, so a script that plans before it queues stops here.
    return 1 if fit is not None and not fit.any_fits else 0


def run(cfg: TrainConfig, *, environ: Mapping[str, str] | None = None, fresh_name: bool | None = None) -> int:
    """Validate ``cfg`` for its launcher and start it (or, with ``launch.dry_run``, print what
    it would run); returns the exit code. Raises ConfigError (every problem listed) before
    anything starts. ``fresh_name``: ``telemetry.out_dir`` was generated, not named by the user
    (:func:`claim_run_dir`); None: it was if it still holds a ``${...}``."""
    environ = os.environ if environ is None else environ
    if fresh_name is None:
        fresh_name = "${" in cfg.telemetry.out_dir
    cfg = resolved(cfg)
    if cfg.launch.dry_run:
        return dry_run(cfg, environ)
    world, rank_env = world_and_env(cfg, environ)
    cfg, layout = _validated(cfg, world)
    if cfg.launch.launcher == "local" and cfg.launch.device == "cuda":
        problem = local_gpu_problem(cfg.launch.nproc, local_gpu_count(environ))
        if problem:
            raise ConfigError(problem)
    if cfg.launch.launcher == "local":
        # One process decides the directory, before any rank starts, and hands it to them in
        # config.yaml: a generated name taken by a run started in the same second gets a suffix.
        out_dir = claim_run_dir(Path(cfg.telemetry.out_dir), fresh_name=fresh_name)
        cfg.telemetry.out_dir = str(out_dir)
        with run_dir_lock(out_dir):
            check_run_dir(cfg, removes=True)
            _announce(cfg, layout)
            _say_taken_export_ports(cfg)
            with config_for_ranks(cfg, out_dir / "config.yaml") as config_path:  # secrets: not in the run dir
                rc = launch_local(
                    config_path, cfg.launch.nproc, run_dir=out_dir, master_port=cfg.launch.master_port
                )
        _where(out_dir)
        return rc
    # slurm / none: this process is one rank. Every rank computes the same name (the job's id),
    # so none may add a suffix; rank 0 makes the directory and holds it for the run.
    out_dir = Path(cfg.telemetry.out_dir)
    lead = rank_env.get("RANK") == "0"
    if lead:
        claim_run_dir(out_dir, fresh_name=False)
    with run_dir_lock(out_dir) if lead else contextlib.nullcontext():
        check_run_dir(cfg, removes=lead)
        os.environ.update(rank_env)
        if lead:
            _announce(cfg, layout)
            save_train_config(cfg, out_dir / "config.yaml")
        from charllm_nemo.train.loop import run_rank
        from charllm_nemo.train.worker import sigterm_unwinds

        with sigterm_unwinds():  # as a locally launched rank: SLURM's SIGTERM still ends in summary.json
            result = run_rank(cfg)
    if lead:
        _where(out_dir)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _generated_out_dir(dcfg: DictConfig) -> bool:
    """Whether ``telemetry.out_dir`` is generated (an interpolation such as the default
    ``runs/${charllm_run_id:...}``), read before it is resolved."""
    raw = OmegaConf.to_container(dcfg, resolve=False)
    telemetry = raw.get("telemetry") if isinstance(raw, dict) else None
    value = telemetry.get("out_dir") if isinstance(telemetry, dict) else None
    return isinstance(value, str) and "${" in value


def _job(dcfg: DictConfig) -> int:
    """The Hydra task: one run (or one job of a sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    if sweep and OmegaConf.select(dcfg, "sweep.run_key") is not None:
        # A sweep recipe's job (+sweep=<name>): attempts and their states (charllm_nemo/sweep).
        from charllm_nemo.train.sweep_job import run_sweep_job

        return run_sweep_job(dcfg, Path(hc.runtime.output_dir), run)
    if sweep:
        # Each job of a sweep gets its own run directory: Hydra's job directory.
        dcfg = OmegaConf.merge(dcfg, {"telemetry": {"out_dir": hc.runtime.output_dir}})  # type: ignore[assignment]
    try:
        return run(train_config_from(dcfg), fresh_name=_generated_out_dir(dcfg))
    except CharllmError as exc:  # a config value, or this machine (no driver, a run directory)
        print(f"charllm train: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    finally:
        if sweep and OmegaConf.select(dcfg, "launch.dry_run"):  # Hydra made the job's folder: empty it stays
            with contextlib.suppress(OSError):
                Path(hc.runtime.output_dir).rmdir()


def main(argv: Sequence[str] | None = None) -> int:
    """``charllm train [hydra overrides and flags]``; returns the exit code (0 ok, 2 config error,
    else the failing rank's code). In a sweep the worst job's code is returned."""
    import hydra

    from charllm_nemo.train.worker import configure_logging

    configure_logging()  # the launcher's own messages; in-process ranks (srun, torchrun) too
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        conf_dir = find_conf_dir()
    except ConfigError as exc:
        print(f"charllm train: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    register_resolvers()
    from charllm_nemo.sinks.base import ABANDONED, exit_now_if_abandoned

    ABANDONED.clear()  # only this run's sinks count (a process may run several: tests, notebooks)
    codes: list[int] = []
    started: list[bool] = []

    def task(dcfg: DictConfig) -> int:
        started.append(True)
        rc = _job(dcfg)
        codes.append(rc)
        return rc

    app = hydra.main(version_base="1.3", config_path=str(conf_dir), config_name=CONFIG_NAME)(task)
    saved_argv = sys.argv
    sys.argv = ["charllm train", *args]
    try:
        app()
    except KeyboardInterrupt:
        # Ctrl-C in an in-process rank (launcher=slurm / none): the rank closed `interrupted`
        # on its way out; the shell's 130, no traceback. (launcher=local forwards it instead.)
        print("charllm train: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0):
            from charllm_nemo.train.sweep_manifest import EXIT_NOT_DONE

            # Hydra rejected the command line (unknown option, bad override), unless a sweep's
            # jobs ran elsewhere (SLURM) and some did not end done.
            if not started and code != EXIT_NOT_DONE:
                return EXIT_CONFIG_ERROR
            return code if isinstance(code, int) else 1
    finally:
        sys.argv = saved_argv
    code = max(codes, default=0, key=lambda c: (c != 0, c))
    exit_now_if_abandoned(code)  # an in-process rank (srun, torchrun) whose W&B hung
    return code


if __name__ == "__main__":
    sys.exit(main())
