#!/usr/bin/env bash
# One device lease's chores, in place of the preamble every queue.sh used to paste: stage the data and
# the GPU wheels, run a queue script detached, poll it, bring its logs back.
#
#   bench/lease.sh setup [DATA_SRC]           on the GPU machine, from the repository root: shards
#                                              into $DATA_DIR, wheels into $SITE, a frozen copy of
#                                              the tree in $REPO_COPY, then the versions
#   bench/lease.sh start QUEUE_FILE [DIR]      run QUEUE_FILE detached (bash, in $REPO_COPY), its
#                                              output to DIR/queue.log (DIR: $LEASE_DIR); returns at once
#   bench/lease.sh poll [SECONDS] [DEST]       wait up to SECONDS (540) while the queue runs; print
#                                              its status, log tail and each run log's last step line;
#                                              with DEST, then collect into DEST; exit 0 finished,
#                                              3 still running, 2 no queue here
#   bench/lease.sh collect DEST                copy the logs (*.txt, *.md, *.out, *.csv, *.json), queue.log, status
#                                              into DEST, flat; more than 7 files: one
#                                              DEST/lease_logs.tar.xz
#   bench/lease.sh pack-cache DEST [FIRST]     the compile caches ($CACHE_DIR) as cache.tar.xz.partNN
#                                              of 15 MiB, packed once per lease; copies parts FIRST
#                                              (0) to FIRST+7 into DEST and says how many there are
#   bench/lease.sh carry [DEST]                here, before a lease (not on the GPU machine): the shards
#                                              ($SHARDS of $DATA_SRC), the GPU wheels and the cu13
#                                              libraries as one tar split into DEST/pN/ (.bench), each part
#                                              as large as the room beside the working tree allows; says
#                                              which call carries which part. setup reassembles them.
#
# Compile caches: a fresh machine compiles for ~6 minutes. The queue writes inductor's, Triton's and
# FlashAttention-4's caches under $CACHE_DIR; `pack-cache` at the end of a lease brings them back in
# parts (the last calls), and a later lease carries the parts into $STAGE, where setup unpacks them
# before the queue starts (a code change recompiles only the graphs it changed).
#
# A lease: setup and start in the first call, then `poll SECONDS "$OUT"` in each later call until it
# exits 0. The queue outlives the call that started it, so its logs live in $LEASE_DIR, not in $OUT
# (the device empties $OUT before every call); collecting in every poll brings back everything so
# far, so a machine taken back between two calls loses nothing already written (at most 8 files,
# each under 16 MiB, return from a call).
#
# The queue runs with these defaults exported (each only where the caller has not set it): the proxy
# rank-slice environment of every record (TRAIN_FILES, VAL_FILES, VAL_TOKENS=3932160, TOKENIZER_DIR,
# RANK_SLICE=1; a full-batch torchrun queue sets RANK_SLICE=0), PYTHONPATH with $SITE and the CuTe
# DSL's dsl_packages (its .pth files are not read from a --target folder), PYTHONUNBUFFERED=1,
# FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1, the three cache folders under $CACHE_DIR, NVLink multicast off (NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), L=LEASE_DIR=the log folder and eight
# functions: `note TEXT` appends "HH:MM:SS TEXT" to $L/status; `arm GPU NAME [VAR=VALUE ...]` runs
# train_gpt.py (ARM_FILE=PATH arm ...: that file instead) alone on GPU with RUN_ID=NAME, SEEDS=1,2,3 (unless given) and LOG_DIR=$L, its output in
# $L/NAME.out, and notes its rc; `check GPU NAME SECONDS COMMAND...` runs COMMAND on GPU under a timeout,
# its output in $L/NAME.out, and notes its rc; `need_shards N...` ends the queue unless $DATA_DIR holds those
# proxy train shards; `watch_gpus SECONDS` writes $L/gpus.txt and samples the clocks into $L/clocks.txt
# every SECONDS until the queue ends; `compile_beside NAME GIB FILE ARM` starts FILE (another train_gpt.py) in
# the background on GPU 0, one seed, its allocator capped at GIB, its output in $L/NAME.out, so that it compiles
# (filling the caches for its own timed arm later) while ARM (started next, `arm 0 ARM ...`) compiles, and kills it
# with its process group the moment either warm-up ends, before any timed step; `stop_beside NAME` kills it where
# still alive; `pack_cache`, the queue's last line, packs the compile caches for `pack-cache` and notes how many
# parts there are. Stop a queue and everything it
# started: kill -- -$(cat $LEASE_DIR/queue.pid).
#
# Variables (environment, default in brackets):
#   DATA_SRC       folder of the proxy shards as *.bin.xz [shared/data/proxy, else .bench, else $STAGE]
#   SHARDS         file patterns taken from it [proxy_train_00000[123].bin.xz proxy_val_000000.bin.xz]:
#                  train shards 1-3 and the validation shard, what every record trained and scored on
#   DATA_DIR       where the shards are decompressed, skipping those already there [/tmp/d]
#   TOKENIZER_SRC  GPT-2's encoder.json and vocab.bpe, copied to $DATA_DIR/gpt2 [data/gpt2]
#   STAGE          carried files kept across the calls of one lease [/tmp/stage]
#   WHEEL_DIR      the small wheels (flash-attn-4, quack-kernels, ...) [.whl, else $STAGE/whl]
#   CU13_PARTS     the nvidia-cutlass-dsl cu13 libraries as a split tar.xz, unpacked into $SITE after
#                  pip [$WHEEL_DIR/cu13.tar.xz.part*, else $STAGE/cu13.tar.xz.part*]
#   SITE           pip --target of the wheels [/tmp/site]; setup skips a $SITE it filled before
#                  unless FORCE=1
#   REPO_COPY      the tree the queue runs in, copied by setup without .git, shared, .whl, .bench, so
#                  that later calls (which re-send the working tree) cannot change a running queue's
#                  code; empty: run in place [/tmp/repo]
#   LEASE_DIR      the queue's folder: queue.sh (its copy), queue.log, queue.pid, queue.rc, status
#                  and whatever the queue writes there [/tmp/q]
#   POLL_EVERY     seconds between poll's checks [10]
#   CACHE_DIR      the compile caches: TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and
#                  FLASH_ATTENTION_CUTE_DSL_CACHE_DIR below it, unless set [/tmp/cc]; setup unpacks
#                  $STAGE/cache.tar.xz.part* into it (once per machine)
#   GPU_WHEELS     carry: the wheels pip downloads for the GPU machine (Python 3.12, manylinux x86-64)
#                  [requirements-gpu.txt's pins, nvidia-cutlass-dsl-libs-base and -libs-cu13]; "none":
#                  the shards alone; a folder: its *.whl as they are
#   PART_MIB       carry: the size of a part [64 MiB less the working tree that travels, less 1]
set -euo pipefail

