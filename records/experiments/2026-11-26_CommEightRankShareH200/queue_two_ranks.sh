#!/usr/bin/env bash
# Issue #24 item 5 on 2 GPUs: optimizer step alone, then real steps with each rank computing an
# 8-rank share (the compute per GPU of an 8-GPU step), then the full batch (accumulation 4).
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
export TOKENIZER_DIR=/tmp/d/gpt2 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=/tmp/q; cd /tmp/repo
note() { echo "$(date +%H:%M:%S) $*" >> $L/status; }
note queue start
nvidia-smi topo -m > $L/topo.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > $L/gpus.txt 2>&1
mkdir -p $L/opt $L/share8 $L/full
torchrun --standalone --nproc_per_node=2 bench/bench_optimizer.py $L/opt > $L/opt.out 2>&1; note "opt rc=$?"
rm -f $L/opt/*.json
torchrun --standalone --nproc_per_node=2 bench/profile_comm.py --share 8 --synthetic --out $L/share8 > $L/share8.out 2>&1; note "share8 rc=$?"
torchrun --standalone --nproc_per_node=2 bench/profile_comm.py --synthetic --out $L/full > $L/full.out 2>&1; note "full rc=$?"
note queue done
