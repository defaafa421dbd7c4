"""The sampled cross-entropy's switch (T4.6) on the CPU: the stage table's STAGE_CE_CANDIDATES column
(0: today's full-softmax path, bit for bit), its checks, the execution plan naming each stage's
budget (validation: the full softmax), a tiny run that trains with it, and the one-line stop when a
forward's targets exceed the budget (the op itself: tests/kernels/test_sampled_cross_entropy.py; with
CUDA graphs: tests/training/test_step_graphs.py)."""

import dataclasses
import math
import re

import pytest
import torch

import train_gpt as T
from helpers import TINY, cpu_execution, random_batch

RECORD_BUDGETS = [10240, 14336, 24576, 0, 0]  # record #92's budgets on our stages, the default (README, T4.6)


def tiny_hp(corpus, budgets, **overrides) -> T.Hyperparameters:
    """The tiny run without the taper row (TAPER_FRACTION=0): one budget per stage and the extension."""
    stages = T.replace_stage_columns(T.set_taper(TINY["stages"], 0), ce_candidates=budgets)
    return T.Hyperparameters.of(**{**TINY, "stages": stages, "taper_fraction": 0, **overrides},
                                train_files=str(corpus / "tiny_train_*.bin"),
                                val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus),
                                num_scheduled_iterations=6, num_extension_iterations=1)


def test_budget_zero_is_todays_full_softmax_path_bit_for_bit(monkeypatch):
    """Budget 0: training_loss is lm_head_softcap_ce on the whole lm_head, bit for bit, and the
    sampled op is never called; a budget calls it with the model's candidate_step."""
    hp = T.Hyperparameters.of(**dict(TINY, vocab_size=1024))
    torch.manual_seed(0)
    model = T.GPT(hp.model, T.longest_forward(hp))
    inputs, targets, cu = random_batch(vocab=1024)
    shape, weights, plan = T.ForwardShape(32, 96, 128, n_predict=3), torch.tensor([1.0, 0.5, 0.25]), cpu_execution(hp)
    assert plan.ce_candidates == 0 and [stage.ce_candidates for stage in T.STAGES] == RECORD_BUDGETS
    calls = []
    sampled = T.sampled_lm_head_softcap_ce
    monkeypatch.setattr(T, "sampled_lm_head_softcap_ce", lambda *args: calls.append(args) or sampled(*args))
    loss, ce = model.training_loss(inputs, targets, cu, shape, plan, weights, 0.5)
    x = model.hidden_states(inputs, cu, shape, plan)
    today = T.lm_head_softcap_ce(x, model.lm_head, model.target_columns(targets.long(), shape), weights, 0.5, False)
    assert not calls and torch.equal(loss, today[0]) and torch.equal(ce, today[1])
    model.candidate_step.fill_(4)
    sampled_loss, _ = model.training_loss(inputs, targets, cu, shape, dataclasses.replace(plan, ce_candidates=256),
                                          weights, 0.5)
    assert len(calls) == 1 and calls[0][4] == 256 and calls[0][5] is model.candidate_step and sampled_loss < loss
    assert model.candidate_shortfall.item() == 0


def test_the_stage_column_comes_from_the_environment_and_is_checked():
    assert [stage.ce_candidates for stage in T.Hyperparameters.from_env({}).schedule.stages] == RECORD_BUDGETS
    hp = T.Hyperparameters.from_env({"STAGE_CE_CANDIDATES": "0,0,0,0,0"})  # the full softmax throughout
    assert [stage.ce_candidates for stage in hp.schedule.stages] == [0] * 5
    T.check_hyperparameters(hp)
    for budgets in ((50320, 0, 0, 0, 0), (1000, 0, 0, 0, 0), (-16, 0, 0, 0, 0)):  # past the vocabulary, not x16, negative
        bad = T.Hyperparameters.of(stages=T.replace_stage_columns(T.STAGES, ce_candidates=budgets))
        with pytest.raises(T.SetupError, match=f"STAGE_CE_CANDIDATES entry {budgets[0]}: use a multiple of 16 "
                                               f"\\(the FP8 lm_head's GEMM\\) up to VOCAB_SIZE=50304, or 0"):
            T.check_hyperparameters(bad)


def test_execution_plans_name_each_stage_budget_and_validation_takes_the_full_softmax(corpus):
    lines = []
    trainer = T.Trainer(tiny_hp(corpus, (1024, 2048, 2048, 0)), 0, 1, torch.device("cpu"), lines.append)
    plans = [re.match(r"execution plan \((.*)\): .* ce_candidates=(\d+) ", line).groups()
             for line in lines if line.startswith("execution plan")]
    assert plans == [("stage 1", "1024"), ("stage 2, stage 3", "2048"), ("extension", "0"), ("validation", "0")]
    assert torch.equal(trainer.candidate_steps, torch.arange(7))
    assert T.Trainer(tiny_hp(corpus, (0, 0, 0, 0)), 0, 1, torch.device("cpu"), lines.append).candidate_steps is None


def test_a_tiny_run_with_sampled_cross_entropy_trains(corpus):
    """Five steps of the three stages on 1,024 candidates (the corpus uses 1,000 tokens: its targets
    and a sweep of negatives): the loss on the candidates falls, each step sweeps for its own number,
    and the full-softmax validation loss (one batch) falls from ln V, its value at initialization."""
    trainer = T.Trainer(tiny_hp(corpus, (1024, 1024, 1024, 0), rank_slice=True), 0, 1, torch.device("cpu"),
                        T.RunLog(None))
    loader = T.TrainLoader(trainer.hp.data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None)
    for step in range(5):
        trainer.train_step(trainer.schedule.plan(step), loader)
        assert trainer.model.candidate_step.item() == step
    losses = trainer.losses[:5]
    assert torch.isfinite(losses).all() and losses[0] > 6.9 and losses[4] < losses[0] - 0.2, losses  # ln 1024 = 6.93
    assert trainer.model.candidate_shortfall.item() == 0
    assert trainer.evaluate(5, max_batches=1) < math.log(50304) - 0.3


def test_a_budget_below_a_forwards_targets_stops_the_run_in_one_line(tmp_path, corpus, monkeypatch):
    """16 candidates for a forward with hundreds of distinct targets: the periodic check (every step here: queued
    after step 1, read after step 2) stops the run naming the setting and the fix (main() writes it as one
    `error:` line, as it does the non-finite loss's)."""
    monkeypatch.setattr(T, "NONFINITE_CHECK_EVERY", 1)
    stages = T.replace_stage_columns(TINY["stages"], ce_candidates=(16, 16, 16, 0, 0))
    hp = T.Hyperparameters.of(**{**TINY, "stages": stages}, rank_slice=True, val_loss_every=0,
                              num_scheduled_iterations=6, num_extension_iterations=1,
                              train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                              tokenizer_dir=str(corpus))
    log = T.RunLog(str(tmp_path / "short.txt"))
    with pytest.raises(T.CandidateShortfall, match=r"^a training forward had \d+ more distinct targets than its stage's "
                       r"cross-entropy candidates \(STAGE_CE_CANDIDATES=16,16,16,0,0; detected at step 2\); raise "
                       r"that stage's entry, or 0 for the full softmax$"):
        T.Trainer(hp, 0, 1, torch.device("cpu"), log).run()
    log.file.flush()
    assert "step:3/7" not in (tmp_path / "short.txt").read_text()
