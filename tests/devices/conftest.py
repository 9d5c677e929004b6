"""Fixtures for the device backends: the stand-in NVML (see tests/fakes/nvml_stub.py)."""

from __future__ import annotations

try:
    from tests.fakes import nvml_stub
except ImportError:  # tests/ not importable as a package (e.g. --import-mode=importlib)
    import importlib.util
    import sys
    from pathlib import Path

    _path = Path(__file__).resolve().parents[1] / "fakes" / "nvml_stub.py"
    _spec = importlib.util.spec_from_file_location("tests.fakes.nvml_stub", _path)
    assert _spec is not None and _spec.loader is not None
    nvml_stub = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = nvml_stub
    _spec.loader.exec_module(nvml_stub)

fake_nvml_lib = nvml_stub.fake_nvml_lib
fake_nvml = nvml_stub.fake_nvml
fake_nvml_env = nvml_stub.fake_nvml_env

__all__ = ["fake_nvml", "fake_nvml_env", "fake_nvml_lib", "nvml_stub"]
