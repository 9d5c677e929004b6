"""bench_soak.py's probe (``--probe``): imported by every Python process of the run because the
bench puts this folder first on PYTHONPATH. Every ``CHARLLM_SOAK_PROBE_EVERY`` seconds a daemon
thread appends to ``$CHARLLM_SOAK_PROBE_DIR/probe-<pid>.jsonl`` one line of what the process's
allocators hold, to tell which one the resident memory went to:

- ``malloc_*``: glibc's ``mallinfo2()`` (all arenas): ``arena`` bytes obtained with brk/mmap
  for the arenas, ``hblkhd`` bytes in mmapped chunks (large allocations), ``uordblks`` bytes in
  use, ``fordblks`` bytes free inside the arenas (fragmentation, or kept for reuse),
  ``keepcost`` the top chunk's releasable bytes;
- ``arrow_*``: pyarrow's default memory pool (only once the process imported pyarrow): its
  backend, bytes allocated now and its peak;
- ``trim``: with ``CHARLLM_SOAK_PROBE_TRIM=1``, ``malloc_trim(0)`` is called after each reading
  (freed pages go back to the kernel; ``trim_s`` how long it took): the RSS it leaves
  tells fragmentation from use.

Not part of the package: a diagnostic of the benchmark only.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _loop(folder: str, every: float, trim: bool) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    path = os.path.join(folder, f"probe-{os.getpid()}.jsonl")
    while True:
        time.sleep(every)
        info = libc.mallinfo2()
        row: dict[str, object] = {"t": time.time(), "pid": os.getpid()}
        for k in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost"):
            row[f"malloc_{k}"] = getattr(info, k)
        pa = sys.modules.get("pyarrow")
        if pa is not None:
            pool = pa.default_memory_pool()
            row.update(arrow_backend=pool.backend_name, arrow_bytes=pool.bytes_allocated())
            row["arrow_max"] = pool.max_memory()
        if trim:
            t0 = time.perf_counter()
            row["trimmed"] = int(libc.malloc_trim(0))
            row["trim_s"] = time.perf_counter() - t0
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


_folder = os.environ.get("CHARLLM_SOAK_PROBE_DIR")
if _folder:
    _every = float(os.environ.get("CHARLLM_SOAK_PROBE_EVERY", "5"))
    threading.Thread(
        target=_loop,
        args=(_folder, _every, os.environ.get("CHARLLM_SOAK_PROBE_TRIM") == "1"),
        name="soak-probe",
        daemon=True,
    ).start()
