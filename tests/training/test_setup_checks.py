"""What `python train_gpt.py --check` (run.sh's first step) and a run's start stop on before any GPU work: one
`error:` line naming the fix and exit code 1 (issue #80's newcomer defects), the token ids of every shard the run
reads, and a second pass over the train files, found by the loader's own plan."""
import os
import sys

import numpy as np
import pytest
import torch

import train_gpt as T
from helpers import tiny_env

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def check(monkeypatch, capsys, env: dict) -> tuple[int, list[str]]:
    """main() with --check in this process under exactly `env`'s settings: (exit code, output lines)."""
    names = set(T.hyperparameter_variables()) | set(T.REMOVED_SETTINGS) | set(LAUNCH) | {"SEED", "SEEDS"}
    for name in names & set(os.environ):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--check"])
    try:
        T.main()
        code = 0
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, (out.out + out.err).strip().splitlines()


@pytest.mark.parametrize("setting, message", [
    ({"DEVICE": "gpu"}, "error: DEVICE='gpu': use cuda (one GPU per process) or cpu"),
    ({"VAL_SEQ_LEN": "0"}, "error: VAL_SEQ_LEN=0: give a whole number >= 1"),
    ({"NUM_SCHEDULED_ITERATIONS": "0"}, "error: NUM_SCHEDULED_ITERATIONS=0: give a whole number >= 1"),
    ({"LOG_DIR": "/proc/speedrun/logs"}, "error: LOG_DIR='/proc/speedrun/logs' is not a folder this process can write "
                                        "(No such file or directory): give another LOG_DIR"),
    ({"LOG_DIR": ""}, "error: LOG_DIR='' is not a folder this process can write (No such file or directory): give "
                      "another LOG_DIR"),
    ({"SEED": "1", "SEEDS": "1,2"}, "error: SEED and SEEDS are both set: SEEDS=1,2,3 makes one run per seed, SEED the "
                                    "seed of a single run; unset one"),
    ({"ATTENTION_BACKEND": "varlen"}, "error: ATTENTION_BACKEND=varlen: use one of auto, fa4, flex, sdpa"),
    ({"WORLD_SIZE": "abc"}, "error: WORLD_SIZE='abc' is not a whole number (torchrun sets it; run.sh passes NGPU as "
                            "WORLD_SIZE)"),
    ({"NGRAM_ROWS_PER_RANK": "3000"}, "error: NGRAM_ROWS=4001 and NGRAM_ROWS_PER_RANK=3000: give one of them"),
    ({"BIGRAM_ROWS": "1001"}, "error: BIGRAM_ROWS was removed: the n-gram table (row-wise RMSprop, orders 2 and 3) "
                              "beat the bigram table and Adam rows (docs/TECHNIQUES.md, Removed); unset it"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, corpus, monkeypatch, capsys, setting, message):
    code, lines = check(monkeypatch, capsys, dict(tiny_env(tmp_path, corpus, run_id="bad"), **setting))
    assert code == 1 and lines == [message]
    assert not (tmp_path / "logs").exists()  # nothing written: the log folder is made only once all else is ok


def test_a_good_check_makes_the_log_folder_and_says_ok(tmp_path, corpus, monkeypatch, capsys):
    code, lines = check(monkeypatch, capsys, tiny_env(tmp_path, corpus, run_id="good"))
    assert code == 0 and len(lines) == 1 and lines[0].startswith("settings and inputs ok (custom (train ")
    assert (tmp_path / "logs").is_dir() and not list((tmp_path / "logs").iterdir())


def test_a_token_id_outside_the_vocabulary_stops_the_check_naming_the_shard(tmp_path, corpus, shards, monkeypatch,
                                                                            capsys):
    """A shard of another tokenizer (ids >= VOCAB_SIZE) stops in --check, not as an IndexError (on a GPU, a device-side
    assert) in the first forward; train and validation files alike."""
    tokens = np.array([T.BOS_ID, 5, 7, 60000, 9] * 400, dtype=np.uint16)
    shards.write_shard(str(tmp_path / "other_train_000001.bin"), tokens)
    env = tiny_env(tmp_path, corpus, train_files=str(tmp_path / "other_train_*.bin"), allow_repeat=True)
    code, lines = check(monkeypatch, capsys, env)
    assert code == 1 and lines == [f"error: {tmp_path}/other_train_000001.bin: token id 60000 at position 3 is outside "
                                   f"the vocabulary of 50304 (VOCAB_SIZE): not GPT-2 tokens? re-tokenize it"]
    code, lines = check(monkeypatch, capsys, tiny_env(tmp_path, corpus, val_files=str(tmp_path / "other_train_*.bin")))
    assert code == 1 and "token id 60000 at position 3" in lines[0]


def steps_in_one_pass(hp: T.Hyperparameters) -> int:
    """How many steps of hp's schedule a TrainLoader plans before it starts a second pass over the files."""
    schedule, slices = T.Schedule(hp.schedule), 1 if hp.run.rank_slice else T.RANKS_PER_STEP
    loader = T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None, grad_accum=slices)
    for step in range(schedule.total_steps):
        stage = hp.schedule.stages[schedule.stage(step)]
        loader.plan_step(stage.batch_tokens // T.RANKS_PER_STEP, stage.max_seq_len)
        if loader.passes > 1:
            return step
    raise AssertionError("the schedule fits the files: make it longer")


@pytest.mark.parametrize("rank_slice", [True, False])
def test_a_run_that_would_repeat_its_data_stops_at_the_loaders_exact_step(corpus, rank_slice):
    """The check replays the run's steps through the loader's own planner: the longest run it accepts is the one
    whose last step the loader plans in its first pass (STOP_AFTER included), one step more stops naming the step
    and the shards needed, and ALLOW_REPEAT=1 lets it repeat. Full batch reads eight slices a step, rank-slice one."""
    hp = T.Hyperparameters.of(device="cpu", ngram_rows=4001, rank_slice=rank_slice, num_extension_iterations=0,
                              num_scheduled_iterations=4000 if rank_slice else 600,
                              stages=T.replace_stage_columns(T.STAGES, batch_tokens=(2048, 4096, 4096, 4096, 4096),
                                                             max_seq_len=(128, 256, 256, 256, 256)),
                              train_files=str(corpus / "tiny_train_*.bin"))
    fits = steps_in_one_pass(hp)
    T.check_train_data(hp.replace(stop_after=fits))
    with pytest.raises(T.SetupError, match=rf"^the run's {fits + 1} steps would read past the end of its 3 train files "
                                           rf"at step {fits + 1} and train on them again: they need 4 shards like "
                                           rf"tiny_train_000001.bin; add train shards \(TRAIN_FILES\), or ALLOW_REPEAT=1$"):
        T.check_train_data(hp.replace(stop_after=fits + 1))
    T.check_train_data(hp.replace(allow_repeat=True))
