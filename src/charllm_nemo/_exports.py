"""The packages' lazy public names: ``from charllm_nemo.<package> import Name`` imports Name's
module when first asked for, so importing a package loads no framework, W&B, DuckDB or
matplotlib (tests/test_package_api.py). Each package's ``__init__.py`` lists its names in a
``{name: module}`` table and calls :func:`lazy_attribute` from its ``__getattr__``."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def lazy_attribute(package: str, where: Mapping[str, str], name: str) -> Any:
    """``name`` of ``package``, from the module ``where[name]`` (relative to the package);
    AttributeError for a name the table does not hold."""
    module = where.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{package}.{module}"), name)
