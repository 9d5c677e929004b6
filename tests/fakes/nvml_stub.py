"""Build and drive the stand-in NVML library (``fake_nvml.c``) for tests and benchmarks.

Two ways to use it:

* **In a child process** (sampler, kill and benchmark tests; Zeus): build the library, then
  start the child with :func:`subprocess_env`, which puts the library's directory first on
  ``LD_LIBRARY_PATH`` and names a script in ``FAKE_NVML_SCRIPT``. The child's unmodified
  ``pynvml`` does ``CDLL("libnvidia-ml.so.1")`` and gets the stand-in::

      from tests.fakes import nvml_stub
      env = nvml_stub.subprocess_env(["* call_delay_us 20", "0 energy_mode dynamic"], tmp_dir=tmp_path)
      subprocess.run([sys.executable, "-c", code], env=env, check=True)

* **In this process** (:func:`load_in_process` + :func:`install_into_pynvml`, or the
  ``fake_nvml`` fixture): a copy built under another soname is loaded with RTLD_LOCAL and
  handed to pynvml as its library, so it never answers a later ``CDLL("libnvidia-ml.so.1")``
  by soname and is removed from pynvml again after the test. :class:`FakeNvml` scripts it
  through the same line format (see the top of fake_nvml.c) and reads its call counters.

The build is cached under ``$CHARLLM_FAKE_NVML_DIR`` (default: a per-user folder in the
system temp directory), keyed by a hash of the source and the compiler command, and written
atomically, so concurrent test processes share one build.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("fake_nvml.c")
SONAME = "libnvidia-ml.so.1"
INPROCESS_SONAME = "libcharllm-fake-nvml-inprocess.so"
SCRIPT_ENV = "FAKE_NVML_SCRIPT"
CACHE_ENV = "CHARLLM_FAKE_NVML_DIR"

_CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


class StubUnavailable(RuntimeError):
    """The stand-in cannot be built here (no C compiler, or the build failed)."""


def compiler() -> str | None:
    """Path of the C compiler used ($CC if set, else gcc), or None."""
    return shutil.which(os.environ.get("CC", "gcc"))


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"charllm-fake-nvml-{uid}"


_build_lock = threading.Lock()


def build(cache_dir: Path | None = None, soname: str = SONAME) -> Path:
    """Compile fake_nvml.c (once per source hash) and return the library's absolute path.

    The file is named after its soname, so its folder can go on LD_LIBRARY_PATH as is.
    """
    cc = compiler()
    if cc is None:
        raise StubUnavailable("no C compiler (gcc) on PATH: cannot build the stand-in libnvidia-ml.so.1")
    source = SOURCE.read_bytes()
    command_key = " ".join((*_CFLAGS, f"-Wl,-soname,{soname}"))
    digest = hashlib.sha256(source + b"\0" + command_key.encode()).hexdigest()[:16]
    out_dir = (cache_dir or default_cache_dir()) / digest
    target = out_dir / soname
    with _build_lock:
        if target.exists():
            return target.resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{soname}.", dir=out_dir)
        os.close(fd)
        cmd = [cc, *_CFLAGS, f"-Wl,-soname,{soname}", "-o", tmp_name, str(SOURCE)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise StubUnavailable(f"building the stand-in NVML failed: {' '.join(cmd)}\n{proc.stderr}")
            os.replace(tmp_name, target)  # atomic: a concurrent builder sees all or nothing
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
    return target.resolve()


def library_dir(cache_dir: Path | None = None) -> Path:
    """The folder holding libnvidia-ml.so.1 (the stand-in): what goes on LD_LIBRARY_PATH."""
    return build(cache_dir).parent


ScriptSpec = str | os.PathLike[str] | Iterable[str]


def script_text(script: Iterable[str] | str) -> str:
    """A script from lines (an iterable) or from text."""
    if isinstance(script, str):
        return script if script.endswith("\n") else script + "\n"
    return "".join(f"{line}\n" for line in script)


def write_script(path: str | os.PathLike[str], script: Iterable[str] | str) -> Path:
    """Write a FAKE_NVML_SCRIPT file (lines like ``0 power_instant_mw 250000``)."""
    out = Path(path)
    out.write_text(script_text(script))
    return out


def subprocess_env(
    script: ScriptSpec | None = None,
    *,
    base: Mapping[str, str] | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
    lib_dir: str | os.PathLike[str] | None = None,
) -> dict[str, str]:
    """Environment for a child process whose pynvml must load the stand-in.

    ``script``: a path to an existing script file (``os.PathLike``), or its lines / text,
    written to a file in ``tmp_dir`` (default: a fresh temp dir); a plain ``str`` is script
    text, not a path. ``lib_dir`` defaults to the cached build's folder. ``base`` defaults to
    os.environ. LD_LIBRARY_PATH gets the stand-in's folder first; FAKE_NVML_SCRIPT is set
    (or removed when ``script`` is None, so the child sees the library's defaults).
    """
    env = dict(os.environ if base is None else base)
    folder_of_lib = str(lib_dir) if lib_dir is not None else str(library_dir())
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = f"{folder_of_lib}:{old}" if old else folder_of_lib
    if script is None:
        env.pop(SCRIPT_ENV, None)
    elif isinstance(script, os.PathLike):
        env[SCRIPT_ENV] = str(Path(script).resolve())
    else:
        folder = Path(tmp_dir) if tmp_dir is not None else Path(tempfile.mkdtemp(prefix="fake-nvml-"))
        fd, name = tempfile.mkstemp(prefix="fake_nvml_script_", suffix=".txt", dir=folder)
        os.close(fd)
        env[SCRIPT_ENV] = str(write_script(name, script).resolve())
    return env


# --- in-process use ---------------------------------------------------------------------------


class FakeNvml:
    """A ctypes handle on a loaded stand-in: script it, read its call counters."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.fake_nvml_command.argtypes = [ctypes.c_char_p]
        lib.fake_nvml_command.restype = ctypes.c_int
        lib.fake_nvml_load_script.argtypes = [ctypes.c_char_p]
        lib.fake_nvml_load_script.restype = ctypes.c_int
        lib.fake_nvml_call_count.argtypes = [ctypes.c_char_p]
        lib.fake_nvml_call_count.restype = ctypes.c_ulonglong
        lib.fake_nvml_field_count.argtypes = [ctypes.c_uint]
        lib.fake_nvml_field_count.restype = ctypes.c_ulonglong
        lib.fake_nvml_refcount.restype = ctypes.c_int
        lib.fake_nvml_reset.restype = None
        lib.fake_nvml_reset_counts.restype = None

    def command(self, line: str) -> None:
        """One script line, e.g. ``"0 temp_gpu_c NOT_SUPPORTED"`` or ``"device_count 2"``."""
        if self.lib.fake_nvml_command(line.encode()) != 0:
            raise ValueError(f"fake NVML cannot parse {line!r} (see the format at the top of fake_nvml.c)")

    def script(self, script: Iterable[str] | str) -> None:
        for line in script_text(script).splitlines():
            self.command(line)

    def set(self, device: int | str, key: str, value: int | str) -> None:
        """``set(0, "power_instant_mw", 300000)``; device ``"*"`` = every device."""
        self.command(f"{device} {key} {value}")

    def set_global(self, key: str, value: int | str) -> None:
        """``set_global("device_count", 2)``, ``set_global("init_error", "DRIVER_NOT_LOADED")``."""
        self.command(f"{key} {value}")

    def load_script(self, path: str | os.PathLike[str]) -> None:
        if self.lib.fake_nvml_load_script(os.fsencode(path)) != 0:
            raise ValueError(f"fake NVML could not read all of {path}")

    def reset(self) -> None:
        """Defaults, not initialized, counters zero; FAKE_NVML_SCRIPT is read at the next init."""
        self.lib.fake_nvml_reset()

    def calls(self, function: str) -> int:
        """How many times the named NVML entry point was called since the last reset."""
        n = int(self.lib.fake_nvml_call_count(function.encode()))
        if n == 2**64 - 1:
            raise KeyError(f"the fake NVML does not implement {function}")
        return n

    def field_calls(self, field_id: int) -> int:
        """How many times a field id was requested through nvmlDeviceGetFieldValues."""
        return int(self.lib.fake_nvml_field_count(field_id))

    def reset_counts(self) -> None:
        self.lib.fake_nvml_reset_counts()

    @property
    def refcount(self) -> int:
        """nvmlInit calls not yet matched by nvmlShutdown."""
        return int(self.lib.fake_nvml_refcount())


_loaded: dict[str, ctypes.CDLL] = {}


def load_in_process(path: str | os.PathLike[str] | None = None, *, via_soname: bool = False) -> FakeNvml:
    """Load the stand-in into this process (once per path) and return its handle.

    Default: the copy built under a private soname, loaded RTLD_LOCAL; pair it with
    :func:`install_into_pynvml`. ``via_soname=True`` loads the libnvidia-ml.so.1 build
    RTLD_GLOBAL before pynvml's first nvmlInit, so pynvml's own ``CDLL("libnvidia-ml.so.1")``
    finds it by soname; that cannot be undone, so use it only in a throwaway process.
    """
    if path is None:
        path = build(soname=SONAME if via_soname else INPROCESS_SONAME)
    key = str(Path(path).resolve())
    lib = _loaded.get(key)
    if lib is None:
        mode = ctypes.RTLD_GLOBAL if via_soname else ctypes.RTLD_LOCAL
        lib = ctypes.CDLL(key, mode=mode)
        _loaded[key] = lib
    return FakeNvml(lib)


@dataclass
class PynvmlState:
    """What install_into_pynvml replaced, to put back."""

    lib: Any
    cache: dict[str, Any]
    refcount: int


def install_into_pynvml(lib: ctypes.CDLL) -> PynvmlState:
    """Make pynvml use ``lib`` as libnvidia-ml (and forget function pointers it cached)."""
    import pynvml

    with pynvml.libLoadLock:
        state = PynvmlState(
            pynvml.nvmlLib, dict(pynvml._nvmlGetFunctionPointer_cache), pynvml._nvmlLib_refcount
        )
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0
    return state


def restore_pynvml(state: PynvmlState) -> None:
    """Undo install_into_pynvml: pynvml sees whatever library it had before (usually none)."""
    import pynvml

    with pynvml.libLoadLock:
        pynvml.nvmlLib = state.lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlGetFunctionPointer_cache.update(state.cache)
        pynvml._nvmlLib_refcount = state.refcount


# --- pytest fixtures (import them into a conftest.py to use them) ------------------------------

try:
    import pytest
except ImportError:  # a benchmark script may import this module without pytest
    pytest = None  # type: ignore[assignment]


@dataclass(frozen=True)
class StubBuild:
    """The built stand-in: ``dir`` goes on LD_LIBRARY_PATH; ``env()`` makes a child's environment."""

    path: Path
    dir: Path
    inprocess_path: Path

    def env(
        self,
        script: ScriptSpec | None = None,
        *,
        base: Mapping[str, str] | None = None,
        tmp_dir: str | os.PathLike[str] | None = None,
    ) -> dict[str, str]:
        return subprocess_env(script, base=base, tmp_dir=tmp_dir, lib_dir=self.dir)


def build_all(cache_dir: Path | None = None) -> StubBuild:
    path = build(cache_dir, SONAME)
    return StubBuild(path=path, dir=path.parent, inprocess_path=build(cache_dir, INPROCESS_SONAME))


if pytest is not None:

    @pytest.fixture(scope="session")
    def fake_nvml_lib() -> StubBuild:
        """The stand-in, built once per source hash; skips the test where gcc is missing."""
        try:
            return build_all()
        except StubUnavailable as exc:
            pytest.skip(str(exc))

    @pytest.fixture
    def fake_nvml(fake_nvml_lib: StubBuild, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
        """The stand-in loaded in this process, reset, and installed as pynvml's library."""
        pytest.importorskip("pynvml")
        monkeypatch.delenv(SCRIPT_ENV, raising=False)
        fake = load_in_process(fake_nvml_lib.inprocess_path)
        fake.reset()
        state = install_into_pynvml(fake.lib)
        try:
            yield fake
        finally:
            fake.reset()
            restore_pynvml(state)

    @pytest.fixture
    def fake_nvml_env(fake_nvml_lib: StubBuild, tmp_path: Path) -> Any:
        """``fake_nvml_env(script_lines_or_text=None, base=None) -> env dict`` for a child process."""

        def make(script: ScriptSpec | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
            return fake_nvml_lib.env(script, base=base, tmp_dir=tmp_path)

        return make