SHARDS=${SHARDS:-"proxy_train_00000[123].bin.xz proxy_val_000000.bin.xz"}
DATA_DIR=${DATA_DIR:-/tmp/d}
TOKENIZER_SRC=${TOKENIZER_SRC:-data/gpt2}
STAGE=${STAGE:-/tmp/stage}
SITE=${SITE:-/tmp/site}
REPO_COPY=${REPO_COPY-/tmp/repo}
LEASE_DIR=${LEASE_DIR:-/tmp/q}
POLL_EVERY=${POLL_EVERY:-10}
CACHE_DIR=${CACHE_DIR:-/tmp/cc}
FORCE=${FORCE:-0}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

die() { echo "lease.sh: $*" >&2; exit 1; }

# first existing folder among the arguments that holds a file matching one of the patterns in $1
first_dir_with() {
    local patterns d p f
    read -r -a patterns <<< "$1"; shift
    for d in "$@"; do
        [ -d "$d" ] || continue
        for p in "${patterns[@]}"; do
            for f in "$d"/$p; do
                [ -e "$f" ] && { echo "$d"; return 0; }
            done
        done
    done
    return 1
}

queue_pid() { [ -s "$1/queue.pid" ] && cat "$1/queue.pid"; }

queue_running() {  # the queue of folder $1 is alive
    local pid
    pid=$(queue_pid "$1") || return 1
    [ ! -e "$1/queue.rc" ] && kill -0 "$pid" 2>/dev/null
}

