"""Console entry point ``charllm``.

Subcommands:

* ``charllm telemetry``: sample a device for a while, marking a small CPU workload as steps
  with forward / backward / optimizer phases, write a run directory, print its attribution.
* ``charllm inspect RUN``: load a run directory (any rank count), report what it holds and
  what was skipped, print the attribution of its windows.
* ``charllm analyze PATH`` / ``charllm report PATH``: tables, figures and an HTML report for a
  run or a sweep directory (docs/analysis.md).
* ``charllm advise PATH``: a pipeline layout and micro batch size from a run's or sweep's
  measurements, with the ``charllm train`` overrides that apply them (docs/advisor.md).
* ``charllm train ...``: Megatron-Core training driven by the Hydra recipes in conf/.
* ``charllm sweep status DIR``: a sweep's configurations and their states (docs/sweeps.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from charllm_nemo.errors import CharllmError, ConfigError, StoreError


def _busy(seconds: float) -> None:
    """Keep one core busy for ``seconds`` with real arithmetic (the demo's 'compute')."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((96, 96))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = np.tanh(a @ a * 0.01)


def cmd_telemetry(args: argparse.Namespace) -> int:
    from charllm_nemo.telemetry.session import TelemetrySession
    from charllm_nemo.telemetry.session_options import SessionOptions, StoreOptions

    out = Path(args.out)
    options: dict[str, Any] = {"activity": "marks"} if args.backend == "synthetic" else {}
    backend, devices = args.backend, None
    if args.devices is not None:
        backend, devices, options = resolve_devices(args.backend, args.devices, options)
    session_options = SessionOptions(
        backend=backend,
        devices=devices,
        hz=args.hz,
        sampler=args.sampler,
        backend_options=options,
        store=StoreOptions(overwrite=args.overwrite, driver_buffers=not args.no_driver_buffers),
    )
    config = {"command": "telemetry", "seconds": args.seconds, "step_s": args.step_s}
    session = TelemetrySession(out, session_options, config=config)
    n_dev = len(session.backend.devices)
    session.start()
    print(
        f"sampling {n_dev} device(s) via {session.source} at {args.hz:g} Hz in a "
        f"{session.sampler_mode} for {args.seconds:g} s: {out}"
    )
    t_end = time.monotonic() + args.seconds
    step = 0
    rec = session.windows
    status = "failed"  # until the loop below ends by itself
    try:
        # Idle lead-in, then steps of forward (40 %), backward (40 %), optimizer (10 %), idle gap.
        time.sleep(min(0.2, args.seconds / 10))
        while time.monotonic() + args.step_s <= t_end:
            with rec.window("step", step=step):
                for phase, share in (("forward", 0.4), ("backward", 0.4), ("optimizer", 0.1)):
                    with rec.window(
                        "phase", phase, step=step, microbatch=0 if phase != "optimizer" else None
                    ):
                        _busy(args.step_s * share)
            time.sleep(args.step_s * 0.1)
            step += 1
        time.sleep(max(0.0, t_end - time.monotonic()))
        status = "complete"
    except KeyboardInterrupt:
        # Ctrl-C: the run so far is kept and said to be cut short (the telemetry process
        # ignores SIGINT and stores what it has); no traceback, the shell's 130.
        status = "interrupted"
    finally:
        session.close(status)
    if status == "interrupted":
        print(f"interrupted (Ctrl-C) after {step} step(s); run directory {out} (status interrupted)")
        return EXIT_INTERRUPTED
    health = session.health
    print(
        f"{health.samples} samples, {health.deadline_ratio() * 100:.1f} % of deadlines met, "
        f"read {health.read_ns_mean() / 1e3:.1f} us/sample; {step} steps marked"
    )
    return _print_run(out, kinds=("step", "phase"))


def devices_list(text: str) -> list[int] | str:
    """``--devices``: ``all``, or host device indices ``0,3`` (each once, >= 0)."""
    if text.strip().lower() == "all":
        return "all"
    try:
        indices = [int(part) for part in text.split(",")]
    except ValueError:
        indices = []
    if not indices or any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device list; use all, or host indices such as 0 or 0,3 (each once)"
        )
    return indices


