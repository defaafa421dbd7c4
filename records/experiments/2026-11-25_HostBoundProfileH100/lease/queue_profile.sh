#!/usr/bin/env bash
# Profile lease (issue #24): main's kernel groups per stage beside df4131e's, stage-1 variants, FP8 Q/K/V off.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160
export TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
L=/tmp/q
cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
prof() { local name=$1 stages=$2; shift 2
  python bench/profile_stages.py "$@" --stages $stages --verbose --out $L/prof_$name > $L/prof_$name.out 2>&1
  note "prof_$name rc=$?"; }
note queue start
sed 's/^    fused_mlp_min_tokens: int = 32768/    fused_mlp_min_tokens: int = 16384/' train_gpt.py > /tmp/v_s1mlp.py
sed 's/^    fp8_qkv_min_tokens: int = 32768/    fp8_qkv_min_tokens: int = 16384/' /tmp/v_s1mlp.py > /tmp/v_s1both.py
sed 's/^    fa4_min_tokens: int = 32768/    fa4_min_tokens: int = 16384/' train_gpt.py > /tmp/v_s1fa4.py
sed 's/^    fp8_qkv: bool = True/    fp8_qkv: bool = False/' train_gpt.py > /tmp/v_qkvoff.py
for v in s1mlp s1both s1fa4 qkvoff; do cmp -s train_gpt.py /tmp/v_$v.py && note "variant $v unchanged!"; done
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_main prof main 1,2,3 main=train_gpt.py
prof base 1,2,3 base=/tmp/stage/base.py
prof s1 1 s1mlp=/tmp/v_s1mlp.py s1both=/tmp/v_s1both.py s1fa4=/tmp/v_s1fa4.py
prof qkvoff 2,3 qkvoff=/tmp/v_qkvoff.py
timeout 300 python -m pytest -q -m gpu tests/test_fp8_qkv.py > $L/gpu_tests.log 2>&1; note "gpu tests rc=$?"
(cd /tmp/ind_main && find . -name '*.py' | tar -cJf $L/inductor_main_code.tar.xz -T -) ; note "code tar rc=$?"
for f in /tmp/extra/*.py; do [ -f "$f" ] && prof "x_$(basename $f .py)" 1,2,3 "$(basename $f .py)=$f"; done
note queue done
