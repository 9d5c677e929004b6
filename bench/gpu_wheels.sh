#!/usr/bin/env bash
# Fetch the wheels bench/gpu_check.py needs on the lent H200 machine (Python 3.12, torch with
# CUDA, numpy, pyarrow and nvidia-ml-py already there) into .whl/ (git-ignored).
# Then, with the device tool: run(carry=[".whl"], command="bash bench/gpu_run.sh").
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for spec in "megatron-core==0.16.1" "hydra-core==1.3.8" "omegaconf==2.3.1"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d .whl "$spec"
done
# The integrations part (bench/gpu_integrations.py): megatron-core 0.19.2 and megatron-bridge 0.6.2,
# installed apart from 0.16.1 by bench/gpu_run.sh (~4.5 MB together).
mkdir -p .whl/mcore019
for spec in "megatron-core==0.19.2" "megatron-bridge==0.6.2"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d .whl/mcore019 "$spec"
done
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 needs) is published as an sdist only: build
# its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
ls -la .whl
