"""The docs, run as code: every shell command, Python snippet and SQL query of README.md and
docs/*.md, extracted from the Markdown at test time (tests/docs_blocks.py holds the convention:
what runs, what is only checked, and the markers that say so in the doc).

Each document's blocks run in order in one temporary folder (a run made by one block is read by
the next); placeholders such as RUN or DIR stand for one small training run made once for the
session. The commands not run are listed, with why, at the end of the session."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.deadline import deadline
from tests.docs_blocks import (
    MODES,
    PLACEHOLDERS,
    ROOT,
    RUN_LANGS,
    Block,
    as_dry_run,
    classify,
    doc_paths,
    logical_lines,
    options_used,
    read_blocks,
    stable_prefixes,
    substitute,
)

SKIPPED: list[str] = []
SKIPPED_KEY = "docs_skipped"  # = tests/conftest.py
_HELP: dict[tuple[str, ...], str] = {}
DEMO = "charllm train model=tiny_gpt"
"""The run placeholders stand for: the quick start's own command (README.md, config.md), which
is then not run again (5 steps, one rank: ~10 s a time)."""
_DRY: set[tuple[str, ...]] = set()  # dry runs done (the same line in two docs runs once)


@pytest.fixture(autouse=True)
def _report_skipped(request: pytest.FixtureRequest) -> Iterator[None]:
    """The commands a test did not run as written go on its report (tests/conftest.py prints them
    at the end of the session, also when the tests ran in several worker processes)."""
    before = len(SKIPPED)
    yield
    request.node.user_properties.extend((SKIPPED_KEY, line) for line in SKIPPED[before:])


def env_for(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["WANDB_MODE"] = "offline"  # logger=wandb without a network: offline, as the doc says
    env["WANDB_DIR"] = str(tmp)
    env.pop("SLURM_JOB_ID", None)
    return env


def workdir(tmp: Path) -> Path:
    """A folder that looks like the repository root for the doc's commands (recipes/, bench/,
    scripts/, tests/, .venv) but keeps what they write (runs/, /tmp/...) to itself."""
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    for name in ("recipes", "bench", "scripts", "tests", "src", "conf", "constraints"):
        if (ROOT / name).exists() and not (tmp / name).exists():
            (tmp / name).symlink_to(ROOT / name)
    if not (tmp / ".venv").exists():
        (tmp / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return tmp


def run(argv: list[str] | str, cwd: Path, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """``argv`` (a string: a bash script) in its own process group, which is ended afterwards: a
    process a doc's command left behind (a run started with ``&``) neither outlives the test nor
    holds its pipes open."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env_for(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        shell=isinstance(argv, str),
        executable="/bin/bash" if isinstance(argv, str) else None,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=deadline(timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`{argv}` did not end within {deadline(timeout_s):.0f} s:\n{out}{err}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], tuple[Path, str]]:
    """(run folder, console output) of one small training run, made on first use: what RUN, DIR,
    A, B ... stand for in the docs; beside it ``sweep/`` (SWEEP), a sweep-shaped copy of it with
    the two configurations docs/compare-energy.md names."""
    made: list[tuple[Path, str]] = []

    def get() -> tuple[Path, str]:
        if not made:
            tmp = workdir(tmp_path_factory.mktemp("docs-demo"))
            out = run(DEMO.split(), tmp)
            assert out.returncode == 0, out.stdout + out.stderr
            (run_dir,) = (tmp / "runs").iterdir()
            for key in ("pp2_mb1", "pp2_mb4"):
                shutil.copytree(run_dir, tmp / "sweep" / f"run={key}" / "attempt=1")
            made.append((run_dir, out.stdout + out.stderr))
        return made[0]

    return get


# -- checks of what is not run --------------------------------------------------------------------


def help_text(prog: tuple[str, ...]) -> str:
    if prog not in _HELP:
        out = run([*prog, "--help"], ROOT, timeout_s=60)
        _HELP[prog] = out.stdout + out.stderr
    return _HELP[prog]


