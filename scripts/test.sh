#!/usr/bin/env bash
# Set up (scripts/setup.sh, scripts/setup-nemo.sh) and run every lane: ruff check, ruff format
# --check, mypy, the main suite in .venv (with a local SLURM for the sweep tests), and the NeMo 2 /
# Lightning integration tests in .venv-nemo, and the privilege-dependent cases of the hostile-input
# corpus once more as user nobody (root only; skipped with a line otherwise). Every lane runs
# whatever an earlier one gave; the end
# lists each lane's result and duration, and the exit status is 1 when any lane failed.
# Arguments go to the main pytest lane (e.g. scripts/test.sh -x -q tests/alerts).
# CHARLLM_REQUIRE_NEMO=1: an integration test whose framework or download is missing fails
# instead of skipping (tests/integrations/conftest.py).
# CHARLLM_TEST_TIMEOUT_FACTOR (default 3): multiplies the tests' subprocess deadlines
# (tests/deadline.py); raise it on a slow or shared machine.
#
# To add a lane: write a function lane_<name> and add <name> to LANES; a set-up step it needs: a
# function setup_<name> added to SETUPS (run before any lane; a failing set-up stops the script,
# since no lane could give a verdict without it).
set -uo pipefail
cd "$(dirname "$0")/.."

# The tests that need NeMo / Lightning: they run in .venv-nemo, the rest in .venv.
NEMO_TESTS=(tests/integrations/test_nemo_callback.py tests/integrations/test_observer_thread.py)
BRIDGE_VERSION=0.6.2  # = BRIDGE_VERSION in tests/integrations/test_bridge.py
PYTEST_ARGS=("$@")

# --- set-up ---------------------------------------------------------------------------------------
setup_venvs() {
  scripts/setup.sh test,megatron,sweep,analysis,spark && scripts/setup-nemo.sh
}

setup_bridge() {
  # Megatron-Bridge's wheel for tests/integrations/test_bridge.py, which reads its callbacks.py
  # (Bridge itself needs Python >= 3.12 and CUDA): fetched here, at set-up, never by a test.
  ls .cache/megatron-bridge/megatron_bridge-"$BRIDGE_VERSION"-*.whl >/dev/null 2>&1 && return 0
  .venv/bin/python -m pip download --no-deps --quiet --python-version 3.12 --only-binary=:all: \
    "megatron-bridge==$BRIDGE_VERSION" -d .cache/megatron-bridge
}

setup_browser() {
  # Debian's chromium for the report test (tests/analysis/test_report.py), installed once (idempotent,
  # quiet); the test fails rather than skips here.
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
}

setup_slurm() {
  # A real single-node SLURM for tests/sweep/test_slurm_sweeps.py (docs/sweeps.md): installs
  # slurm-wlm and munge with apt if missing and starts slurmctld, slurmd and munged as root
  # (idempotent); the tests find it through SLURM_CONF and the sacct stand-in on PATH. Not root:
  # those tests are skipped, and say so.
  if [ "$(id -u)" = 0 ]; then
    scripts/local-slurm.sh start || return 1
    eval "$(scripts/local-slurm.sh env)"
  else
    echo "test.sh: not root: no local SLURM; tests/sweep/test_slurm_sweeps.py will be skipped" >&2
  fi
}

