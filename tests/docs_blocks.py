"""The fenced code blocks of README.md and docs/*.md, and how tests/test_docs.py treats each.

The convention (docs/README-level, stated in README.md "Tests"): every ```bash, ```python and
```sql block runs on a CPU as written, in the order of its document, in one temporary folder per
document; an HTML comment on the line just before a block changes that:

    <!-- docs-test: gpu REASON -->       GPU only: checked, not run (below)
    <!-- docs-test: slurm REASON -->     needs a SLURM cluster (a sweep's jobs): checked, not run
    <!-- docs-test: dry-run REASON -->   runs on a CPU but costs minutes, or is run for real by a
                                         test REASON names: checked, not run
    <!-- docs-test: parse REASON -->     a fragment (names from its context): checked, not run
    <!-- docs-test: skip REASON -->      not run and not checked, REASON printed
    <!-- docs-test: output -->           (before a plain ``` block) what the block before it
                                         prints: each line's text up to its first digit must appear

A line whose comment starts ``# GPU only`` or ``# needs ...`` (a W&B server, ...) is checked
instead of run; a plain ``` block whose
first line starts with ``$ `` is a console session: its ``$`` command runs and the lines after it
are its output, checked as above. "Checked" means: a ``charllm train`` line runs with
``dry_run=true`` (its config composed and validated for its world size, nothing started), a
``charllm <command>`` line or a script has every ``--option`` it uses in its ``--help``, a Python
block compiles and its imports run, any other line passes ``bash -n``.

Set-up commands (scripts/setup.sh, scripts/test.sh, pip install, sudo, the local SLURM's start)
are what CI runs before the tests: never run here, listed as skipped. SLURM lines (``srun``,
``launcher=slurm``, ``hydra/launcher=slurm_*``, ``squeue``) are checked, not run: a sweep on the
local SLURM takes minutes, and tests/sweep/test_slurm_sweeps.py submits real jobs to it. A
``charllm train`` line with a bare ``...`` (the user's other arguments) is a template: checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("run", "gpu", "slurm", "dry-run", "parse", "skip", "output")
RUN_LANGS = ("bash", "sh", "python", "sql")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*([\w-]+)\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")

# Words that stand for a run or sweep folder (docs/analysis.md, compare-energy.md, advisor.md):
# replaced by a run the test trains once.
PLACEHOLDERS = ("RUN_OR_SWEEP_DIR", "RUN_A", "RUN_B", "RUN_C", "RUN", "DIR", "SWEEP", "A", "B")

# (pattern of a logical line, why it is not run): what CI's own set-up does.
SETUP = [
    (re.compile(r"^(sudo\s|scripts/local-slurm\.sh\b|eval \"\$\(scripts/local-slurm\.sh)"),
     "local SLURM set-up: CI starts it (scripts/test.sh setup_slurm)"),
    (re.compile(r"^scripts/(setup|setup-nemo|test)\.sh\b"), "set-up: what CI itself runs (scripts/test.sh)"),
    (re.compile(r"^(python -m )?pip install\b"), "installs packages: CI's set-up does (scripts/setup.sh)"),
    (re.compile(r"^(bench/gpu_wheels\.sh|echo /\.whl/)"), "GPU machine set-up (docs/gpu-check.md)"),
    (re.compile(r"^(git worktree add|mkdir /tmp/base && git archive)"),
     "an older tree to compare against: a benchmark's set-up"),
]  # fmt: skip
SLURM = re.compile(r"(^srun\s|\blauncher=slurm\b|hydra/launcher=slurm_|^squeue\b|^sbatch\b)")


@dataclass
class Block:
    """One fenced block: where it is, its language, its text (indentation removed) and mode."""

    doc: str
    line: int
    lang: str
    text: str
    mode: str = "run"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass
class Command:
    """One logical shell line (continuations joined) and what the test does with it."""

    text: str
    action: str  # "run" | "check" | "skip"
    reason: str = ""
    extra: list[str] = field(default_factory=list)


def doc_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with the mode its marker gives (``run`` without one)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
        block = Block(str(path.relative_to(ROOT)), i + 1, lang, "\n".join(body))
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = _MARKER.match(lines[k]) if k >= 0 else None
        if mk:
            block.mode, block.reason = mk.group(1), mk.group(2)
        elif lang == "" and body and body[0].startswith("$ "):
            block.mode = "session"
        elif lang not in RUN_LANGS:
            block.mode = "text"
        out.append(block)
        i = j + 1
    return out


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined; blank and comment-only lines dropped."""
    out: list[str] = []
    cur = ""
    for raw in text.split("\n"):
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        if cur.strip() and not cur.strip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def strip_comment(line: str) -> tuple[str, str]:
    """(the command, its trailing ``# comment``) of one shell line; quotes respected."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line, ""


def classify(line: str, block_mode: str, block_reason: str = "") -> list[Command]:
    """What to do with one logical shell line of a block in ``block_mode`` (its marker's
    ``block_reason``, said when the line is not run)."""
    cmd, comment = strip_comment(line)
    # `scripts/setup.sh && charllm train ...`: the set-up is skipped, what follows it runs; any
    # other line stays whole (`curl ... && break` inside a loop is one command)
    head, _, rest = cmd.partition(" && ")
    parts = [head.strip(), rest.strip()] if rest and _setup(head.strip()) else [cmd]
    out: list[Command] = []
    for part in parts:
        setup = _setup(part)
        if setup:
            out.append(Command(part, "skip", setup))
        elif block_mode in ("gpu", "slurm", "dry-run", "parse"):
            out.append(Command(part, "check", f"{block_mode}: {block_reason or _reason(block_mode)}"))
        elif re.match(r"(GPU only|needs )", comment):
            out.append(Command(part, "check", f"{comment.split(':')[0]} (marked on the line)"))
        elif SLURM.search(part):
            out.append(Command(part, "check", "needs SLURM: a sweep there takes minutes "
                               "(tests/sweep/test_slurm_sweeps.py submits real jobs)"))  # fmt: skip
        elif re.search(r"\bcharllm train\b", part) and re.search(r"(^|\s)\.\.\.(\s|$)", part):
            out.append(Command(part, "check", "a template (`...`: the user's other arguments)"))
        else:
            out.append(Command(part, "run"))
    return out


def _setup(cmd: str) -> str | None:
    return next((why for pat, why in SETUP if pat.search(cmd)), None)


def _reason(mode: str) -> str:
    return {
        "gpu": "GPU only",
        "slurm": "needs a SLURM cluster (tests/sweep/test_slurm_sweeps.py: real jobs on the local one)",
        "dry-run": "costs minutes on a CPU",
        "parse": "a fragment",
    }[mode]


def substitute(text: str, run_dir: str, tmp: str, sweep_dir: str = "") -> str:
    """Placeholders (RUN, DIR, A, B, ...) as whole shell words or path heads -> ``run_dir``
    (SWEEP -> ``sweep_dir``); ``/tmp/`` -> the test's own folder, so no two runs share a path."""
    alt = "|".join(PLACEHOLDERS)
    text = re.sub(r"(?<![\w.])/tmp/", f"{tmp}/tmp/", text)
    return re.sub(
        rf"(?<![\w./=\-])({alt})(?=$|[\s/'\"])",
        lambda m: sweep_dir if m.group(1) == "SWEEP" else run_dir,
        text,
        flags=re.M,
    )