def check_command(cmd: str, cwd: Path, where: str) -> None:
    """A command not run: a training line as a dry run, options against the program's --help
    (or the script's source), anything else through ``bash -n``."""
    argv = as_dry_run(cmd)
    if argv is not None:
        if tuple(argv) in _DRY:
            return
        _DRY.add(tuple(argv))
        out = run(argv, cwd, timeout_s=120)
        assert out.returncode == 0, (
            f"{where}: `{cmd}` as a dry run ({shlex.join(argv)}):\n{out.stdout}{out.stderr}"
        )
        return
    syntax = subprocess.run(["bash", "-n"], input=cmd, capture_output=True, text=True)
    assert syntax.returncode == 0, f"{where}: `{cmd}` is not valid shell: {syntax.stderr}"
    try:
        prog, opts = options_used(cmd)
    except ValueError:
        return
    if not prog:
        return
    if prog[0].endswith("charllm") and len(prog) > 1:
        text = help_text(("charllm", prog[1]))
        assert "usage:" in text, f"{where}: `charllm {prog[1]}` is not a command:\n{text}"
    elif re.search(r"(^|/)python3?$", prog[0]) and len(prog) > 1 and prog[1].endswith(".py"):
        script = ROOT / prog[1]
        assert script.is_file(), f"{where}: {prog[1]} does not exist"
        text = script.read_text(encoding="utf-8")
    elif "/" in prog[0] and not prog[0].startswith("/"):
        assert (ROOT / prog[0]).exists(), f"{where}: {prog[0]} does not exist"
        return
    else:
        return
    missing = [o for o in opts if o not in text]
    assert not missing, f"{where}: `{cmd}` uses option(s) {missing} that {' '.join(prog[:2])} does not have"


def check_python(block: Block) -> None:
    """Compiles, and its imports run (a renamed module or name fails here). An integration module
    whose framework is not in this venv (NeMo / Lightning live in .venv-nemo) is checked from its
    source instead: the module exists and defines the names imported."""
    tree = ast.parse(block.text, filename=block.where)
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    for node in imports:
        code = compile(ast.Module(body=[node], type_ignores=[]), block.where, "exec")
        try:
            exec(code, {})
        except ImportError as exc:
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if not (module and module.startswith("charllm_nemo.integrations.") and "needs" in str(exc)):
                raise
            spec = importlib.util.find_spec(module)
            assert spec is not None and spec.origin, f"{block.where}: no module {module}"
            source = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
            defined = {n.name for n in ast.walk(source) if isinstance(n, ast.ClassDef | ast.FunctionDef)}
            missing = [a.name for a in node.names if a.name not in defined]
            assert not missing, f"{block.where}: {module} defines no {missing}"


# -- running -----------------------------------------------------------------------------------------


def sweep_dir(run_dir: str) -> str:
    return str(Path(run_dir).parent.parent / "sweep") if run_dir else ""


def needs_run(text: str) -> bool:
    alt = "|".join(PLACEHOLDERS)
    return re.search(rf"(?<![\w./=\-])({alt})(?=$|[\s/'\"])", text, flags=re.M) is not None


def run_shell_block(block: Block, cwd: Path, run_dir: str, demo_run: Callable[[], tuple[Path, str]]) -> str:
    """Runs the block's runnable lines as one script (in order, ``set -e``); checks the rest."""
    script = ["set -eo pipefail"]
    for line in logical_lines(block.text):
        for cmd in classify(line, block.mode, block.reason):
            if cmd.action == "skip":
                SKIPPED.append(f"  {block.where}: {cmd.text}  -- skipped: {cmd.reason}")
            elif cmd.action == "check":
                text = substitute(cmd.text, run_dir, str(cwd), sweep_dir(run_dir))
                check_command(text, cwd, block.where)
                SKIPPED.append(f"  {block.where}: {cmd.text}  -- checked, not run: {cmd.reason}")
            elif re.sub(r"^(\.venv/bin/)?", "", cmd.text) == DEMO:
                demo_run()  # made once for the session
                SKIPPED.append(f"  {block.where}: {cmd.text}  -- ran once for the session (the demo run)")
            else:
                script.append(substitute(cmd.text, run_dir, str(cwd), sweep_dir(run_dir)))
    if len(script) == 1:
        return ""
    out = run("\n".join(script), cwd)
    text = out.stdout + out.stderr
    assert out.returncode == 0, (
        f"{block.where}: exit {out.returncode}\n" + "\n".join(script[1:]) + "\n" + text
    )
    return text


