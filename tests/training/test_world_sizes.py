"""World sizes 2, 4 and 8 (gloo processes on the CPU) against one process with gradient accumulation 8,
through the real main() on the tiny configuration and corpus.

Full-batch mode computes the same training at every world size: world W accumulates 8 // W
micro-batches per rank, so the runs differ only in the order of the bf16 gradient sums (local
accumulation against gloo's reduction). Per-step losses then agree to a few 1e-3 (the train losses to
3e-4; step 4's validation, after the largest steps, to 6e-3 at most as measured on 2026-11-27), while a
wrong data slice, a missed reduction or a wrong gradient scale moves them by more than 1e-1.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import train_gpt as T
from helpers import CPU_MALLOC, ROOT, write_tiny_corpus

STEPS = 4  # STOP_AFTER: steps 1-4 of the 7-step schedule, stages 1 and 2 and the first step of stage 3
TINY = dict(DEVICE="cpu", COMPILE=0, WARMUP=0, MODEL_DIM=128, NUM_HEADS=2, HEAD_DIM=64, MLP_HIDDEN=256,
            NGRAM_ROWS=4001, STAGE_BATCH_TOKENS="1024,2048,2048,2048,2048", STAGE_MAX_SEQ_LEN="128,256,256,256,256",
            WINDOW_BLOCK_SIZE=16, VAL_TOKENS=2048, VAL_SEQ_LEN=1024, NUM_SCHEDULED_ITERATIONS=6,
            NUM_EXTENSION_ITERATIONS=1, STOP_AFTER=STEPS, VAL_LOSS_EVERY=2, TRAIN_LOSS_EVERY=1,
            MUON_MOMENTUM_WARMUP_STEPS=5, MUON_MOMENTUM_COOLDOWN_STEPS=2)
HYPERPARAMETERS = set(T.hyperparameter_variables())
TOLERANCE = 1e-2
# One pytest-xdist worker runs this file's tests (the README's command: --dist loadgroup), so the
# one-process run of the module's fixture (about 20 s) is made once, not once per worker.
pytestmark = pytest.mark.xdist_group("world_sizes")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, shards):
    """run(world_size) -> (train losses, val losses, log text) of the tiny configuration at that world size."""
    folder = tmp_path_factory.mktemp("world_sizes")
    corpus = write_tiny_corpus(folder, shards.write_shard)

    def run(world_size):
        env = {k: v for k, v in os.environ.items() if k not in HYPERPARAMETERS}
        env.update({k: str(v) for k, v in TINY.items()}, RUN_ID=f"world{world_size}", LOG_DIR=str(folder / "logs"),
                   TRAIN_FILES=str(corpus / "tiny_train_*.bin"), VAL_FILES=str(corpus / "tiny_val_*.bin"),
                   TOKENIZER_DIR=str(corpus))
        if world_size <= 4:  # faster (world size 1: 20 -> 13 s); at 8 no faster, and 7 -> 10 GiB in all
            env.setdefault("GLIBC_TUNABLES", CPU_MALLOC)
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
        command = [sys.executable, *(launcher if world_size > 1 else []), os.path.join(ROOT, "train_gpt.py")]
        proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = (folder / "logs" / f"world{world_size}.txt").read_text()
        train = [float(x) for x in re.findall(r"^step:\d+/7 train_loss:(\S+) ", log, re.M)]
        val = [float(x) for x in re.findall(r"^step:\d+/7 val_loss:(\S+) ", log, re.M)]
        assert len(train) == STEPS and len(val) == 3, log[-2000:]  # val at steps 0, 2 and 4
        return train, val, log

    return run


@pytest.fixture(scope="module")
def one_process(tiny_run):
    train, val, log = tiny_run(1)
    assert "world_size: 1" in log and "grad_accum_steps: 8" in log
    return train, val


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gloo_processes_match_one_process_with_accumulation(tiny_run, one_process, world_size):
    train, val, log = tiny_run(world_size)
    assert "world_size: {}\ngrad_accum_steps: {}\n".format(world_size, 8 // world_size) in log
    assert np.allclose(train, one_process[0], atol=TOLERANCE, rtol=0), (train, one_process[0])
    assert np.allclose(val, one_process[1], atol=TOLERANCE, rtol=0), (val, one_process[1])
