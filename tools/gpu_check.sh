#!/usr/bin/env bash
# The labs on a GPU box, in one command: what the machine is, then tests/test_gpu.py (the
# labs on NCCL and CUDA tensors against gloo), then the rest of the library's tests with the
# GPU visible (tests that need Jupyter, a browser or the slow marker are left out). Writes
# env.txt, gpu.log, gpu.xml, suite.log and suite.xml to the folder given (default _build/gpu).
# Usage: tools/gpu_check.sh [OUT_DIR]   (uses the python3 on PATH: the box's own CUDA torch)
set -u
out=${1:-_build/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
{
  date -u
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count()); print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
  nproc
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
common=(-p no:cacheprovider -q -rfEs)
"$py" -c "import pytest_timeout" 2>/dev/null && common+=(--timeout=120)
timeout 200 "$py" -m pytest tests/test_gpu.py "${common[@]}" --junitxml="$out/gpu.xml" 2>&1 | tee "$out/gpu.log"
workers=$(( $(nproc) > 12 ? 12 : $(nproc) ))
timeout "${SUITE_SECONDS:-300}" "$py" -m pytest tests "${common[@]}" -n "$workers" --dist worksteal \
  -m "not slow and not browser and not gpu" --continue-on-collection-errors \
  --junitxml="$out/suite.xml" 2>&1 | tee "$out/suite.log" | tail -150
echo "gpu_check: done"
