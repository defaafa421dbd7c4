"""The stage table's extra rows and columns (T5.5) on the CPU: TAPER_FRACTION's taper row (the default's,
with the full softmax; every plan as without it unless a column changes the row; set_taper), STAGE_FRACTION, the per-stage attention cap (only the
attention segments change), their one-line errors, and a tiny run through a taper and a cap."""

import dataclasses
import re

import numpy as np
import pytest
import torch
from helpers import tiny_env

import train_gpt as T

# the default taper, on the 1400 scheduled steps whose boundaries the tests below spell out
TAPER = {"TAPER_FRACTION": "0.08", "NUM_SCHEDULED_ITERATIONS": "1400"}
NO_TAPER = {"TAPER_FRACTION": "0", "NUM_SCHEDULED_ITERATIONS": "1400"}


def plans(hp: T.Hyperparameters) -> list[T.StepPlan]:
    schedule = T.Schedule(hp.schedule)
    return [schedule.plan(step, final=step == schedule.total_steps) for step in range(schedule.total_steps + 1)]


def without_row_indices(plan: T.StepPlan) -> T.StepPlan:
    return dataclasses.replace(plan, stage=0, graph_stage=0)


def test_a_taper_row_leaves_every_plan_as_it_was():
    """The default TAPER_FRACTION=0.08 holds steps 1288-1399 of 1400 scheduled ones in a row of their own, named taper, stage 3's
    row with the full softmax: the plans (steps, lr, windows, MTP weights, YaRN's long windows, cap) stay
    those of the table without it (TAPER_FRACTION=0, stage 3 to the end), the taper's other candidate
    budget gives it graphs of its own, and the warm-up compiles both sides of its start."""
    hp = T.Hyperparameters.from_env(TAPER)
    T.check_hyperparameters(hp)
    stages = hp.schedule.stages
    assert stages == T.Hyperparameters().schedule.stages == T.STAGES
    assert T.stage_names(stages) == ["stage 1", "stage 2", "stage 3", "taper", "extension"]
    assert stages[3] == dataclasses.replace(T.STAGES[2], fraction=0.08, ce_candidates=0, taper=True)
    assert abs(stages[2].fraction - (1 / 3 - 0.08)) < 1e-12
    schedule = T.Schedule(hp.schedule)
    assert schedule.stage_starts == [0, 467, 933, 1288, 1400] and schedule.graph_stages == [0, 1, 2, 3, 4]
    assert {1286, 1287, 1288, 1289} <= set(schedule.warmup_steps())
    without = T.Hyperparameters.from_env(NO_TAPER)
    T.check_hyperparameters(without)
    assert T.stage_names(without.schedule.stages) == ["stage 1", "stage 2", "stage 3", "extension"]
    assert [stage.ce_candidates for stage in without.schedule.stages] == [10240, 14336, 24576, 0]
    tapered, today = plans(hp), plans(without)
    assert [without_row_indices(p) for p in tapered] == [without_row_indices(p) for p in today]
    assert [p.step for p in tapered if p.stage == 3] == list(range(1288, 1400))
    assert len({T.StepGraphs.key(p) for p in tapered}) == len({T.StepGraphs.key(p) for p in today}) + 2  # taper: Adam, not
    assert tapered[1300].long_windows == today[1300].long_windows == (384, 896, 1408)  # no second YaRN rescale
    frequencies = T.rope_frequencies(128)
    for got, want in zip(T.yarn(frequencies, [384, 896, 1408, 1408]), T.yarn(frequencies, [384, 896, 1408])):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))


def test_set_taper_moves_removes_and_cuts_the_row():
    """set_taper on a table with a taper row keeps the row's columns and moves its boundary, 0 gives its
    steps back to stage 3; on a table without one it cuts a copy of stage 3's row."""
    moved = T.set_taper(T.STAGES, 0.1)
    assert [(s.fraction, s.ce_candidates, s.taper) for s in moved[2:]] == [
        (pytest.approx(1 / 3 - 0.1), 24576, False), (0.1, 0, True), (None, 0, False)]
    removed = T.set_taper(T.STAGES, 0)
    assert removed == (*T.STAGES[:2], dataclasses.replace(T.STAGES[2], fraction=pytest.approx(1 / 3)), T.STAGES[4])
    cut = T.set_taper(removed, 0.08)
    assert cut[3] == dataclasses.replace(T.STAGES[2], fraction=0.08, taper=True)  # stage 3's budget: a copy
    assert T.set_taper(removed, 0) == removed


