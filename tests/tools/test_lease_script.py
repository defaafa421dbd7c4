"""bench/lease.sh on the CPU: a fake queue started detached, polled while it waits (exit 3) and after
it ends (exit 0), its logs collected flat; more than seven logs come back as one tar.xz."""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tarfile
import time
import zipfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "lease.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("tar") is None or shutil.which("xz") is None,
    reason="needs bash, tar and xz",
)


def lease(tmp_path, *args, timeout=30):
    return lease_env(tmp_path, {}, *args, timeout=timeout)


def lease_env(tmp_path, extra: dict, *args, timeout=30):
    env = dict(os.environ, LEASE_DIR=str(tmp_path / "q"), REPO_COPY="", POLL_EVERY="1", **extra)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def stop_queue(tmp_path):
    pid_file = tmp_path / "q" / "queue.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def test_start_poll_collect(tmp_path):
    queue = tmp_path / "queue.sh"
    # waits (at most 20 s) for the test's go-ahead, so the first poll finds it running
    queue.write_text(
        'note "queue start"; mkdir -p "$L/full"\n'
        'echo "step:0/2 val_loss:10.8 train_time:0ms" > "$L/full/new_s1.txt"\n'
        'echo "| log | steps |" > "$L/equivalence.md"\n'
        'mkdir -p "$L/prof"; echo "kernel,ms" > "$L/prof/kernels.csv"; echo "{}" > "$L/prof/main.json"\n'
        'echo "{}" | gzip > "$L/prof/trace.json.gz"\n'
        'for i in $(seq 200); do [ -e "$L/go" ] && break; sleep 0.1; done\n'
        'echo "step:2/2 val_loss:3.63 train_time:20ms" >> "$L/full/new_s1.txt"\n'
        'echo "RANK_SLICE=$RANK_SLICE VAL_TOKENS=$VAL_TOKENS"; note "queue done"\n'
    )
    try:
        t0 = time.monotonic()
        started = lease(tmp_path, "start", str(queue))
        assert started.returncode == 0, started.stderr
        assert time.monotonic() - t0 < 8  # returns at once, the queue runs on
        assert lease(tmp_path, "start", str(queue)).returncode == 1  # one queue at a time

        running = lease(tmp_path, "poll", "0", str(tmp_path / "early"))
        assert running.returncode == 3, running.stdout + running.stderr
        assert "full/new_s1.txt: step:0/2" in running.stdout
        # a poll with DEST brings back what is written so far: a machine lost later loses none of it
        assert (tmp_path / "early" / "new_s1.txt").read_text().startswith("step:0/2")
        assert (tmp_path / "early" / "equivalence.md").exists()

        (tmp_path / "q" / "go").touch()
        done = lease(tmp_path, "poll", "20")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "QUEUE_DONE rc=0" in done.stdout and "full/new_s1.txt: step:2/2" in done.stdout

        collected = lease(tmp_path, "collect", str(tmp_path / "out"))
        assert collected.returncode == 0, collected.stderr
        out = tmp_path / "out"
        assert sorted(p.name for p in out.iterdir()) == ["equivalence.md", "kernels.csv", "main.json", "new_s1.txt", "queue.log",
                                                     "status.txt"]  # no gzipped trace
        assert "RANK_SLICE=1 VAL_TOKENS=3932160" in (out / "queue.log").read_text()
        assert "queue done" in (out / "status.txt").read_text()
    finally:
        stop_queue(tmp_path)


def test_the_queue_runs_arms_and_checks_on_their_gpus(tmp_path):
    """`arm` runs train_gpt.py (ARM_FILE: another file) with its GPU, RUN_ID, SEEDS (1,2,3 unless the arm gives
    them), LOG_DIR and the arm's settings; `check` runs a command on its GPU under a timeout; both log to
    $L/NAME.out and note the rc."""
    (tmp_path / "train_gpt.py").write_text(
        "import os\nprint(*(os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'RUN_ID', 'SEEDS', 'LOG_DIR', 'X')))\n")
    (tmp_path / "base.py").write_text("import os\nprint('base', os.environ.get('RUN_ID'))\n")
    queue = tmp_path / "queue.sh"
    queue.write_text(f'arm 2 plain; arm 1 seeded SEEDS=4,5 X=7; ARM_FILE={tmp_path / "base.py"} arm 0 base\n'
                     'check 3 probe 5 bash -c \'echo gpu $CUDA_VISIBLE_DEVICES\'; check 0 slow 1 sleep 5\n')
    try:
        assert lease(tmp_path, "start", str(queue)).returncode == 0
        done = lease(tmp_path, "poll", "20")
        assert done.returncode == 0, done.stdout + done.stderr
        q = tmp_path / "q"
        assert (q / "plain.out").read_text().split() == ["2", "plain", "1,2,3", str(q), "None"]
        assert (q / "seeded.out").read_text().split() == ["1", "seeded", "4,5", str(q), "7"]
        assert (q / "base.out").read_text().split() == ["base", "base"]
        assert (q / "probe.out").read_text().strip() == "gpu 3"
        status = (q / "status").read_text()
        assert "plain (GPU2) rc=0" in status and "seeded (GPU1) rc=0" in status and "probe rc=0" in status
        assert "slow rc=124" in status  # timeout's code: the check ran out of time
    finally:
        stop_queue(tmp_path)