apt_install() {
  # Debian packages, installed once (idempotent, quiet): $1 the command that shows it is there.
  command -v "$1" >/dev/null 2>&1 && return 0
  shift
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

setup_prometheus() {
  # Debian's prometheus for tests/telemetry/test_export_prometheus.py (docs/export.md); the test
  # starts it on 127.0.0.1 itself and fails, not skips, here.
  apt_install prometheus prometheus
}

setup_java() {
  # Java 17 for the real Spark test (tests/analysis/test_spark.py, pyspark local[2]; docs/analysis.md).
  apt_install java openjdk-17-jre-headless
}

SETUPS=(venvs bridge browser prometheus java slurm)

# --- lanes ----------------------------------------------------------------------------------------
lane_ruff() { .venv/bin/ruff check src tests bench scripts; }
lane_format() { .venv/bin/ruff format --check src tests bench scripts; }
lane_mypy() { .venv/bin/mypy; }
# Each pytest lane sees its own environment's bin first on PATH (subprocesses that run `charllm`),
# and lists its 25 slowest tests (DURATIONS), so that a slow test shows in every CI log.
DURATIONS=--durations=25
# The main lane runs its tests in CHARLLM_TEST_WORKERS processes (pytest-xdist; default 2, one per
# core of the CI machine; 0: in pytest's own process). Most tests wait on subprocesses, samplers
# and deadlines: two workers took the lane from 1,345 s to 870-879 s on a quiet 2-core VM (-35 %).
# Tests that share a resource run in one worker (the SLURM queue: xdist_group "slurm"; --dist loadgroup).
WORKERS=${CHARLLM_TEST_WORKERS:-2}
lane_pytest() {
  local xdist=()
  [ "$WORKERS" -gt 0 ] && xdist=(-n "$WORKERS" --dist loadgroup)
  PATH="$PWD/.venv/bin:$PATH" VIRTUAL_ENV="$PWD/.venv" .venv/bin/python -m pytest "${xdist[@]}" "$DURATIONS" "${NEMO_TESTS[@]/#/--ignore=}" "${PYTEST_ARGS[@]}"
}
lane_nemo() { PATH="$PWD/.venv-nemo/bin:$PATH" VIRTUAL_ENV="$PWD/.venv-nemo" .venv-nemo/bin/python -m pytest -q "$DURATIONS" "${NEMO_TESTS[@]}"; }

# The hostile-input corpus once more as an unprivileged user (the pytest lane ran it as root):
# what a file's mode, a FIFO, a device or a link does to a user without root's overrides.
# Only the cases where a user's rights matter (FIFOs, devices, links, outputs, file modes): the
# memory-bomb children, generated files and CSV or name cases take minutes and do not depend on them.
CORPUS_TESTS=(tests/test_hostile_corpus.py tests/test_hostile_corpus_more.py)
CORPUS_UNPRIVILEGED="fifo or dev_zero or link or special or sweep_status"
lane_unprivileged() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: not root: the unprivileged run of the hostile corpus is skipped (it switches to user nobody); the pytest lane ran it as $(id -un)"
    return 0
  fi
  local user=nobody tmp base site repo rc
  tmp=$(mktemp -d /tmp/charllm-unprivileged.XXXXXX) || return 1
  chmod 755 "$tmp"
  mkdir -p "$tmp/home" && chown "$user" "$tmp/home"
  base=$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  repo=$PWD
  # What the user cannot reach (a checkout or an interpreter under /root, mode 700) it gets as
  # hard links where /tmp is the same file system (seconds, no space; the files stay root's, mode
  # 644), else as copies; a shared libpython is then found through LD_LIBRARY_PATH.
  can() { runuser -u "$user" -- test -r "$1"; }
  link() { cp -al "$1" "$2" 2>/dev/null || { rm -rf "$2"; cp -a "$1" "$2"; }; }
  if ! can "$base/bin/python3"; then  # the interpreter and its standard library, not its packages
    local e std
    std=$(basename "$base"/lib/python3*)
    mkdir -p "$tmp/python/lib/$std" && link "$base/bin" "$tmp/python/bin" || { rm -rf "$tmp"; return 1; }
    for e in "$base"/lib/* "$base/lib/$std"/*; do
      case "$e" in "$base/lib/$std" | */site-packages | "$base/lib/$std/test") continue ;; esac
      link "$e" "$tmp/python/${e#"$base"/}" || { rm -rf "$tmp"; return 1; }
    done
    base=$tmp/python
  fi
  if ! can "$site/pyarrow/__init__.py"; then link "$site" "$tmp/site" && site=$tmp/site || { rm -rf "$tmp"; return 1; }; fi
  if ! can "$repo/tests/test_hostile_corpus.py"; then
    mkdir "$tmp/repo" && link src "$tmp/repo/src" && link tests "$tmp/repo/tests" && link pyproject.toml "$tmp/repo/pyproject.toml" &&
      repo=$tmp/repo || { rm -rf "$tmp"; return 1; }
  fi
  # The checkout's own install (an editable .pth) is not read: the sources are on PYTHONPATH.
  (cd "$repo" && runuser -u "$user" -- env -i PATH=/usr/bin:/bin USER="$user" HOME="$tmp/home" TMPDIR="$tmp/home" \
    LD_LIBRARY_PATH="$base/lib" LANG=C.UTF-8 PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$repo/src:$repo:$site" \
    CHARLLM_TEST_TIMEOUT_FACTOR="${CHARLLM_TEST_TIMEOUT_FACTOR:-3}" \
    "$base/bin/python3" -m pytest -q -p no:cacheprovider -k "$CORPUS_UNPRIVILEGED" "${CORPUS_TESTS[@]}")
  rc=$?
  rm -rf "$tmp"
  return "$rc"
}

LANES=(ruff format mypy pytest nemo unprivileged)

# --- run ------------------------------------------------------------------------------------------
export CHARLLM_REQUIRE_NEMO=1 CHARLLM_REQUIRE_BROWSER=1 CHARLLM_REQUIRE_PROMETHEUS=1 CHARLLM_REQUIRE_SPARK=1

for s in "${SETUPS[@]}"; do
  start=$SECONDS
  if ! "setup_$s"; then
    echo "test.sh: set-up '$s' failed after $((SECONDS - start)) s; no lane can run without it" >&2
    exit 1
  fi
  echo "test.sh: set-up $s: $((SECONDS - start)) s"
done

results=()
failed=0
for lane in "${LANES[@]}"; do
  echo "=== test.sh: lane $lane"
  start=$SECONDS
  "lane_$lane"
  rc=$?
  took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    results+=("$(printf '%-8s passed  %5d s' "$lane" "$took")")
  else
    results+=("$(printf '%-8s FAILED  %5d s (exit %d)' "$lane" "$took" "$rc")")
    failed=1
  fi
done

echo "=== test.sh: results"
printf '  %s\n' "${results[@]}"
exit "$failed"
