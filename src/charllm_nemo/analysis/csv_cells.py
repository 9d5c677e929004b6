"""CSV cells a spreadsheet will not run: every CSV the tool writes goes through here.

Text in the tables comes from the run (a host name, a model name, a status): a cell that starts
with ``=``, ``+``, ``-`` or ``@`` (or a tab or carriage return, which some spreadsheets strip
before looking) is read by Excel, LibreOffice and Google Sheets as a formula, so a host named
``=cmd|' /C calc'!A0`` would run a command on the machine of whoever opens ``nodes.csv``
(CSV injection, OWASP). Such a text cell is written with a leading ``'``, the escape those
spreadsheets expect (they show the text as it was, without the quote). Numbers are never
changed: a negative number is a number column, not text. The Parquet tables keep the text as
it is.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from charllm_nemo.telemetry.write import write_with

FORMULA_START = r"^([=+\-@\t\r])"
"""The first characters that make a spreadsheet read a cell as a formula."""


def _safe_column(col: Any) -> Any:
    t = col.type
    if pa.types.is_dictionary(t):
        col = col.cast(t.value_type)
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pc.replace_substring_regex(col, FORMULA_START, r"'\1")
    return col


def spreadsheet_safe(data: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
    """``data`` with every text cell that a spreadsheet would run as a formula escaped (``'``)."""
    columns = [_safe_column(c) for c in data.columns]
    if isinstance(data, pa.RecordBatch):
        return pa.RecordBatch.from_arrays(columns, names=data.schema.names)
    return pa.Table.from_arrays(columns, names=data.column_names)


def write_csv(path: Path, table: pa.Table) -> Path:
    """``table`` as CSV at ``path`` (the hardened write layer), formula cells escaped."""
    return write_with(path, partial(pacsv.write_csv, spreadsheet_safe(table)))


def csv_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of :func:`spreadsheet_safe`'s batches of ``schema`` (dictionaries decoded), for a
    ``CSVWriter`` that writes them one by one."""
    return pa.schema(
        [pa.field(f.name, f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema]
    )
