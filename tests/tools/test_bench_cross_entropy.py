"""bench/bench_cross_entropy.py section (a) on the CPU: one row per width, gradient dtype and launch, the problem
and its floor at that row width (--widths: the sampled budgets' candidates), the references skipped on request."""
import os
import sys

import pytest

from helpers import ROOT

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_cross_entropy as B  # noqa: E402


def test_the_kernel_section_runs_each_row_width(monkeypatch, capsys):
    shapes, problem = [], B.problem

    def cpu_problem(tokens, width=B.V):
        logits, targets, weights = problem(tokens, width, device="cpu")
        shapes.append(tuple(logits.shape))
        return logits, targets, weights

    monkeypatch.setattr(B, "problem", cpu_problem)
    monkeypatch.setattr(B.T, "_sm_count", lambda device: 2)
    monkeypatch.setattr(B, "bench", lambda fn: (fn(), 0.25)[1])

    class Args:
        tokens, widths, num_warps, programs_per_sm, fast_tanh, skip_references = [48], [96, 130], [8], [1, 2], [1], True
        prefetch, grad_dtypes = [0, 1], ["e5m2", "bf16"]

    B.section_kernel(Args)
    assert shapes == [(48, 96), (48, 130)]  # 130: the row's parts 128 + 2 (masked), as vocab_parts splits it
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("    48 ")]
    assert len(lines) == 2 * 2 * 2 * 2  # widths × gradient dtypes × programs an SM × prefetch; no reference rows
    assert sorted((int(f[1]), f[3], f[5], f[7]) for f in lines) == sorted(
        (w, g, p, a) for w in (96, 130) for g in ("bfloat16", "float8_e5m2") for p in ("1", "2") for a in ("0", "1"))
    assert all(f[4] == "8" and float(f[15]) < 1e-5 and float(f[17]) < 1e-5 for f in lines)  # loss, ce0 vs float64
    shapes.clear()
    rows = B.kernel_rows(4096, 130, Args, None, None)  # the floor: one read of the logits, one write of the gradient
    assert shapes == [(4096, 130)] and len(rows) == 8
    for tokens, width, _, grad, *_, floor, _, _, _ in rows:
        element = 1 if grad == "float8_e5m2" else 2
        assert (tokens, width) == (4096, 130)
        assert floor == pytest.approx(4096 * 130 * (2 + element) / B.HBM_BYTES_PER_MS)


def test_the_kernel_section_launches_as_training_where_the_sweep_is_left_out(monkeypatch):
    """No --num-warps / --programs-per-sm / --prefetch: the launch train_gpt.ce_launch picks at each row width."""
    problem, launches = B.problem, []
    softcap_ce = B.T.softcap_ce
    monkeypatch.setattr(B, "problem", lambda tokens, width=B.V: problem(tokens, width, device="cpu"))
    monkeypatch.setattr(B.T, "_sm_count", lambda device: 2)
    monkeypatch.setattr(B.T, "CE_LAUNCH", ((96, 4, 3, True), (1 << 62, 8, 1, False)))
    monkeypatch.setattr(B, "bench", lambda fn: 0.25)

    def recorded(*args, **config):
        launches.append((config["num_warps"], config["programs"], config["prefetch"]))
        return softcap_ce(*args, **config)
    monkeypatch.setattr(B.T, "softcap_ce", recorded)

    class Args:
        num_warps, programs_per_sm, prefetch, fast_tanh, grad_dtypes, skip_references = [], [], [], [1], ["bf16"], True

    rows = B.kernel_rows(48, 96, Args, None, None) + B.kernel_rows(48, 130, Args, None, None)
    assert launches == [(4, 6, True), (8, 2, False)]
    assert [(row[4], row[5], row[7]) for row in rows] == [(4, 3, 1), (8, 1, 0)]


def test_the_kernel_section_times_only_the_gradient_dtypes_asked(monkeypatch):
    problem = B.problem
    monkeypatch.setattr(B, "problem", lambda tokens, width=B.V: problem(tokens, width, device="cpu"))
    monkeypatch.setattr(B.T, "_sm_count", lambda device: 2)
    monkeypatch.setattr(B, "bench", lambda fn: (fn(), 0.25)[1])

    class Args:
        num_warps, programs_per_sm, fast_tanh, prefetch, grad_dtypes = [8], [1], [1], [0], ["e5m2"]
        skip_references = True

    rows = B.kernel_rows(64, 96, Args, None, None)
    assert [row[3] for row in rows] == ["float8_e5m2"]
