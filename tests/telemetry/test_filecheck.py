"""JSON files of a run directory checked against their documented schema, and text from them
made safe for a terminal."""

from __future__ import annotations

from charllm_nemo.telemetry.filecheck import (
    printable,
    validate_manifest,
    validate_step,
    validate_summary,
)


def test_a_manifest_that_is_not_an_object_is_a_warning_and_empty() -> None:
    for data, kind in (([1, 2], "list"), ("running", "string"), (5, "int")):
        problems: list[str] = []
        assert validate_manifest(data, "rank=0/manifest.json", problems) == {}
        assert problems == [f"rank=0/manifest.json: file holds a JSON {kind}, not an object; ignored"]


def test_fields_of_the_wrong_type_are_dropped_and_named_the_rest_kept() -> None:
    problems: list[str] = []
    m = validate_manifest(
        {
            "status": 5,
            "backend": ["nvml"],
            "rank": True,  # a bool is not a rank number
            "host": "node1",
            "devices": [{"index": 0, "name": "H200"}, {"index": "0"}, "gpu"],
            "newer_field": {"kept": 1},
        },
        "m.json",
        problems,
    )
    assert m == {"host": "node1", "devices": [{"index": 0, "name": "H200"}], "newer_field": {"kept": 1}}
    assert problems == [
        "m.json: field 'status' is int (5), expected string; ignored",
        "m.json: field 'backend' is list (['nvml']), expected string; ignored",
        "m.json: field 'rank' is bool (True), expected int; ignored",
        "m.json: field 'devices[1].index' is string ('0'), expected int; ignored",
        "m.json: devices[2] holds a JSON string, not an object; ignored",
    ]


def test_summary_and_step_lines_are_checked_field_by_field() -> None:
    problems: list[str] = []
    s = validate_summary(
        {
            "status": "complete",
            "steps": "12",
            "step_time_s_median": "fast",
            "mfu_median": None,
            "per_step": [{"step": 0, "loss": 2.5}, {"step": 1, "loss": "nan"}, 7],
            "memory": {"measure": "max_rss", "peak_bytes": [1, 2], "plan_bytes": [1], "pp_stage": [0, 0]},
        },
        "summary.json",
        problems,
    )
    assert s == {
        "status": "complete",
        "mfu_median": None,
        "per_step": [{"step": 0, "loss": 2.5}, {"step": 1}],
        "memory": None,
    }
    assert len(problems) == 5 and all(p.startswith("summary.json: ") for p in problems)
    assert "field 'per_step[1].loss' is string ('nan'), expected number or null" in problems[2]
    assert "'memory' does not hold equal-length lists" in problems[4]
    problems.clear()
    assert validate_step({"step": 3, "loss": float("nan")}, "steps.jsonl:4", problems)["step"] == 3
    assert problems == []


def test_control_characters_are_escaped_and_long_text_cut() -> None:
    assert printable("complete") == "complete"
    assert printable("\x1b[2J\x1b[31mok\rX") == "\\x1b[2J\\x1b[31mok\\rX"
    assert printable("a\u202eb") == "a\\u202eb"  # a bidirectional override reorders what follows
    assert printable("x" * 300, 10) == "xxxxxxx..."
    assert printable("n\u00e9ud") == "n\u00e9ud"  # ordinary non-ASCII text stays
