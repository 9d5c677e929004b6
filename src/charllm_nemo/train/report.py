"""Per-step results: cross-rank reduction, throughput/MFU, and rank 0's console line.

Cross-rank figures travel as one small fixed-size float64 vector per rank in one ``all_gather``
(summed or maxed on each rank), never pickled objects. Per-step energy figures of a rank come
from its telemetry session one step late (the sampler must have taken a sample after the step
ended; asking at once would mean waiting), so the figures of step ``k-1`` ride in step ``k``'s
reduction and rank 0's console line for a step is printed one step after it ends (the last one
after a final reduction).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from charllm_nemo.train.config import TrainConfig

log = logging.getLogger("charllm_nemo.train")

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""A write refused because the disk, or the user's quota, is full."""

# Index of each entry in the SUM and MAX vectors.
SUM_FIELDS: tuple[str, ...] = ("loss_sum", "loss_tokens", "energy_j", "power_avg_w", "reporting")
MAX_FIELDS: tuple[str, ...] = ("step_time_s", "power_peak_w", "temp_gpu_peak_c", "throttle_s")


@dataclass
class RankFigures:
    """One rank's telemetry figures of one step (all its devices together); NaN = not known."""

    energy_j: float = math.nan
    power_avg_w: float = math.nan
    power_peak_w: float = math.nan
    temp_gpu_peak_c: float = math.nan
    throttle_s: float = math.nan

    @property
    def known(self) -> bool:
        return not math.isnan(self.energy_j)


CONSOLE_FIGURES: tuple[str, ...] = (
    "energy_j",
    "power_avg_w",
    "power_peak_w",
    "temp_gpu_peak_c",
    "throttle_any_limiting_s",
)
"""The attribution figures the per-step console line and summary.json use."""


def rank_figures(rows: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None) -> RankFigures | None:
    """One rank's figures from its devices' attribution rows (``TelemetrySession.step_figures``);
    None while those are not available. Devices of a rank add up (energy, power) or take the
    max (peak power, temperature, throttle time): charllm_nemo.sinks.keys.combine_devices."""
    from charllm_nemo.sinks.keys import combine_devices

    if rows is None:
        return None
    f = combine_devices(rows, CONSOLE_FIGURES)
    return RankFigures(
        energy_j=f["energy_j"],
        power_avg_w=f["power_avg_w"],
        power_peak_w=f["power_peak_w"],
        temp_gpu_peak_c=f["temp_gpu_peak_c"],
        throttle_s=f["throttle_any_limiting_s"],
    )


@dataclass
class StepSummary:
    """One step over all ranks. Energy over all ranks in J; power per reporting rank in W (mean
    of the ranks' averages; peak = max over ranks); ``throttle_share`` = max over ranks of
    the time a limiting throttle reason was set / step time. Throughput fields are None while
    charllm_nemo.metrics is not available; ``mfu`` None when the peak rate is unknown."""

    step: int
    loss: float | None
    step_time_s: float
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    model_tflops_per_gpu: float | None = None
    hardware_tflops_per_gpu: float | None = None
    mfu: float | None = None
    energy_j: float | None = None
    power_avg_w: float | None = None
    power_peak_w: float | None = None
    temp_gpu_peak_c: float | None = None
    throttle_share: float | None = None
    ranks_reporting: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _opt(v: float) -> float | None:
    return None if math.isnan(v) else v


