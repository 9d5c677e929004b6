"""What a run was: its model, layout, batch, platform, read from the run's own files.

Sources, first that has it: ``summary.json`` (the validated layout, the medians), the resolved
config (``config.yaml``, else the manifests' ``config``), the manifests (devices, hosts,
sampling rate, status). Nothing is taken from a sweep's matrix: a run directory describes itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from charllm_nemo.analysis.load import Run
from charllm_nemo.errors import StoreError
from charllm_nemo.telemetry.figures import finite_or_none
from charllm_nemo.telemetry.filecheck import sweep_json_defect
from charllm_nemo.telemetry.layout import SIZE_CAPS, UnsafeFileError, parse_json, read_bounded


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def layout_label(layout: dict[str, Any]) -> str:
    """``TP2-PP4-DP4`` style label (degrees of 1 left out, DP always shown; ``EP``, ``CP``,
    ``VPP`` when used; ``FSDP`` when sharded)."""
    parts = []
    for key, tag in (("ep", "EP"), ("tp", "TP"), ("pp", "PP"), ("vpp", "VPP"), ("cp", "CP")):
        v = layout.get(key)
        if isinstance(v, int) and v > 1:
            parts.append(f"{tag}{v}")
    if layout.get("fsdp"):
        parts.append("FSDP")
    dp = layout.get("dp")
    parts.append(f"DP{dp}" if isinstance(dp, int) else "DP?")
    return "-".join(parts)


INFO_TYPES: dict[str, str] = {
    "run": "string", "sweep": "string", "model": "string", "layout": "string",
    "tp": "int", "pp": "int", "dp": "int", "ep": "int", "cp": "int", "fsdp": "bool",
    "world_size": "int", "nodes": "int", "device": "string", "platform": "string", "synthetic": "bool",
    "sampling_hz": "float", "global_batch_size": "int", "micro_batch_size": "int", "seq_length": "int",
    "status": "string", "mfu": "float", "model_tflops_per_gpu": "float", "tokens_per_s_reported": "float",
    "vpp": "int", "optim": "string", "layers_per_stage": "string", "job_id": "string", "hosts": "string",
}  # fmt: skip
"""The type of each field of a run's row. A run directory's files may hold anything in these
fields (a config's ``batch.global_batch_size`` a string, a model name a list): a value of
another type is None, so the SQL over the rows never meets a string where it multiplies."""

MAX_COUNT = 10**9
"""Largest count (batch size, sequence length, parallel degree, world size) a row keeps."""


def typed(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with each :data:`INFO_TYPES` field of its type or None: whole numbers in
    1..:data:`MAX_COUNT` for counts, finite floats, strings (a number given as a name, e.g. a
    model called 5, kept as its text)."""
    out = dict(row)
    for key, kind in INFO_TYPES.items():
        v = row.get(key)
        if kind == "int":
            ok = isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_COUNT
            out[key] = v if ok else None
        elif kind == "float":
            out[key] = finite_or_none(v)
        elif kind == "bool":
            out[key] = v if isinstance(v, bool) else None
        elif v is not None and not isinstance(v, str):
            out[key] = str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    return out


def run_info(run: Run) -> dict[str, Any]:
    """One row describing the run (:data:`INFO_TYPES`; None where unknown or of another type)."""
    return typed(_run_info(run))


def _run_info(run: Run) -> dict[str, Any]:
    cfg, summ = run.config, run.summary
    manifests = list(run.manifests.values())
    first = manifests[0] if manifests else {}
    devices = first.get("devices") or [{}]  # validated: a list of objects
    layout = dict(summ["layout"]) if isinstance(summ.get("layout"), dict) else {}
    par: dict[str, Any] = cfg["parallel"] if isinstance(cfg.get("parallel"), dict) else {}
    for key in ("tp", "pp", "vpp", "cp", "ep", "dp"):
        layout.setdefault(key, par.get(key))
    layout["fsdp"] = bool(par.get("fsdp"))
    world = summ.get("world_size") or first.get("world_size")
    if layout.get("dp") is None and isinstance(world, int) and not isinstance(world, bool):
        denom = 1
        for key in ("tp", "pp", "cp"):
            v = layout.get(key)
            denom *= v if isinstance(v, int) and v > 0 else 1
        layout["dp"] = world // denom if world % denom == 0 else None
    hosts = {m.get("host") for m in manifests if isinstance(m.get("host"), str)}
    statuses = sorted({str(m.get("status")) for m in manifests if m.get("status")})
    device_name = devices[0].get("name") if isinstance(devices[0], dict) else None
    n_gpus = world if isinstance(world, int) else len(run.ranks)
    status = (
        summ.get("job_state") or summ.get("status") or ("/".join(statuses) if statuses else "no manifest")
    )
    return {
        "run": run.key,
        "sweep": run.sweep,
        "model": summ.get("model") or _get(cfg, "model", "name"),
        "layout": layout_label(layout),
        "tp": layout.get("tp"),
        "pp": layout.get("pp"),
        "dp": layout.get("dp"),
        "ep": layout.get("ep"),
        "cp": layout.get("cp"),
        "fsdp": layout["fsdp"],
        "world_size": world,
        "nodes": len(hosts) or None,
        "device": device_name,
        "platform": f"{n_gpus}x {device_name}" if device_name else None,
        "synthetic": any(bool(m.get("synthetic")) for m in manifests),
        "sampling_hz": first.get("sampling_hz"),
        "global_batch_size": _get(cfg, "batch", "global_batch_size"),
        "micro_batch_size": _get(cfg, "batch", "micro_batch_size"),
        "seq_length": _get(cfg, "model", "seq_length"),
        "optim": _text(_get(cfg, "optim", "name")),
        "job_id": _text(_get(first, "env", "SLURM_JOB_ID")),
        "hosts": ",".join(sorted(str(h) for h in hosts)) or None,
        "layers_per_stage": _stages_text(layout.get("layers_per_stage")),
        "status": status,
        "mfu": summ.get("mfu_median"),
        "model_tflops_per_gpu": summ.get("model_tflops_per_gpu_median"),
        "tokens_per_s_reported": summ.get("tokens_per_s_median"),
    }


GAP_STATES = ("out_of_memory", "out_of_memory_predicted", "failed", "preempted", "pending")
"""Sweep states that leave a configuration without figures: drawn as marked gaps."""


def sweep_gaps(run_dirs: list[Path], analysed: set[Path]) -> list[dict[str, Any]]:
    """Rows for the configurations a sweep's ``sweep.json`` lists in a :data:`GAP_STATES` state
    and that have no analysed run directory (an out-of-memory prediction never starts one), so
    the figures can show them as gaps. Model and layout come from the configuration's
    overrides (``model=...``, ``layout=...`` / ``parallel=...``). StoreError naming the file,
    the field and the fix when a ``sweep.json`` is no record of its sweep (bytes that are not
    UTF-8, ``runs`` not a list): read leniently, its gaps would silently go unseen."""
    rows: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for d in run_dirs:
        sweep_dir = next((p for p in [d, *d.parents] if p.name.startswith("sweep=")), None)
        if sweep_dir is None or sweep_dir in seen:
            continue
        seen.add(sweep_dir)
        problems: list[str] = []
        path = sweep_dir / "sweep.json"
        if not path.is_file() or path.is_symlink():
            continue
        try:
            raw = read_bounded(path, SIZE_CAPS["summary"])
        except UnsafeFileError:
            continue  # not a regular file, or over the cap: no gaps from it (its runs are read)
        defect = sweep_json_defect(raw, path)
        if defect is not None:  # read leniently, an empty sweep: its gaps would go unseen
            raise StoreError(defect)
        data = parse_json(raw, path, problems)
        entries = data.get("runs") if isinstance(data, dict) else None
        for e in entries if isinstance(entries, list) else []:
            if not isinstance(e, dict) or e.get("state") not in GAP_STATES:
                continue
            run_dir = sweep_dir / f"run={e.get('key')}"
            if any(run_dir == a or run_dir in a.parents for a in analysed):
                continue
            fixed = data.get("fixed_overrides") if isinstance(data.get("fixed_overrides"), list) else []
            over = {str(o).split("=", 1)[0].lstrip("+"): str(o).split("=", 1)[1]
                    for o in [*fixed, *(e.get("overrides") or [])] if "=" in str(o)}  # fmt: skip
            rows.append(typed(gap_row(sweep_dir.name.split("=", 1)[1], f"{sweep_dir.name}/run={e.get('key')}",
                                      str(e["state"]), over, problems)))  # fmt: skip
    return rows


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _stages_text(v: Any) -> str | None:
    """``[7, 1]`` as ``[7,1]`` (layers per pipeline stage); None unless a list of ints."""
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return "[" + ",".join(str(x) for x in v) + "]"
    return None


def _preset(group: str, name: str | None, problems: list[str]) -> dict[str, Any]:
    """A conf/ preset (``conf/<group>/<name>.yaml``) as a mapping, read through the hardened
    reader; {} when absent or unreadable. A layout or sweep preset's ``defaults`` list
    (``override /model: tiny_gpt``) becomes ``{"model": "tiny_gpt", ...}`` entries too."""
    if not name or not all(c.isalnum() or c in "_-." for c in name) or name.startswith("."):
        return {}
    conf = Path(os.environ.get("CHARLLM_CONF_DIR") or Path(__file__).resolve().parents[1] / "conf")
    path = conf / group / f"{name}.yaml"
    if not path.is_file():
        return {}
    try:
        import yaml  # type: ignore[import-untyped]

        data = yaml.safe_load(read_bounded(path, SIZE_CAPS["config"]))
    except Exception:  # a preset we cannot read gives no fields; the gap keeps its key
        return {}
    if not isinstance(data, dict):
        return {}
    for item in data.get("defaults") or []:
        if isinstance(item, dict):
            for k, v in item.items():
                key = str(k).replace("override", "").strip().lstrip("/")
                if key in ("model", "parallel", "optim") and isinstance(v, str):
                    data.setdefault(key, v)
    return data


def gap_row(sweep: str, run: str, state: str, over: dict[str, str], problems: list[str]) -> dict[str, Any]:
    """The ``runs`` row of a configuration that never ran: its model, layout and batch from its
    overrides, else from the presets they name (``+layout=`` -> conf/layout, the sweep's own
    conf/sweep preset), so the gap is drawn in place among its model's configurations."""
    layout_preset = _preset("layout", over.get("layout"), problems)
    sweep_preset = _preset("sweep", sweep, problems)
    model = over.get("model") or layout_preset.get("model") or sweep_preset.get("model")
    # A sweep that names no parallelism runs train.yaml's default one (``parallel: single``,
    # dp = the world size): without it the gap had no layout and was labelled by its path.
    parallel_name = (
        over.get("parallel")
        or layout_preset.get("parallel")
        or sweep_preset.get("parallel")
        or _preset(".", "train", problems).get("parallel")
    )
    par = _preset("parallel", parallel_name if isinstance(parallel_name, str) else None, problems)
    par.update(
        {k.split(".", 1)[1]: _int(v) for k, v in over.items() if k.startswith("parallel.") and _int(v)}
    )
    fields = {
        k: par.get(k) if isinstance(par.get(k), int) else None for k in ("tp", "pp", "vpp", "cp", "ep", "dp")
    }
    world = _int(over.get("nproc")) or sweep_preset.get("nproc")
    if fields["dp"] is None and isinstance(world, int) and par:
        denom = (fields["tp"] or 1) * (fields["pp"] or 1) * (fields["cp"] or 1)
        fields["dp"] = world // denom if world % denom == 0 else None
    batch: dict[str, Any] = sweep_preset["batch"] if isinstance(sweep_preset.get("batch"), dict) else {}
    mb = _int(over.get("batch.micro_batch_size"))
    return {
        "run": run,
        "sweep": sweep,
        "model": model if isinstance(model, str) else None,
        "layout": layout_label({**fields, "fsdp": bool(par.get("fsdp"))})
        if par
        else over.get("layout"),  # unknown: "?" in the figures, never the run's path
        **fields,
        "micro_batch_size": mb if mb is not None else batch.get("micro_batch_size"),
        "global_batch_size": _int(over.get("batch.global_batch_size")) or batch.get("global_batch_size"),
        "optim": over.get("optim"),
        "world_size": world if isinstance(world, int) else None,
        "status": state,
    }