stage_data() {
    local src=$1 p f out patterns pids=() failed=0
    read -r -a patterns <<< "$SHARDS"
    mkdir -p "$DATA_DIR"
    for p in "${patterns[@]}"; do
        for f in "$src"/$p; do
            [ -e "$f" ] || { echo "data: no $src/$p"; continue; }
            out=$DATA_DIR/$(basename "$f" .xz)
            if [ -s "$out" ]; then echo "data: $out already there"; continue; fi
            ( xz -dc "$f" > "$out.part" && mv "$out.part" "$out" ) &
            pids+=("$!")
        done
    done
    for p in "${pids[@]+"${pids[@]}"}"; do wait "$p" || failed=1; done
    [ "$failed" = 0 ] || die "data: a shard failed to decompress (see above)"
    mkdir -p "$DATA_DIR/gpt2"
    for f in encoder.json vocab.bpe; do
        if [ ! -s "$DATA_DIR/gpt2/$f" ]; then
            [ -s "$TOKENIZER_SRC/$f" ] || die "tokenizer: no $TOKENIZER_SRC/$f"
            cp "$TOKENIZER_SRC/$f" "$DATA_DIR/gpt2/$f"
        fi
    done
    ls -l "$DATA_DIR"
}

install_wheels() {
    local wheels parts tarball=$STAGE/cu13.tar.xz
    if [ -e "$SITE/.lease_installed" ] && [ "$FORCE" != 1 ]; then
        echo "wheels: $SITE already filled by an earlier setup (FORCE=1 redoes it)"
        return 0
    fi
    wheels=${WHEEL_DIR:-$(first_dir_with "*.whl" .whl "$STAGE/whl" || true)}
    if [ -z "$wheels" ] || ! compgen -G "$wheels/*.whl" > /dev/null; then
        echo "wheels: none found (.whl, $STAGE/whl): no FA4, ATTENTION_BACKEND=auto falls back"
        return 0
    fi
    mkdir -p "$SITE" "$STAGE"
    # pip first: --upgrade --target replaces folders it installs, so the cu13 libraries go in after it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$wheels"/*.whl
    echo "wheels: installed $(ls "$wheels"/*.whl | wc -l) from $wheels into $SITE"
    parts=${CU13_PARTS:-}
    if [ -z "$parts" ]; then
        if compgen -G "$wheels/cu13.tar.xz.part*" > /dev/null; then parts="$wheels/cu13.tar.xz.part*"
        elif compgen -G "$STAGE/cu13.tar.xz.part*" > /dev/null; then parts="$STAGE/cu13.tar.xz.part*"
        fi
    fi
    if [ -n "$parts" ] && compgen -G "$parts" > /dev/null; then
        # the glob sorts the parts (part00, part01, ...) in the order they were split
        # shellcheck disable=SC2086
        cat $parts > "$tarball"
        tar -xJf "$tarball" -C "$SITE"
        rm -f "$tarball"
        echo "wheels: unpacked the cu13 libraries ($parts) into $SITE"
    else
        echo "wheels: no cu13.tar.xz.part* beside them: the CuTe DSL's cu13 libraries are missing"
    fi
    date > "$SITE/.lease_installed"
}

copy_tree() {
    [ -n "$REPO_COPY" ] || { echo "tree: REPO_COPY empty, the queue runs in place"; return 0; }
    if queue_running "$LEASE_DIR"; then
        echo "tree: a queue is running from $REPO_COPY; not replaced"
        return 0
    fi
    rm -rf "$REPO_COPY"
    mkdir -p "$REPO_COPY"
    tar -C "$PWD" --exclude=./.git --exclude=./shared --exclude=./.whl --exclude=./.bench \
        --exclude=./.dev -cf - . | tar -C "$REPO_COPY" -xf -
    echo "tree: $PWD copied to $REPO_COPY"
}

