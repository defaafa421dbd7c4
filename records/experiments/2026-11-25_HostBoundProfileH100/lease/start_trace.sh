#!/usr/bin/env bash
set -euo pipefail
S=/tmp/stage
mkdir -p /tmp/site /tmp/d /tmp/q
cat $S/cu13.tar.xz.part0* > /tmp/cu13.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/whl/*.whl
tar -xJf /tmp/cu13.tar.xz -C /tmp/site
for f in $S/*.bin.xz; do xz -dc $f > /tmp/d/$(basename $f .xz) & done; wait
cp -r $S/gpt2 /tmp/d/gpt2
rm -rf /tmp/repo && cp -r "$PWD" /tmp/repo && rm -rf /tmp/repo/.dev /tmp/repo/.git
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1
cd /tmp/repo
setsid nohup bash -c "python bench/profile_stages.py main=train_gpt.py --stages 2 --verbose --traces --out /tmp/q/prof_tr > /tmp/q/prof_tr.out 2>&1; echo done >> /tmp/q/status" > /dev/null 2>&1 < /dev/null &
echo started
