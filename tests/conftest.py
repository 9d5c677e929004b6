"""Session-wide reporting shared by the test modules."""

from __future__ import annotations

from typing import Any

DOCS_SKIPPED = "docs_skipped"  # = tests/test_docs.py SKIPPED_KEY


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The docs test's list of the commands it did not run as written, and why: printed on the
    terminal (the list is the test's report, not a debug aid), gathered from the test reports'
    user properties so that it survives pytest-xdist's worker processes."""
    lines: list[str] = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == DOCS_SKIPPED and value not in lines:
                    lines.append(value)
    if lines:
        terminalreporter.write_line("")
        terminalreporter.write_line(f"docs test: {len(lines)} command(s) not run as written, and why:")
        for line in lines:
            terminalreporter.write_line(line)