print_versions() {
    PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'EOF' || true
import sys
from importlib import metadata
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda)
except Exception as e:  # a CPU machine without torch still gets the rest
    print("torch: not importable:", e)
for dist in ("triton", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels"):
    try:
        print(dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(dist, "not installed")
try:
    import flash_attn.cute  # noqa: F401
    print("flash_attn.cute imports")
except Exception as e:
    print("flash_attn.cute does not import:", type(e).__name__, e)
EOF
    if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "nvidia-smi: not on this machine"; fi
}

# carry's parts (blob.tar.partNN-of-MM), each brought by a call into $STAGE: all there, reassembled into $STAGE
unpack_carried() {
    local parts total have missing=() i
    compgen -G "$STAGE/blob.tar.part*-of-*" > /dev/null || return 0
    parts=("$STAGE"/blob.tar.part*-of-*)
    total=${parts[0]##*-of-}
    for (( i = 0; i < 10#$total; i++ )); do
        have=$(printf '%s/blob.tar.part%02d-of-%s' "$STAGE" "$i" "$total")
        [ -e "$have" ] || missing+=("$(basename "$have")")
    done
    [ ${#missing[@]} -eq 0 ] || die "carry: missing ${missing[*]} in $STAGE: carry those calls' parts first"
    cat "${parts[@]}" | tar -xf - -C "$STAGE" || die "carry: the parts in $STAGE do not unpack"
    rm -f "${parts[@]}"
    echo "carry: reassembled $((10#$total)) parts into $STAGE"
}

cmd_setup() {
    unpack_carried
    local src=${1:-${DATA_SRC:-}}
    if [ -z "$src" ]; then
        src=$(first_dir_with "$SHARDS" shared/data/proxy .bench "$STAGE") \
            || die "data: no shards ($SHARDS) in shared/data/proxy, .bench or $STAGE; give DATA_SRC"
    fi
    [ -d "$src" ] || die "data: no folder $src"
    echo "data: $src -> $DATA_DIR"
    stage_data "$src"
    install_wheels
    unpack_cache
    copy_tree
    print_versions
}

unpack_cache() {
    if [ -e "$CACHE_DIR/.lease_unpacked" ]; then echo "cache: $CACHE_DIR already unpacked"; return 0; fi
    if ! compgen -G "$STAGE/cache.tar.xz.part*" > /dev/null; then
        echo "cache: no $STAGE/cache.tar.xz.part*: the first run compiles from scratch"
        return 0
    fi
    mkdir -p "$CACHE_DIR"
    cat "$STAGE"/cache.tar.xz.part* | tar -xJf - -C "$CACHE_DIR"
    date > "$CACHE_DIR/.lease_unpacked"
    echo "cache: unpacked $(ls "$STAGE"/cache.tar.xz.part* | wc -l) parts into $CACHE_DIR ($(du -sh "$CACHE_DIR" | cut -f1))"
}

# the compile caches ($CACHE_DIR) as parts of 15 MiB in $LEASE_DIR/cache_parts, once per lease
pack_cache_parts() {
    local parts=$LEASE_DIR/cache_parts
    [ -e "$parts/.done" ] && return 0
    rm -rf "$parts"; mkdir -p "$parts"
    tar -C "$CACHE_DIR" --exclude=.lease_unpacked --exclude='*.lock' -cf - . | xz -T0 -6 \
        | split -b 15M -d -a 2 - "$parts/cache.tar.xz.part"
    touch "$parts/.done"
}

cmd_pack_cache() {
    [ $# -ge 1 ] || die "pack-cache needs DEST (bench/lease.sh -h)"
    local dest=$1 first=${2:-0} parts=$LEASE_DIR/cache_parts i n f
    [[ "$first" =~ ^[0-9]+$ ]] || die "pack-cache takes a whole FIRST part number, not $first"
    [ -d "$CACHE_DIR" ] || die "no $CACHE_DIR: nothing compiled on this machine yet"
    if [ ! -e "$parts/.done" ]; then
        if queue_running "$LEASE_DIR"; then
            die "the queue is still running: pack the caches once it is done (or end the queue with pack_cache)"
        fi
        pack_cache_parts
    fi
    n=$(ls "$parts"/cache.tar.xz.part* | wc -l)
    mkdir -p "$dest"
    for (( i = first; i < first + 8 && i < n; i++ )); do
        f=$(printf '%s/cache.tar.xz.part%02d' "$parts" "$i")
        cp "$f" "$dest/"
        echo "packed $(basename "$f") ($(du -h "$f" | cut -f1))"
    done
    echo "cache: $n parts; this call brought parts $first-$(( (first + 8 < n ? first + 8 : n) - 1 ))"
}

cmd_start() {
    [ $# -ge 1 ] || die "start needs QUEUE_FILE (bench/lease.sh -h)"
    local queue=$1 dir=${2:-$LEASE_DIR} workdir pid i
    [ -f "$queue" ] || die "no queue file $queue"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if queue_running "$dir"; then die "a queue is already running (pid $(queue_pid "$dir")); poll it"; fi
    rm -f "$dir/queue.pid" "$dir/queue.rc"
    # bash reads a script as it runs: a copy keeps later edits of the working tree out of it
    [ "$(cd "$(dirname "$queue")" && pwd)/$(basename "$queue")" = "$dir/queue.sh" ] || cp "$queue" "$dir/queue.sh"
    workdir=$PWD
    if [ -n "$REPO_COPY" ] && [ -d "$REPO_COPY" ]; then workdir=$REPO_COPY; fi
    export L=$dir LEASE_DIR=$dir
    export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}
    export TRAIN_FILES=${TRAIN_FILES:-"$DATA_DIR/proxy_train_*.bin"}
    export VAL_FILES=${VAL_FILES:-"$DATA_DIR/proxy_val_*.bin"}
    export VAL_TOKENS=${VAL_TOKENS:-3932160}
    export TOKENIZER_DIR=${TOKENIZER_DIR:-$DATA_DIR/gpt2}
    export RANK_SLICE=${RANK_SLICE:-1}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$CACHE_DIR/inductor}
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$CACHE_DIR/triton}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$CACHE_DIR/cute}
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    note() { echo "$(date +%H:%M:%S) $*" >> "$L/status"; }
    # arm GPU NAME [VAR=VALUE ...]: train_gpt.py (or ARM_FILE, e.g. a baseline's staged file) alone on GPU (SEEDS
    # 1,2,3 unless given), its output in $L/NAME.out
    arm() {
        local gpu=$1 name=$2; shift 2
        env CUDA_VISIBLE_DEVICES="$gpu" RUN_ID="$name" SEEDS="${SEEDS:-1,2,3}" LOG_DIR="$L" "$@" \
            python "${ARM_FILE:-train_gpt.py}" > "$L/$name.out" 2>&1
        note "$name (GPU$gpu) rc=$?"
    }
    # check GPU NAME SECONDS COMMAND...: COMMAND on GPU under a timeout of SECONDS, its output in $L/NAME.out
    check() {
        local gpu=$1 name=$2 seconds=$3; shift 3
        CUDA_VISIBLE_DEVICES="$gpu" timeout "$seconds" "$@" > "$L/$name.out" 2>&1
        note "$name rc=$?"
    }
    # need_shards N...: end the queue (rc 1, noted) unless $DATA_DIR holds proxy train shard N for every N
    need_shards() {
        local i
        for i in "$@"; do
            [ -f "$DATA_DIR/proxy_train_$(printf %06d "$i").bin" ] || { note "shard $i missing: give setup SHARDS"; exit 1; }
        done
    }
    # watch_gpus SECONDS: the GPUs into $L/gpus.txt, then each one's clock, power, temperature and memory every
    # SECONDS into $L/clocks.txt, until the queue ends
    watch_gpus() {
        nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv \
            > "$L/gpus.txt" 2>&1
        ( while sleep "$1"; do nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,memory.used \
              --format=csv,noheader >> "$L/clocks.txt" 2>&1; done ) &
        echo "$!" > "$L/watch.pid"
    }
    # compile_beside NAME GIB FILE ARM: FILE's untimed compile beside ARM's (see the header); returns at once
    compile_beside() {
        local name=$1 gib=$2 file=$3 watched=$4 pid logs
        logs=$(mktemp -d)  # its run log stays out of $L (its console output, $L/NAME.out, comes back)
        CUDA_VISIBLE_DEVICES=0 RUN_ID="$name" SEEDS=1 LOG_DIR="$logs" GPU_MEMORY_GIB="$gib" \
            setsid python "$file" > "$L/$name.out" 2>&1 &
        pid=$!
        echo "$pid" > "$L/$name.pid"
        note "$name: $file compiling beside $watched (pid $pid)"
        ( while kill -0 "$pid" 2>/dev/null; do
              if grep -qs "Compile and warm-up took" "$L/$watched.out" "$L/$name.out"; then
                  kill -KILL -- -"$pid" 2>/dev/null; note "$name stopped: a warm-up ended"; break
              fi
              sleep 0.3
          done ) &
    }
    # stop_beside NAME: compile_beside's process group killed, where still alive
    stop_beside() { [ -s "$L/$1.pid" ] && kill -KILL -- -"$(cat "$L/$1.pid")" 2>/dev/null; true; }
    # pack_cache: the compile caches into parts now, after the queue's timed runs (their CPU time would slow a
    # run), so that the pack-cache calls after the queue only copy them
    pack_cache() {
        [ -d "$CACHE_DIR" ] || { note "pack_cache: no $CACHE_DIR"; return 0; }
        pack_cache_parts
        note "pack_cache: $(ls "$LEASE_DIR"/cache_parts/cache.tar.xz.part* | wc -l) parts of 15 MiB ($(du -sh \
            "$CACHE_DIR" | cut -f1) of caches): bench/lease.sh pack-cache DEST FIRST brings 8 a call"
    }
    export DATA_DIR CACHE_DIR
    export -f note arm check need_shards watch_gpus compile_beside stop_beside pack_cache pack_cache_parts
    local runner='echo $$ > "$1/queue.pid"; cd "$2" || exit 1
note "lease: queue start ($2)"; bash "$1/queue.sh"; rc=$?
[ -s "$1/watch.pid" ] && kill "$(cat "$1/watch.pid")" 2>/dev/null
note "lease: queue end rc=$rc"; echo "$rc" > "$1/queue.rc.part"; mv "$1/queue.rc.part" "$1/queue.rc"; exit "$rc"'
    if command -v setsid > /dev/null; then
        setsid nohup bash -c "$runner" lease-queue "$dir" "$workdir" > "$dir/queue.log" 2>&1 < /dev/null &
    else
        nohup bash -c "$runner" lease-queue "$dir" "$workdir" > "$dir/queue.log" 2>&1 < /dev/null &
    fi
    for i in $(seq 50); do [ -s "$dir/queue.pid" ] && break; sleep 0.1; done
    pid=$(queue_pid "$dir") || die "the queue did not start (see $dir/queue.log)"
    echo "started $queue as pid $pid in $workdir; log $dir/queue.log; poll with: bench/lease.sh poll"
}

last_step_lines() {
    local dir=$1 f line
    while IFS= read -r f; do
        line=$(grep -E '^step:[0-9]+' "$f" | tail -n 1 || true)
        if [ -z "$line" ]; then line=$(grep -v '^[[:space:]]*$' "$f" | tail -n 1 | cut -c1-200 || true); fi
        echo "${f#"$dir"/}: $line"
        grep -E '^(error:|Traceback|[A-Za-z_.]*(Error|Exception)\b)' "$f" | tail -n 1 | sed 's/^/    /' | cut -c1-200 || true
    done < <(find "$dir" -type f \( -name '*.txt' -o -name '*.out' \) | sort)
}

cmd_poll() {
    local limit=${1:-540} dest=${2:-} dir=$LEASE_DIR start now left rc
    [[ "$limit" =~ ^[0-9]+$ ]] || die "poll takes whole SECONDS, not $limit"
    if [ ! -e "$dir/queue.pid" ]; then
        echo "no queue on this machine ($dir/queue.pid missing): a fresh machine? setup and start again"
        exit 2
    fi
    start=$(date +%s)
    while queue_running "$dir"; do
        now=$(date +%s); left=$(( limit - (now - start) ))
        [ "$left" -gt 0 ] || break
        sleep "$(( left < POLL_EVERY ? left : POLL_EVERY ))"
    done
    echo "=== $dir/status"; tail -n 20 "$dir/status" 2>/dev/null || true
    echo "=== $dir/queue.log (last 10 lines)"; tail -n 10 "$dir/queue.log" 2>/dev/null || true
    echo "=== run logs: last step line"; last_step_lines "$dir"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=index,utilization.gpu,memory.used,clocks.sm,power.draw,temperature.gpu \
            --format=csv,noheader || true
    fi
    if queue_running "$dir"; then
        echo "QUEUE_RUNNING pid $(queue_pid "$dir") after $(( $(date +%s) - start )) s of polling"
        rc=3
    else
        if [ -s "$dir/queue.rc" ]; then echo "QUEUE_DONE rc=$(cat "$dir/queue.rc")"
        else echo "QUEUE_DONE rc=unknown (the queue was killed)"; fi
        rc=0
    fi
    if [ -n "$dest" ]; then ( cmd_collect "$dest" ) | tail -n 1 || true; fi
    exit "$rc"
}

cmd_collect() {
    [ $# -ge 1 ] || die "collect needs DEST (bench/lease.sh -h)"
    local dest=$1 dir=$LEASE_DIR rel name f files=()
    local -A seen=()
    [ -d "$dir" ] || die "no $dir: nothing to collect"
    mkdir -p "$dest"
    dest=$(cd "$dest" && pwd)
    while IFS= read -r f; do
        case "$f" in "$dest"/*) continue ;; esac
        files+=("${f#"$dir"/}")
    done < <(find "$dir" -type f \( -name '*.txt' -o -name '*.md' -o -name '*.out' -o -name '*.csv' -o -name '*.json' \) | sort)
    [ -f "$dir/queue.log" ] && files+=(queue.log)
    [ -f "$dir/status" ] && files+=(status)
    [ "${#files[@]}" -gt 0 ] || die "no logs in $dir"
    if [ "${#files[@]}" -le 7 ]; then
        for rel in "${files[@]}"; do
            name=$(basename "$rel")
            seen[$name]=$(( ${seen[$name]:-0} + 1 ))
        done
        for rel in "${files[@]}"; do
            name=$(basename "$rel")
            # two logs of one name in different folders: the folder joins the name
            [ "${seen[$name]}" -gt 1 ] && name=${rel//\//_}
            [ "$rel" = status ] && name=status.txt
            name=$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '_')
            cp "$dir/$rel" "$dest/$name"
            echo "collected $dest/$name"
        done
    else
        # a log still being written makes tar exit 1 ("file changed as we read it"): the archive
        # holds it up to that point
        tar -C "$dir" -cJf "$dest/lease_logs.tar.xz" "${files[@]}" || [ $? -eq 1 ] \
            || die "tar failed"
        echo "collected ${#files[@]} files into $dest/lease_logs.tar.xz (tar -xJf to unpack)"
    fi
}

# The wheels requirements-gpu.txt pins, by name==version, with the two that nvidia-cutlass-dsl[cu13] pulls in
gpu_wheel_pins() {
    local pins
    pins=$(sed -e 's/#.*//' -e 's/\[[a-z0-9]*\]//' requirements-gpu.txt | grep '==' | tr -d ' ') \
        || die "carry: no pins in requirements-gpu.txt"
    local dsl
    dsl=$(printf '%s\n' "$pins" | sed -n 's/^nvidia-cutlass-dsl==//p')
    [ -n "$dsl" ] || die "carry: requirements-gpu.txt pins no nvidia-cutlass-dsl"
    printf '%s\n' "$pins" "nvidia-cutlass-dsl-libs-base==$dsl" "nvidia-cutlass-dsl-libs-cu13==$dsl"
}

cmd_carry() {
    local dest=${1:-.bench} src=${DATA_SRC:-} wheels=${GPU_WHEELS:-} work tree room part n i p f patterns
    [ -n "$src" ] && [ -d "$src" ] || die "carry: give DATA_SRC, the folder of the proxy shards (*.bin.xz)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    mkdir -p "$work/blob/whl"
    read -r -a patterns <<< "$SHARDS"
    for p in "${patterns[@]}"; do
        for f in "$src"/$p; do
            [ -e "$f" ] || die "carry: no $src/$p"
            cp "$f" "$work/blob/"
        done
    done
    if [ "$wheels" != none ]; then
        if [ -z "$wheels" ]; then
            wheels=$work/download
            # shellcheck disable=SC2046
            python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                $(for n in 17 24 27 28 31 34 35; do echo --platform "manylinux_2_${n}_x86_64"; done) \
                --platform manylinux2014_x86_64 -d "$wheels" $(gpu_wheel_pins) \
                || die "carry: pip download failed (a package registry is needed here)"
        fi
        compgen -G "$wheels/*.whl" > /dev/null || die "carry: no wheels in $wheels"
        wheels=$(cd "$wheels" && pwd)  # the cu13 wheel is unzipped from another folder
        for f in "$wheels"/*.whl; do
            case $(basename "$f") in
                nvidia_cutlass_dsl_libs_cu13-*)  # installed by unpacking after pip (pip --target replaces folders)
                    mkdir -p "$work/cu13" && (cd "$work/cu13" && python3 -m zipfile -e "$f" .)
                    tar -C "$work/cu13" -cf - . | xz -T0 -9 > "$work/blob/whl/cu13.tar.xz.part00" ;;
                *) cp "$f" "$work/blob/whl/" ;;
            esac
        done
    fi
    if [ -n "${PART_MIB:-}" ]; then
        part=$(( PART_MIB * 1048576 ))
    else
        tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
        room=$(( 64 * 1048576 - tree - 1048576 ))
        [ "$room" -gt 1048576 ] || die "carry: the working tree ($tree bytes) leaves no room under 64 MiB"
        part=$room
    fi
    rm -rf "$dest"/p[0-9]*
    tar -C "$work/blob" -cf - . | split -b "$part" -d -a 2 - "$work/blob.tar.part"
    n=$(ls "$work"/blob.tar.part* | wc -l)
    i=0
    for f in "$work"/blob.tar.part*; do
        mkdir -p "$dest/p$i"
        mv "$f" "$dest/p$i/$(basename "$f")-of-$(printf %02d "$n")"
        i=$((i + 1))
    done
    echo "carry: $n parts of at most $((part / 1048576)) MiB in $dest/p0-p$((n - 1)); one call each, on one machine:"
    echo "  carry [\"$dest/pK\"], run: mkdir -p $STAGE && cp $dest/pK/* $STAGE/"
    echo "  after the last: SHARDS='$SHARDS' bash bench/lease.sh setup (it reassembles them), then start"
}

case "${1:-}" in
    carry) shift; cmd_carry "$@" ;;
    setup) shift; cmd_setup "$@" ;;
    start) shift; cmd_start "$@" ;;
    poll) shift; cmd_poll "$@" ;;
    collect) shift; cmd_collect "$@" ;;
    pack-cache) shift; cmd_pack_cache "$@" ;;
    -h|--help|help) usage ;;
    *) usage >&2; [ -n "${1:-}" ] && echo "lease.sh: unknown subcommand '$1'" >&2; exit 1 ;;
esac
