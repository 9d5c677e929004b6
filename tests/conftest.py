"""Session-wide reporting shared by the test modules."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

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


@pytest.fixture(autouse=True)
def _logging_restored() -> Iterator[None]:
    """The root logger's handlers and the package's level as they were before each test.

    ``charllm`` commands run in-process (``main([...])``) call ``logging.basicConfig``, which binds
    a handler to the ``sys.stderr`` of that moment: pytest's capture file, closed after the test.
    Left on the root, every later log line in the same worker fails with "Logging error" text on
    stderr, which tests that read stderr then see (CI failure of test_disk_full, 2026-12-06)."""
    handlers = list(logging.root.handlers)
    root_level = logging.root.level
    pkg = logging.getLogger("charllm_nemo")
    pkg_level = pkg.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(root_level)
    pkg.setLevel(pkg_level)