def test_the_taper_continues_its_stages_weights_and_takes_its_own_columns():
    """Weights that move across stage 3 move on through its taper as if uncut; an entry of its own (a
    smaller batch, another long window) changes the taper's steps only and gives it its own graphs."""
    plain = T.set_taper(T.STAGES, 0)
    moving = dataclasses.replace(plain[2], mtp_weights=((1.0, 1.0), (0.5, 0.0)), prefix_weight=(0.25, 0.0))
    table = plain[:2] + (moving,) + plain[3:]
    base = T.Hyperparameters.of(stages=table, taper_fraction=0, num_scheduled_iterations=100)
    tapered = base.replace(stages=T.set_taper(table, 0.2), taper_fraction=0.2)
    T.check_hyperparameters(tapered)
    assert [without_row_indices(p) for p in plans(tapered)] == [without_row_indices(p) for p in plans(base)]
    assert plans(tapered)[80].stage == 3 and 0 < plans(tapered)[80].target_weights[1] < 0.5
    env = dict(TAPER, STAGE_BATCH_TOKENS="131072,262144,393216,262144,393216", STAGE_LONG_WINDOW="3,7,11,12,13")
    changed, today = plans(T.Hyperparameters.from_env(env)), plans(T.Hyperparameters.from_env(TAPER))
    taper = [p.step for p in changed if p.stage == 3]
    assert all(p.tokens_per_rank == 32768 and p.shape.long_window == 1536 for p in changed if p.stage == 3)
    assert changed[1300].long_windows == (384, 896, 1408, 1536) and changed[1405].long_windows == (384, 896, 1408, 1536, 1664)
    assert {p.graph_stage for p in changed if p.stage == 3} == {3}
    same = ("lr_multiplier", "momentum", "target_weights", "adam_step", "untie", "step")
    for p, q in zip(changed, today):
        assert all(getattr(p, name) == getattr(q, name) for name in same)
        if p.step not in taper and p.step < 1400:
            assert without_row_indices(p) == without_row_indices(q)


def test_stage_fractions_come_from_the_environment():
    hp = T.Hyperparameters.from_env(dict(NO_TAPER, STAGE_FRACTION="0.3,0.3,0.4"))
    T.check_hyperparameters(hp)
    assert T.Schedule(hp.schedule).stage_starts == [0, 420, 840, 1400]
    hp = T.Hyperparameters.from_env(dict(TAPER, STAGE_FRACTION="0.3,0.3,0.34,0.06"))  # the taper's entry wins
    T.check_hyperparameters(hp)
    assert T.Schedule(hp.schedule).stage_starts == [0, 420, 840, 1316, 1400]


@pytest.mark.parametrize("env, message", [
    ({"TAPER_FRACTION": "0.34"}, r"TAPER_FRACTION=0.34: give a share of the scheduled steps in \[0, 0.333333\)"),
    ({"TAPER_FRACTION": "-0.1"}, r"TAPER_FRACTION=-0.1: give a share"),
    ({"STAGE_FRACTION": "0.5,0.5"}, (r"STAGE_FRACTION has 2 entries; the stage table has 4 rows with a fraction "
                                     r"\(stage 1, stage 2, stage 3, taper; TAPER_FRACTION=0 removes the taper row\)")),
    (dict(NO_TAPER, STAGE_FRACTION="0.5,0.5"), (r"STAGE_FRACTION has 2 entries; the stage table has 3 rows with a "
                                                r"fraction \(stage 1, stage 2, stage 3; TAPER_FRACTION>0 adds a taper row\)")),
    (dict(TAPER, STAGE_CE_CANDIDATES="10240,14336,24576,0"),
     r"STAGE_CE_CANDIDATES has 4 entries; the stage table has 5 rows \(stage 1, stage 2, stage 3, taper, extension; "
     r"TAPER_FRACTION=0 removes the taper row\)"),
    (dict(NO_TAPER, STAGE_CE_CANDIDATES="10240,14336,24576,0,0"), r"has 5 entries; the stage table has 4 rows .*TAPER_FRACTION"),
    (dict(NO_TAPER, STAGE_FRACTION="0.5,0.5,0.1"), r"STAGE_FRACTION=0.5,0.5,0.1: .* positive and add up to 1 \(within 1e-6\)"),
    ({"STAGE_FRACTION": "0.5,0.6,-0.1,0.0"}, r"must be positive"),
    ({"STAGE_FRACTION": "0.5,half,0.25"}, r"STAGE_FRACTION='0.5,half,0.25' is not a valid"),
    ({"STAGE_ATTENTION_CAP": "0,0,-1,0,0"}, r"STAGE_ATTENTION_CAP entry -1"),
])
def test_bad_rows_and_columns_are_one_line_setup_errors(env, message):
    with pytest.raises(T.SetupError, match=message):
        T.check_hyperparameters(T.Hyperparameters.from_env(env))