def as_dry_run(cmd: str) -> list[str] | None:
    """The ``charllm train`` argv of a line (srun / torchrun / env prefixes and ``...`` dropped)
    with ``dry_run=true``; None when the line is not a training command."""
    try:
        words = shlex.split(cmd)
    except ValueError:
        return None
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words = words[1:]  # WANDB_MODE=offline charllm ...
    world: list[str] = []  # the ranks srun / torchrun would start, on GPUs
    if words and words[0] == "torchrun" and "charllm_nemo.cli" in words:
        n = _flag(words, "--nproc-per-node")
        world = [f"nproc={n}", "launch.device=cuda"] if n else []
        words = ["charllm", *words[words.index("charllm_nemo.cli") + 1 :]]
    if words and words[0] == "srun":
        nodes, per = _flag(words, "-N"), _flag(words, "--ntasks-per-node")
        world = [f"nproc={int(nodes) * int(per)}", "launch.device=cuda"] if nodes and per else []
        at = next((i for i, w in enumerate(words) if w.endswith("charllm")), None)
        words = words[at:] if at is not None else words
    if len(words) < 2 or not words[0].endswith("charllm") or words[1] != "train":
        return None
    if "..." in words:
        world = []  # a template: the user's own arguments (batch sizes) go with the world size
    args = [w for w in words[2:] if w != "..." and not w.startswith(("launcher=", "dry_run="))]
    return ["charllm", "train", *args, *world, "dry_run=true"]


def _flag(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words and words.index(name) + 1 < len(words) else None


def options_used(cmd: str) -> tuple[list[str], list[str]]:
    """(the program and its sub-command words, every ``--option`` given) of a simple line."""
    words = shlex.split(cmd, comments=True)
    opts = [w.split("=")[0] for w in words if w.startswith("--") and len(w) > 2]
    prog = [w for w in words[:3] if not w.startswith("-")]
    return prog, opts


def stable_prefixes(output_block: str) -> list[str]:
    """Each line's text up to its first digit (what a run cannot change), long enough to say
    something (8 characters)."""
    out = []
    for ln in output_block.split("\n"):
        head = re.split(r"\d", ln, maxsplit=1)[0].strip()
        if len(head) >= 8:
            out.append(head)
    return out