def test_need_shards_ends_the_queue_and_the_gpu_watch_ends_with_it(tmp_path):
    """`need_shards` passes where $DATA_DIR holds the shards and ends the queue (rc 1, noted) where one is
    missing; `watch_gpus` writes gpus.txt at once and its sampler stops when the queue ends."""
    data = tmp_path / "d"
    data.mkdir()
    (data / "proxy_train_000001.bin").write_bytes(b"")
    queue = tmp_path / "queue.sh"
    queue.write_text('watch_gpus 1\nneed_shards 1\nnote "shard 1 there"\nneed_shards 1 2\nnote "not reached"\n')
    try:
        assert lease_env(tmp_path, {"DATA_DIR": str(data)}, "start", str(queue)).returncode == 0
        done = lease(tmp_path, "poll", "20")
        assert done.returncode == 0, done.stdout + done.stderr
        q = tmp_path / "q"
        status = (q / "status").read_text()
        assert "shard 1 there" in status and "shard 2 missing" in status and "not reached" not in status
        assert "queue end rc=1" in status and (q / "gpus.txt").exists()
        watcher = int((q / "watch.pid").read_text())
        for _ in range(50):
            if not os.path.exists(f"/proc/{watcher}"):
                break
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{watcher}"), "the GPU sampler outlived its queue"
    finally:
        stop_queue(tmp_path)


def test_many_logs_come_back_as_one_archive(tmp_path):
    queue = tmp_path / "queue.sh"
    queue.write_text('mkdir -p "$L/full"\n'
                     'for i in 1 2 3 4 5 6 7 8; do echo "step:$i/8" > "$L/full/r$i.txt"; done\n'
                     "exit 5\n")
    try:
        assert lease(tmp_path, "start", str(queue)).returncode == 0
        done = lease(tmp_path, "poll", "20")
        assert done.returncode == 0 and "QUEUE_DONE rc=5" in done.stdout
        assert lease(tmp_path, "collect", str(tmp_path / "out")).returncode == 0
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["lease_logs.tar.xz"]
        with tarfile.open(tmp_path / "out" / "lease_logs.tar.xz") as tar:
            names = sorted(tar.getnames())
        assert names == sorted([f"full/r{i}.txt" for i in range(1, 9)] + ["queue.log", "status"])
    finally:
        stop_queue(tmp_path)


def test_usage_and_no_queue(tmp_path):
    assert lease(tmp_path, "-h").returncode == 0
    unknown = lease(tmp_path, "launch")
    assert unknown.returncode == 1 and "unknown subcommand 'launch'" in unknown.stderr
    assert lease(tmp_path, "poll", "1").returncode == 2  # a fresh machine: nothing started here


def test_compile_caches_round_trip_through_parts(tmp_path):
    """pack-cache splits the cache folder into parts (eight per call, FIRST picks the rest); a later
    lease's setup, finding the parts in its stage folder, unpacks them before anything compiles."""
    cache = tmp_path / "cc"
    (cache / "inductor" / "fx").mkdir(parents=True)
    (cache / "triton").mkdir()
    payload = os.urandom(3 << 20)  # incompressible: 3 MiB
    (cache / "inductor" / "fx" / "graph.so").write_bytes(payload)
    (cache / "triton" / "k.cubin").write_bytes(b"cubin")
    (tmp_path / "q").mkdir()
    env = {"CACHE_DIR": str(cache)}
    packed = lease_env(tmp_path, env, "pack-cache", str(tmp_path / "back"))
    assert packed.returncode == 0, packed.stderr
    parts = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert parts == ["cache.tar.xz.part00"] and "cache: 1 parts" in packed.stdout
    assert lease_env(tmp_path, env, "pack-cache", str(tmp_path / "none"), "1").returncode == 0
    assert not list((tmp_path / "none").iterdir())  # FIRST beyond the last part: nothing to bring

    stage, data = tmp_path / "stage", tmp_path / "data"
    stage.mkdir()
    shutil.copy(tmp_path / "back" / "cache.tar.xz.part00", stage)
    (stage / "tiny_val.bin").write_bytes(b"\0" * 16)
    subprocess.run(["xz", "-z", str(stage / "tiny_val.bin")], check=True)
    (tmp_path / "tok").mkdir()
    for name in ("encoder.json", "vocab.bpe"):
        (tmp_path / "tok" / name).write_text("{}")
    fresh = tmp_path / "cc2"
    setup = lease_env(tmp_path, {"CACHE_DIR": str(fresh), "STAGE": str(stage), "SHARDS": "tiny_val.bin.xz",
                                 "DATA_DIR": str(data), "TOKENIZER_SRC": str(tmp_path / "tok")},
                      "setup", str(stage), timeout=120)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "cache: unpacked 1 parts" in setup.stdout
    assert (fresh / "inductor" / "fx" / "graph.so").read_bytes() == payload
    assert (fresh / "triton" / "k.cubin").read_bytes() == b"cubin"


