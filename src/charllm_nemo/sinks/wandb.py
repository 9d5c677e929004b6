"""Weights & Biases sink: one W&B run per job, written by rank 0 (docs/wandb.md).

* ``start``: ``wandb.init`` with the resolved training config plus the run manifest (devices,
  backend, versions) as the run's config, secrets removed (:func:`charllm_nemo.redact.redact_secrets`,
  as in every file the artifact holds); tags and
  group from the recipe (:func:`recipe_tags`, :func:`recipe_group`); the custom step axis
  ``trainer/global_step`` for every key. Offline when there is no API key (said once).
* ``log_step``: one ``run.log`` per step; unknown values are omitted, never logged as 0.
* ``finish``: the per-window table (built from the run directory), the run directory's
  telemetry as an artifact (skipped above ``artifact_max_mb``), ``run.finish()``.

The sink itself is synchronous; build it through :func:`charllm_nemo.sinks.config.build_sink`,
which wraps it in an :class:`~charllm_nemo.sinks.base.AsyncSink` so that W&B never runs on the
training thread. wandb is imported lazily (in ``start``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import netrc
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from charllm_nemo.redact import redact_secrets
from charllm_nemo.sinks.base import Metrics
from charllm_nemo.sinks.keys import STEP_KEY, finite
from charllm_nemo.sinks.logger_config import LoggerConfig
from charllm_nemo.telemetry.write import make_dir

log = logging.getLogger("charllm_nemo.sinks")

WANDB_MODES: tuple[str, ...] = ("auto", "online", "offline", "disabled")
"""``logger.mode`` values; None means ``auto``: online with an API key, else offline."""

WINDOWS_TABLE_KEY = "telemetry/windows"
ARTIFACT_TYPE = "telemetry"

# -- mode -----------------------------------------------------------------------------------------

_DEFAULT_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")
_announced: set[str] = set()


def _netrc_path(env: Mapping[str, str]) -> Path | None:
    if env.get("NETRC"):
        return Path(env["NETRC"]).expanduser()
    home = Path(env.get("HOME") or Path.home())
    for name in (".netrc", "_netrc"):
        if (home / name).is_file():
            return home / name
    return None


def has_api_key(env: Mapping[str, str] | None = None) -> bool:
    """Whether wandb would find credentials without asking: ``WANDB_API_KEY``,
    ``WANDB_IDENTITY_TOKEN_FILE``, or a netrc entry (``$NETRC``, ``~/.netrc``) with a password
    for the ``WANDB_BASE_URL`` host or W&B's default hosts. Reads files only; no network."""
    e: Mapping[str, str] = os.environ if env is None else env
    if e.get("WANDB_API_KEY") or e.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = _netrc_path(e)
    if path is None:
        return False
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):
        return False
    hosts = list(_DEFAULT_HOSTS)
    base = e.get("WANDB_BASE_URL")
    if base and urlsplit(base).netloc:
        hosts.insert(0, urlsplit(base).netloc)
    for host in hosts:
        creds = entries.authenticators(host)
        if creds and creds[2]:
            return True
    return False


