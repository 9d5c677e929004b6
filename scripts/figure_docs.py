"""Rewrite the field tables of docs/store.md and docs/wandb.md from the one table of step
figures (charllm_nemo.telemetry.figures); tests/steps/test_figures.py fails until they agree.

    PYTHONPATH=src python scripts/figure_docs.py [DOCS_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

from charllm_nemo.telemetry.figures import render_docs

if __name__ == "__main__":
    docs = Path(sys.argv[1] if len(sys.argv) > 1 else "docs")
    for page in ("store.md", "wandb.md"):
        path = docs / page
        text = path.read_text(encoding="utf-8")
        new = render_docs(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote {path}")
