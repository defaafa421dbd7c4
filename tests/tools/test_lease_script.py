"""bench/lease.sh on the CPU: a fake queue started detached, polled while it waits (exit 3) and after
it ends (exit 0), its logs collected flat; more than seven logs come back as one tar.xz."""
import os
import pathlib
import shutil
import signal
import subprocess
import tarfile
import time

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "lease.sh"

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("tar") is None or shutil.which("xz") is None,
    reason="needs bash, tar and xz",
)


def lease(tmp_path, *args, timeout=30):
    env = dict(os.environ, LEASE_DIR=str(tmp_path / "q"), REPO_COPY="", POLL_EVERY="1")
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
        assert sorted(p.name for p in out.iterdir()) == ["equivalence.md", "new_s1.txt", "queue.log", "status.txt"]
        assert "RANK_SLICE=1 VAL_TOKENS=3932160" in (out / "queue.log").read_text()
        assert "queue done" in (out / "status.txt").read_text()
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