class Throughput:
    """FLOPs per step and the peak rate, computed once; :meth:`fill` adds the rates to a summary.
    Uses charllm_nemo.metrics lazily: if it cannot be imported, nothing is filled in."""

    def __init__(
        self,
        cfg: TrainConfig,
        world_size: int,
        device_name: str | None,
        on_cpu: bool,
        layers_per_virtual_stage: list[int] | None = None,
        compute_units: int | None = None,
        tf32_gemms: bool = False,
    ) -> None:
        """``device_name`` and ``compute_units`` (its SMs / CUs: torch's ``multi_processor_count``)
        identify the peak rate: the count tells an MI250X GCD (110) from an MI250 one (104),
        which share a name, and scales the rate of a MIG slice or an MI300X CPX partition.
        ``tf32_gemms``: fp32 training whose GEMMs run as TF32 (TransformerEngine's layers do):
        MFU against the TF32 rate, not the CUDA-core FP32 one (which would put it above 100 %)."""
        self.cfg = cfg
        self.world_size = world_size
        self.model_flops: float | None = None
        self.hardware_flops: float | None = None
        self.peak: float | None = None
        self._rate: Any = None
        try:
            from charllm_nemo.metrics import flops, peak, throughput
        except ImportError:
            return
        b, o, p = cfg.batch, cfg.optim, cfg.parallel
        try:
            shape = flops.ModelShape.from_model_config(cfg.model)
            self.model_flops = float(flops.model_flops_per_step(shape, b.global_batch_size).total)
            uneven = layers_per_virtual_stage and len(set(layers_per_virtual_stage)) > 1
            hw = flops.hardware_flops_per_step(
                shape,
                b.global_batch_size,
                o.recompute_granularity,
                o.recompute_method,
                o.recompute_num_layers,
                pipeline_parallel=p.pp,
                virtual_pipeline=p.vpp if p.vpp and p.vpp > 1 else None,
                pipeline_layout=layers_per_virtual_stage if uneven else None,
            )
            self.hardware_flops = float(hw.total)
            override = cfg.telemetry.cpu_peak_tflops if on_cpu else None
            name = "cpu" if on_cpu else (device_name or "")
            dtype = "tf32" if tf32_gemms and b.precision == "fp32" and not on_cpu else b.precision
            self.peak = peak.lookup_peak_tflops(
                name, dtype, override_tflops=override, compute_units=None if on_cpu else compute_units
            )
        except Exception:  # a metrics error must not stop training; the figures stay absent
            return
        self._rate = throughput.step_throughput

    def fill(self, s: StepSummary) -> None:
        if self._rate is None or self.model_flops is None or not s.step_time_s > 0:
            return
        b = self.cfg.batch
        try:
            r = self._rate(
                s.step_time_s,
                b.global_batch_size,
                self.cfg.model.seq_length,
                self.model_flops,
                self.hardware_flops,
                self.world_size,
                self.peak,
            )
        except Exception:
            return
        s.tokens_per_s, s.samples_per_s = r.tokens_per_s, r.samples_per_s
        s.model_tflops_per_gpu, s.hardware_tflops_per_gpu = r.model_tflops_per_gpu, r.hardware_tflops_per_gpu
        s.mfu = r.mfu


