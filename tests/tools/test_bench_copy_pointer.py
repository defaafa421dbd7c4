"""bench/bench_copy_pointer.py: it times the train_gpt.py it is given (--train-gpt, the A/B against another version,
through profile_stages.load_source), and on a GPU its time is the pointer's kernels' device time, its own three
kernels within the total."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_copy_pointer as B  # noqa: E402

import train_gpt  # noqa: E402


def test_the_bench_loads_the_train_gpt_it_is_given(tmp_path):
    """In a subprocess, as the bench runs: a second train_gpt.py executed in this process would register the
    custom ops again and leave the suite's train_gpt calling freed ones (conftest.replaced_custom_ops)."""
    other = tmp_path / "before.py"
    shutil.copy(os.path.join(ROOT, "train_gpt.py"), other)
    with open(other, "a") as f:
        f.write("\nBENCH_MARKER = 'before'\n")
    code = ("import sys; import bench_copy_pointer as B; m = B.load_source(sys.argv[1]); "
            "print(m.BENCH_MARKER, m.__file__, 'train_gpt' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "bench"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, str(other)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["before", str(other), "False"]  # that file, and the project's not imported


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_time_counts_the_pointer_kernels_within_the_total(monkeypatch):
    monkeypatch.setattr(B, "T", train_gpt)
    params, rest, upstream = B.problem(4096, 512)
    total, own = B.gpu_time(lambda: train_gpt.copy_pointer(*params, *rest, use_triton=True), calls=3)
    assert 0 < own < total
    none_total, none_own = B.gpu_time(lambda: train_gpt.copy_pointer(*params, *rest, use_triton=False), calls=3)
    assert none_own == 0 and none_total > 0
