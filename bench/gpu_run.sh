#!/usr/bin/env bash
# What runs on the lent GPU machine: install the carried wheels, then bench/gpu_check.py (its
# parts include the driver's throttle counters against the sampled bits, bench/gpu_counters.py;
# then that comparison again, alone, over the load run, into $OUT/gpu_counters.json). Run
# directories stay in /tmp/gpucheck; the report, the log and a tarball of the runs go to $OUT
# (which returns at most 8 files, two folders down).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpucheck_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,temperature.gpu --format=csv || true
# megatron-core 0.19.2 and megatron-bridge 0.6.2 (no deps) in a folder of their own, for the
# integrations part (bench/gpu_integrations.py); 0.16.1 stays the default.
MCORE019=()
if ls .whl/mcore019/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore019 .whl/mcore019/*.whl \
    && MCORE019=(--mcore019 /tmp/mcore019)
fi
python3 bench/gpu_check.py --mode gpu --out /tmp/gpucheck "${MCORE019[@]}" "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
cp /tmp/gpucheck/gpu_check.json "$OUT/" 2>/dev/null
# The driver's per-reason throttle counters vs the sampled reason bits on this GPU (#46), and whether
# it serves the module power scope (Grace modules; an H100 / H200 says not supported).
python3 bench/gpu_counters.py /tmp/gpucheck/load_run "$OUT/gpu_counters.json" 2>&1 | tee "$OUT/gpu_counters.log"
tar -czf "$OUT/gpucheck_runs.tar.gz" -C /tmp gpucheck 2>/dev/null
ls -la "$OUT"
grep -h "module power scope" "$OUT/gpu_counters.log" || echo "module power scope: not reported (bench/gpu_counters.py failed?)"
exit "$rc"