def run_python_block(block: Block, cwd: Path, run_dir: str) -> str:
    lines = []
    for ln in substitute(block.text, run_dir, str(cwd), sweep_dir(run_dir)).split("\n"):
        if re.search(r"#\s*GPU only", ln):
            SKIPPED.append(f"  {block.where}: {ln.strip()}  -- not run (GPU only)")
            ln = ln[: len(ln) - len(ln.lstrip())] + "pass  # GPU only: not run"
        lines.append(ln)
    path = cwd / f"snippet_{block.line}.py"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = run([sys.executable, path.name], cwd)
    assert out.returncode == 0, f"{block.where}:\n" + "\n".join(lines) + "\n" + out.stdout + out.stderr
    return out.stdout + out.stderr


def run_sql_block(block: Block, cwd: Path, run_dir: str, monkeypatch: pytest.MonkeyPatch) -> str:
    import duckdb

    monkeypatch.chdir(cwd)
    rows = duckdb.sql(substitute(block.text, run_dir, str(cwd), sweep_dir(run_dir))).fetchall()
    assert rows, f"{block.where}: the query returned no rows"
    return repr(rows)


def check_output(block: Block, produced: str, source: str) -> None:
    missing = [p for p in stable_prefixes(block.text) if p not in produced]
    assert not missing, f"{block.where}: documented output not printed by {source}: {missing}\n{produced}"


