#!/usr/bin/env bash
# queue.sh REPO: data, GPU tests (runs with DC-MHA are skipped if they fail), DC bench, then batches from /tmp/R/batches.txt (re-read before each
# batch; batch i = lines between the (i-1)th and ith '---'); each line "NAME ENV=V ..." runs concurrently.
# QUEUE_PRE=0 skips the GPU tests and the bench (code they already passed on); QUEUE_BENCH=0 the bench only. Only a DC-MHA test
# failure (test_architecture.py) skips runs; the kernel and optimizer tests' result is reported.
cd $1
mkdir -p /tmp/R/logs
cp train_gpt.py /tmp/R/train_gpt.py
cp .devscripts/batches.txt /tmp/R/batches.txt
bash .devscripts/data.sh
if [ "${QUEUE_PRE:-1}" = 1 ]; then
  echo "gputest start $(date)"
  python -m pytest -q -m gpu tests/test_architecture.py > /tmp/R/logs/gputest.txt 2>&1 || touch /tmp/R/GPUTEST_FAILED
  python -m pytest -q -m gpu tests/test_kernels.py tests/test_optimizer.py > /tmp/R/logs/gputest_kernels.txt 2>&1
  if [ "${QUEUE_BENCH:-1}" = 1 ]; then
    echo "bench start $(date)"
    timeout 400 python bench/bench_arch.py --model-tokens 0 --dc-warps 4,8 > /tmp/R/logs/bench.txt 2>&1
  fi
fi
i=0
while true; do
  i=$((i+1))
  batch=$(awk -v want=$i 'BEGIN{n=1} /^---/{n++; next} n==want && NF' /tmp/R/batches.txt)
  [ -z "$batch" ] && break
  echo "batch $i start $(date)"
  while read -r name envs; do
    if [ -f /tmp/R/GPUTEST_FAILED ] && [[ "$envs" != *DC_MHA=0* ]]; then echo "skip $name (DC-MHA kernels failed their test)"; continue; fi
    bash .devscripts/run.sh $name /tmp/R/train_gpt.py $envs &
    sleep 2
  done <<< "$batch"
  wait
  echo "batch $i end $(date)"
done
touch /tmp/R/DONE
