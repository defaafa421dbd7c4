#!/usr/bin/env bash
# run.sh NAME SRC [ENV=V ...]  -> /tmp/R/logs/NAME.txt (rank-slice proxy run)
NAME=$1; SRC=$2; shift 2
mkdir -p /tmp/R/logs
env RANK_SLICE=1 VAL_TOKENS=3932160 TRAIN_FILES="/tmp/d/proxy_train_*.bin" VAL_FILES="/tmp/d/proxy_val_*.bin" \
  TOKENIZER_DIR=/tmp/d/gpt2 LOG_DIR=/tmp/R/logs/full "$@" python $SRC > /tmp/R/logs/$NAME.txt 2>&1
echo "$NAME exit $?" >> /tmp/R/logs/status.txt
