"""Read a ``.wandb`` file back (wandb 0.31 ships no Python reader for it).

The format, as checked against files wandb 0.31.0's wandb-core writes:

* a 7-byte file header: ``:W&B`` (4 bytes), magic ``0xBEE1`` (u16 little-endian), version
  ``0`` (u8);
* then a LevelDB-log stream (github.com/google/leveldb doc/log_format.md) in 32 KiB blocks
  counted from the start of the file (the header sits in the first block): records with a
  7-byte header, crc32 (u32 LE), length (u16 LE), type (u8: FULL=1, FIRST=2, MIDDLE=3,
  LAST=4), then ``length`` bytes. The checksum is plain IEEE CRC-32 (zlib.crc32) over the
  type byte and the data, not masked and not crc32c. A block with fewer than 7 bytes left is
  padded with zeros; a zero-length record of type 0 is padding too.
* each reassembled payload is a ``wandb.proto.wandb_internal_pb2.Record``: ``history``
  records hold the logged items (``key`` or ``nested_key`` path, ``value_json``),
  ``config``/``run`` the config, ``artifact`` the logged artifacts, ``exit`` the end.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """Not a .wandb file, or a damaged one."""


def read_payloads(path: str | Path) -> list[bytes]:
    """Every record payload of a .wandb file, in order; checks header and checksums."""
    data = Path(path).read_bytes()
    if data[:7] != HEADER:
        raise WandbFileError(f"{path}: header {data[:7]!r} is not {HEADER!r}")
    out: list[bytes] = []
    pending: bytes | None = None
    pos = 7
    while pos + RECORD_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER:
            pos += left  # block trailer
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        start = pos + RECORD_HEADER
        payload = data[start : start + length]
        pos = start + length
        if kind == 0 and length == 0:
            continue  # padding
        if len(payload) < length:
            raise WandbFileError(f"{path}: record at {start - RECORD_HEADER} is truncated")
        if zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF != crc:
            raise WandbFileError(f"{path}: bad checksum in the record at {start - RECORD_HEADER}")
        if kind == FULL:
            out.append(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE and pending is not None:
            pending += payload
        elif kind == LAST and pending is not None:
            out.append(pending + payload)
            pending = None
        else:
            raise WandbFileError(f"{path}: record type {kind} out of sequence at {start - RECORD_HEADER}")
    return out


def read_records(path: str | Path) -> list[Any]:
    """The file's ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for payload in read_payloads(path):
        rec = pb.Record()
        rec.ParseFromString(payload)
        records.append(rec)
    return records


def _item_key(item: Any) -> str:
    return item.key if item.key else "/".join(item.nested_key)


def _config_update(cfg: dict[str, Any], items: Any) -> None:
    for item in items:
        cfg[_item_key(item)] = json.loads(item.value_json)


@dataclass
class WandbRun:
    """What a .wandb file holds, decoded."""

    run_id: str = ""
    project: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    artifacts: list[Any] = field(default_factory=list)
    metrics: list[Any] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    exited: bool = False
    kinds: list[str] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)  # wandb.alert: title, text, level


def read_run(path: str | Path, wait_s: float = 0.0) -> WandbRun:
    """Decode a .wandb file: run header, config, history rows (key -> value), artifacts.

    ``wait_s``: wait up to that long for the file's ``exit`` record. wandb 0.31's
    ``run.finish()`` in offline mode returns before wandb-core (a separate process) has written
    the last records: measured 0-4 ms here, longer on a loaded machine (the process's exit
    waits for it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            run = _decode(path)
        except WandbFileError:  # a record half written: read again, until the deadline
            if time.monotonic() >= deadline:
                raise
        else:
            if run.exited or time.monotonic() >= deadline:
                return run
        time.sleep(0.005)


def _decode(path: str | Path) -> WandbRun:
    run = WandbRun()
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        run.kinds.append(kind)
        if kind == "run":
            r = rec.run
            run.run_id, run.project, run.group = r.run_id, r.project, r.run_group
            run.tags = list(r.tags)
            _config_update(run.config, r.config.update)
        elif kind == "config":
            _config_update(run.config, rec.config.update)
        elif kind == "history":
            row = {_item_key(i): json.loads(i.value_json) for i in rec.history.item}
            run.history.append(row)
        elif kind == "artifact":
            run.artifacts.append(rec.artifact)
        elif kind == "metric":
            run.metrics.append(rec.metric)
        elif kind == "files":
            run.files.extend(f.path for f in rec.files.files)
        elif kind == "alert":
            a = rec.alert
            run.alerts.append({"title": a.title, "text": a.text, "level": a.level})
        elif kind == "exit":
            run.exited = True
    return run


def find_wandb_file(root: str | Path) -> Path:
    """The single ``run-*.wandb`` file under ``root`` (e.g. a run directory's wandb/ folder)."""
    found = sorted(Path(root).rglob("run-*.wandb"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one run-*.wandb under {root}, found {[str(p) for p in found]}")
    return found[0]
