"""The C twins of what runs on the training thread between two pieces of training work.

``charllm_nemo._hot`` (src/charllm_nemo/_hot.c, built at install when a C compiler is there)
holds Megatron-Core's timer calls (train/marks.py), the synthetic device's mark listener
(devices/synthetic.py) and the mark ring's writer (telemetry/shm.py) in C. Each has a Python
twin with the same behaviour, used when the module is not built or when
``CHARLLM_PURE_PYTHON=1`` is set in the environment; tests run both.
docs/training-internals.md says what they save.
"""

from __future__ import annotations

import os
from types import ModuleType

hot: ModuleType | None
try:
    from charllm_nemo import _hot as hot  # type: ignore[attr-defined,no-redef]
except ImportError:  # not built: the Python twins
    hot = None
if os.environ.get("CHARLLM_PURE_PYTHON") == "1":
    hot = None

IN_C: bool = hot is not None
"""Whether the training thread's hot paths run in C in this process."""
