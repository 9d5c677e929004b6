"""SessionOptions and its parts (telemetry/session_options.py): checked when made, each check
and default declared once (the config's checks ask the same functions), and made from a config
in one place (telemetry/config.py ``session_options``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.telemetry.config import (
    TelemetryConfig,
    session_options,
    telemetry_problems,
)
from charllm_nemo.telemetry.session import TelemetrySession
from charllm_nemo.telemetry.session_options import Placement, ProcessOptions, SessionOptions, StoreOptions

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("session", {"hz": 0}, r"telemetry\.hz=0 is not a sampling rate.*e\.g\. telemetry\.hz=100"),
    ("session", {"hz": math.nan}, r"telemetry\.hz=nan"),
    ("session", {"counter_hz": -1}, r"telemetry\.counter_hz=-1 is not a positive finite rate.*null"),
    ("session", {"counter_hz": math.inf}, r"telemetry\.counter_hz=inf"),
    (
        "session",
        {"sampler": "fork"},
        r"telemetry\.sampler='fork' is not valid; use one of \[auto, thread, process\]",
    ),
    ("session", {"backend": "rapl"}, r"telemetry\.backend='rapl' is not valid; use one of \[auto, "),
    ("session", {"devices": [-1]}, r"SessionOptions\.devices=\[-1\] must be a list of device indices"),
    ("session", {"devices": "0"}, r"SessionOptions\.devices='0'"),
    ("process", {"nice": 20}, r"telemetry\.nice=20: .*from 0 .* to 19"),
    ("process", {"nice": True}, r"telemetry\.nice=True"),
    (
        "process",
        {"collector_sched": "fifo"},
        r"telemetry\.collector_sched='fifo' is not valid; use one of \[auto",
    ),
    ("process", {"rank_threads": -1}, r"ProcessOptions\.rank_threads=-1 must be an integer >= 0"),
    ("process", {"rank_threads": 1.5}, r"ProcessOptions\.rank_threads=1\.5 must be an integer"),
    ("store", {"flush_interval_s": 0}, r"StoreOptions\.flush_interval_s=0 must be a positive finite number"),
    ("store", {"live_window_s": math.inf}, r"StoreOptions\.live_window_s=inf"),
    ("store", {"overwrite": "yes"}, r"telemetry\.overwrite='yes' must be True or False"),
    ("store", {"driver_buffers": 1}, r"telemetry\.driver_buffers=1 must be True or False"),
]


@pytest.mark.parametrize(("part", "values", "message"), BAD)
def test_a_bad_value_is_refused_when_made_naming_the_field_and_a_fix(
    part: str, values: dict[str, Any], message: str
) -> None:
    kind = {"session": SessionOptions, "process": ProcessOptions, "store": StoreOptions}[part]
    with pytest.raises(ConfigError, match=message) as err:
        kind(**values)
    assert isinstance(err.value, ValueError)


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        SessionOptions(hz=0, sampler="fork", backend="rapl")
    text = str(err.value)
    assert (
        "telemetry.hz=0" in text and "telemetry.sampler='fork'" in text and "telemetry.backend='rapl'" in text
    )


def test_an_object_of_the_wrong_kind_is_a_type_error_naming_the_fix(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match=r"SessionOptions\.store=\{.*\} must be a StoreOptions"):
        SessionOptions(store={"flush_interval_s": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SessionOptions\.backend_options=\[\] must be a mapping"):
        SessionOptions(backend_options=[])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ProcessOptions\.export='prometheus' must be a mapping"):
        ProcessOptions(export="prometheus")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"give a SessionOptions, e\.g\. TelemetrySession\(out_dir, SessionOptions"
    ):
        TelemetrySession(tmp_path, {"backend": "synthetic"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"give a Placement"):
        TelemetrySession(tmp_path, SessionOptions(backend="synthetic"), placement=(0, 0, 1))  # type: ignore[arg-type]
    assert not (tmp_path / "rank=0").exists()  # refused before anything was made


def test_options_are_frozen_and_normalised() -> None:
    o = SessionOptions(hz=50, devices=[0, 1], backend_options={"activity": "marks"})
    assert o.hz == 50.0 and isinstance(o.hz, float) and o.devices == (0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.hz = 10.0  # type: ignore[misc]


def _defaults(kind: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(kind) if f.default is not dataclasses.MISSING}


def test_the_config_and_the_options_default_alike() -> None:
    # Each default is declared once (a constant that both name): a config left at its defaults
    # gives the options' defaults, field for field.
    config = _defaults(TelemetryConfig)
    shared = {**_defaults(SessionOptions), **_defaults(StoreOptions), **_defaults(ProcessOptions)}
    # telemetry.export (off | prometheus | ...) becomes ProcessOptions.export, the exporter's
    # settings (None: off) through export_options: a different value, compared below.
    common = sorted(set(config) & set(shared) - {"export"})
    assert common == [
        "backend",
        "collector_sched",
        "counter_hz",
        "driver_buffers",
        "hz",
        "nice",
        "overwrite",
        "sampler",
    ]
    assert {k: config[k] for k in common} == {k: shared[k] for k in common}
    assert session_options(TelemetryConfig(), Placement()).process.export is None


def test_the_config_checks_ask_the_same_checks_as_the_options() -> None:
    # The config's problem for a field is the one SessionOptions raises for it, word for word.
    for field, value, kind in [
        ("hz", 5000, SessionOptions),
        ("counter_hz", 0, SessionOptions),
        ("sampler", "fork", SessionOptions),
        ("nice", 20, ProcessOptions),
        ("collector_sched", "fifo", ProcessOptions),
    ]:
        cfg = dataclasses.replace(TelemetryConfig(out_dir="unused"), **{field: value})
        problems = telemetry_problems(cfg, check_out_dir=False)
        with pytest.raises(ConfigError) as err:
            kind(**{field: value})
        assert problems == [str(err.value)], field


def test_a_config_becomes_session_options_field_for_field() -> None:
    cfg = TelemetryConfig(
        backend="synthetic",
        hz=250,
        counter_hz=25,
        sampler="thread",
        nice=19,
        collector_sched="idle",
        overwrite=True,
        driver_buffers=False,
        out_dir="runs/x",
    )
    o = session_options(cfg, Placement(1, 1, 2, 2), rank_threads=3)
    assert (o.backend, o.hz, o.counter_hz, o.sampler) == ("synthetic", 250.0, 25, "thread")
    assert o.store == StoreOptions(overwrite=True, driver_buffers=False)
    assert o.process == ProcessOptions(nice=19, collector_sched="idle", rank_threads=3, export=None)
    assert o.backend_options == {} and o.devices is None
    # nvml takes no synthetic options; the live exporter's settings name this rank
    cfg = dataclasses.replace(cfg, backend="nvml", export="prometheus", export_port=9500)
    o = session_options(cfg, Placement(1, 1, 2, 2))
    assert o.backend_options == {} and o.process.export is not None
    assert (o.process.export["mode"], o.process.export["port"], o.process.export["rank"]) == (
        "prometheus",
        9500,
        1,
    )


def test_a_session_takes_its_placement_labels_and_options(tmp_path: Any) -> None:
    place = Placement(1, 1, 2, 2, {"pp_stage": 1, "tp_rank": 0, "other": 5})
    options = SessionOptions(
        backend="synthetic", hz=100, sampler="thread", store=StoreOptions(flush_interval_s=0.1)
    )
    tel = TelemetrySession(tmp_path, options, placement=place, handle_signals=False).start()
    try:
        assert (tel.rank, tel.local_rank, tel.world_size) == (1, 1, 2)
        assert tel.options is options and tel.placement is place
        with tel.windows.window("step", step=0):
            pass
        assert tel.manifest["rank"] == 1 and tel.manifest["world_size"] == 2
    finally:
        tel.close()
    assert (tmp_path / "rank=1" / "manifest.json").is_file()
    from charllm_nemo.telemetry.reader import load_run

    windows = load_run(tmp_path).windows.to_pylist()
    assert [(w["pp_stage"], w["tp_rank"]) for w in windows] == [(1, 0)]
