"""bench/compare_runs.py: per-step loss differences between logs, complete or stopped early."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = importlib.util.spec_from_file_location("compare_runs", os.path.join(ROOT, "bench", "compare_runs.py"))
C = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = C
SPEC.loader.exec_module(C)


def write_log(path, train, val, world=1, accum=8, total=1285, ms_per_step=80.0):
    """The run-description and step lines of a train_gpt.py log (TRAIN_LOSS_EVERY=1)."""
    lines = ["mode: full-batch", f"world_size: {world}", f"grad_accum_steps: {accum}", "hardware: 2x NVIDIA H200"]
    for step in range(len(train) + 1):
        ms = step * ms_per_step
        if step in val:
            lines.append(f"step:{step}/{total} val_loss:{val[step]:.4f} train_time:{ms:.0f}ms step_avg:{ms / max(step, 1):.2f}ms")
        if step < len(train):
            lines.append(f"step:{step + 1}/{total} train_loss:{train[step]:.4f} train_time:{ms + ms_per_step:.0f}ms "
                         f"step_avg:{ms_per_step:.2f}ms")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_differences_steps_and_exit_code(tmp_path, capsys):
    base = write_log(tmp_path / "one.txt", [9.0, 8.0, 7.0, 6.0], {0: 10.8, 4: 6.5})
    close = write_log(tmp_path / "two.txt", [9.0, 8.002, 7.001, 6.0], {0: 10.8, 4: 6.503}, world=2, accum=4,
                      ms_per_step=42.5)
    far = write_log(tmp_path / "four.txt", [9.0, 8.0, 7.2, 6.0], {0: 10.8, 4: 6.5}, world=4, accum=2)
    assert C.main([base, close]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == f"| {base} (base) | full-batch, world 1, accumulation 8 | 4 | 80.00 | | |"
    assert out[3] == f"| {close} | full-batch, world 2, accumulation 4 | 4 | 42.50 | 2.00e-03 (2, 4 steps) | 3.00e-03 (4, 2 steps) |"
    assert out[-1] == "all differences within 0.005"
    assert C.main([base, close, far]) == 1  # step 3's train loss is 0.2 away
    assert "2.00e-01 (3, 4 steps)" in capsys.readouterr().out


def test_stopped_runs_compare_on_common_steps_and_missing_train_loss_is_named(tmp_path, capsys):
    base = write_log(tmp_path / "one.txt", [9.0, 8.0, 7.0, 6.0], {0: 10.8, 4: 6.5})
    short = write_log(tmp_path / "short.txt", [9.001, 8.0], {0: 10.8, 2: 7.7})
    assert C.main([base, short, "--tolerance", "1e-2"]) == 0
    assert "| 2 | 80.00 | 1.00e-03 (1, 2 steps) | 0.00e+00 (0, 1 steps) |" in capsys.readouterr().out
    (tmp_path / "plain.txt").write_text("step:1/1285 train_time:80ms step_avg:80.00ms\n")
    with pytest.raises(SystemExit, match="no train_loss in its step lines; rerun with TRAIN_LOSS_EVERY=1"):
        C.main([base, str(tmp_path / "plain.txt")])