def resolve_devices(
    backend: str, wanted: list[int] | str, options: dict[str, Any]
) -> tuple[str, list[int], dict[str, Any]]:
    """The backend name, device indices and backend options that ``--devices`` asks for.

    The backend is opened once to see which devices the host has, so that an index it lacks is
    an error naming ``--devices`` and the indices present (``auto`` would otherwise fall back to
    another device). The synthetic model has as many devices as asked for: ``all`` is one, a
    list ``0,3`` opens devices up to index 3 and samples those two."""
    from charllm_nemo.devices.factory import open_backend

    if backend != "synthetic":
        probe = open_backend(backend)
        try:
            name, present = probe.name, [d.identity.index for d in probe.devices]
        finally:
            probe.close()
        if name != "synthetic":
            if isinstance(wanted, str):  # all
                return name, present, options
            missing = [i for i in wanted if i not in present]
            if missing:
                raise ConfigError(
                    f"--devices {','.join(map(str, wanted))}: {', '.join(map(str, missing))} not on this "
                    f"host ({name} sees {', '.join(map(str, present)) or 'none'}); use all or those indices"
                )
            return name, list(wanted), options
        backend = "synthetic"  # auto found no GPU library: the warning has been given
    indices = [0] if isinstance(wanted, str) else list(wanted)
    return "synthetic", indices, {**options, "count": max(indices) + 1}


EXIT_INTERRUPTED = 128 + 2
"""``charllm telemetry``'s exit code after Ctrl-C (SIGINT), as a shell reports it."""


