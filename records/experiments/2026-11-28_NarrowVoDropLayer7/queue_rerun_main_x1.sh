#!/usr/bin/env bash
# One H200 (nvidia-h200): main's seed 1 again, and seed 4, alone with the step graphs (one compile), after
# queue_equal_loss_x2.sh's main seed 1 ended 0.02 above its seeds 2 and 3. Proxy train shards 1-4, rank-slice
# (setup as queue_x4.sh). arm, note, need_shards: bench/lease.sh.
need_shards 1 2 3 4
note "rerun: main seeds 1 and 4 alone on one H200; graphs on"
SEEDS=1,4 arm 0 r_main