def reduce_step(
    torch_mod: Any,
    device: Any,
    *,
    loss_sum: float,
    loss_tokens: float,
    step_time_s: float,
    figures: RankFigures | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """One step's figures over all ranks: SUM of some, MAX of the others, from one all_gather of
    one float64 vector per rank (one collective a step, none with a single rank). ``loss_*`` are 0
    on ranks that do not report the loss; ``figures`` None = not known."""
    f = figures if figures is not None else RankFigures()
    known = f.known

    def z(v: float) -> float:
        return 0.0 if math.isnan(v) else v

    sums = [loss_sum, loss_tokens, z(f.energy_j), z(f.power_avg_w), 1.0 if known else 0.0]
    # MAX of "unknown" must not win: -inf is neutral, turned back into NaN below.
    maxes = [step_time_s] + [
        v if not math.isnan(v) else -math.inf for v in (f.power_peak_w, f.temp_gpu_peak_c, f.throttle_s)
    ]
    dist = torch_mod.distributed
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        mine = torch_mod.tensor(sums + maxes, dtype=torch_mod.float64, device=device)
        rows = [torch_mod.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        per_rank = torch_mod.stack(rows).tolist()
        n = len(sums)
        s_vals = [math.fsum(r[i] for r in per_rank) for i in range(n)]
        m_vals = [max(r[n + i] for r in per_rank) for i in range(len(maxes))]
    else:
        s_vals, m_vals = [float(v) for v in sums], [float(v) for v in maxes]
    m_vals = [v if math.isfinite(v) else math.nan for v in m_vals]
    return dict(zip(SUM_FIELDS, s_vals, strict=True)), dict(zip(MAX_FIELDS, m_vals, strict=True))


def apply_figures(s: StepSummary, sums: dict[str, float], maxes: dict[str, float]) -> None:
    """Put the reduced telemetry figures of a step into its summary."""
    n = round(sums["reporting"])
    s.ranks_reporting = n
    # The maxima stand on their own (a device may report temperature but no energy).
    s.power_peak_w = _opt(maxes["power_peak_w"])
    s.temp_gpu_peak_c = _opt(maxes["temp_gpu_peak_c"])
    thr = maxes["throttle_s"]
    s.throttle_share = None if math.isnan(thr) or s.step_time_s <= 0 else thr / s.step_time_s
    if n:
        s.energy_j = sums["energy_j"]
        s.power_avg_w = sums["power_avg_w"] / n


def _si(v: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f}{unit}"
    return f"{v:.1f}"


def format_summary(s: StepSummary, total_steps: int, world_size: int) -> str:
    """Rank 0's console line for one step."""
    parts = [f"step {s.step + 1}/{total_steps}"]
    parts.append("loss n/a" if s.loss is None else f"loss {s.loss:.4f}")
    parts.append(f"{s.step_time_s * 1e3:.1f} ms")
    if s.tokens_per_s is not None:
        parts.append(f"{_si(s.tokens_per_s)} tok/s")
    if s.model_tflops_per_gpu is not None:
        parts.append(f"{s.model_tflops_per_gpu:.3g} TFLOP/s/GPU")
    if s.tokens_per_s is not None:
        parts.append("MFU n/a" if s.mfu is None else f"MFU {100 * s.mfu:.1f}%")
    if s.energy_j is None:
        parts.append("energy n/a")
    else:
        partial = "" if s.ranks_reporting >= world_size else f" ({s.ranks_reporting}/{world_size} ranks)"
        parts.append(f"{s.energy_j:.3g} J{partial}")
    peak = "" if s.power_peak_w is None else f"peak {s.power_peak_w:.0f} W"
    if s.power_avg_w is not None:
        parts.append(f"{s.power_avg_w:.0f} W/GPU avg" + (f", {peak}" if peak else ""))
    elif peak:
        parts.append(peak)
    if s.temp_gpu_peak_c is not None:
        parts.append(f"max {s.temp_gpu_peak_c:.0f} C")
    if s.throttle_share is not None:
        parts.append(f"throttle {100 * s.throttle_share:.0f}%")
    return " | ".join(parts)


STEPS_FILE = "steps.jsonl"
"""Rank 0's per-step figures, one JSON object per line, written as each step is reported."""
SUMMARY_FILE = "summary.json"
"""Rank 0's steps and their medians, written when training ends (train/loop.py)."""


class StepsFile:
    """Rank 0's per-step figures on disk as the run goes (``steps.jsonl`` in the run directory):
    one line per reported step, handed to the kernel at once (one ``write`` a line, no buffer),
    so a run that is killed keeps every step reported before (docs/store.md). The file is
    truncated when opened: a run directory holds one run. A write that fails (a full disk)
    never stops training: the part of the line that got out is cut off again (the file ends
    with a whole line, always), one error line says so, the file is given up, and
    :attr:`disk_full` is set when the disk (or quota) was the reason."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 0  # bytes of whole lines written: where a failed line is cut back to
        self.lines = 0  # lines written
        self.disk_full = False

    def write(self, summary: dict[str, Any]) -> None:
        if self._fd is None:
            return
        data = (json.dumps(summary, default=str) + "\n").encode()
        done = 0
        try:
            while done < len(data):  # a short write (the last free blocks) is followed by ENOSPC
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            self.disk_full = exc.errno in DISK_FULL_ERRNOS
            if done:
                with contextlib.suppress(OSError):  # not a regular file (/dev/full): nothing to cut
                    os.ftruncate(self._fd, self._size)
            log.error(
                "cannot write %s (%s): per-step lines stop here, the %d before are whole; summary.json "
                "gets them all if it can be written",
                self.path,
                exc.strerror or exc,
                self.lines,
            )
            self.close()
            return
        self._size += len(data)
        self.lines += 1

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class Progress:
    """A progress bar for the run on rank 0's stderr: tqdm when installed, else a plain line
    redrawn with ``\\r`` on a terminal; silent (the per-step lines suffice) when not a TTY."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.done = 0
        self._bar: Any = None
        self._tty = enabled and sys.stderr.isatty()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr, leave=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            if self._tty:
                sys.stderr.write("\r\033[K")
            print(line, flush=True)
            self._draw()

    def update(self, n: int = 1) -> None:
        if not self.enabled:
            return
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._draw()

    def _draw(self) -> None:
        if not self._tty:
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else float("nan")
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} eta {eta:.0f}s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._tty:
            sys.stderr.write("\n")


SUMMARY_FIELDS: tuple[str, ...] = (
    "step_time_s",
    "tokens_per_s",
    "samples_per_s",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "energy_j",
    "power_avg_w",
    "power_peak_w",
    "temp_gpu_peak_c",
    "throttle_share",
)


def run_summary(
    summaries: list[dict[str, Any]], skip_first: int = 1, world_size: int | None = None
) -> dict[str, Any]:
    """Medians over steps of each per-step figure (the first ``skip_first`` steps, which carry
    warm-up and allocation, are left out when more steps exist). Keys ``<field>_median``;
    a field no step reported is None. ``world_size``: ``energy_j`` (a sum over ranks) only over
    the steps every rank reported (``ranks_reporting``), not partial sums."""
    rows = summaries[skip_first:] if len(summaries) > skip_first else summaries
    out: dict[str, Any] = {"steps": len(summaries), "steps_in_medians": len(rows)}
    for name in SUMMARY_FIELDS:
        some = rows
        if name == "energy_j" and world_size is not None:
            some = [r for r in rows if r.get("ranks_reporting", world_size) >= world_size]
        values = sorted(v for r in some if (v := r.get(name)) is not None and not math.isnan(v))
        if not values:
            out[f"{name}_median"] = None
            continue
        mid = len(values) // 2
        out[f"{name}_median"] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return out