def resolve_mode(requested: str | None, env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The W&B mode to use and, when it differs from what was asked, why (to say once).

    ``requested``: ``logger.mode`` (None / ``auto``, ``online``, ``offline``, ``disabled``).
    ``offline`` / ``disabled`` are used as asked. ``WANDB_MODE=offline`` (or ``dryrun``) and
    ``WANDB_MODE=disabled`` win over ``online`` and ``auto``. Online needs credentials
    (:func:`has_api_key`): without them the run is written offline instead of asking for a
    key or failing at the first request, and the reason says how to sync it later.
    """
    e: Mapping[str, str] = os.environ if env is None else env
    asked = (requested or "auto").lower()
    if asked not in WANDB_MODES:
        raise ValueError(f"W&B mode {requested!r}; use one of {', '.join(WANDB_MODES)}")
    if asked in ("offline", "disabled"):
        return asked, None
    env_mode = (e.get("WANDB_MODE") or "").lower()
    if env_mode in ("offline", "dryrun"):
        return "offline", None
    if env_mode == "disabled":
        return "disabled", None
    if has_api_key(e):
        return "online", None
    return "offline", (
        "no W&B API key (WANDB_API_KEY unset, no netrc entry for W&B): logging offline; "
        "upload later with `wandb sync <dir>/wandb/offline-run-*`"
    )


DEFAULT_BASE_URL = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 5.0
"""How long :func:`server_problem` waits for a TCP connection to the W&B server."""
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def server_problem(
    base_url: str | None = None, env: Mapping[str, str] | None = None, timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """Why the W&B server cannot be reached, or None: one TCP connection to ``base_url``
    (``$WANDB_BASE_URL``, else W&B's cloud) within ``timeout_s``. wandb itself retries an
    unreachable server for minutes (``init`` gives up after 90 s, and its exit hooks wait
    for it after that); this answers in at most ``timeout_s`` (a refused port: at once).
    Behind a proxy (``HTTPS_PROXY`` and the like) the server is not probed: None."""
    import socket

    e: Mapping[str, str] = os.environ if env is None else env
    if any(e.get(v) for v in PROXY_VARS):
        return None
    url = base_url or e.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    parts = urlsplit(url if "://" in url else f"https://{url}")
    try:
        port = parts.port or (80 if parts.scheme == "http" else 443)
    except ValueError:
        return f"{url!r} has no valid port"
    if not parts.hostname:
        return f"{url!r} names no host"
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return f"{parts.hostname}:{port} ({reason})"


def _say_once(message: str) -> None:
    if message not in _announced:
        _announced.add(message)
        log.warning(message)


# -- tags and group from the recipe -------------------------------------------------------------


def _get(d: Mapping[str, Any] | None, *path: str) -> Any:
    cur: Any = d
    for p in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(p)
    return cur


def layout_tag(parallel: Mapping[str, Any] | None, world_size: int | None = None) -> str | None:
    """``tp2-pp1-dp1`` (plus ``-cp2``, ``-ep4``, ``-vpp6``, ``-fsdp`` when used) from
    ``config["parallel"]``; dp, when not set, is world_size / (tp * pp * cp)."""
    if not isinstance(parallel, Mapping):
        return None
    tp, pp, cp = (int(parallel.get(k) or 1) for k in ("tp", "pp", "cp"))
    dp = parallel.get("dp")
    if dp is None and world_size:
        dp = world_size // max(tp * pp * cp, 1)
    parts = [f"tp{tp}", f"pp{pp}"]
    if dp is not None:
        parts.append(f"dp{int(dp)}")
    if cp > 1:
        parts.append(f"cp{cp}")
    ep = int(parallel.get("ep") or 1)
    if ep > 1:
        parts.append(f"ep{ep}")
    vpp = parallel.get("vpp")
    if vpp and int(vpp) > 1:
        parts.append(f"vpp{int(vpp)}")
    if parallel.get("fsdp"):
        parts.append("fsdp")
    return "-".join(parts)


def recipe_tags(config: Mapping[str, Any], manifest: Mapping[str, Any]) -> list[str]:
    """Tags that let a dashboard group a sweep: the parallel layout (``tp2-pp1-dp1``),
    ``model:<name>``, ``parallel:<name>``, ``optim:<name>``, ``precision:<p>``,
    ``backend:<telemetry backend>``, ``synthetic`` when the figures are not from hardware,
    and ``sweep:<name>`` for a sweep job."""
    tags: list[str] = []
    world = manifest.get("world_size")
    lt = layout_tag(_get(config, "parallel"), int(world) if isinstance(world, int) else None)
    if lt:
        tags.append(lt)
    for label, path in (
        ("model", ("model", "name")),
        ("parallel", ("parallel", "name")),
        ("optim", ("optim", "name")),
        ("precision", ("batch", "precision")),
    ):
        v = _get(config, *path)
        if v is not None:
            tags.append(f"{label}:{v}")
    if manifest.get("backend"):
        tags.append(f"backend:{manifest['backend']}")
    if manifest.get("synthetic"):
        tags.append("synthetic")
    sweep = recipe_group(config)
    if sweep:
        tags.append(f"sweep:{sweep}")
    return tags


def recipe_group(config: Mapping[str, Any]) -> str | None:
    """The sweep a job belongs to: ``config["extra"]["sweep"]`` if a recipe sets it, else
    ``<name>`` of a sweep recipe's run directory ``.../sweep=<name>/run=<key>/attempt=<n>``
    (docs/sweeps.md), else the ``sweep-<id>`` folder a plain Hydra multirun puts the job's run
    directory in, else None."""
    explicit = _get(config, "extra", "sweep")
    if explicit:
        return str(explicit)
    out_dir = _get(config, "telemetry", "out_dir")
    if isinstance(out_dir, str) and out_dir:
        path = Path(out_dir)
        if path.name.startswith("attempt=") and path.parent.name.startswith("run="):
            sweep = path.parent.parent.name
            if sweep.startswith("sweep=") and len(sweep) > len("sweep="):
                return sweep[len("sweep=") :]
        parent = path.parent.name
        if parent.startswith("sweep-"):
            return parent
    return None


def default_run_name(config: Mapping[str, Any], manifest: Mapping[str, Any]) -> str | None:
    """``<model>-<layout>-<optim>``, e.g. ``tiny_gpt-tp2-pp1-dp1-base``; None without a model."""
    model = _get(config, "model", "name")
    if model is None:
        return None
    world = manifest.get("world_size")
    parts = [str(model)]
    lt = layout_tag(_get(config, "parallel"), int(world) if isinstance(world, int) else None)
    if lt:
        parts.append(lt)
    optim = _get(config, "optim", "name")
    if optim:
        parts.append(str(optim))
    return "-".join(parts)


def shared_run_id(run_dir: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> str:
    """A W&B run id every node computes alike for one job (shared mode): the run directory's
    absolute path (on the shared file system all nodes write to) and SLURM_JOB_ID, hashed; e.g.
    ``charllm-3f2a9c1d0b7e``. Two runs in directories that share their last two names get
    different ids."""
    e: Mapping[str, str] = os.environ if env is None else env
    seed = f"{Path(run_dir).absolute()}|{e.get('SLURM_JOB_ID', '')}"
    return "charllm-" + hashlib.sha1(seed.encode()).hexdigest()[:12]


# -- the run directory as an artifact -----------------------------------------------------------


def telemetry_files(run_dir: Path, exclude: Iterable[Path] = ()) -> list[Path]:
    """The files of a run directory to upload: every regular file but dot-files (a writer's
    temporary segments), W&B's own ``wandb/`` folder and the ``exclude`` folders; sorted. A
    symbolic link is never uploaded (nor followed): it could point at any file of the user's,
    such as ``~/.netrc``; nor is a FIFO or device."""
    skip = [p.resolve() for p in exclude]
    out: list[Path] = []
    for root, dirs, files in os.walk(run_dir):
        here = Path(root)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and not (here == run_dir and d == "wandb")
            and (here / d).resolve() not in skip
        )
        out.extend(here / f for f in sorted(files) if not f.startswith(".") and _regular(here / f))
    return out


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


# -- the sink -------------------------------------------------------------------------------------


class WandbSink:
    """A W&B run, made from the ``logger`` config (:class:`~charllm_nemo.sinks.config.LoggerConfig`)
    as it is: ``project``, ``entity``, ``run_name``, ``group``, ``tags``,
    ``mode``, ``run_id``, the artifact and windows-table limits (a limit of 0 turns its part
    off), ``shared``, ``settings`` (extra ``wandb.Settings`` fields, e.g. ``console: "off"``).

    ``dir`` (the config's): where wandb writes its ``wandb/`` folder (None: ``$WANDB_DIR``, else
    the run directory given as ``run_dir``, else the working directory). With ``shared`` (W&B
    shared mode, online only, experimental in wandb 0.31): ``primary`` for the writer that logs
    metrics, ``label`` names this writer's system metrics and console logs, ``run_id`` is the
    run every writer joins. ``table_kinds``: the window kinds of the windows table. ``env``: the
    environment to decide the mode from (tests).
    """

    def __init__(
        self,
        config: LoggerConfig,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        primary: bool = True,
        label: str | None = None,
        table_kinds: tuple[str, ...] = ("microbatch", "phase"),
        env: Mapping[str, str] | None = None,
    ) -> None:
        cfg = config
        self.project = cfg.project
        self.entity = cfg.entity
        self.name = cfg.run_name
        self.group = cfg.group
        self.tags = list(cfg.tags)
        self.requested_mode = cfg.mode
        self.run_dir = Path(run_dir) if run_dir is not None else None
        e = os.environ if env is None else env
        wandb_dir = e.get("WANDB_DIR")
        self.dir = Path(cfg.dir) if cfg.dir is not None else (Path(wandb_dir) if wandb_dir else None)
        if self.dir is None and self.run_dir is not None:
            self.dir = self.run_dir
        self.run_id = cfg.run_id
        self.upload_artifact = cfg.upload_artifact and cfg.artifact_max_mb > 0
        self.artifact_max_mb = float(cfg.artifact_max_mb)
        self.log_windows_table_enabled = cfg.log_windows_table and cfg.table_max_rows > 0
        self.table_max_rows = int(cfg.table_max_rows)
        self.table_kinds = tuple(table_kinds)
        self.shared = cfg.shared
        self.primary = primary
        self.label = label
        self.settings = dict(cfg.settings or {})
        self.env = env
        self.mode: str | None = None  # the mode in use, after start
        self.run: Any = None
        self._wandb: Any = None
        self._table_logged = False
        self.artifact_skipped: str | None = None  # why the artifact was not logged

    # -- start ---------------------------------------------------------------------------------
    def init_kwargs(self, config: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
        """The arguments :meth:`start` passes to ``wandb.init`` (``settings`` as a dict)."""
        mode, why = resolve_mode(self.requested_mode, self.env)
        if why:
            _say_once(why)
        man = {k: v for k, v in manifest.items() if k != "config"}
        run_config = redact_secrets({**config, "manifest": man})
        tags = list(dict.fromkeys([*self.tags, *recipe_tags(config, manifest)]))
        settings: dict[str, Any] = dict(self.settings)
        # W&B's own metadata copies the command line (values this module redacts from the config)
        # and every SLURM_* variable (a job comment, a token in it) into the run: off unless the
        # logger's settings ask for it. The run config carries our redacted manifest instead (host,
        # devices, versions, argv).
        settings.setdefault("x_disable_meta", True)
        run_id = self.run_id
        if self.shared and mode == "online":
            mode = "shared"
            settings.setdefault("x_primary", self.primary)
            if self.label:
                settings.setdefault("x_label", self.label)
            if not self.primary:
                settings.setdefault("x_update_finish_state", False)
            if run_id is None and self.run_dir is not None:
                run_id = shared_run_id(self.run_dir, self.env)
        elif self.shared:
            _say_once(f"W&B shared mode needs an online run; this run is {mode}: one writer (rank 0) only")
        kwargs: dict[str, Any] = {
            "project": self.project,
            "entity": self.entity,
            "name": self.name or default_run_name(config, manifest),
            "group": self.group or recipe_group(config),
            "tags": [t[:64] for t in tags],  # W&B limits a tag to 64 characters
            "config": run_config,
            "mode": mode,
            # Our own run even if the process has another one active (a notebook, a user's
            # run): never log into it or finish it.
            "reinit": "create_new",
            "settings": settings,
        }
        if self.dir is not None:
            kwargs["dir"] = str(self.dir)
        if run_id is not None:
            kwargs["id"] = run_id
        return kwargs

    def start(self, config: dict[str, Any], manifest: dict[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        kwargs = self.init_kwargs(config, manifest)
        if kwargs["mode"] in ("online", "shared"):
            problem = server_problem(self.settings.get("base_url"), self.env)
            if problem is not None:
                # Training must not wait on, nor its end be held by, a server that is not there:
                # the metrics go to an offline run (a secondary writer of shared mode stops).
                offline = "offline" if self.primary else "disabled"
                kwargs["mode"] = offline
                if self.shared:  # shared mode's own settings mean nothing to an offline run
                    for key in ("x_primary", "x_label", "x_update_finish_state"):
                        kwargs["settings"].pop(key, None)
                log.warning(
                    "W&B server unreachable: %s; this run logs %s%s",
                    problem,
                    offline,
                    " (upload it later with `wandb sync <dir>/wandb/offline-run-*`)" if self.primary else "",
                )
        self.mode = kwargs["mode"]
        if self.dir is not None:
            if self.run_dir is not None and self.dir == self.run_dir:
                # wandb makes RUN/wandb itself, following a link planted there: made (or checked)
                # here first, one component at a time from the run folder (telemetry/write.py)
                make_dir(self.dir / "wandb", root=self.run_dir)
            else:  # the user's own WANDB_DIR / logger dir (a link there is theirs)
                self.dir.mkdir(parents=True, exist_ok=True)
        kwargs["settings"] = wandb.Settings(**kwargs["settings"])
        self.run = wandb.init(**kwargs)
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        log.info("W&B run %s (%s) in %s", self.run.id, self.mode, getattr(self.run, "dir", "?"))

    # -- per step --------------------------------------------------------------------------------
    def _require_run(self) -> Any:
        if self.run is None:
            raise RuntimeError("WandbSink: start() has not run (or failed)")
        return self.run

    def log_step(self, step: int, metrics: Metrics) -> None:
        run = self._require_run()
        if self.shared and not self.primary:
            return  # a secondary writer sends only W&B's own system metrics and console logs
        data: dict[str, float | int] = {}
        for k, v in metrics.items():
            f = finite(v)
            if f is not None:
                data[k] = int(v) if isinstance(v, int) and not isinstance(v, bool) else f
        data[STEP_KEY] = int(step)
        run.log(data)

    def log_alert(self, step: int, alert: dict[str, Any]) -> None:
        """One alert (docs/alerts.md): ``wandb.alert`` (title ``charllm <kind>: rank <r>``,
        level WARN or INFO, no wait), and a history row with ``alerts/<kind>`` = the rank (-1
        for none) and ``alerts/count`` (alerts so far) at ``step``."""
        run = self._require_run()
        if self.shared and not self.primary:
            return
        self._alerts = getattr(self, "_alerts", 0) + 1
        kind = str(alert.get("kind", "alert"))
        rank = alert.get("rank")
        run.log(
            {
                f"alerts/{kind}": -1 if rank is None else int(rank),
                "alerts/count": self._alerts,
                STEP_KEY: int(step),
            }
        )
        level = "INFO" if alert.get("severity") == "info" else "WARN"
        title = f"charllm {kind}" + ("" if rank is None else f": rank {rank}")
        run.alert(title=title, text=str(alert.get("message", "")), level=level, wait_duration=0)

    def log_windows_table(self, rows: list[dict[str, Any]]) -> None:
        run = self._require_run()
        if self.shared and not self.primary:
            return
        if not rows:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = [[_table_cell(r.get(c)) for c in columns] for r in rows]
        table = self._wandb.Table(columns=columns, data=data)
        run.log({WINDOWS_TABLE_KEY: table})
        self._table_logged = True

    # -- finish --------------------------------------------------------------------------------
    def finish(self, run_dir: Path | None = None) -> None:
        """Table (if not logged yet), artifact, then ``run.finish()``. A failure in the table or
        the artifact is logged and does not keep the run from finishing."""
        run = self._require_run()
        rd = Path(run_dir) if run_dir is not None else self.run_dir
        if not (self.shared and not self.primary) and rd is not None and rd.is_dir():
            if self.log_windows_table_enabled and not self._table_logged:
                try:
                    from charllm_nemo.sinks.windows_table import windows_table_rows

                    rows, _total = windows_table_rows(
                        rd, kinds=self.table_kinds, max_rows=self.table_max_rows
                    )
                    self.log_windows_table(rows)
                except Exception:
                    log.warning("W&B windows table from %s failed", rd, exc_info=True)
            if self.upload_artifact:
                try:
                    self.log_run_artifact(rd)
                except Exception:
                    log.warning("W&B artifact of %s failed", rd, exc_info=True)
        run.finish()

    def log_run_artifact(self, run_dir: Path) -> bool:
        """Log the run directory's telemetry (manifests, Parquet segments, config) as an artifact
        of type ``telemetry`` named ``telemetry-<run id>``; False (and a log line) when it is
        over ``artifact_max_mb`` or empty. Files are referenced in place (policy immutable): an
        offline run keeps them where they are until ``wandb sync``."""
        run = self._require_run()
        wandb_dir = Path(run.dir).parent.parent if getattr(run, "dir", None) else None
        files = telemetry_files(run_dir, exclude=[wandb_dir] if wandb_dir else [])
        size = sum(f.stat().st_size for f in files)
        limit = self.artifact_max_mb * 2**20
        if not files:
            self.artifact_skipped = "no files"
            log.info("W&B artifact: %s has no telemetry files; nothing uploaded", run_dir)
            return False
        if size > limit:
            self.artifact_skipped = f"{size / 2**20:.1f} MiB > artifact_max_mb={self.artifact_max_mb:g}"
            log.info(
                "W&B artifact skipped: %s holds %.1f MiB of telemetry, over logger.artifact_max_mb=%g "
                "(raise it, or keep the directory: it has everything)",
                run_dir,
                size / 2**20,
                self.artifact_max_mb,
            )
            return False
        ranks = sorted(
            {p.name for f in files for p in f.relative_to(run_dir).parents if p.name.startswith("rank=")}
        )
        art = self._wandb.Artifact(
            name=f"telemetry-{run.id}",
            type=ARTIFACT_TYPE,
            description="charllm-nemo run directory: per-rank manifests, samples and windows (Parquet)",
            metadata={"bytes": size, "files": len(files), "ranks": ranks, "run_dir": str(run_dir)},
        )
        for f in files:
            art.add_file(str(f), name=f.relative_to(run_dir).as_posix(), policy="immutable")
        run.log_artifact(art)
        return True


def _table_cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
