#!/usr/bin/env bash
# Device set-up (third carry call): wheels, data, a frozen copy of the repo; then the detached queue.
set -euo pipefail
S=/tmp/stage
mkdir -p /tmp/site /tmp/d /tmp/q
cat $S/cu13.tar.xz.part0* > /tmp/cu13.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/whl/*.whl
tar -xJf /tmp/cu13.tar.xz -C /tmp/site
for f in $S/*.bin.xz; do xz -dc $f > /tmp/d/$(basename $f .xz) & done; wait
cp -r $S/gpt2 /tmp/d/gpt2
rm -rf /tmp/repo && cp -r "$PWD" /tmp/repo
rm -rf /tmp/repo/.dev /tmp/repo/.git
ls -la /tmp/d
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
python3 -c "import flash_attn.cute, cutlass, torch; print('fa4 import ok', torch.__version__)"
python3 -c "import cuda.bindings, google.protobuf; print('cuda-bindings', 'protobuf ok')" || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
setsid nohup bash $S/queue.sh > /tmp/q/queue.log 2>&1 < /dev/null &
echo started queue
