"""Files of one kind whose segment ranges overlap: rows that two of them hold are read once.

A compacted file is named for the segments it holds (``samples-000001-000003.parquet``,
telemetry/compact.py). One inside a wider one is superseded at the scan (telemetry/layout.py);
two that only overlap (1-3 and 2-4: a copy of a run put beside another compaction of it, a
hand-made merge) each hold rows the other lacks, so neither can be dropped whole. Read as they
were, segments 2-3 were counted twice, and ``charllm compact`` wrote the doubling into one file
for good (381 of 323 samples). Here every reader and compaction keeps the first copy: a row of a
later file whose key (:data:`ROW_KEYS`) an earlier overlapping file holds is dropped, and a line
in ``problems`` names both files and how many rows were dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

ROW_KEYS: dict[str, tuple[str, ...]] = {
    "samples": ("t_mono_ns", "device_index"),
    "windows": ("window_id", "t_begin_mono_ns"),
    "buffered": ("t_mono_ns", "device_index", "metric"),
}
"""Columns that tell one row of a kind from another (a rank's sample of one device at one time;
a window; a driver-buffered value)."""

_RANGE = re.compile(r"-([0-9]+)(?:-([0-9]+))?\.parquet$")


def segment_range(path: Path) -> tuple[int, int] | None:
    """(first, last) segment number of a segment or compacted file, from its name."""
    m = _RANGE.search(path.name)
    if m is None:
        return None
    first = int(m.group(1))
    return first, int(m.group(2)) if m.group(2) else first


def _keys(table: pa.Table, kind: str) -> list[str] | None:
    names = [k for k in ROW_KEYS.get(kind, ()) if k in table.column_names]
    return names or None


def _plain(table: pa.Table, names: list[str]) -> pa.Table:
    """The key columns, dictionaries decoded (a join takes plain types)."""
    cols = [table.column(n) for n in names]
    cols = [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c for c in cols]
    return pa.table(dict(zip(names, cols, strict=True)))


def read_once(items: Sequence[tuple[Path, pa.Table]], kind: str, problems: list[str]) -> list[pa.Table]:
    """The tables of ``items`` (files of one kind in read order), each later file's rows that an
    earlier file with an overlapping segment range holds dropped (one line in ``problems`` per
    such pair)."""
    out: list[pa.Table] = []
    ranges = [segment_range(p) for p, _ in items]
    for j, (path, table) in enumerate(items):
        rj = ranges[j]
        earlier = [
            i for i in range(j)
            if rj is not None and (ri := ranges[i]) is not None and ri[0] <= rj[1] and rj[0] <= ri[1]
        ]  # fmt: skip
        names = _keys(table, kind)
        if earlier and names is not None and table.num_rows:
            held = [_plain(out[i], names) for i in earlier if _keys(out[i], kind) == names]
            if held:
                idx = _plain(table, names).append_column("__row", pa.array(np.arange(table.num_rows)))
                keep = idx.join(pa.concat_tables(held), keys=names, join_type="left anti")
                rows = np.sort(keep.column("__row").to_numpy())
                dropped = table.num_rows - len(rows)
                if dropped:
                    others = ", ".join(items[i][0].name for i in earlier)
                    problems.append(
                        f"{path}: its segments overlap {others}; {dropped} {kind} row(s) both hold are "
                        "read once (the first file's copy)"
                    )
                    table = table.take(pa.array(rows, pa.int64()))
        out.append(table)
    return out