def test_the_queue_packs_the_caches_for_the_calls_after_it(tmp_path):
    """`pack_cache` at a queue's end packs the caches into parts and notes how many; `pack-cache` after the
    queue then copies those parts (it does not pack again), and refuses to pack while a queue runs."""
    cache = tmp_path / "cc"
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "k.cubin").write_bytes(os.urandom(1 << 20))
    env = {"CACHE_DIR": str(cache)}
    queue = tmp_path / "queue.sh"
    queue.write_text("pack_cache\n")
    try:
        assert lease_env(tmp_path, env, "start", str(queue)).returncode == 0
        done = lease_env(tmp_path, env, "poll", "20")
        assert done.returncode == 0, done.stdout + done.stderr
        status = (tmp_path / "q" / "status").read_text()
        assert re.search(r"pack_cache: 1 parts of 15 MiB \(\S+ of caches\)", status), status
        part = tmp_path / "q" / "cache_parts" / "cache.tar.xz.part00"
        packed_at = part.stat().st_mtime_ns
        (cache / "triton" / "later.cubin").write_bytes(b"compiled after the queue")
        brought = lease_env(tmp_path, env, "pack-cache", str(tmp_path / "back"))
        assert brought.returncode == 0, brought.stderr
        assert part.stat().st_mtime_ns == packed_at  # copied as the queue packed it
        assert (tmp_path / "back" / "cache.tar.xz.part00").read_bytes() == part.read_bytes()
    finally:
        stop_queue(tmp_path)
    (tmp_path / "q" / "cache_parts" / ".done").unlink()
    queue.write_text("sleep 30\n")
    try:
        assert lease_env(tmp_path, env, "start", str(queue)).returncode == 0
        refused = lease_env(tmp_path, env, "pack-cache", str(tmp_path / "again"))
        assert refused.returncode == 1 and "the queue is still running" in refused.stderr
    finally:
        stop_queue(tmp_path)