DOCS = [str(p.relative_to(ROOT)) for p in doc_paths()]


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_of_the_doc_runs_as_written(
    doc: str,
    tmp_path: Path,
    demo_run: Callable[[], tuple[Path, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cwd = workdir(tmp_path)
    produced, source = "", ""
    for block in read_blocks(ROOT / doc):
        if block.mode == "text":
            continue
        if block.mode == "skip":
            SKIPPED.append(
                f"  {block.where}: the whole {block.lang or 'text'} block -- skipped: {block.reason}"
            )
            continue
        if block.mode == "output":
            check_output(block, produced, source)
            continue
        run_dir = str(demo_run()[0]) if needs_run(block.text) else ""
        if block.mode == "session":
            head = [ln for ln in block.text.split("\n")]
            n = 1
            while head[n - 1].rstrip().endswith("\\"):
                n += 1
            cmd = "\n".join(head[:n])[2:]
            out = run(substitute(cmd, run_dir, str(cwd), sweep_dir(run_dir)), cwd)
            assert out.returncode == 0, f"{block.where}: `{cmd}`:\n{out.stdout}{out.stderr}"
            check_output(Block(block.doc, block.line, "", "\n".join(head[n:])), out.stdout + out.stderr, cmd)
            continue
        source = f"the block at {block.where}"
        if block.lang in ("bash", "sh"):
            produced = run_shell_block(block, cwd, run_dir, demo_run)
        elif block.lang == "python" and block.mode == "run":
            produced = run_python_block(block, cwd, run_dir)
        elif block.lang == "python":
            check_python(block)
            SKIPPED.append(
                f"  {block.where}: python block -- compiled, imports run: {block.mode}: {block.reason}"
            )
        elif block.lang == "sql" and block.mode == "run":
            produced = run_sql_block(block, cwd, run_dir, monkeypatch)
        else:
            SKIPPED.append(f"  {block.where}: {block.lang} block -- not run: {block.mode}: {block.reason}")


def test_every_marker_is_known_and_says_why() -> None:
    bad = []
    for path in doc_paths():
        for b in read_blocks(path):
            if b.mode in ("text", "session"):
                continue
            if b.mode not in MODES:
                bad.append(f"{b.where}: unknown docs-test mode {b.mode!r} (known: {', '.join(MODES)})")
            elif b.mode not in ("run", "output") and not b.reason:
                bad.append(f"{b.where}: docs-test: {b.mode} needs a reason")
            elif b.mode != "output" and b.lang not in RUN_LANGS:
                bad.append(f"{b.where}: a docs-test marker on a {b.lang or 'plain'} block")
    assert not bad, "\n".join(bad)


def test_the_console_numbers_steps_as_the_files_and_inspect_do(
    demo_run: Callable[[], tuple[Path, str]],
) -> None:
    # One numbering (from 0): the console's "step N (k/T)", steps.jsonl's step, inspect's step column.
    run_dir, console = demo_run()
    shown = [int(m.group(1)) for m in re.finditer(r"^step (\d+) \((\d+)/5\) \|", console, flags=re.M)]
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    written = [json.loads(line)["step"] for line in lines if line.strip()]
    assert shown and shown == written and shown[0] == 0, (shown, written)
    out = run(["charllm", "inspect", str(run_dir), "--kind", "step"], run_dir.parent)
    listed = [int(ln.split()[3]) for ln in out.stdout.splitlines() if re.match(r"^\s*0\s+step\s+step\s", ln)]
    assert listed == list(range(5)), out.stdout


def test_the_readme_names_the_extras_the_scripts_install() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    test = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    default = re.search(r'EXTRAS="\$\{1:-([\w,]+)\}"', setup)
    in_ci = re.search(r"scripts/setup\.sh ([\w,]+)", test)
    assert default and in_ci
    assert f"pip install -e '.[{default.group(1)}]'" in readme
    assert f"`scripts/setup.sh {in_ci.group(1)}`" in readme


def test_the_readme_extras_table_names_every_extra_and_its_packages() -> None:
    """README's "Install extras" table has a row per extra of pyproject.toml naming each of its
    packages (torch apart: the megatron row's build is chosen by scripts/setup.sh), and no row
    for an extra that does not exist; the table had drifted (pandas, pytest-xdist, spark)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Install extras", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([\w-]+)` \| ([^|]+) \|", table, flags=re.M))
    assert set(rows) == set(extras), (sorted(rows), sorted(extras))
    for extra, requirements in extras.items():
        named = {n.strip().lower() for n in rows[extra].split(",")}
        wanted = {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in requirements} - {"torch"}
        assert named == wanted, (extra, "missing", sorted(wanted - named), "extra", sorted(named - wanted))


def test_the_markdown_is_read_as_the_convention_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The machinery itself, on a made-up doc: markers, sessions, what runs and what is checked.
    from tests import docs_blocks

    monkeypatch.setattr(docs_blocks, "ROOT", tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\nscripts/setup.sh && charllm inspect RUN --kind step   # read it\n"
        "charllm train parallel=tp2 nproc=2 \\\n    batch.global_batch_size=8\n"
        "python bench/x.py --out /tmp/x   # GPU only: a GPU check\n"
        "charllm train ... alerts=off\n"
        "for i in 1 2; do curl -sf URL | grep X && break; sleep 1; done\n```\n\n"
        "<!-- docs-test: gpu 8 GPUs -->\n```python\nimport os\n```\n\n"
        "<!-- docs-test: output -->\n```\nstep 0 (1/5) | loss\n```\n\n"
        "```\n$ charllm train dry_run=true\nvalid\n```\n"
    )
    blocks = read_blocks(doc)
    assert [(b.lang, b.mode, b.reason) for b in blocks] == [
        ("bash", "run", ""),
        ("python", "gpu", "8 GPUs"),
        ("", "output", ""),
        ("", "session", ""),
    ]
    actions = [(c.action, c.text) for line in logical_lines(blocks[0].text) for c in classify(line, "run")]
    assert actions == [
        ("skip", "scripts/setup.sh"),
        ("run", "charllm inspect RUN --kind step"),
        ("run", "charllm train parallel=tp2 nproc=2      batch.global_batch_size=8"),
        ("check", "python bench/x.py --out /tmp/x"),
        ("check", "charllm train ... alerts=off"),
        ("run", "for i in 1 2; do curl -sf URL | grep X && break; sleep 1; done"),
    ]
    assert substitute("charllm compare A B --format json < /tmp/in", "/r", "/t") == (
        "charllm compare /r /r --format json < /t/tmp/in"
    )
    assert as_dry_run("srun -N 2 --ntasks-per-node 8 charllm train model=m launcher=slurm") == [
        "charllm", "train", "model=m", "nproc=16", "launch.device=cuda", "dry_run=true",
    ]  # fmt: skip
    assert as_dry_run("charllm inspect RUN") is None
    assert stable_prefixes("step 0 (1/5) | loss 6.9\ncharllm ALERT [straggler] rank 1") == [
        "charllm ALERT [straggler] rank"
    ]
