#!/usr/bin/env bash
# unpack carried proxy shards into /tmp/d (idempotent)
set -e
mkdir -p /tmp/d/gpt2
cp -n .bench/gpt2/* /tmp/d/gpt2/ 2>/dev/null || true
for f in .bench/*.xz; do b=/tmp/d/$(basename $f .xz); [ -s $b ] || xz -dc $f > $b & done; wait
ls -la /tmp/d