def finite_number(least: float, *, inclusive: bool) -> Any:
    """An argparse ``type`` for a float that must be finite and > ``least`` (>= when
    ``inclusive``): ``nan``, ``inf`` and out-of-range values are a usage error naming the bound,
    not a run that never ends or ends at once."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = value >= least if inclusive else value > least
        if not (math.isfinite(value) and above):
            raise argparse.ArgumentTypeError(
                f"{text!r} must be a finite number {'>=' if inclusive else '>'} {least:g}"
            )
        return value

    parse.__name__ = "number"  # argparse names the type in its message
    return parse


def sampling_rate(text: str) -> float:
    """An argparse ``type`` for ``--hz``: the samplers' own range check (sample_loop.hz_problem)."""
    from charllm_nemo.telemetry.sample_loop import hz_problem

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    problem = hz_problem(value, "--hz")
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def nonempty_path(text: str) -> str:
    """An argparse ``type`` for an output path: empty (or blank) would write into the current
    directory, which is never what was meant."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "an empty path would write into the current directory; give a directory"
        )
    return text


def steps_range(text: str) -> tuple[int | None, int | None]:
    """``--steps``: ``A:B`` (steps A to B-1), ``A:`` (from A), ``:B``, or ``N`` (step N alone).
    Bounds past the 64-bit range a step column holds are clamped to it (same steps selected)."""

    def bound(v: int) -> int:
        return min(max(v, -(2**63)), 2**63 - 1)

    try:
        if ":" not in text:
            return bound(int(text)), bound(int(text) + 1)
        a, b = text.split(":", 1)
        return (bound(int(a)) if a.strip() else None), (bound(int(b)) if b.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step range; use e.g. 100:110, 100:, :10 or 7"
        ) from None


def _print_run(
    path: Path,
    kinds: tuple[str, ...] | None,
    steps: tuple[int | None, int | None] = (None, None),
    ranks: Sequence[int] | None = None,
) -> int:
    import dataclasses

    import pyarrow as pa
    import pyarrow.compute as pc

    from charllm_nemo.telemetry.filecheck import printable
    from charllm_nemo.telemetry.join import attribute_run
    from charllm_nemo.telemetry.layout import scan_run
    from charllm_nemo.telemetry.reader import load_run
    from charllm_nemo.telemetry.window_table import sampling_gap_line, window_table_lines

    files = scan_run(path)
    run = load_run(path, files)
    missing = sorted(set(ranks or ()) - set(run.ranks))
    if missing:
        raise StoreError(f"--rank {', '.join(map(str, missing))}: not in {path}; ranks present: {run.ranks}")
    windows = run.windows
    first, end = steps
    if windows.num_rows and first is not None:
        windows = windows.filter(pc.greater_equal(windows.column("step"), first))
    if windows.num_rows and end is not None:
        windows = windows.filter(pc.less(windows.column("step"), end))
    if windows.num_rows and ranks:
        windows = windows.filter(
            pc.is_in(windows.column("rank"), pa.array(list(ranks), windows.column("rank").type))
        )
    problems = list(run.problems)
    ended = _how_it_ended(files, run.manifests, problems)
    # Everything printed from here on may hold text from the run's files (names, statuses,
    # hosts, paths): escaped, so a file cannot move the cursor or recolour the terminal.
    for p in problems:
        print(f"warning: {printable(p, 1000)}", file=sys.stderr)
    backends = sorted({str(m.get("backend", "?")) for m in run.manifests.values()})
    print(
        f"{printable(path, 1000)}: {len(run.ranks)} rank(s), {run.samples.num_rows} samples, "
        f"{run.windows.num_rows} windows, backend {printable(', '.join(backends))}"
    )
    for line in ended:
        print(printable(line, 1000))
    if "synthetic" in backends:
        print("NOTE: synthetic device: the figures below come from a model, not from hardware")
    buffered = None
    if any(f.buffered for f in files.ranks.values()):
        from charllm_nemo.telemetry.buffered import load_buffered

        buffered = load_buffered(path)
    table = attribute_run(dataclasses.replace(run, windows=windows), kinds, buffered)
    if table.num_rows == 0:
        print("no windows to attribute")
        return 0
    gaps = sampling_gap_line(table)
    if gaps:
        print(gaps)
    for line in window_table_lines(table):
        print(line)
    return 0


def _how_it_ended(files: Any, manifests: Mapping[int, Mapping[str, Any]], problems: list[str]) -> list[str]:
    """Each rank's writer status (manifest), and for a training run what rank 0 reported
    (summary.json, or steps.jsonl when the rank could not write a summary). ``files``: the
    run's :class:`~charllm_nemo.telemetry.layout.RunFiles`; what is wrong with a file goes to
    ``problems`` (the lines returned are not yet escaped for a terminal)."""
    from charllm_nemo.telemetry.filecheck import validate_step, validate_summary
    from charllm_nemo.telemetry.layout import SIZE_CAPS, iter_jsonl_numbered, read_json

    ranks_by_status: dict[str, list[int]] = {}
    for rank, m in sorted(manifests.items()):
        ranks_by_status.setdefault(str(m.get("status", "?")), []).append(rank)
    lines = [
        "status: "
        + ", ".join(
            f"{status} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
            if len(ranks) <= 8
            else f"{status} ({len(ranks)} ranks)"
            for status, ranks in ranks_by_status.items()
        )
    ]
    if files.summary is not None:
        raw = read_json(files.summary, SIZE_CAPS["summary"], problems)
        if raw is None:
            return [*lines, "training: summary.json unreadable (see the warning above)"]
        d = validate_summary(raw, files.summary, problems)
        step_ms = d.get("step_time_s_median")
        tok = d.get("tokens_per_s_median")
        energy = d.get("energy_j_median")
        lines.append(
            f"training: {d.get('status', '?')} after {d.get('steps', '?')} step(s)"
            + (f"; median step {step_ms * 1e3:.1f} ms" if step_ms is not None else "")
            + (f", {tok:.0f} tokens/s" if tok is not None else "")
            + (f", {energy:.1f} J/step (all ranks)" if energy is not None else "")
        )
        if isinstance(d.get("memory"), dict):
            from charllm_nemo.train.plan import memory_line

            line = memory_line(d["memory"])
            if line:
                lines.append(line)
    elif files.steps is not None:
        n = sum(
            1
            for lineno, row in iter_jsonl_numbered(files.steps, SIZE_CAPS["steps"], problems)
            if validate_step(row, f"{files.steps}:{lineno}", problems)
        )
        lines.append(
            f"training: no summary.json (rank 0 did not get to write it: killed?); steps.jsonl holds "
            f"{n} step(s)"
        )
    return lines


def cmd_inspect(args: argparse.Namespace) -> int:
    kinds = tuple(args.kind) if args.kind else None
    return _print_run(Path(args.run_dir), kinds, args.steps, args.rank)


def cmd_compact(args: argparse.Namespace) -> int:
    from charllm_nemo.telemetry.compact import cmd_compact as run

    return run(args.run_dir)


def cmd_sweep_status(args: argparse.Namespace) -> int:
    from charllm_nemo.sweep.status import sweep_status
    from charllm_nemo.telemetry.filecheck import printable
    from charllm_nemo.train.sweep_manifest import find_sweeps

    path = Path(args.dir)
    sweeps = find_sweeps(path)
    if not sweeps:
        raise StoreError(
            f"{path} holds no sweep (no sweep.json in it, nor one or two folders down); sweeps are "
            "written by `charllm train -m +sweep=<name>` under sweep.dir (default runs/sweeps)"
        )
    listed = 0
    for i, folder in enumerate(sweeps):
        lines, problems = sweep_status(folder, ask_slurm=not args.no_slurm)
        if i:
            print()
        for line in lines:
            print(line)
        for p in problems:
            print(f"charllm sweep status: warning: {p}", file=sys.stderr)
        listed += bool(lines)
    if not listed:  # every sweep.json found was unreadable: nothing was shown, say so in the status
        print(
            f"charllm sweep status: error: no sweep under {printable(path)} could be read "
            f"({len(sweeps)} sweep.json found, each named above with why)",
            file=sys.stderr,
        )
        return 2
    return 0


def _cmd_wandb_dashboard(args: argparse.Namespace) -> int:
    from charllm_nemo.sinks.dashboard import cmd_wandb_dashboard

    return cmd_wandb_dashboard(args)


def cmd_train(argv: Sequence[str]) -> int:
    from charllm_nemo.train.app import main as train_main

    return train_main(list(argv))


def build_parser() -> argparse.ArgumentParser:
    from charllm_nemo.devices.factory import BACKEND_NAMES
    from charllm_nemo.telemetry.placement import SAMPLER_MODES
    from charllm_nemo.telemetry.sample_loop import DEFAULT_HZ, MAX_HZ, MIN_HZ

    parser = argparse.ArgumentParser(prog="charllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "telemetry", help="sample a device under a small marked workload and write a run directory"
    )
    t.add_argument("--backend", default="auto", choices=BACKEND_NAMES, help="device backend (default: auto)")
    t.add_argument(
        "--hz",
        type=sampling_rate,
        default=DEFAULT_HZ,
        help=f"sampling rate, {MIN_HZ:g}-{MAX_HZ:g} Hz (default: {DEFAULT_HZ:g})",
    )
    t.add_argument(
        "--sampler",
        default="auto",
        choices=SAMPLER_MODES,
        help="where sampling and storing run (default: auto = a telemetry process, else threads)",
    )
    t.add_argument(
        "--seconds",
        type=finite_number(0.0, inclusive=False),
        default=3.0,
        help="how long to sample (default: 3)",
    )
    t.add_argument(
        "--step-s",
        type=finite_number(0.0, inclusive=False),
        default=0.5,
        help="length of one marked step, seconds (default: 0.5)",
    )
    t.add_argument(
        "--devices",
        type=devices_list,
        default=None,
        help="devices to sample: all, or host indices such as 0,3 (default: the one of local rank 0); "
        "all land in rank=0/, one device_index each",
    )
    t.add_argument("--out", type=nonempty_path, required=True, help="run directory to write")
    t.add_argument(
        "--overwrite", action="store_true", help="replace a run already in --out (default: refuse)"
    )
    t.add_argument(
        "--no-driver-buffers",
        action="store_true",
        help="do not store the driver's own sample buffers (NVML: buffered-*.parquet; docs/store.md)",
    )
    t.set_defaults(func=cmd_telemetry)

    i = sub.add_parser("inspect", help="load a run directory and print the attribution of its windows")
    i.add_argument("run_dir")
    i.add_argument(
        "--kind", action="append", choices=["step", "microbatch", "phase"], help="only these window kinds"
    )
    i.add_argument(
        "--steps",
        type=steps_range,
        default=(None, None),
        help="only these steps: A:B (A to B-1), A:, :B or N",
    )
    i.add_argument("--rank", type=int, action="append", help="only this rank (repeatable)")
    i.set_defaults(func=cmd_inspect)

    from charllm_nemo.analysis.commands import add_commands

    add_commands(sub)  # analyze, report, compare

    from charllm_nemo.analysis.advise_cmd import add_command as add_advise

    add_advise(sub)  # advise

    from charllm_nemo.analysis.calibrate import add_command as add_calibrate

    add_calibrate(sub)  # calibrate-energy

    cp = sub.add_parser("compact", help="merge a run's segments into a few large Parquet files, crash-safely")
    cp.add_argument("run_dir", help="the run directory (rank=N folders inside)")
    cp.set_defaults(func=cmd_compact)

    sw = sub.add_parser("sweep", help="sweeps run by `charllm train -m +sweep=<name>`")
    sw_sub = sw.add_subparsers(dest="sweep_command", required=True)
    st = sw_sub.add_parser("status", help="print a sweep's configurations and their states as a table")
    st.add_argument("dir", help="a sweep directory (sweep=<name>/) or the folder holding sweeps")
    st.add_argument(
        "--no-slurm", action="store_true", help="only the files: do not ask SLURM about unfinished jobs"
    )
    st.set_defaults(func=cmd_sweep_status)

    d = sub.add_parser(
        "wandb-dashboard",
        help="build the W&B workspace for charllm's keys (power, energy, temperature, clocks, throttle, "
        "throughput, alerts) and save it, or print it with --dry-run",
    )
    d.add_argument("--entity", help="W&B entity (user or team) that owns the project; needed to save")
    d.add_argument("--project", required=True, help="W&B project the runs are logged to (logger.project)")
    d.add_argument("--name", help="workspace name (default: charllm telemetry[: sweep NAME | group G])")
    only = d.add_mutually_exclusive_group()
    only.add_argument(
        "--sweep", help="only the runs of this sweep (tag sweep:NAME), grouped by configuration"
    )
    only.add_argument(
        "--group", help="only the runs of this W&B group (logger.group), grouped by configuration"
    )
    d.add_argument(
        "--group-by",
        action="append",
        metavar="CONFIG_KEY",
        help="group runs by this config key (repeatable; default with --sweep/--group: model.name, "
        "parallel.name, optim.name, batch.micro_batch_size)",
    )
    d.add_argument(
        "--detail-rank", type=int, default=0, help="rank whose throttle reasons are stacked (default 0)"
    )
    d.add_argument("--max-runs", type=int, default=20, help="runs (or groups) drawn per panel (default 20)")
    d.add_argument("--dry-run", action="store_true", help="do not save: print the specification (JSON)")
    d.add_argument("--json", metavar="PATH", help="write the specification (JSON) to PATH")
    d.set_defaults(func=_cmd_wandb_dashboard)

    sub.add_parser(
        "train", help="train with Megatron-Core (Hydra overrides follow: model=tiny_gpt ...)", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = 0  # global options before the command
    while lead < len(argv) and argv[lead] in ("-v", "--verbose"):
        lead += 1
    if lead < len(argv) and argv[lead] == "train":
        if lead:  # -v: every rank logs at INFO (they read it from the environment)
            from charllm_nemo.train.worker import LOG_LEVEL_ENV

            os.environ[LOG_LEVEL_ENV] = "INFO"
        return cmd_train(argv[lead + 1 :])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except CharllmError as exc:
        print(f"charllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handling (starting up, reading): no traceback
        print("charllm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``charllm inspect RUN | head``): stop quietly, as Unix tools do.
        # stdout points at nothing from here on, so that the exit's own flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as if killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
