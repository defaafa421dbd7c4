"""Tests for records/tool.py on synthetic logs written per the train_gpt.py log format (CPU, fast)."""
import importlib.util
import io
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as st

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("records_tool", REPO / "records" / "tool.py")
tool = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = tool  # dataclasses look their module up in sys.modules
SPEC.loader.exec_module(tool)
T = tool.train_gpt  # the log format's writers (step_line, ...): the fake logs change when the format does

SOURCE = 'import os\nprint("fake train_gpt.py")\n# a line of "=" * 100 is built, never written literally\n'
NVSMI = """Sat Nov 22 03:13:00 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: 12.8     |
+-----------------------------------------------------------------------------------------+"""


def make_log(path, final_loss, final_ms, *, total=100, val_every=25, run_id=None, source=SOURCE,
             hardware="8x NVIDIA H100 80GB HBM3", mode="rank-slice", data=None, truncate_after_step=None,
             bad_line_at_step=None, error_at_step=None, overrides=None, world_size=8, grad_accum=1, train_loss=None,
             seed=None, schedule=None, step_ms=None, host_cpu=None, stop_after=None, startup_error=None,
             unmasked=None, gpu_memory_gib=None):
    """Write a complete log (or a broken one) with a known final val loss and train time (ms), its
    lines made by train_gpt.py's writers. schedule: (scheduled steps, stage fractions) logged as the
    hyperparameters' stage table; step_ms: train_time (ms) after a given number of steps (default:
    linear up to final_ms); stop_after: STOP_AFTER (logged, and the run validates and ends there);
    startup_error: the run fails before its first step with this `error:` line; unmasked: VAL_MASK=1's
    `unmasked` line after each validation, this much above its val loss; gpu_memory_gib: GPU_MEMORY_GIB's line
    and setting."""
    path = Path(path)
    data = data or "FineWeb (train data/fineweb10B/fineweb_train_*.bin; val data/fineweb10B/fineweb_val_*.bin, 10485760 tokens)"
    lines = [source.rstrip("\n"), T.LOG_SEPARATOR,
             "Running Python 3.12.3 (main, Apr 10 2024, 05:33:47) [GCC 13.2.0]",
             "Running PyTorch 2.11.0+cu128 compiled for CUDA 12.8", "Running Triton version 3.6.0",
             *([f"Running on host CPU {host_cpu}"] if host_cpu else []), NVSMI, T.LOG_SEPARATOR,
             f"run_id: {run_id or path.stem}", f"hardware: {hardware}",
             *([f"gpu_memory: the allocator capped at {gpu_memory_gib:g} GiB of 139.8 (GPU_MEMORY_GIB)"]
               if gpu_memory_gib else []), f"mode: {mode}", f"world_size: {world_size}",
             f"grad_accum_steps: {grad_accum}", f"data: {data}", *([f"overrides: {overrides}"] if overrides is not None else []),
             "hyperparameters: " + json.dumps({"num_iterations": total, "val_loss_every": val_every,
                                               **({} if seed is None else {"seed": seed}),
                                               **({} if gpu_memory_gib is None else {"gpu_memory_gib": gpu_memory_gib}),
                                               **({} if stop_after is None else {"stop_after": stop_after}),
                                               **({} if schedule is None else {
                                                   "num_scheduled_iterations": schedule[0],
                                                   "stages": [{"fraction": f} for f in schedule[1]] + [{"fraction": None}]})})]
    if startup_error is not None:  # train_gpt.py's report_setup_error: the line, and nothing after it
        lines.append(f"error: {startup_error}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return path
    lines += ["Compiling model and warming up kernels", "Warm-up steps [0, 1, 2]", "Resetting model"]
    last = stop_after or total

    def ms_at(step):
        return step_ms(step) if step_ms else round(final_ms * step / total)

    for step in range(last + 1):
        ms = ms_at(step)
        if step == truncate_after_step:
            break
        if step == error_at_step:
            lines.append(f"error: non-finite loss nan at step {step}")
            break
        if step == bad_line_at_step:
            lines.append(f"step:{step}/{total} train_time:{ms}ms step_avg:garbage")
        if step % val_every == 0 or step == last:
            loss = final_loss if step == total else final_loss + 5.0 * (1 - step / total)
            lines.append(T.step_line(step, total, ms, val_loss=loss))
            if unmasked is not None:
                lines.append(unmasked_val_line(step, total, loss + unmasked))
        if step < last:  # train_loss(step): the loss logged after step + 1 (TRAIN_LOSS_EVERY=1)
            lines.append(T.step_line(step + 1, total, ms_at(step + 1),
                                     train_loss=train_loss(step + 1) if train_loss else None))
        if step == total // 2:
            lines.append("data: pass 2 over 3 train files")
    else:
        lines.append(T.peak_memory_line(40345, 52942))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def unmasked_val_line(step, total, val_loss):
    """The legacy VAL_MASK=1 line (train_gpt.py wrote it after each validation until validation masking
    was removed): old logs keep it, and the tool still reads it."""
    return f"unmasked step:{step}/{total} val_loss:{val_loss:.4f}"


def make_logs(folder, losses, times_s, **kw):
    return [make_log(Path(folder) / f"run{i}.txt", loss, t * 1000, **kw)
            for i, (loss, t) in enumerate(zip(losses, times_s))]


def run_tool(*argv):
    return tool.main([str(a) for a in argv])


def make_record(root, folder, losses, times, source=SOURCE, **kw):
    d = Path(root) / "records" / folder
    make_logs(d, losses, times, source=source, **kw)
    (d / "train_gpt.py").write_text(source)
    return d


# ------------------------------------------------------------------ parsing

def test_parse_complete_log(tmp_path):
    p = make_log(tmp_path / "a.txt", 3.2712, 181234, total=100)
    r = tool.parse_log(p)
    assert r.source == SOURCE.encode()
    assert (r.final_loss, r.train_time, r.total) == (3.2712, 181.234, 100)
    assert (r.peak_allocated, r.peak_reserved) == (40345, 52942)
    assert r.hardware == "8x NVIDIA H100 80GB HBM3" and r.mode == "rank-slice" and r.world_size == 8
    assert r.data.startswith("FineWeb") and r.hyperparameters["num_iterations"] == 100
    assert (r.torch, r.cuda, r.triton, r.driver) == ("2.11.0+cu128", "12.8", "3.6.0", "570.86.15")
    assert [v[0] for v in r.val] == [0, 25, 50, 75, 100]


def test_host_cpu_line_is_read_and_shown_in_the_statistics_setup(tmp_path, capsys):
    cpu = "Intel(R) Xeon(R) Platinum 8480+ (16 cores usable)"
    for i, loss in enumerate(LOSSES):
        make_log(tmp_path / "new" / f"run{i}.txt", loss, 180000 + i, host_cpu=cpu)
    make_log(tmp_path / "old" / "run0.txt", 3.27, 180000)
    make_log(tmp_path / "old" / "run1.txt", 3.28, 180000)
    assert tool.parse_log(tmp_path / "new" / "run0.txt").host_cpu == cpu
    assert tool.parse_log(tmp_path / "old" / "run0.txt").host_cpu == ""
    assert run_tool("stats", tmp_path / "new", "--no-plot") == 0
    assert f"- host CPU: {cpu}\n" in (tmp_path / "new" / "statistics.md").read_text()
    assert run_tool("stats", tmp_path / "old", "--no-plot") == 0  # logs from before the line: none shown
    assert "host CPU" not in (tmp_path / "old" / "statistics.md").read_text()


def test_gpu_memory_cap_is_shown_in_the_statistics_setup(tmp_path):
    """GPU_MEMORY_GIB runs (a larger GPU checking what fits a smaller one) say so beside the hardware."""
    for i, loss in enumerate(LOSSES):
        make_log(tmp_path / "capped" / f"run{i}.txt", loss, 180000 + i, gpu_memory_gib=78.0)
        make_log(tmp_path / "whole" / f"run{i}.txt", loss, 180000 + i, gpu_memory_gib=0.0)
    assert tool.parse_log(tmp_path / "capped" / "run0.txt").hardware == "8x NVIDIA H100 80GB HBM3"
    for folder in ("capped", "whole"):
        assert run_tool("stats", tmp_path / folder, "--no-plot") == 0
    setup = (tmp_path / "capped" / "statistics.md").read_text()
    assert "- hardware: 8x NVIDIA H100 80GB HBM3\n- GPU memory: the allocator capped at 78 GiB (GPU_MEMORY_GIB)\n" in setup
    assert "GPU memory" not in (tmp_path / "whole" / "statistics.md").read_text()


def test_malformed_step_line_names_file_and_line(tmp_path):
    p = make_log(tmp_path / "x.txt", 3.27, 100000, bad_line_at_step=30)
    bad = next(i for i, ln in enumerate(p.read_text().split("\n"), 1) if "garbage" in ln)
    with pytest.raises(tool.RecordsError, match=rf"x\.txt:{bad}: cannot parse step line: .*garbage"):
        tool.parse_log(p)


def test_truncated_log_names_file_line_and_last_step(tmp_path):
    p = make_log(tmp_path / "x.txt", 3.27, 100000, total=100, truncate_after_step=61)
    n = len(p.read_text().splitlines())
    with pytest.raises(tool.RecordsError, match=rf"x\.txt:{n}: truncated run: no final validation line \(last step 61/100\)"):
        tool.parse_log(p)


def test_missing_peak_memory_and_error_line(tmp_path):
    p = make_log(tmp_path / "x.txt", 3.27, 100000)
    p.write_text(p.read_text().replace(T.peak_memory_line(40345, 52942) + "\n", ""))
    with pytest.raises(tool.RecordsError, match=r"x\.txt:\d+: truncated run: no 'peak memory"):
        tool.parse_log(p)
    q = make_log(tmp_path / "y.txt", 3.27, 100000, error_at_step=40)
    with pytest.raises(tool.RecordsError, match=r"y\.txt:\d+: run stopped with an error: non-finite loss"):
        tool.parse_log(q)


def test_log_without_separator(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text(T.step_line(1, 10, 1.0) + "\n")
    with pytest.raises(tool.RecordsError, match=r"x\.txt: no source separator"):
        tool.parse_log(p)


def test_cli_error_exit_code_without_traceback(tmp_path):
    make_log(tmp_path / "x.txt", 3.27, 100000, truncate_after_step=10)
    res = subprocess.run([sys.executable, str(REPO / "records" / "tool.py"), "stats", str(tmp_path), "--no-plot"],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "truncated run" in res.stderr and "Traceback" not in res.stderr


def test_help_works():
    res = subprocess.run([sys.executable, str(REPO / "records" / "tool.py"), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "stats" in res.stdout and "table" in res.stdout


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`tool.py diff | head`: the reader leaves early; the tool stops without a BrokenPipeError
    traceback (exit status 141, as for SIGPIPE), whether the pipe closed before or while it writes."""
    for name, letter in (("2025-01-01_A", "a"), ("2025-01-02_B", "b")):  # a diff of ~0.5 MB, beyond a pipe's buffer
        (tmp_path / "records" / name).mkdir(parents=True)
        (tmp_path / "records" / name / "train_gpt.py").write_text("".join(f"{letter} = {i}\n" for i in range(20000)))
    command = [sys.executable, str(REPO / "records" / "tool.py"), "--root", str(tmp_path), "diff"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the tool has written anything (it takes seconds to import torch)
    stderr = proc.stderr.read().decode()
    code = proc.wait()
    assert "Traceback" not in stderr and stderr == ""
    assert code == 141
    res = subprocess.run(f"{' '.join(map(shlex.quote, command))} | head -1", shell=True, capture_output=True, text=True)
    assert res.stdout == "--- records/2025-01-01_A/train_gpt.py\n"
    assert res.stderr == "" and res.returncode == 0  # head's status


def test_the_log_format_is_train_gpts():
    """The tool parses with train_gpt.py's patterns (no copies of its own); the step pattern reads
    each field of what step_line writes, a line with both losses included."""
    for name in ("LOG_SEPARATOR", "STEP_LINE_RE", "PEAK_MEMORY_RE", "FINAL_WINDOWS_RE", "DESCRIPTION_RE", "LOG_NUMBER"):
        assert getattr(tool, name) is getattr(T, name)
    # the legacy VAL_MASK pattern is the tool's own (train_gpt.py no longer writes those lines)
    m = tool.UNMASKED_VAL_RE.match(unmasked_val_line(1285, 1285, 3.6317))
    assert (m["step"], m["total"], m["val_loss"]) == ("1285", "1285", "3.6317")
    assert tool.UNMASKED_VAL_RE.match("unmasked step:5/9 val_loss:nan") and not tool.UNMASKED_VAL_RE.match(
        "unmasked step:5/9 val_loss:3.6 x")
    assert tool.UNMASKED_VAL_RE is not getattr(T, "UNMASKED_VAL_RE", None)
    for stale in ("SEP", "SEP_RE", "VAL_RE", "TRAIN_RE", "PEAK_RE", "DESC_RE", "NUM"):
        assert not hasattr(tool, stale)
    m = tool.STEP_LINE_RE.match(T.step_line(12, 20, 1234.4, val_loss=3.25, train_loss=3.5))
    assert (m["step"], m["total"], m["val_loss"], m["train_loss"], m["train_time"], m["step_avg"]) == (
        "12", "20", "3.2500", "3.5000", "1234", "102.87")


# ------------------------------------------------------------------ statistics

LOSSES = [3.2761, 3.2790, 3.2774, 3.2802, 3.2755]
TIMES = [181.2, 180.4, 182.9, 181.7, 180.8]
BASE_LOSSES = [3.2795, 3.2801, 3.2779, 3.2810]
BASE_TIMES = [190.3, 191.1, 189.7, 190.9]


def welch_by_hand(a, b):
    a, b = np.asarray(a), np.asarray(b)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return t, df, 2 * st.t.sf(abs(t), df), st.t.cdf(t, df)


def test_stats_one_sample_and_welch(tmp_path, capsys):
    new, base = tmp_path / "new", tmp_path / "base"
    make_logs(new, LOSSES, TIMES)
    make_logs(base, BASE_LOSSES, BASE_TIMES)
    s = tool.summarize(tool.load_runs(new), 3.28, tool.load_runs(base))
    x = np.array(LOSSES)
    t = (x.mean() - 3.28) / (x.std(ddof=1) / math.sqrt(len(x)))
    assert s["t"] == pytest.approx(t, rel=1e-9)
    assert s["p"] == pytest.approx(st.t.cdf(t, len(x) - 1), rel=1e-9)
    assert s["loss_std"] == pytest.approx(x.std(ddof=1), rel=1e-9)
    assert s["time_mean"] == pytest.approx(np.mean(TIMES), rel=1e-9)
    for key, a, b in (("time", TIMES, BASE_TIMES), ("loss", LOSSES, BASE_LOSSES)):
        t, df, p2, p1 = welch_by_hand(a, b)
        w = s["baseline"][key]
        assert w["t"] == pytest.approx(t, rel=1e-9) and w["df"] == pytest.approx(df, rel=1e-9)
        assert w["p_two_sided"] == pytest.approx(p2, rel=1e-9) and w["p_less"] == pytest.approx(p1, rel=1e-9)
        assert w["diff"] == pytest.approx(np.mean(a) - np.mean(b), rel=1e-9)

    assert run_tool("stats", new, "--target", 3.28, "--baseline", base) == 0
    out = capsys.readouterr().out
    assert "t = " in out and "Welch" in out
    md = (new / "statistics.md").read_text()
    assert "8x NVIDIA H100 80GB HBM3" in md and "rank-slice" in md and "FineWeb" in md
    assert "PyTorch 2.11.0+cu128 (CUDA 12.8)" in md and "Triton 3.6.0" in md
    assert "Welch" in md and "run0" in md and "3.2761" in md
    assert (new / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_report_the_loss_without_validation_masking(tmp_path, capsys):
    """VAL_MASK=1 logs (T4.5): the step lines' masked val loss scores the runs; the `unmasked` line after
    the final one is read, shown per run and summarized. Logs without it show neither."""
    make_logs(tmp_path / "masked", [3.2700, 3.2720], [60.0, 61.0], unmasked=0.0017, overrides="VAL_MASK=1")
    run = tool.parse_log(tmp_path / "masked" / "run0.txt")
    assert run.final_loss == 3.27 and run.unmasked_final_loss == 3.2717
    assert run_tool("stats", tmp_path / "masked", "--no-plot") == 0
    md = (tmp_path / "masked" / "statistics.md").read_text()
    assert "| final val loss | without the mask | train time (s) |" in md and "| 3.2700 | 3.2717 | 60.000 |" in md
    assert "- final val loss: mean 3.2710" in md
    assert "- final val loss without validation masking (the loss above is masked, VAL_MASK=1): mean 3.2727, " \
           "std 0.0014\n" in md
    make_logs(tmp_path / "plain", [3.27, 3.28], [60.0, 61.0])
    assert math.isnan(tool.parse_log(tmp_path / "plain" / "run0.txt").unmasked_final_loss)
    assert run_tool("stats", tmp_path / "plain", "--no-plot") == 0
    assert "without" not in (tmp_path / "plain" / "statistics.md").read_text()


def with_passes(path, *passes, files=3):
    """Add the loader's `data: starting pass N over M train files` lines (N in passes) to a log."""
    lines = "".join(f"data: starting pass {n} over {files} train files\n" for n in passes)
    path.write_text(path.read_text().replace("Resetting model\n", "Resetting model\n" + lines))
    return path


def test_stats_warns_about_runs_that_read_their_data_more_than_once(tmp_path, capsys):
    logs = make_logs(tmp_path, [3.27, 3.28, 3.275], [180.0, 181.0, 182.0])
    with_passes(logs[0], 2, 3)
    with_passes(logs[2], 2, files=6)
    assert tool.parse_log(logs[0]).data_passes == 3 and tool.parse_log(logs[1]).data_passes == 1
    assert run_tool("stats", tmp_path, "--no-plot") == 0
    out, md = capsys.readouterr().out, (tmp_path / "statistics.md").read_text()
    assert [ln for ln in out.splitlines() if "repeated data" in ln] == [
        f"warning: repeated data: {logs[0]} read its training data more than once (it started pass 3 over its 3 train files)",
        f"warning: repeated data: {logs[2]} read its training data more than once (it started pass 2 over its 6 train files)"]
    assert [ln for ln in md.splitlines() if "repeated data" in ln] == [
        "- Warning: repeated data: run0.txt read its training data more than once (it started pass 3 over its 3 train files)",
        "- Warning: repeated data: run2.txt read its training data more than once (it started pass 2 over its 6 train files)"]
    make_logs(tmp_path / "once", [3.27, 3.28], [180.0, 181.0])
    assert run_tool("stats", tmp_path / "once", "--no-plot") == 0
    assert "repeated data" not in capsys.readouterr().out + (tmp_path / "once" / "statistics.md").read_text()


def test_stats_name_the_time_at_the_loss_target(tmp_path, capsys):
    """Per run its train time and whether it reached the target; in the summary, the mean train time with
    how many runs reached the target when the mean val loss does, else that the mean misses it."""
    make_logs(tmp_path, [3.2750, 3.2800, 3.2860], [180.0, 181.0, 185.0])
    assert run_tool("stats", tmp_path, "--target", 3.28, "--no-plot") == 0
    out, md = capsys.readouterr().out, (tmp_path / "statistics.md").read_text()
    line = "- time at loss <= 3.28: not reached: mean val 3.2803 misses the target by 0.0003 (2 of 3 runs reached it; " \
           "mean train time 182.000 s)"
    assert line in out.splitlines() and line in md.splitlines()
    assert ["- run0.txt: train time 180.000 s, final val loss 3.2750 <= 3.28 (reached)",
            "- run1.txt: train time 181.000 s, final val loss 3.2800 <= 3.28 (reached)",
            "- run2.txt: train time 185.000 s, final val loss 3.2860 > 3.28 (missed)"] == out.splitlines()[1:4]
    assert "| final val loss | train time (s) | val loss <= 3.28 | steps |" in md
    assert "| run1 | [run1.txt](run1.txt) | 3.2800 | 181.000 | yes | 100 |" in md
    assert "| run2 | [run2.txt](run2.txt) | 3.2860 | 185.000 | no | 100 |" in md
    assert run_tool("stats", tmp_path, "--target", 3.2805, "--no-plot") == 0
    line = "- time at loss <= 3.2805: mean train time 182.000 s (2 of 3 runs reached it); mean val 3.2803"
    assert line in capsys.readouterr().out.splitlines() and line in (tmp_path / "statistics.md").read_text().splitlines()
    logs = make_logs(tmp_path / "logs", [3.2750, 3.2790], [180.0, 181.0])  # new writes it into the record's README
    assert run_tool("--root", tmp_path, "new", "Fast", *logs, "--date", "2025-02-03") == 0
    readme = (tmp_path / "records" / "2025-02-03_Fast" / "README.md").read_text()
    assert "- time at loss <= 3.28: mean train time 180.500 s (2 of 2 runs reached it); mean val 3.2770\n" in readme
    assert "| 3.2790 | 181.000 | yes | 100 |" in readme


def test_stats_single_run_says_needs_two(tmp_path, capsys):
    make_logs(tmp_path, [3.27], [180.0])
    assert run_tool("stats", tmp_path, "--no-plot") == 0
    assert "needs >= 2 runs" in capsys.readouterr().out
    assert "needs >= 2 runs" in (tmp_path / "statistics.md").read_text()
    assert not (tmp_path / "val_loss.png").exists()


def test_plot_legend_labels_runs_by_their_full_run_ids(tmp_path):
    """Issue #50: labels were cut to 8 characters, so the runs of one SEEDS= process
    (smoke_20a_s1, smoke_20a_s2) shared the label "smoke_20"."""
    import matplotlib.pyplot as plt
    for seed in (1, 2):
        make_log(tmp_path / f"smoke_20a_s{seed}.txt", 3.27 + 0.001 * seed, 180000, seed=seed)
    fig = tool.val_loss_figure(tool.load_runs(tmp_path), 3.28, "smoke")
    try:
        labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
        assert labels == ["smoke_20a_s1", "smoke_20a_s2", "target 3.28"]
        assert [line.get_label() for line in fig.axes[0].get_lines()][:2] == ["smoke_20a_s1", "smoke_20a_s2"]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("seeds,caution,shown", [((0, 0, 1), True, "0, 0, 1"), ((1, 2, 3), False, "1, 2, 3 (one per run)"),
                                                  ((None, 4), False, "?, 4")])
def test_stats_lists_seeds_and_cautions_when_runs_repeat_one(tmp_path, capsys, seeds, caution, shown):
    for i, seed in enumerate(seeds):
        make_log(tmp_path / f"run{i}.txt", 3.27 + 0.001 * i, 180000, seed=seed)
    assert run_tool("stats", tmp_path, "--no-plot") == 0
    out, md = capsys.readouterr().out, (tmp_path / "statistics.md").read_text()
    for text in (out, md):
        assert f"- seeds: {shown}" in text
        assert ("Caution: runs of one seed start from the same initialization" in text) == caution


def test_stats_keeps_the_target_baseline_and_plot_choice_of_the_existing_statistics(tmp_path, capsys):
    new = make_record(tmp_path, "2025-02-01_New", LOSSES, TIMES)
    base = make_record(tmp_path, "2025-01-01_Base", BASE_LOSSES, BASE_TIMES)
    assert run_tool("--root", tmp_path, "stats", new, "--target", 3.279, "--baseline", base, "--no-plot") == 0
    md = (new / "statistics.md").read_text()
    assert "--target 3.279 --baseline records/2025-01-01_Base --no-plot`" in md and "## Against baseline" in md
    assert "wrote " in capsys.readouterr().out
    assert run_tool("--root", tmp_path, "stats", new) == 0  # the README's form
    assert (new / "statistics.md").read_text() == md and not (new / "val_loss.png").exists()
    assert capsys.readouterr().out.endswith(f"{new / 'statistics.md'}: unchanged\n")
    assert run_tool("--root", tmp_path, "stats", new, "--target", 3.3) == 0  # a given option wins, and says so
    out, md = capsys.readouterr().out, (new / "statistics.md").read_text()
    assert f"note: {new / 'statistics.md'} was made with --target 3.279; now 3.3" in out
    # changed: the command, the t-test, the time at the target, the table's target column and run3's cell
    assert "(lines added or removed: 10; git diff shows them)" in out
    assert "--target 3.3 --baseline records/2025-01-01_Base --no-plot`" in md and "< 3.3: t = " in md


def test_stats_refuses_a_statistics_file_it_did_not_write(tmp_path, capsys):
    make_logs(tmp_path, LOSSES, TIMES)
    (tmp_path / "statistics.md").write_text("# Notes written by hand\n")
    assert run_tool("stats", tmp_path, "--no-plot") == 2
    assert "has no 'Generated ... by `python records/tool.py stats ...`' line" in capsys.readouterr().err
    assert (tmp_path / "statistics.md").read_text() == "# Notes written by hand\n"


def test_stats_of_the_committed_records_keep_their_targets_and_baselines(tmp_path, capsys):
    shutil.copytree(REPO / "records", tmp_path / "records")
    for md in sorted((tmp_path / "records").glob("*/statistics.md")):
        command = tool.GENERATED_RE.search(md.read_text()).group(1)
        assert run_tool("--root", tmp_path, "stats", md.parent, "--no-plot") == 0
        assert tool.GENERATED_RE.search(md.read_text()).group(1) == command + " --no-plot"
    capsys.readouterr()


@pytest.mark.parametrize("overrides, warned", [(("XSA=0 RANK_SLICE=1", "RANK_SLICE=1", "RANK_SLICE=1"), True),
                                              (("RANK_SLICE=1 SEED=1 RUN_ID=a", "LOG_DIR=/x RANK_SLICE=1 SEED=2"), False)])
def test_stats_warns_when_the_runs_have_different_overrides(tmp_path, capsys, overrides, warned):
    for i, line in enumerate(overrides):
        make_log(tmp_path / f"run{i}.txt", 3.27 + 0.001 * i, 180000, overrides=line)
    assert run_tool("stats", tmp_path, "--no-plot") == 0
    warning = "the runs have different overrides, so these statistics pool different configurations"
    err, md = capsys.readouterr().err, (tmp_path / "statistics.md").read_text()
    assert (warning in err) == (warning in md) == warned
    if warned:
        assert f"warning: {warning} (run0.txt: XSA=0; run1.txt: none; run2.txt: none)" in err


@pytest.mark.parametrize("attr,value", [("hardware", "1x NVIDIA H100 80GB HBM3"), ("mode", "full-batch"),
                                        ("data", "proxy (train data/proxy/p_*.bin; val data/proxy/v_*.bin, 1 tokens)")])
def test_stats_refuses_mixed_setup(tmp_path, capsys, attr, value):
    make_logs(tmp_path, [3.27, 3.28], [180.0, 181.0])
    make_log(tmp_path / "other.txt", 3.27, 180000, **{attr: value})
    assert run_tool("stats", tmp_path, "--no-plot") == 2
    assert f"logs disagree on {attr}" in capsys.readouterr().err


# ------------------------------------------------------------------ new

def test_new_creates_record(tmp_path, capsys):
    src = SOURCE + "# the real thing\r\nx = 1  \n\n\t# tabs, trailing spaces, CRLF are kept byte-exact\n"
    logs = make_logs(tmp_path / "logs", LOSSES, TIMES, source=src)
    make_record(tmp_path, "2025-01-01_Baseline", BASE_LOSSES, BASE_TIMES, source=SOURCE)
    assert run_tool("--root", tmp_path, "new", "FasterThing", *logs, "--date", "2025-02-03") == 0
    d = tmp_path / "records" / "2025-02-03_FasterThing"
    assert (d / "train_gpt.py").read_bytes() == src.encode()
    for p in logs:
        assert (d / p.name).read_bytes() == p.read_bytes()
    assert (d / "statistics.md").is_file() and (d / "val_loss.png").is_file()
    readme = (d / "README.md").read_text()
    assert readme.startswith("# FasterThing (2025-02-03)")
    assert "## Changes against the previous record" in readme and "2025-01-01_Baseline" in readme
    assert "TODO" in readme and "+4 −0 lines" in readme
    assert "torchrun --standalone --nproc_per_node=8 train_gpt.py" in readme
    assert "![val loss](val_loss.png)" in readme and "Triton: 3.6.0" in readme
    assert "Welch" in readme  # compared against the previous record (same hardware/mode/data), from another lease
    assert "2025-01-01_Baseline ran in another lease: its times compare with these only as far as" in readme
    # refuses an existing folder
    assert run_tool("--root", tmp_path, "new", "FasterThing", *logs, "--date", "2025-02-03") == 2
    assert "already exists" in capsys.readouterr().err


def test_new_with_a_same_lease_baseline(tmp_path, capsys):
    """new --baseline LOGS: the baseline arm's logs (another source, run beside the record) kept whole in baseline/,
    compared in statistics.md (reproducibly: stats names the folder) and the README, instead of the previous record."""
    logs = make_logs(tmp_path / "logs", LOSSES, TIMES, source=SOURCE_V2)
    make_record(tmp_path, "2025-01-01_Baseline", BASE_LOSSES, BASE_TIMES, source=SOURCE)
    base = [make_log(tmp_path / "lease" / f"base_s{i}.txt", loss, t * 1000)
            for i, (loss, t) in enumerate(zip(BASE_LOSSES, [200.1, 201.3, 199.8, 200.6]))]
    assert run_tool("--root", tmp_path, "new", "Beside", *logs, "--baseline", *base, "--date", "2025-02-03") == 0
    d = tmp_path / "records" / "2025-02-03_Beside"
    assert sorted(p.name for p in (d / "baseline").iterdir()) == [p.name for p in base]
    assert all((d / "baseline" / p.name).read_bytes() == p.read_bytes() for p in base)
    stats, readme = (d / "statistics.md").read_text(), (d / "README.md").read_text()
    assert "--baseline records/2025-02-03_Beside/baseline" in stats and "| 200.450 |" in stats
    assert "## Against baseline in the same lease ([baseline/](baseline/))" in readme and "| 200.450 |" in readme
    assert "another lease" not in readme and "Previous record: [2025-01-01_Baseline]" in readme
    assert "\n".join(tool.summary_lines(tool.summarize(tool.load_runs(d), 3.28))) in readme
    assert run_tool("--root", tmp_path, "stats", d, "--no-plot") == 0  # the folder's stats run again, baseline kept
    assert "--baseline records/2025-02-03_Beside/baseline" in (d / "statistics.md").read_text()
    capsys.readouterr()


@pytest.mark.parametrize("problem, message", [
    ("hardware", "ran on other hardware, mode or data than"), ("sources", "--baseline: logs come from different sources"),
    ("run_id", "has the run id of one of the record's logs"), ("suffix", "log files must be named *.txt")])
def test_new_refuses_a_baseline_that_cannot_stand_beside_the_record(tmp_path, capsys, problem, message):
    logs = make_logs(tmp_path / "logs", LOSSES[:3], TIMES[:3])
    base = [make_log(tmp_path / "lease" / f"base{i}.txt", 3.28, 190_000,
                     hardware="1x NVIDIA H200" if problem == "hardware" else "8x NVIDIA H100 80GB HBM3",
                     source=SOURCE_V2 if problem == "sources" and i else SOURCE,
                     run_id="run0" if problem == "run_id" and i else None) for i in range(2)]
    if problem == "suffix":
        base[1] = base[1].rename(base[1].with_suffix(".log"))
    assert run_tool("--root", tmp_path, "new", "Beside", *logs, "--baseline", *base, "--date", "2025-02-03") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "records" / "2025-02-03_Beside").exists()


def test_new_readme_reproduces_proxy_runs_at_the_repository_paths(tmp_path):
    """The Reproduce section of proxy runs made on a device: the proxy rebuilt, this folder's script
    copied in, the device's data paths mapped to data/proxy/ (the 3 shards the runs cycled over),
    the seeds listed, and the scope said."""
    data = "proxy (train /tmp/d/proxy_train_*.bin; val /tmp/d/proxy_val_*.bin, 3932160 tokens)"
    overrides = ("TRAIN_FILES='/tmp/d/proxy_train_*.bin' VAL_FILES='/tmp/d/proxy_val_*.bin' VAL_TOKENS=3932160 "
                 "TOKENIZER_DIR=/tmp/d/gpt2 RANK_SLICE=1 SEEDS=1,2 LOG_DIR=/tmp/q")
    logs = [make_log(tmp_path / "logs" / f"s{seed}.txt", loss, 70000, data=data, overrides=overrides, seed=seed,
                     world_size=1, hardware="1x NVIDIA H100 80GB HBM3") for seed, loss in ((2, 3.63), (1, 3.62))]
    for path in logs:  # the loader's line when the runs wrapped around their train files
        path.write_text(path.read_text().replace("Resetting model\n", "Resetting model\ndata: starting pass 2 over 3 train files\n"))
    assert run_tool("--root", tmp_path, "new", "Proxy", *logs, "--date", "2025-02-03") == 0
    readme = (tmp_path / "records" / "2025-02-03_Proxy" / "README.md").read_text()
    reproduce = readme[readme.index("## Reproduce"):]
    assert "python data/proxy_corpus.py\ncp records/2025-02-03_Proxy/train_gpt.py train_gpt.py\n" in reproduce
    settings = ("TRAIN_FILES='data/proxy/proxy_train_00000[1-3].bin' VAL_FILES='data/proxy/proxy_val_*.bin' "
                "VAL_TOKENS=3932160 RANK_SLICE=1 SEEDS=1,2")
    assert (f"{settings} WORLD_SIZE=1 python train_gpt.py --check &&\n"
            f"{settings} torchrun --standalone --nproc_per_node=1 train_gpt.py\n```") in reproduce
    assert "/tmp/" not in reproduce
    assert "**Not a FineWeb 8-GPU result**: every number above is proxy data, rank-slice, 1x NVIDIA H100" in reproduce


def test_new_names_a_run_stopped_early_by_stop_after(tmp_path, capsys):
    """A STOP_AFTER=N run is not truncated: it stopped where it was told to, and a record needs the whole
    schedule; stats says the same. An interrupted run is still a truncated one."""
    stopped = make_log(tmp_path / "logs" / "stop.txt", 3.6, 8_000, total=100, val_every=25, stop_after=40)
    assert run_tool("--root", tmp_path, "new", "Stopped", stopped, "--date", "2025-02-03") == 2
    err = capsys.readouterr().err
    assert err == (f"error: {stopped}: the run was stopped early by STOP_AFTER=40 after 40 of 100 steps; a record needs "
                   "the whole schedule (compare and stages read stopped runs)\n")
    assert "truncated" not in err and not (tmp_path / "records").exists()
    assert run_tool("stats", tmp_path / "logs", "--no-plot") == 2
    assert "stopped early by STOP_AFTER=40 after 40 of 100 steps" in capsys.readouterr().err
    cut = make_log(tmp_path / "cut" / "cut.txt", 3.6, 8_000, total=100, val_every=25, stop_after=40, truncate_after_step=30)
    with pytest.raises(tool.RecordsError, match=r"cut\.txt:\d+: truncated run: no final validation line \(last step 30/100\)"):
        tool.parse_log(cut)


def reproduce_block(readme):
    """The bash lines of a README's Reproduce section."""
    section = readme[readme.index("## Reproduce"):]
    return section[section.index("```bash\n") + len("```bash\n"):section.index("\n```", section.index("```bash"))]


@pytest.mark.parametrize("check_fails", [True, False])
def test_new_readme_reproduce_checks_the_machine_before_torchrun(tmp_path, check_fails):
    """The Reproduce block runs `train_gpt.py --check` with the runs' settings before torchrun: a machine
    that cannot run them stops there with the check's one line; else torchrun runs with the same settings.
    (python and torchrun are stand-ins on PATH that print their arguments and settings.)"""
    logs = [make_log(tmp_path / "logs" / f"s{seed}.txt", 3.27, 180000, seed=seed, world_size=8,
                     overrides=f"MUON_LR=0.03 RANK_SLICE=0 SEED={seed} RUN_ID=x") for seed in (1, 2)]
    assert run_tool("--root", tmp_path, "new", "Checked", *logs, "--date", "2025-02-03") == 0
    block = reproduce_block((tmp_path / "records" / "2025-02-03_Checked" / "README.md").read_text()).splitlines()
    assert block[-2:] == ["MUON_LR=0.03 RANK_SLICE=0 SEEDS=1,2 WORLD_SIZE=8 python train_gpt.py --check &&",
                          "MUON_LR=0.03 RANK_SLICE=0 SEEDS=1,2 torchrun --standalone --nproc_per_node=8 train_gpt.py"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fail = 'echo "error: no CUDA GPU visible"; exit 1' if check_fails else 'echo "settings and inputs ok"'
    for name, body in (("python", fail), ("torchrun", "true")):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $* MUON_LR=$MUON_LR SEEDS=$SEEDS WORLD_SIZE=$WORLD_SIZE"\n{body}\n')
        (bin_dir / name).chmod(0o755)
    res = subprocess.run(["bash", "-c", "\n".join(block[-2:])], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, check=False)
    check = "python train_gpt.py --check MUON_LR=0.03 SEEDS=1,2 WORLD_SIZE=8"
    if check_fails:
        assert (res.returncode, res.stdout) == (1, f"{check}\nerror: no CUDA GPU visible\n")
    else:
        assert res.returncode == 0 and res.stdout == (f"{check}\nsettings and inputs ok\ntorchrun --standalone "
                                                      "--nproc_per_node=8 train_gpt.py MUON_LR=0.03 SEEDS=1,2 WORLD_SIZE=\n")


def test_committed_records_reproduce_blocks_check_before_torchrun():
    """Each record's Reproduce block checks the machine before torchrun, with the torchrun line's settings:
    `train_gpt.py --check` where the record's script has it, and a GPU check where that one does not."""
    for readme in sorted((REPO / "records").glob("20*_*/README.md")):
        block = reproduce_block(readme.read_text()).splitlines()
        run = next(i for i, ln in enumerate(block) if " torchrun " in ln)
        settings = block[run][:block[run].index(" torchrun ")]
        checks = block[block.index(f"cp records/{readme.parent.name}/train_gpt.py train_gpt.py") + 1:run]
        assert checks and all(ln.endswith(" &&") for ln in checks), readme
        script = (readme.parent / "train_gpt.py").read_text()
        if '["--check"]' in script:
            assert checks[0] == f"{settings} WORLD_SIZE=1 python train_gpt.py --check &&", readme
        # a GPU check in its --check (V8-V9 check_gpus, since V10 check_device); none in V5-V7's, no --check in V1-V4
        if "check_gpus(hp, world_size)" not in script and "check_device(hp, world_size)" not in script:
            assert checks[-1].startswith('python -c "import sys, torch; torch.cuda.is_available() or sys.exit('), readme


def test_new_refuses_mixed_sources(tmp_path, capsys):
    a = make_log(tmp_path / "a.txt", 3.27, 180000, source=SOURCE)
    b = make_log(tmp_path / "b.txt", 3.27, 180000, source=SOURCE + "# changed\n")
    assert run_tool("--root", tmp_path, "new", "Mixed", a, b, "--date", "2025-02-03") == 2
    err = capsys.readouterr().err
    assert "different sources" in err and "a.txt" in err and "b.txt" in err
    assert not (tmp_path / "records" / "2025-02-03_Mixed").exists()


@pytest.mark.parametrize("name", ["lowerCase", "With_Underscore", "With-Dash", "With Space"])
def test_new_refuses_bad_name(tmp_path, capsys, name):
    a = make_log(tmp_path / "a.txt", 3.27, 180000)
    assert run_tool("--root", tmp_path, "new", name, a) == 2
    assert "CamelCase" in capsys.readouterr().err


# ------------------------------------------------------------------ diff

def test_diff_picks_predecessor_by_date(tmp_path, capsys):
    # Names sort opposite to dates: Zeta (oldest) < Alpha < Mid by date.
    make_record(tmp_path, "2025-01-05_Zeta", [3.28], [200], source="v = 1\n")
    make_record(tmp_path, "2025-02-10_Alpha", [3.28], [190], source="v = 2\n")
    make_record(tmp_path, "2025-03-01_Mid", [3.28], [180], source="v = 3\n")
    assert run_tool("--root", tmp_path, "diff") == 0
    out = capsys.readouterr().out
    assert "--- records/2025-02-10_Alpha/train_gpt.py" in out and "-v = 2\n+v = 3" in out
    assert run_tool("--root", tmp_path, "diff", "2025-02-10_Alpha") == 0
    out = capsys.readouterr().out
    assert "records/2025-01-05_Zeta/train_gpt.py" in out and "-v = 1\n+v = 2" in out
    assert run_tool("--root", tmp_path, "diff", tmp_path / "records" / "2025-01-05_Zeta") == 2
    assert "no previous record" in capsys.readouterr().err
    (tmp_path / "train_gpt.py").write_text("v = 4\n")
    assert run_tool("--root", tmp_path, "diff", "--working") == 0
    out = capsys.readouterr().out
    assert "--- records/2025-03-01_Mid/train_gpt.py" in out and "+++ train_gpt.py" in out and "+v = 4" in out
    assert run_tool("--root", tmp_path, "diff", "2025-01-05_Zeta", "--working") == 0
    assert "-v = 1\n+v = 4" in capsys.readouterr().out


def test_diff_same_date_ties_by_name(tmp_path, capsys):
    make_record(tmp_path, "2025-01-05_Beta", [3.28], [200], source="b\n")
    make_record(tmp_path, "2025-01-05_Alpha", [3.28], [200], source="a\n")
    assert run_tool("--root", tmp_path, "diff") == 0
    assert "-a\n+b" in capsys.readouterr().out


def test_a_record_made_later_on_a_day_follows_that_days_records_whatever_its_name(tmp_path, capsys):
    """Issue #50: records of one day were ordered by name, so a new record named before "V6" became
    V6's and V7's predecessor and `new` diffed it against V5. Records of one date are ordered by
    their record.json sequence, which `new` sets to one more than the day's largest."""
    make_record(tmp_path, "2025-01-04_V5", [3.28], [210], source="v = 5\n")
    make_record(tmp_path, "2025-01-05_V6", [3.28], [200], source="v = 6\n")
    make_record(tmp_path, "2025-01-05_V7", [3.28], [190], source="v = 7\n")
    for name, sequence in (("V6", 1), ("V7", 2)):
        (tmp_path / "records" / f"2025-01-05_{name}" / "record.json").write_text(json.dumps({"sequence": sequence}))
    logs = make_logs(tmp_path / "logs", [3.28], [180], source="v = 8\n")
    assert run_tool("--root", tmp_path, "new", "Alpha", *logs, "--date", "2025-01-05") == 0
    new = tmp_path / "records" / "2025-01-05_Alpha"
    readme = (new / "README.md").read_text()
    assert "Previous record: [2025-01-05_V7](../2025-01-05_V7/)." in readme and "+1 −1 lines" in readme
    assert "--baseline records/2025-01-05_V7" in (new / "statistics.md").read_text()
    assert json.loads((new / "record.json").read_text()) == {"sequence": 3}
    assert "record.json (sequence 3 of 2025-01-05)" in capsys.readouterr().out
    assert [p.name for p in tool.list_records(tmp_path / "records")] == [
        "2025-01-04_V5", "2025-01-05_V6", "2025-01-05_V7", "2025-01-05_Alpha"]
    assert tool.predecessor(tmp_path / "records", tool.record_key(tmp_path / "records" / "2025-01-05_V7")).name == "2025-01-05_V6"
    assert run_tool("--root", tmp_path, "diff") == 0  # the latest record: Alpha, against V7
    out = capsys.readouterr().out
    assert out.startswith("--- records/2025-01-05_V7/train_gpt.py\n+++ records/2025-01-05_Alpha/train_gpt.py\n")
    assert "-v = 7\n+v = 8" in out
    assert run_tool("--root", tmp_path, "diff", "2025-01-05_V7") == 0
    assert "-v = 6\n+v = 7" in capsys.readouterr().out
    (tmp_path / "README.md").write_text(README)
    assert run_tool("--root", tmp_path, "table", "--write") == 0
    text = (tmp_path / "README.md").read_text()
    assert text.index("[V5]") < text.index("[V6]") < text.index("[V7]") < text.index("[Alpha]")


def test_records_without_record_json_keep_name_order_before_numbered_ones(tmp_path, capsys):
    """Folders made before record.json have sequence 0: by name among themselves, before the day's
    numbered records; a new record after them gets sequence 1. A broken record.json is named."""
    make_record(tmp_path, "2025-01-05_Beta", [3.28], [200], source="b\n")
    make_record(tmp_path, "2025-01-05_Alpha", [3.28], [200], source="a\n")
    assert tool.next_sequence(tmp_path / "records", "2025-01-05") == 1
    assert tool.next_sequence(tmp_path / "records", "2025-01-06") == 1
    logs = make_logs(tmp_path / "logs", [3.28], [180], source="c\n")
    assert run_tool("--root", tmp_path, "new", "Aardvark", *logs, "--date", "2025-01-05") == 0
    assert [p.name for p in tool.list_records(tmp_path / "records")] == [
        "2025-01-05_Alpha", "2025-01-05_Beta", "2025-01-05_Aardvark"]
    assert tool.next_sequence(tmp_path / "records", "2025-01-05") == 2
    capsys.readouterr()
    for bad in ('{"sequence": 0}', '{"sequence": "2"}', '{"order": 2}', "[2]", "not json"):
        (tmp_path / "records" / "2025-01-05_Beta" / "record.json").write_text(bad)
        assert run_tool("--root", tmp_path, "diff") == 2
        assert capsys.readouterr().err == (f"error: {tmp_path / 'records' / '2025-01-05_Beta' / 'record.json'}: expected "
                                           '{"sequence": N} with a whole number N >= 1 (the record\'s place among the '
                                           "records of its date)\n")


def test_committed_records_are_in_version_order():
    """V1-V7 carry record.json sequences (V2-V4 share a date, as do V6-V7) that keep their order."""
    folders = tool.list_records(REPO / "records")
    numbered = [(int(m.group(1)), p) for p in folders if (m := re.match(r"^\d{4}-\d{2}-\d{2}_V(\d+)[A-Z]", p.name))]
    assert len(numbered) >= 7 and [v for v, _ in numbered] == sorted(v for v, _ in numbered)
    assert all(tool.record_sequence(p) >= 1 for _, p in numbered)


# ------------------------------------------------------------------ table

README = "# speedrun\n\nintro\n\n<!-- records-table:start -->\n<!-- records-table:end -->\n\nmore text\n"


def test_table_write_and_check(tmp_path, capsys):
    make_record(tmp_path, "2025-01-05_First", [3.2790, 3.2770], [200.0, 202.0])
    make_record(tmp_path, "2025-02-10_Second", [3.2760], [150.0], hardware="1x NVIDIA H100 80GB HBM3")
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert run_tool("--root", tmp_path, "table", "--check") == 1
    capsys.readouterr()
    assert run_tool("--root", tmp_path, "table", "--write") == 0
    text = readme.read_text()
    assert text.startswith("# speedrun\n\nintro\n\n<!-- records-table:start -->\n| date |")
    assert text.endswith("<!-- records-table:end -->\n\nmore text\n")
    assert "| 2025-01-05 | [First](records/2025-01-05_First) | 201.0 ± 1.4 | 3.2780 | 2 | 8x NVIDIA H100 80GB HBM3 | rank-slice | FineWeb |" in text
    assert "| 2025-02-10 | [Second](records/2025-02-10_Second) | 150.0 | 3.2760 | 1 | 1x NVIDIA H100 80GB HBM3 |" in text
    assert text.index("First") < text.index("Second")
    assert run_tool("--root", tmp_path, "table", "--check") == 0
    readme.write_text(text.replace("3.2780", "3.2700"))
    assert run_tool("--root", tmp_path, "table", "--check") == 1
    changed = [ln for ln in capsys.readouterr().out.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert [ln[:13] for ln in changed] == ["-| 2025-01-05", "+| 2025-01-05"]  # the last, unchanged row is not marked


def test_table_without_markers(tmp_path, capsys):
    (tmp_path / "README.md").write_text("# no markers\n")
    assert run_tool("--root", tmp_path, "table", "--write") == 2
    assert "records-table:start" in capsys.readouterr().err


def test_repo_readme_table_in_sync(capsys):
    readme = REPO / "README.md"
    if not readme.is_file() or tool.TABLE_START not in readme.read_text(encoding="utf-8"):
        pytest.skip("repo README.md has no records-table markers yet")
    assert run_tool("--root", REPO, "table", "--check") == 0, capsys.readouterr().out


# ------------------------------------------------------------------ ablation

def test_ablation_groups_runs_by_their_own_overrides(tmp_path, capsys):
    shared = "RANK_SLICE=1 TRAIN_FILES='/data/p_*.bin' LOG_DIR=/out"
    logs = [make_log(tmp_path / "a.txt", 3.60, 80_000, overrides=f"{shared} SEED=1"),
            make_log(tmp_path / "b.txt", 3.62, 82_000, overrides=shared),
            make_log(tmp_path / "x.txt", 3.65, 81_000, overrides=f"{shared} XSA=0"),
            make_log(tmp_path / "y.txt", 3.70, 84_000, overrides=f"XSA=0 {shared} MUDD_GATES=0")]
    assert run_tool("ablation", *logs) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| defaults | 2 | 3.6100 | +0.0000 |  | 81.00 | +0.0% |"  # seeds are repeats
    assert lines[3] == "| MUDD_GATES=0 XSA=0 | 1 | 3.7000 | +0.0900 | n/a | 84.00 | +3.7% |"  # worst first
    assert lines[4] == "| XSA=0 | 1 | 3.6500 | +0.0400 | n/a | 81.00 | +0.0% |"
    assert lines[6] == "| overrides | step 0 | step 25 | step 50 | step 75 | step 100 |"
    assert lines[8] == "| defaults | 8.6100 | 7.3600 | 6.1100 | 4.8600 | 3.6100 |"


def staged_ms(per_step):
    """Cumulative train time of a 100-step run scheduled as 90 steps in thirds plus a 10-step
    extension, each stage taking per_step[k] ms per step."""
    starts = [0, 30, 60, 90, 100]
    return lambda n: sum(per_step[k] * max(0, min(n, starts[k + 1]) - starts[k]) for k in range(4))


def test_stage_times_come_from_the_logged_schedule(tmp_path, capsys):
    """ms/step per stage: boundaries from the logged stage fractions (round(n·Σ fractions), then
    the extension), times from the step lines at them; in statistics.md and the ablation table."""
    schedule = (90, [1 / 3, 1 / 3, 1 / 3])
    run = tool.parse_log(make_log(tmp_path / "one.txt", 3.6, 0, schedule=schedule, step_ms=staged_ms([10, 20, 30, 40])))
    assert tool.stage_bounds(run) == [("stage 1", 0, 30), ("stage 2", 30, 60), ("stage 3", 60, 90), ("extension", 90, 100)]
    assert tool.stage_ms_per_step(run) == pytest.approx({"stage 1": 10, "stage 2": 20, "stage 3": 30, "extension": 40})
    assert tool.stage_bounds(tool.parse_log(make_log(tmp_path / "old.txt", 3.6, 1000))) == []  # no stage table logged
    # before the stage table (V1-V4's logs): per-stage columns, three equal stages; round(1270/3) = 423
    v4 = make_log(tmp_path / "v4.txt", 3.6, 0, total=1285, schedule=(1270, [1 / 3] * 3))
    text = v4.read_text().replace('"stages": [{"fraction": 0.3333333333333333}, {"fraction": 0.3333333333333333}, '
                                  '{"fraction": 0.3333333333333333}, {"fraction": null}]',
                                  '"stage_batch_tokens": [131072, 262144, 393216, 393216]')
    assert "stage_batch_tokens" in text and '"stages"' not in text
    v4.write_text(text)
    assert tool.stage_bounds(tool.parse_log(v4)) == [("stage 1", 0, 423), ("stage 2", 423, 847),
                                                     ("stage 3", 847, 1270), ("extension", 1270, 1285)]
    # TAPER_FRACTION's row (T5.5) is logged with "taper": true and labelled taper
    taper = make_log(tmp_path / "taper.txt", 3.6, 0, schedule=(90, [1 / 3, 1 / 3, 2 / 9, 1 / 9]))
    taper.write_text(taper.read_text().replace('{"fraction": 0.1111111111111111}',
                                               '{"fraction": 0.1111111111111111, "taper": true}'))
    assert tool.stage_bounds(tool.parse_log(taper))[2:] == [("stage 3", 60, 80), ("taper", 80, 90), ("extension", 90, 100)]
    new = [make_log(tmp_path / "new" / f"n{i}.txt", 3.6, 0, schedule=schedule, overrides=f"SEED={i} FAST=1",
                    step_ms=staged_ms([10, 20 + i, 30, 40])) for i in (1, 3)]
    base = [make_log(tmp_path / "base" / f"b{i}.txt", 3.6, 0, schedule=schedule, overrides=f"SEED={i}",
                     step_ms=staged_ms([10, 25, 35, 45])) for i in (1, 3)]
    assert run_tool("stats", tmp_path / "new", "--baseline", tmp_path / "base", "--no-plot") == 0
    md = (tmp_path / "new" / "statistics.md").read_text()
    assert "| ms/step | stage 1 | stage 2 | stage 3 | extension |" in md
    assert "| new | 10.00 | 22.00 | 30.00 | 40.00 |" in md and "| base | 10.00 | 25.00 | 35.00 | 45.00 |" in md
    assert run_tool("ablation", *new, *base) == 0
    out = capsys.readouterr().out
    assert "| defaults | 10.00 | 25.00 | 35.00 | 45.00 |" in out and "| FAST=1 | 10.00 | 22.00 | 30.00 | 40.00 |" in out


def test_stages_reads_the_logged_stage_table_of_complete_stopped_and_interrupted_runs(tmp_path, capsys):
    """`stages` (which replaced bench/stage_times.py and its three equal stages): boundaries from a
    stage table of unequal fractions (0.5, 0.3, 0.2 of 100 scheduled steps, then a 10-step
    extension), ms/step from the step lines at them; a stopped run up to its last step."""
    per_step, starts = [10, 20, 30, 40], [0, 50, 80, 100, 110]
    ms = lambda n: sum(per_step[k] * max(0, min(n, starts[k + 1]) - starts[k]) for k in range(4))  # noqa: E731
    kw = dict(total=110, val_every=25, schedule=(100, [0.5, 0.3, 0.2]), step_ms=ms)
    full = make_log(tmp_path / "full.txt", 3.6, 0, **kw)
    stopped = make_log(tmp_path / "stop.txt", 3.6, 0, stop_after=90, **kw)
    cut = make_log(tmp_path / "cut.txt", 3.6, 0, truncate_after_step=65, **kw)
    assert tool.stage_bounds(tool.parse_log(full)) == [("stage 1", 0, 50), ("stage 2", 50, 80), ("stage 3", 80, 100),
                                                       ("extension", 100, 110)]
    assert run_tool("stages", full, stopped, cut) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{full} (run_id full)",
        "  stage 1 (steps 0-49): 10.00 ms/step",
        "  stage 2 (steps 50-79): 20.00 ms/step",
        "  stage 3 (steps 80-99): 30.00 ms/step",
        "  extension (steps 100-109): 40.00 ms/step",
        "  total train_time 2.100 s (110 steps)",
        f"{stopped} (run_id stop)",
        "  stage 1 (steps 0-49): 10.00 ms/step",
        "  stage 2 (steps 50-79): 20.00 ms/step",
        "  stage 3 (steps 80-89 of 80-99, stopped at step 90): 30.00 ms/step",
        "  extension (steps 100-109): not reached",
        "  train_time 1.400 s at step 90 of 110 (stopped early with STOP_AFTER=90)",
        f"{cut} (run_id cut)",
        "  stage 1 (steps 0-49): 10.00 ms/step",
        "  stage 2 (steps 50-64 of 50-79, stopped at step 65): 20.00 ms/step",
        "  stage 3 (steps 80-99): not reached",
        "  extension (steps 100-109): not reached",
        "  train_time 0.800 s at step 65 of 110 (interrupted)"]
    old = make_log(tmp_path / "old.txt", 3.6, 1000)  # no stage table logged
    assert run_tool("stages", old) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  no stage table in the logged hyperparameters (num_scheduled_iterations and stages)",
        "  total train_time 1.000 s (100 steps)"]
    assert not (REPO / "bench" / "stage_times.py").exists()


def test_ablation_names_a_run_that_stopped_with_an_error_in_one_line(tmp_path):
    d = make_log(tmp_path / "d.txt", 3.60, 80_000, overrides="")
    x = make_log(tmp_path / "x.txt", 3.65, 81_000, overrides="XSA=0", error_at_step=40)
    res = subprocess.run([sys.executable, str(REPO / "records" / "tool.py"), "ablation", str(d), str(x)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.count("error") == 2  # the prefix, and "with an error"
    assert res.stderr.startswith("error: ") and "run stopped with an error: non-finite loss nan at step 40" in res.stderr


def test_ablation_needs_defaults_and_one_source(tmp_path, capsys):
    x = make_log(tmp_path / "x.txt", 3.65, 81_000, overrides="XSA=0")
    y = make_log(tmp_path / "y.txt", 3.70, 84_000, overrides="MUDD_GATES=0")
    assert run_tool("ablation", x, y) == 2
    assert "no run with only the shared overrides" in capsys.readouterr().err
    d = make_log(tmp_path / "d.txt", 3.60, 80_000, overrides="", source=SOURCE + "# changed\n")
    assert run_tool("ablation", d, x) == 2
    assert "ran different train_gpt.py sources" in capsys.readouterr().err


def test_ablation_compares_against_a_named_baseline(tmp_path, capsys):
    """Two arms that both override a switch (e.g. two attention backends) need no defaults run."""
    logs = [make_log(tmp_path / "v1.txt", 3.62, 80_000, overrides="ATTENTION_BACKEND=varlen SEED=1"),
            make_log(tmp_path / "v2.txt", 3.64, 82_000, overrides="SEED=2 ATTENTION_BACKEND=varlen"),
            make_log(tmp_path / "f1.txt", 3.62, 76_000, overrides="ATTENTION_BACKEND=fa4 SEED=1")]
    assert run_tool("ablation", *logs) == 2
    assert "ATTENTION_BACKEND=fa4, ATTENTION_BACKEND=varlen" in capsys.readouterr().err
    assert run_tool("ablation", "--baseline", "ATTENTION_BACKEND=varlen", *logs) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("| overrides | runs | final val loss | vs ATTENTION_BACKEND=varlen "
                        "| paired by seed (seeds, p two-sided) | train time (s) | vs ATTENTION_BACKEND=varlen |")
    assert lines[2] == "| ATTENTION_BACKEND=varlen | 2 | 3.6300 | +0.0000 |  | 81.00 | +0.0% |"
    assert lines[3] == "| ATTENTION_BACKEND=fa4 | 1 | 3.6200 | -0.0100 | n/a | 76.00 | -6.2% |"
    assert run_tool("ablation", "--baseline", "XSA=0", *logs) == 2
    assert "no run has exactly the overrides 'XSA=0'" in capsys.readouterr().err


PAIRED_BASE = {1: 3.6318, 2: 3.6354, 3: 3.6350, 4: 3.6330}
PAIRED_NEW = {1: 3.6285, 2: 3.6312, 3: 3.6299, 5: 3.6200}  # seeds 4 and 5 ran on one side only


def paired_logs(folder, losses, overrides=""):
    return [make_log(Path(folder) / f"{Path(folder).name}_s{seed}.txt", loss, 80_000, seed=seed,
                     overrides=f"{overrides} SEED={seed}".strip()) for seed, loss in losses.items()]


def test_paired_by_seed_pairs_the_seeds_both_sides_ran_once(tmp_path, capsys):
    """The paired t-test over seeds 1-3 (the seeds on both sides), by hand: mean difference over
    its standard error; Welch's test over all runs stays beside it."""
    new, base = paired_logs(tmp_path / "new", PAIRED_NEW, "COOLDOWN_FRAC=0.55"), paired_logs(tmp_path / "base", PAIRED_BASE)
    d = np.array([PAIRED_NEW[s] - PAIRED_BASE[s] for s in (1, 2, 3)])
    t = d.mean() / (d.std(ddof=1) / math.sqrt(3))
    p = tool.paired_by_seed(tool.load_runs(tmp_path / "new"), tool.load_runs(tmp_path / "base"))
    assert p["seeds"] == [1, 2, 3] and p["diffs"] == pytest.approx(d.tolist(), abs=1e-12)
    assert p["t"] == pytest.approx(t, rel=1e-9) and p["df"] == 2
    assert p["p_less"] == pytest.approx(st.t.cdf(t, 2), rel=1e-9)
    assert p["p_two_sided"] == pytest.approx(2 * st.t.cdf(-abs(t), 2), rel=1e-9)
    assert 0.005 < p["p_less"] < 0.01  # unpaired, the same runs are far from it (Welch below)
    assert run_tool("stats", tmp_path / "new", "--baseline", tmp_path / "base", "--no-plot") == 0
    md = (tmp_path / "new" / "statistics.md").read_text()
    assert "Welch" in md and (f"Paired by seed (final val loss, new − baseline, seeds 1, 2, 3): -0.0033 / -0.0042 / "
                              f"-0.0051, mean -0.0042; paired t = {t:.4f}, df = 2") in md
    assert run_tool("ablation", *new, *base) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| COOLDOWN_FRAC=0.55 |"))
    assert f"| -0.0042 (3, p {tool.fmt_p(p['p_two_sided'])}) |" in row


@pytest.mark.parametrize("new_seeds,base_seeds", [((1, 2), (3, 4)), ((1, 1, 2), (1, 2)), ((1, 2), (None, None))])
def test_paired_by_seed_needs_two_seeds_each_side_ran_once(tmp_path, new_seeds, base_seeds):
    for side, seeds in (("new", new_seeds), ("base", base_seeds)):
        for i, seed in enumerate(seeds):
            make_log(tmp_path / side / f"r{i}.txt", 3.63 + 0.001 * i, 80_000, seed=seed)
    assert tool.paired_by_seed(tool.load_runs(tmp_path / "new"), tool.load_runs(tmp_path / "base")) is None
    assert run_tool("stats", tmp_path / "new", "--baseline", tmp_path / "base", "--no-plot") == 0
    assert "Paired by seed: needs >= 2 seeds that each side ran once" in (tmp_path / "new" / "statistics.md").read_text()


def with_final_windows(path, losses):
    """Append bench/eval_windows.py's lines (setting label -> loss) after the run's peak-memory line."""
    path = Path(path)
    path.write_text(path.read_text() + "".join(T.final_windows_line(k, v) + "\n" for k, v in losses.items()))
    return path


def test_final_windows_lines_can_stand_in_for_the_final_validation(tmp_path, capsys):
    """stats and ablation score runs by an eval_windows setting when asked, both sides alike; stats
    keeps the choice on regeneration; a log without that setting is named in one line."""
    own, wide = "short:6 long:20 yarn:0", "short:6 long:32 yarn:0"
    for side, offset in (("base", 0.0), ("new", -0.002)):
        for seed in (1, 2, 3):
            log = make_log(tmp_path / side / f"{side}_s{seed}.txt", 3.63 + offset + 0.001 * seed, 80_000, seed=seed,
                           overrides=f"SEED={seed}" + (" MUON_LR=0.026" if side == "new" else ""))
            jitter = 0.0005 * (seed == 2 and side == "new")
            with_final_windows(log, {own: 3.63 + offset + 0.001 * seed, wide: 3.62 + 2 * offset + 0.001 * seed + jitter})
    run = tool.parse_log(tmp_path / "new" / "new_s1.txt")
    assert run.final_windows == {own: pytest.approx(3.629), wide: pytest.approx(3.617)} and run.final_loss == 3.629
    assert run_tool("stats", tmp_path / "new", "--baseline", tmp_path / "base", "--no-plot", "--final-windows", wide) == 0
    md = (tmp_path / "new" / "statistics.md").read_text()
    assert f"--final-windows '{wide}'`" in md and f"each log's `final_windows {wide}` line" in md
    assert "| new_s1 | [new_s1.txt](new_s1.txt) | 3.6170 |" in md
    assert "-0.0040 / -0.0035 / -0.0040, mean -0.0038;" in md  # paired by seed under the wide setting
    capsys.readouterr()
    assert run_tool("stats", tmp_path / "new", "--baseline", tmp_path / "base") == 0  # regenerated: setting kept
    assert (tmp_path / "new" / "statistics.md").read_text() == md
    assert run_tool("ablation", "--final-windows", wide, *sorted((tmp_path / "new").glob("*.txt")),
                    *sorted((tmp_path / "base").glob("*.txt"))) == 0
    assert "| MUON_LR=0.026 | 3 | 3.6182 | -0.0038 | -0.0038 (3, p 0.0019) |" in capsys.readouterr().out
    assert run_tool("ablation", "--final-windows", "short:8 long:32 yarn:0", tmp_path / "base" / "base_s1.txt") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "base_s1.txt: no 'final_windows short:8 long:32 yarn:0 val_loss:...' line" in err
    assert f"'{own}', '{wide}'" in err


# ------------------------------------------------------------------ compare

def equivalence_logs(tmp_path, **offsets):
    """name -> log of a 1-GPU-style base (train loss 10 - step) and runs whose train loss is off by
    offsets[name] = (step, amount); val every 4 of 8 steps."""
    kw = dict(total=8, val_every=4, mode="full-batch")
    logs = {"one": make_log(tmp_path / "one.txt", 3.6, 8_000, world_size=1, grad_accum=8,
                            train_loss=lambda s: 10.0 - s, **kw)}
    for name, (step, amount) in offsets.items():
        logs[name] = make_log(tmp_path / f"{name}.txt", 3.6, 4_000, world_size=1, grad_accum=8,
                              train_loss=lambda s, step=step, amount=amount: 10.0 - s + (amount if s == step else 0.0),
                              **kw)
    return logs


def test_compare_reports_largest_differences_and_fails_past_the_tolerance(tmp_path, capsys):
    kw = dict(total=8, val_every=4, mode="full-batch")
    base = make_log(tmp_path / "one.txt", 3.6, 8_000, world_size=1, grad_accum=8, train_loss=lambda s: 10.0 - s, **kw)
    close = make_log(tmp_path / "two.txt", 3.603, 4_000, world_size=2, grad_accum=4,
                     train_loss=lambda s: 10.0 - s + (0.002 if s == 2 else 0.0), **kw)
    far = make_log(tmp_path / "four.txt", 3.6, 2_000, world_size=4, grad_accum=2,
                   train_loss=lambda s: 10.0 - s + (0.2 if s == 3 else 0.0), **kw)
    assert run_tool("compare", base, close) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == f"| {base} (base) | full-batch, world 1, accumulation 8 | 8 | 1000.00 | | |"
    assert out[3] == f"| {close} | full-batch, world 2, accumulation 4 | 8 | 500.00 | 0.0020 (2) | 0.0030 (0) |"
    assert out[5] == "Over the steps every log has (8 train loss steps, 3 val loss steps):"
    assert out[6] == f"{close}: train loss within tolerance 0.005 (0.0020); val loss within tolerance 0.005 (0.0030)"
    assert out[-1] == "all within tolerance"
    assert run_tool("compare", base, close, far) == 1
    out = capsys.readouterr().out
    assert f"{far}: train loss beyond tolerance 0.005 by 0.1950 (0.2000); val loss within" in out
    assert out.endswith("a difference lies beyond tolerance (exit code 1)\n")
    assert run_tool("compare", base, close, far, "--tolerance", "0.25") == 0


def test_compare_judges_against_the_noise_of_repeated_runs(tmp_path, capsys):
    logs = equivalence_logs(tmp_path, repeat=(5, 0.03), inside=(6, -0.025), outside=(6, 0.05))
    noise = ("--noise", logs["one"], logs["repeat"])
    assert run_tool("compare", logs["one"], logs["inside"], *noise) == 0
    out = capsys.readouterr().out
    assert f"| noise: {logs['one']} vs {logs['repeat']} | full-batch, world 1, accumulation 8 | 8 | 1000.00 | 0.0300 (5) | 0.0000 (0) |" in out
    assert f"{logs['inside']}: train loss within noise (0.0250 <= 0.0300); val loss within noise (0.0000 <= 0.0000)" in out
    assert out.endswith("all within noise\n")
    assert run_tool("compare", logs["one"], logs["outside"], *noise) == 1
    out = capsys.readouterr().out
    assert "train loss beyond noise by 0.0200 (0.0500 vs 0.0300)" in out and "beyond noise (exit code 1)" in out
    assert run_tool("compare", logs["one"], logs["outside"], *noise, "--tolerance", "0.06") == 0
    assert "train loss beyond noise by 0.0200 but within tolerance 0.06 (0.0500)" in capsys.readouterr().out
    # more pairs: the largest floor counts
    assert run_tool("compare", logs["one"], logs["outside"], *noise, "--noise", logs["one"], logs["outside"]) == 0


def test_compare_judges_each_run_against_every_repeat_by_the_median(tmp_path, capsys):
    """--repeats: the noise is every pair of repeats; a candidate passes when its median difference
    to the repeats is within it, even when the one repeat it is far from would fail it as a base."""
    logs = equivalence_logs(tmp_path, second=(5, 0.03), third=(5, 0.028), near=(5, 0.04), far=(6, 0.05))
    repeats = ("--repeats", logs["one"], logs["second"], logs["third"])
    assert run_tool("compare", logs["one"], logs["near"], "--noise", logs["one"], logs["second"]) == 1
    capsys.readouterr()
    assert run_tool("compare", logs["near"], logs["far"], *repeats) == 1
    out = capsys.readouterr().out
    assert f"| noise: {logs['second']} vs {logs['third']} | full-batch, world 1, accumulation 8 | 8 | 500.00 | 0.0020 (5) |" in out
    assert f"| {logs['near']} vs {logs['one']} | full-batch, world 1, accumulation 8 | 8 | 500.00 | 0.0400 (5) |" in out
    assert f"{logs['near']} (median over 3 repeats): train loss within noise (0.0120 <= 0.0300)" in out
    assert f"{logs['far']} (median over 3 repeats): train loss beyond noise by 0.0200 (0.0500 vs 0.0300)" in out
    assert out.endswith("a difference lies beyond noise (exit code 1)\n")
    assert run_tool("compare", logs["near"], *repeats) == 0
    assert capsys.readouterr().out.endswith("all within noise\n")
    assert run_tool("compare", logs["near"], *repeats, "--noise", logs["one"], logs["second"]) == 2
    assert "give --repeats or --noise, not both" in capsys.readouterr().err
    assert run_tool("compare", logs["near"], "--repeats", logs["one"]) == 2
    assert "--repeats needs at least two runs" in capsys.readouterr().err


def test_compare_takes_repeats_of_different_seeds_as_a_seed_noise_floor(tmp_path, capsys):
    """--repeats of one configuration with different seeds (a seed-noise floor) are accepted; repeats of
    two configurations are refused in one line that names --repeats and what differs."""
    kw = dict(total=8, val_every=4, mode="full-batch", world_size=1, grad_accum=8)
    repeats = [make_log(tmp_path / f"seed{seed}.txt", 3.6, 8_000, seed=seed, overrides=f"SEED={seed}",
                        train_loss=lambda s, seed=seed: 10.0 - s + 0.01 * seed * (s == 3), **kw) for seed in (1, 2, 3)]
    candidate = make_log(tmp_path / "two.txt", 3.6, 4_000, seed=4, train_loss=lambda s: 10.0 - s + 0.015 * (s == 3), **kw)
    assert run_tool("compare", candidate, "--repeats", *repeats) == 0
    out = capsys.readouterr().out
    assert f"| noise: {repeats[0]} vs {repeats[2]} | full-batch, world 1, accumulation 8 | 8 | 1000.00 | 0.0200 (3) |" in out
    assert f"{candidate} (median over 3 repeats): train loss within noise (0.0050 <= 0.0200)" in out
    assert out.endswith("all within noise\n")
    other = make_log(tmp_path / "capped.txt", 3.6, 8_000, seed=5, gpu_memory_gib=70.0, train_loss=lambda s: 10.0 - s, **kw)
    assert run_tool("compare", candidate, "--repeats", *repeats, other) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: --repeats logs {repeats[0]} and {other} differ in gpu_memory_gib: the repeats "
                                 "must be runs of one configuration (they may differ only in seed, seeds, run_id and "
                                 "log_dir)\n")
    assert run_tool("compare", repeats[0], candidate, "--noise", repeats[0], repeats[1]) == 2  # --noise: one seed
    assert "--noise logs" in capsys.readouterr().err


def test_compare_refuses_a_noise_pair_of_two_configurations(tmp_path, capsys):
    logs = equivalence_logs(tmp_path, candidate=(2, 0.001))
    other_seed = make_log(tmp_path / "seed1.txt", 3.6, 8_000, total=8, val_every=4, mode="full-batch", world_size=1,
                          grad_accum=8, train_loss=lambda s: 10.0 - s, seed=1)
    assert run_tool("compare", logs["one"], logs["candidate"], "--noise", logs["one"], other_seed) == 2
    assert "differ in seed: the noise floor needs two runs of one configuration" in capsys.readouterr().err


def test_compare_accepts_stopped_runs_and_names_missing_train_loss(tmp_path, capsys):
    base = make_log(tmp_path / "one.txt", 3.6, 8_000, total=8, val_every=4, train_loss=lambda s: 10.0 - s)
    stopped = make_log(tmp_path / "stop.txt", 3.6, 8_000, total=8, val_every=4, train_loss=lambda s: 10.0 - s,
                       stop_after=4)
    assert run_tool("compare", base, stopped) == 0
    out = capsys.readouterr().out
    assert "| 4 | 1000.00 | 0.0000 (1) | 0.0000 (0) |" in out and "(4 train loss steps, 2 val loss steps)" in out
    plain = make_log(tmp_path / "plain.txt", 3.6, 8_000, total=8, val_every=4)
    assert run_tool("compare", base, plain) == 2
    assert "no train_loss in its step lines; rerun with TRAIN_LOSS_EVERY=1" in capsys.readouterr().err
    assert run_tool("compare", base, plain, "--only", "val") == 0


def test_compare_refuses_an_interrupted_run_in_one_line_naming_its_last_step(tmp_path, capsys):
    """Issue #50: a run interrupted at 7 of 22 steps (no final validation, no STOP_AFTER) is no
    equivalence evidence; compare accepted it (exit 0). stats refuses it too."""
    kw = dict(total=22, val_every=4, train_loss=lambda s: 10.0 - s)
    base = make_log(tmp_path / "base.txt", 3.6, 22_000, **kw)
    cut = make_log(tmp_path / "cut" / "cut.txt", 3.6, 22_000, truncate_after_step=7, **kw)
    assert tool.parse_log(cut, complete=False).last_step == 7
    for logs in ((base, cut), (cut, base), (base, base, "--noise", base, cut)):
        assert run_tool("compare", *logs) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (f"error: {cut}: incomplete run: it stopped at step 7/22, before its planned last "
                                     "step (interrupted?); compare reads complete runs and runs stopped early with "
                                     "STOP_AFTER\n")
    # interrupted during the final validation: every step line, no validation at the last step
    text = base.read_text()
    late = tmp_path / "late.txt"
    late.write_text(text[:text.index(T.step_line(22, 22, 22_000, val_loss=3.6))])
    assert run_tool("compare", base, late) == 2
    assert "late.txt: incomplete run: no validation at its last step 22" in capsys.readouterr().err
    # stopped on purpose with STOP_AFTER=7: its last validation is the planned one
    stopped = make_log(tmp_path / "stop.txt", 3.6, 22_000, stop_after=7, **kw)
    assert run_tool("compare", base, stopped) == 0
    assert capsys.readouterr().out.endswith("all within tolerance\n")
    assert run_tool("stats", tmp_path / "cut", "--no-plot") == 2  # as stats did already
    assert "cut.txt:" in (err := capsys.readouterr().err) and "truncated run: no final validation line (last step 7/22)" in err


def test_compare_and_stats_name_a_run_that_failed_at_start_up(tmp_path, capsys):
    """Issue #50: a run that failed at start-up (an `error:` line after the description, no step
    lines) got "rerun with TRAIN_LOSS_EVERY=1" from compare; both commands now quote its error."""
    base = make_log(tmp_path / "base.txt", 3.6, 8_000, total=8, val_every=4, train_loss=lambda s: 10.0 - s)
    failed = make_log(tmp_path / "failed" / "failed.txt", 3.6, 8_000, total=8, val_every=4,
                      startup_error="no files match TRAIN_FILES=data/proxy/p_*.bin")
    expected = f"error: {failed}: the run failed at start-up: no files match TRAIN_FILES=data/proxy/p_*.bin\n"
    for argv in (("compare", base, failed), ("compare", base, failed, "--only", "val"),
                 ("stats", tmp_path / "failed", "--no-plot"), ("ablation", failed)):
        assert run_tool(*argv) == 2
        assert capsys.readouterr().err == expected


def test_shipped_equivalence_experiment_passes_with_its_readme_command(capsys, monkeypatch):
    folder = REPO / "records" / "experiments" / "2026-11-22_TwoGpuEquivalenceTiny"
    command = next(ln for ln in (folder / "README.md").read_text().splitlines()
                   if ln.startswith("python records/tool.py compare "))
    monkeypatch.chdir(REPO)
    assert run_tool(*command.split()[2:]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.endswith("all within tolerance\n")


# ------------------------------------------------------------------ slim logs

SOURCE_V2 = SOURCE + "# the second version\n"
SOURCE_OLD = SOURCE + "# only ever in a record folder\n"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com",
                           "-c", "commit.gpgsign=false", *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git repository (the --root of these tests) whose history has train_gpt.py as SOURCE, then as
    SOURCE_V2 at the root, and SOURCE_OLD only as a record folder's copy."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / "train_gpt.py").write_text(SOURCE)
    git(root, "add", "train_gpt.py")
    git(root, "commit", "-q", "-m", "first")
    (root / "train_gpt.py").write_text(SOURCE_V2)
    (root / "records" / "2025-01-01_Old").mkdir(parents=True)
    (root / "records" / "2025-01-01_Old" / "train_gpt.py").write_text(SOURCE_OLD)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "second")
    (root / "train_gpt.py").write_text(SOURCE + "# not committed\n")
    return root


def stub(repo, commit, path="train_gpt.py"):
    blob = git(repo, "rev-parse", f"{commit}:{path}")
    return (f"source: {path} at commit {git(repo, 'rev-parse', commit)} (blob {blob}); python records/tool.py full "
            "<this log> restores it\n").encode()


def test_slim_logs_name_their_source_by_commit_and_blob_and_full_restores_them(repo, capsys):
    logs = {name: make_log(repo / "logs" / f"{name}.txt", 3.27, 80_000, source=source)
            for name, source in (("first", SOURCE), ("second", SOURCE_V2), ("old", SOURCE_OLD))}
    original = {name: p.read_bytes() for name, p in logs.items()}
    runs = {name: tool.parse_log(p) for name, p in logs.items()}
    assert run_tool("--root", repo, "slim", *logs.values()) == 0
    out = capsys.readouterr().out
    assert out.endswith("slim: 3 log(s) slimmed "
                        f"({sum(map(len, original.values()))} -> {sum(p.stat().st_size for p in logs.values())} bytes), "
                        "0 kept full (source in no commit), 0 slim already\n")
    sep = T.LOG_SEPARATOR.encode() + b"\n"
    for name, commit, path in (("first", "HEAD~1", "train_gpt.py"), ("second", "HEAD", "train_gpt.py"),
                               ("old", "HEAD", "records/2025-01-01_Old/train_gpt.py")):
        slim = logs[name].read_bytes()
        assert slim.startswith(stub(repo, commit, path) + sep)  # the oldest commit with that text
        assert slim[len(stub(repo, commit, path)):] == original[name][original[name].index(sep):]
        assert tool.parse_log(logs[name], repo=repo) == runs[name]  # source included, read from git
    assert run_tool("--root", repo, "slim", repo / "logs") == 0  # a folder; nothing left to do
    assert capsys.readouterr().out == "slim: 0 log(s) slimmed (0 -> 0 bytes), 0 kept full (source in no commit), 3 slim already\n"
    assert run_tool("--root", repo, "full", logs["first"], "--stdout") == 0
    assert capsys.readouterr().out == original["first"].decode()
    assert logs["first"].read_bytes() != original["first"]  # --stdout leaves the file as it is
    assert run_tool("--root", repo, "full", repo / "logs") == 0
    assert capsys.readouterr().out.endswith("full: 3 log(s) restored, 0 full already\n")
    assert {name: p.read_bytes() for name, p in logs.items()} == original


def test_commands_read_slim_logs_as_their_full_originals(repo, capsys):
    """stats, compare, stages, ablation and new give the same results on slim logs as on the full ones;
    new writes the full logs into the record folder."""
    kw = dict(total=8, val_every=4, train_loss=lambda s: 10.0 - s, schedule=(6, [0.5, 0.5]))
    for folder in ("fullcopy", "slimcopy"):
        for i, overrides in enumerate(("SEED=1", "SEED=2", "SEED=1 XSA=0")):
            make_log(repo / folder / f"run{i}.txt", 3.6 + 0.01 * i, 8_000 + 100 * i, overrides=overrides,
                     seed=int(overrides[5]), **kw)
    assert run_tool("--root", repo, "slim", repo / "slimcopy") == 0
    assert all((repo / "slimcopy" / f"run{i}.txt").read_bytes().startswith(b"source: ") for i in range(3))
    capsys.readouterr()
    results = {}
    for folder in ("fullcopy", "slimcopy"):
        logs = [repo / folder / f"run{i}.txt" for i in range(3)]
        for argv in (("stages", *logs), ("compare", *logs), ("ablation", *logs), ("compare", logs[2], "--repeats", *logs[:2]),
                     ("stats", repo / folder, "--no-plot")):
            assert run_tool("--root", repo, *argv) in (0, 1)
            results.setdefault(folder, []).append(capsys.readouterr().out.replace(folder, "X"))
        results[folder].append((repo / folder / "statistics.md").read_text().replace(folder, "X"))
    assert results["slimcopy"] == results["fullcopy"]
    assert "ms/step" in results["fullcopy"][0] and "time at loss <= 3.28" in results["fullcopy"][-1]
    slim_logs = [repo / "slimcopy" / f"run{i}.txt" for i in range(2)]
    assert run_tool("--root", repo, "new", "FromSlim", *slim_logs, "--date", "2025-02-03") == 0
    record = repo / "records" / "2025-02-03_FromSlim"
    assert (record / "train_gpt.py").read_text() == SOURCE
    for i in range(2):
        assert (record / f"run{i}.txt").read_bytes() == (repo / "fullcopy" / f"run{i}.txt").read_bytes()


def test_a_log_whose_source_is_in_no_commit_stays_full(repo, capsys):
    log = make_log(repo / "logs" / "dirty.txt", 3.27, 80_000, source=(repo / "train_gpt.py").read_text())
    before = log.read_bytes()
    assert run_tool("--root", repo, "slim", log) == 0
    out = capsys.readouterr().out.splitlines()
    blob = tool.blob_id((repo / "train_gpt.py").read_bytes())
    assert out == [(f"kept full {log}: its train_gpt.py source (blob {blob}) is in no commit of the history of "
                    f"{repo}, so git cannot rebuild it"),
                   "slim: 0 log(s) slimmed (0 -> 0 bytes), 1 kept full (source in no commit), 0 slim already"]
    assert log.read_bytes() == before


@pytest.mark.parametrize("corrupt, message", [
    (lambda text, blob: text.replace(blob, blob[:-1] + ("0" if blob[-1] != "0" else "1")),
     ("its source stub names blob {bad}, which the git repository at {repo} does not have (a corrupted stub, or a "
      "shallow clone: `git fetch --unshallow`)")),
    (lambda text, blob: text.replace(" (blob ", " (blob  ", 1),
     ("1: corrupted source stub 'source: train_gpt.py at commit {commit} (blob  {blob}); python records/tool.py full "
      "<this log> restores it': expected 'source: train_gpt.py at commit <40 hex> (blob <40 hex>); python "
      "records/tool.py full <this log> restores it'")),
    (lambda text, blob: text.replace(blob, blob[:20], 1), "1: corrupted source stub 'source: train_gpt.py at commit "),
])
def test_a_corrupted_stub_is_one_error_line(repo, capsys, corrupt, message):
    log = make_log(repo / "logs" / "a.txt", 3.27, 80_000, source=SOURCE)
    assert run_tool("--root", repo, "slim", log) == 0
    commit, blob = git(repo, "rev-parse", "HEAD~1"), tool.blob_id(SOURCE.encode())
    text = log.read_text()
    log.write_text(corrupt(text, blob))
    bad = re.search(r"\(blob +([0-9a-f]*)", log.read_text())[1]
    expected = f"error: {log}: " if not message.startswith("1:") else f"error: {log}:"
    for argv in (("stats", log.parent, "--no-plot"), ("full", log), ("stages", log)):
        assert run_tool("--root", repo, *argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(expected + message.format(bad=bad, repo=repo, commit=commit, blob=blob)) and err.count("\n") == 1
    # a stub whose commit has another train_gpt.py than its blob
    log.write_text(text.replace(commit, git(repo, "rev-parse", "HEAD")))
    assert run_tool("--root", repo, "stages", log) == 2
    assert capsys.readouterr().err == (f"error: {log}: corrupted source stub: commit {git(repo, 'rev-parse', 'HEAD')} has "
                                       f"no train_gpt.py with blob {blob} in the git repository at {repo}\n")


def test_xz_compressed_logs_are_read_as_the_logs_they_hold(tmp_path, capsys):
    """A log kept full (its source in no commit) may be xz-compressed: stats and the parser read run.txt.xz
    as run.txt (which wins when both are there); a damaged one is one error line."""
    import lzma
    logs = make_logs(tmp_path, [3.27, 3.28], [180.0, 181.0])
    run = tool.parse_log(logs[1])
    packed = logs[1].with_name("run1.txt.xz")
    packed.write_bytes(lzma.compress(logs[1].read_bytes()))
    assert tool.parse_log(packed) == replace_path(run, packed)
    assert [r.path.name for r in tool.load_runs(tmp_path)] == ["run0.txt", "run1.txt"]
    logs[1].unlink()
    assert [r.path.name for r in tool.load_runs(tmp_path)] == ["run0.txt", "run1.txt.xz"]
    assert run_tool("stats", tmp_path, "--no-plot") == 0
    assert "| run1 | [run1.txt.xz](run1.txt.xz) | 3.2800 |" in (tmp_path / "statistics.md").read_text()
    packed.write_bytes(packed.read_bytes()[:-20])
    assert run_tool("stages", packed) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {packed}: cannot decompress log: ") and err.count("\n") == 1


def replace_path(run, path):
    import dataclasses
    return dataclasses.replace(run, path=path)


def test_slim_and_full_archives_keep_their_members(repo, capsys):
    """A .tar.xz of logs is repacked with the same members (names, order, modes, times); the logs whose
    source git has are slim in it, the others as they were; full restores every member's bytes."""
    import tarfile
    work = repo / "work"
    files = {"a.txt": make_log(work / "a.txt", 3.27, 80_000, source=SOURCE).read_bytes(),
             "sub/b.txt": make_log(work / "b.txt", 3.28, 80_000, source=SOURCE + "# dirty\n").read_bytes(),
             "notes.out": b"not a log\n" + T.LOG_SEPARATOR.encode() + b"\n"}
    archive = repo / "exp" / "logs.tar.xz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:xz", format=tarfile.GNU_FORMAT) as tar:
        for i, (name, data) in enumerate(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_700_000_000 + i, 0o640 + i
            tar.addfile(info, io.BytesIO(data))

    def members():
        with tarfile.open(archive) as tar:
            return [((m.name, m.mtime, m.mode), tar.extractfile(m).read()) for m in tar.getmembers()]

    meta = [m for m, _ in members()]
    assert run_tool("--root", repo, "slim", repo / "exp") == 0
    out = capsys.readouterr().out
    assert f"kept full {archive}:sub/b.txt: its train_gpt.py source" in out and f"slimmed {archive}: 1 of its 3 files" in out
    slim = members()
    assert [m for m, _ in slim] == meta
    assert slim[0][1] == stub(repo, "HEAD~1") + files["a.txt"][files["a.txt"].index(T.LOG_SEPARATOR.encode()):]
    assert [data for _, data in slim[1:]] == [files["sub/b.txt"], files["notes.out"]]
    assert run_tool("--root", repo, "full", archive) == 0
    assert f"restored {archive}: 1 of its 3 files" in capsys.readouterr().out
    assert members() == list(zip(meta, files.values()))


def test_slim_leaves_record_folders_full(repo, capsys):
    log = make_log(repo / "records" / "2025-02-01_Rec" / "run0.txt", 3.27, 80_000, source=SOURCE)
    other = make_log(repo / "records" / "experiments" / "2025-02-01_Exp" / "run0.txt", 3.27, 80_000, source=SOURCE)
    before = log.read_bytes()
    assert run_tool("--root", repo, "slim", repo / "records") == 0
    out = capsys.readouterr().out
    assert f"kept full {(repo / 'records' / '2025-02-01_Rec').resolve()}: record folders keep full logs" in out
    assert log.read_bytes() == before and other.read_bytes().startswith(b"source: ")
    assert run_tool("--root", repo, "slim", log) == 2
    assert capsys.readouterr().err == (f"error: {log}: a log of the record 2025-02-01_Rec; record folders keep full "
                                       "logs\n")