def test_carry_splits_shards_and_wheels_into_parts_that_setup_reassembles(tmp_path):
    """carry (here) packs the shards, the small wheels and the cu13 libraries' tarball into parts of PART_MIB
    in .bench/pN; setup (there) refuses an incomplete set with one line naming what is missing, then
    reassembles them into the stage folder, where the shards and the wheels are found as before."""
    src, wheels = tmp_path / "proxy", tmp_path / "wheels"
    src.mkdir(), wheels.mkdir()
    payload = os.urandom(5 << 19)  # 2.5 MiB, incompressible: three 1 MiB parts
    for name, data in (("tiny_train_000001.bin", payload), ("tiny_val_000000.bin", b"\0" * 16)):
        (src / name).write_bytes(data)
        subprocess.run(["xz", "-0", str(src / name)], check=True)
    library = os.urandom(1000)
    with zipfile.ZipFile(wheels / "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr("nvidia_cutlass_dsl/lib/libcute.so", library)
    with zipfile.ZipFile(wheels / "small-1.0-py3-none-any.whl", "w") as z:
        z.writestr("small/__init__.py", "")
    carried = lease_env(tmp_path, {"DATA_SRC": str(src), "SHARDS": "tiny_*.bin.xz", "GPU_WHEELS": str(wheels),
                                   "PART_MIB": "1"}, "carry", timeout=120)
    assert carried.returncode == 0, carried.stderr
    folders = sorted((tmp_path / ".bench").iterdir())
    assert [f.name for f in folders] == [f"p{i}" for i in range(len(folders))] and len(folders) >= 3
    parts = [next(f.iterdir()) for f in folders]
    assert all(p.stat().st_size <= 1 << 20 for p in parts) and f"{len(parts)} parts" in carried.stdout
    assert [p.name for p in parts] == [f"blob.tar.part{i:02d}-of-{len(parts):02d}" for i in range(len(parts))]

    stage, empty = tmp_path / "stage", tmp_path / "no_wheels"
    stage.mkdir(), empty.mkdir()
    (tmp_path / "tok").mkdir()
    for name in ("encoder.json", "vocab.bpe"):
        (tmp_path / "tok" / name).write_text("{}")
    env = {"STAGE": str(stage), "SHARDS": "tiny_*.bin.xz", "DATA_DIR": str(tmp_path / "data"),
           "TOKENIZER_SRC": str(tmp_path / "tok"), "WHEEL_DIR": str(empty), "CACHE_DIR": str(tmp_path / "cc")}
    for p in parts[:-1]:
        shutil.copy(p, stage)
    incomplete = lease_env(tmp_path, env, "setup", timeout=120)
    assert incomplete.returncode != 0 and f"missing {parts[-1].name}" in incomplete.stderr
    shutil.copy(parts[-1], stage)
    setup = lease_env(tmp_path, env, "setup", timeout=120)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert f"reassembled {len(parts)} parts" in setup.stdout and not list(stage.glob("blob.tar.part*"))
    assert (tmp_path / "data" / "tiny_train_000001.bin").read_bytes() == payload
    assert sorted(p.name for p in (stage / "whl").iterdir()) == ["cu13.tar.xz.part00", "small-1.0-py3-none-any.whl"]
    with tarfile.open(stage / "whl" / "cu13.tar.xz.part00") as tar:
        assert tar.extractfile("./nvidia_cutlass_dsl/lib/libcute.so").read() == library


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
@pytest.mark.parametrize("first", ["arm", "beside"])
def test_compile_beside_is_killed_with_its_children_when_a_warm_up_ends(tmp_path, first):
    """`compile_beside` runs another train_gpt.py on GPU 0 (one seed, its allocator capped) beside an arm and kills
    its process group, children included, as soon as the arm's warm-up or its own ends; `stop_beside` after."""
    beside = tmp_path / "base.py"
    beside.write_text(  # a child that would outlive a kill of the parent alone, then its own warm-up end on cue
        "import os, subprocess, sys, time\n"
        "print(*(os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'RUN_ID', 'SEEDS', 'GPU_MEMORY_GIB')),"
        " flush=True)\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "open(os.path.join(os.environ['L'], 'child.pid'), 'w').write(str(child.pid))\n"
        "for _ in range(200):\n"
        "    if os.path.exists(os.path.join(os.environ['L'], 'go_beside')):\n"
        "        print('Compile and warm-up took 1s. Resetting model', flush=True)\n"
        "    time.sleep(0.1)\n")
    (tmp_path / "train_gpt.py").write_text(  # the arm: its warm-up ends on cue, then it outlives the watch
        "import os, time\n"
        "for _ in range(200):\n"
        "    if os.path.exists(os.path.join(os.environ['L'], 'go_arm')):\n"
        "        print('Compile and warm-up took 1s. Resetting model', flush=True)\n"
        "        break\n"
        "    if os.path.exists(os.path.join(os.environ['L'], 'go_beside')):\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "time.sleep(1)\n")
    queue = tmp_path / "queue.sh"
    queue.write_text(f'compile_beside base_compile 52 {beside} record\n'
                     f'for i in $(seq 50); do [ -s "$L/child.pid" ] && break; sleep 0.1; done\n'
                     f'touch "$L/go_{first}"\n'
                     'arm 0 record SEEDS=1\n'
                     'for f in base_compile.pid child.pid; do  # each one\'s state once the arm is done\n'
                     '    s=$(cut -d" " -f3 "/proc/$(cat "$L/$f")/stat" 2>/dev/null)\n'
                     '    note "$f after the arm: ${s:-gone}"\n'
                     'done\n'
                     'stop_beside base_compile\n')
    try:
        assert lease(tmp_path, "start", str(queue)).returncode == 0
        done = lease(tmp_path, "poll", "25")
        assert done.returncode == 0, done.stdout + done.stderr
        q = tmp_path / "q"
        assert (q / "base_compile.out").read_text().split()[:4] == ["0", "base_compile", "1", "52"]
        status = (q / "status").read_text()
        assert "base_compile stopped: a warm-up ended" in status and "record (GPU0) rc=0" in status
        assert status.index("base_compile stopped") < status.index("record (GPU0) rc=0")
        states = dict(re.findall(r"(\w+)\.pid after the arm: (\w+)", status))
        assert set(states) == {"base_compile", "child"} and all(s in ("gone", "Z") for s in states.values()), states
    finally:
        stop_queue(tmp_path)
