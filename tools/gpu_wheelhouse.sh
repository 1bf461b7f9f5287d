#!/usr/bin/env bash
# The wheels a GPU box without network needs beside its own torch to run `make test-gpu`
# (nbval, ipykernel, ipywidgets, jupytext, myst-nb for the chapters' glue, and what they
# need), resolved here at the versions requirements.lock pins, for the box's Python.
# Usage: tools/gpu_wheelhouse.sh [OUT_DIR]   (default _build/wheelhouse)
#   GPU_PY=3.12        the box's Python (major.minor)
#   GPU_BOX_HAS="..."  packages the box already has, left out (default: those a CUDA
#                      PyTorch image such as the H200 box of reports/gpu/ ships); set it
#                      empty to take every wheel (about 41 MiB instead of 36)
# On the box: python3 -m pip install --no-index --no-deps --target DIR OUT_DIR/*.whl, then
# PYTHONPATH=DIR (tools/gpu_check.sh does this when it finds _build/wheelhouse).
set -eu
out=${1:-_build/wheelhouse}
py=${GPU_PY:-3.12}
abi=cp${py/./}
default_has="attrs certifi charset-normalizer click coverage idna iniconfig jinja2
markdown-it-py markupsafe mdurl packaging pluggy psutil pygments pytest python-dateutil
pyyaml requests tabulate typing-extensions urllib3 zipp"
has=${GPU_BOX_HAS-$default_has}
rm -rf "$out" && mkdir -p "$out"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download --quiet --only-binary=:all: --python-version "$py" --implementation cp \
  --abi "$abi" --abi abi3 --abi none "${platforms[@]}" -c requirements.lock -d "$out" \
  nbval ipykernel ipywidgets jupytext myst-nb 2>&1 | grep -v "is ignored: it is neither" || true
for wheel in "$out"/*.whl; do
  name=$(basename "$wheel" | sed -E 's/-[0-9].*//' | tr 'A-Z_' 'a-z-')
  for skip in $has; do
    [ "$name" = "$skip" ] && rm "$wheel" && break
  done
done
count=$(ls "$out"/*.whl | wc -l)
mib=$(( $(cat "$out"/*.whl | wc -c) / 1048576 ))
echo "gpu_wheelhouse: $count wheels, $mib MiB in $out (Python $py; left out as the box's: $(echo $has | wc -w) packages)"
[ "$mib" -le 40 ] || { echo "gpu_wheelhouse: over 40 MiB; the device tool carries 64 MiB with the tree"; exit 1; }
