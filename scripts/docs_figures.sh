#!/usr/bin/env bash
# Regenerate the figures in docs/ (docs/analysis.md) from CPU sweeps: one command, ~5 min on 2 cores.
#
#   scripts/docs_figures.sh [WORK_DIR]     # WORK_DIR (default: a fresh temporary directory) keeps the sweeps
#
# 1. cpu_parallelism (tiny_gpt TP2 / PP2 / DP2, tiny_moe EP2; 2 ranks each, synthetic device) with
#    rank 1's device poorly cooled, so that it throttles from the first steps: the configuration
#    panels (paper Fig. 4), the heatmaps (Figs. 5, 17), the PP2 run's timeline (Fig. 8) and
#    throttle to slowdown (Fig. 13);
# 2. cpu_microbatch (micro batch 1, 2, 4, 8 on DP2): the normalised microbatch panels, the
#    per-microbatch excursions, micro batch 1's job power waveform and the sweep's swing comparison.
# Then `charllm report` on each sweep, and the PNGs copied to docs/analysis-*.png.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d -t charllm-docs-figures.XXXXXX)}
charllm=.venv/bin/charllm
hot=(++telemetry.synthetic.devices.1.cooling=0.15 ++telemetry.synthetic.devices.1.tau_s=1.0)

echo "docs_figures: sweeps under $work"
"$charllm" train -m +sweep=cpu_parallelism sweep.dir="$work" batch.train_steps=8 \
  batch.global_batch_size=8 "${hot[@]}"
"$charllm" train -m +sweep=cpu_microbatch sweep.dir="$work" batch.train_steps=6
par="$work/sweep=cpu_parallelism"
mb="$work/sweep=cpu_microbatch"
"$charllm" report "$par"
"$charllm" report "$mb"

copy() {  # copy SRC_GLOB NAME: the one figure matching SRC_GLOB to docs/analysis-NAME.png
  local found=($1)
  [ -f "${found[0]}" ] || { echo "docs_figures: no figure matches $1" >&2; return 1; }
  cp "${found[0]}" "docs/analysis-$2.png"
  echo "docs_figures: docs/analysis-$2.png <- ${found[0]#"$work"/}"
}
copy "$par/analysis/figures/configs.png" configs
copy "$par/analysis/figures/heatmaps.png" heatmaps
copy "$par/analysis/figures/throttle_slowdown.png" throttle-slowdown
copy "$par/analysis/figures/timeline_*pp2*.png" timeline
copy "$mb/analysis/figures/configs_normalised.png" microbatch
copy "$mb/analysis/figures/excursions.png" excursions
copy "$mb/analysis/figures/powerwave_*micro_batch_size-1_*.png" powerwave
copy "$mb/analysis/figures/gridsweep.png" gridsweep
echo "docs_figures: reports at $par/analysis/report.html and $mb/analysis/report.html"
