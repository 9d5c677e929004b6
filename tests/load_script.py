"""Import a script that is not in a package (bench/, scripts/) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The module of ``REPO / relative``, executed once per call."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as an import would: a dataclass defined in it looks its module
    # up in sys.modules (its annotations are strings).
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