def test_taper_fraction_and_the_table_must_agree():
    with pytest.raises(T.SetupError, match="TAPER_FRACTION=0.08 but the stage table has 0 taper rows"):
        T.check_hyperparameters(T.Hyperparameters.of(stages=T.set_taper(T.STAGES, 0)))
    with pytest.raises(T.SetupError, match="TAPER_FRACTION=0.0 but the stage table has 1 taper rows"):
        T.check_hyperparameters(T.Hyperparameters.of(taper_fraction=0.0))


def test_the_attention_cap_splits_segments_and_moves_no_token(corpus):
    """Segments longer than the cap become consecutive pieces of at most cap tokens; the loader's
    tokens (inputs and targets) are those of the uncapped batch, cu_seqlens a superset of its
    boundaries at the fixed length max_segments_per_batch + 1."""
    assert T.capped_lengths([5, 64, 65, 1, 130], 64) == [5, 64, 64, 1, 1, 64, 64, 2]
    assert T.max_segments_per_batch(4096, 0) == T.max_docs_per_batch(4096)
    assert T.max_segments_per_batch(4096, 64) == T.max_docs_per_batch(4096) + 64
    pattern, cpu = str(corpus / "tiny_train_*.bin"), torch.device("cpu")
    plain, capped = (T.TrainLoader(pattern, 0, 1, cpu, log=lambda _: None) for _ in range(2))
    for tokens, max_seq_len, cap in ((4096, 256, 64), (2048, 128, 100), (4096, 256, 1)):
        for _ in range(2):
            inputs, targets, cu = plain.next_batch(tokens, max_seq_len)
            capped_inputs, capped_targets, capped_cu = capped.next_batch(tokens, max_seq_len, attention_cap=cap)
            assert torch.equal(inputs, capped_inputs) and torch.equal(targets, capped_targets)
            assert len(capped_cu) == T.max_segments_per_batch(tokens, cap) + 1
            bounds, capped_bounds = set(cu.tolist()), set(capped_cu.tolist())
            assert bounds <= capped_bounds and capped_cu[0] == 0 and capped_cu[-1] == tokens
            assert np.diff(capped_cu.numpy()).min() >= 0 and np.diff(capped_cu.numpy()).max() <= cap
            # each new boundary lies a whole number of caps past the document start before it
            starts = sorted(bounds)
            assert all((b - max(s for s in starts if s <= b)) % cap == 0 for b in capped_bounds - bounds)


def test_a_tiny_run_through_a_taper_with_a_smaller_batch_and_an_attention_cap(tmp_path, corpus):
    """From the environment: a taper of 20 % (step 5 of 6) on half the batch with attention capped at
    64 tokens; the log names the taper's execution plan, and the last stage, the taper and the
    extension train (steps 4-6: the first steps' shapes are the other tests' business)."""
    env = tiny_env(tmp_path, corpus, rank_slice=True, taper_fraction=0.2, stage_batch_tokens=(2048, 2048, 2048, 1024, 2048),
                   stage_max_seq_len=(128,) * 5, stage_attention_cap=(0, 0, 0, 64, 0), stage_ce_candidates=(0,) * 5)
    hp = T.Hyperparameters.from_env(env)
    T.check_hyperparameters(hp)
    lines = []
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), lines.append)
    assert trainer.schedule.stage_starts == [0, 2, 4, 5, 6]
    assert any(re.match(r"execution plan \(stage 1, stage 2, stage 3, taper, extension\b", line) for line in lines), lines
    loader = T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None)
    for step in range(4, trainer.schedule.total_steps):
        plan = trainer.schedule.plan(step)
        assert (plan.stage, plan.attention_cap, plan.tokens_per_rank) == [(2, 0, 256), (3, 64, 128), (4, 0, 256)][step - 4]
        trainer.train_step(plan, loader)
    assert torch.isfinite(trainer.losses[4:]).all() and trainer.losses[4:].min() > 0
