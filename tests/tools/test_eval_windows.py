"""bench/eval_windows.py on the tiny CPU configuration: each run's model is scored under the listed
final-validation windows (and softmax scales), the schedule's own setting reproduces the run's number,
others differ."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, tiny_env

sys.path.insert(0, os.path.join(ROOT, "bench"))
import eval_windows as E  # noqa: E402


def test_parse_settings():
    assert E.parse_settings("6:20, 8:32y,6:32x1.05, 6:32yx.9") == [
        E.WindowSetting(6, 20, False), E.WindowSetting(8, 32, True), E.WindowSetting(6, 32, False, 1.05),
        E.WindowSetting(6, 32, True, 0.9)]
    assert E.WindowSetting(8, 32, True).label() == "short:8 long:32 yarn:1"
    assert E.WindowSetting(6, 32, False, 1.05).label() == "short:6 long:32 yarn:0 scale:1.05"
    assert E.parse_settings("6:32c8192,6:32yx1.1c64") == [E.WindowSetting(6, 32, False, 1.0, 8192),
                                                           E.WindowSetting(6, 32, True, 1.1, 64)]
    assert E.WindowSetting(6, 32, False, 1.0, 8192).label() == "short:6 long:32 yarn:0 copy:8192"
    for bad in ("6", "6:x", "0:20", "6:20:1", "6:20x", "6:20x0", "6:20xy1.1", "6:20x1.1y", "6:20c", "6:20c0",
                "6:20c64x1.1"):
        with pytest.raises(SystemExit, match="window setting"):
            E.parse_settings(bad)


def test_sweep_after_each_seed(tmp_path, corpus):
    # rank-slice: one micro-batch a step instead of eight, 4 steps instead of 7 and no validation but the
    # first and the final one (the tool scores trained models; how they trained is main()'s business,
    # tested in tests/training)
    env = tiny_env(tmp_path, corpus, rank_slice=True, seeds="1,2", run_id="sweep", final_long_window=20,
                   num_scheduled_iterations=3, val_loss_every=0)
    out = tmp_path / "windows.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "eval_windows.py"),
                           "--windows", "6:20x1.5,6:20,2:4,6:20y", "--out", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert sorted(results) == ["sweep_s1", "sweep_s2"]
    for run_id, result in results.items():
        losses = result["settings"]
        assert losses["short:6 long:20 yarn:0"] == result["run_val_loss"]  # the schedule's own final setting,
        # after a setting that scaled the softmax: the schedule's scale came back
        assert losses["short:6 long:20 yarn:0 scale:1.5"] != result["run_val_loss"]
        assert losses["short:2 long:4 yarn:0"] != result["run_val_loss"]  # windows shorter than the documents
        assert losses["short:6 long:20 yarn:1"] != result["run_val_loss"]  # other rotary tables
        log = (tmp_path / "logs" / f"{run_id}.txt").read_text()
        assert f"final_windows short:2 long:4 yarn:0 val_loss:{losses['short:2 long:4 yarn:0']:.4f}" in log
    assert results["sweep_s1"]["run_val_loss"] != results["sweep_s2"]["run_val_loss"]


def test_copy_pointer_windows(tmp_path, corpus):
    """With COPY_POINTER=1 a setting's cW scores the run's model with the pointer looking W tokens back at validation:
    FINAL_COPY_WINDOW's own (and no cW) reproduces the run's number, after another W too; other windows differ
    (training's COPY_WINDOW among them); without COPY_POINTER the tool refuses cW before training."""
    env = tiny_env(tmp_path, corpus, rank_slice=True, seeds="1", run_id="copy", final_long_window=20,
                   num_scheduled_iterations=3, val_loss_every=0, copy_pointer=True, copy_window=64,
                   final_copy_window=256)
    out = tmp_path / "windows.json"
    command = [sys.executable, os.path.join(ROOT, "bench", "eval_windows.py"), "--out", str(out)]
    proc = subprocess.run(command + ["--windows", "6:20c4,6:20,6:20c256,6:20c64"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())["copy_s1"]
    losses, run = result["settings"], result["run_val_loss"]
    assert losses["short:6 long:20 yarn:0"] == losses["short:6 long:20 yarn:0 copy:256"] == run
    assert losses["short:6 long:20 yarn:0 copy:4"] != run and losses["short:6 long:20 yarn:0 copy:64"] != run
    env["COPY_POINTER"] = "0"
    proc = subprocess.run(command + ["--windows", "6:20c64"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0 and "needs COPY_POINTER=1" in proc.stderr and "step:" not in proc.stdout
