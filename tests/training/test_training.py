"""The training loop on a tiny configuration (CPU): learning, the log format, environment overrides,
the schedule, start-up errors, the non-finite stop, STOP_AFTER, SEEDS, guards, run.sh and --check
(several gloo processes against one: tests/training/test_world_sizes.py; the tiny model's forward
and backward with each switch: tests/model/test_tiny_model.py)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import train_gpt as T
from helpers import ROOT, TINY, tiny_env


def schedule_of(hp: T.Hyperparameters) -> T.Schedule:
    return T.Schedule(hp.schedule)


def test_schedule_matches_the_recipe():
    """The reference's schedule (its LR examples with its 1270 scheduled steps and cooldown 0.60), and ours:
    1085 scheduled steps by default (1350 until the copy pointer spent the loss margin on fewer steps, issue #79),
    and at 1400 spelled out with the 8 % taper row, cooldown 0.55, final window 32."""
    reference = schedule_of(T.Hyperparameters.of(num_scheduled_iterations=1270, cooldown_frac=0.60, final_long_window=20,
                                                 stages=T.set_taper(T.STAGES, 0), taper_fraction=0))
    for step, expected in [(0, 1.0), (423, 1.52), (600, 1.355), (846, 0.912), (847, 1.027), (1000, 0.710),
                           (1269, 0.152), (1280, 0.15)]:
        assert abs(reference.plan(step).lr_multiplier - expected) < 2e-3, step
    assert reference.stage_starts == [0, 423, 847, 1270] and reference.total_steps == 1285
    assert reference.plan(1285, final=True).shape.long_window == 2560
    default = schedule_of(T.Hyperparameters())
    assert default.stage_starts == [0, 362, 723, 998, 1085] and default.total_steps == 1100
    s = schedule_of(T.Hyperparameters.of(num_scheduled_iterations=1400))
    plan = s.plan
    assert s.stage_starts == [0, 467, 933, 1288, 1400] and s.total_steps == 1415 and s.untie_step == 933
    assert [step for step in range(1415) if plan(step).untie] == [933]
    assert s.cooldown_start == 629  # int(1400 · 0.45): the float product is 629.99...
    for step, expected in [(0, 1.0), (467, 1.52), (630, 1.518), (700, 1.394), (932, 0.982), (933, 1.107),
                           (1000, 0.970), (1288, 0.380), (1399, 0.152), (1410, 0.15)]:
        assert abs(plan(step).lr_multiplier - expected) < 2e-3, step
    assert plan(0).momentum == 0.85 and abs(plan(300).momentum - 0.95) < 1e-12 and abs(plan(1415).momentum - 0.85) < 1e-12
    assert [plan(step).adam_step for step in range(4)] == [False, True, False, True]
    assert (plan(0).shape.short_window, plan(0).shape.long_window) == (128, 384)
    assert (plan(1410).shape.short_window, plan(1410).shape.long_window) == (768, 1664)
    assert plan(1415, final=True).shape.long_window == 4096 and plan(1410).long_windows == (384, 896, 1408, 1664)
    assert plan(0).target_weights[:3] == (1.0, 0.5, 0.25) and plan(500).shape.n_predict == 2
    assert plan(1000).shape.n_predict == 1 and plan(1000).target_weights == (1.0,)
    assert plan(0).tokens_per_rank == 16384 and plan(1000).tokens_per_rank == 49152
    assert plan(0).shape.max_seq_len == 896 and plan(500).shape.max_seq_len == 2048 and plan(1000).shape.max_seq_len == 3072
    assert (plan(500).attention_cap, plan(1000).attention_cap, plan(1350).attention_cap, plan(1410).attention_cap) == (0, 2560, 2560, 2560)
    assert s.warmup_steps() == [0, 1, 464, 465, 466, 467, 468, 469, 930, 931, 932, 933, 934, 935, 1286, 1287, 1288,
                                1289, 1398, 1399, 1400, 1401]


@pytest.mark.parametrize("n", [1350, 1400, 1185, 1135, 1085, 1078, 1001])
def test_warmup_compiles_every_adam_step_the_run_takes(n):
    """Each Adam step sums the gradients kept since the last one, and dynamo's guards are skipped after the
    warm-up: every run's Adam step (the forwards of the steps it sums) must occur in the warm-up, also where a
    stage starts on an Adam step (1185 scheduled steps: stage 2 at 395; its first Adam step of two stage-2
    steps, 397, was never compiled and the run died there)."""
    s = schedule_of(T.Hyperparameters.of(num_scheduled_iterations=n))

    def adam_steps(steps):
        seen, kept = set(), []
        for step in steps:
            plan = s.plan(step)
            kept.append(plan.graph_stage)
            if plan.adam_step:
                seen.add((tuple(kept), plan.untie))
                kept = []
        return seen

    assert adam_steps(range(s.total_steps)) <= adam_steps(s.warmup_steps())


def test_stage_table_fractions_and_columns():
    """Stage boundaries follow the table's fractions; STAGE_* variables replace whole columns."""
    stages = tuple(T.dataclasses.replace(stage, fraction=f) for stage, f in zip(T.set_taper(T.STAGES, 0), (0.5, 0.25, 0.25, None)))
    assert schedule_of(T.Hyperparameters.of(stages=stages, taper_fraction=0, num_scheduled_iterations=100)).stage_starts == [0, 50, 75, 100]
    hp = T.Hyperparameters.from_env({"STAGE_BATCH_TOKENS": "8,16,24,32,40", "STAGE_LR_MUL": "1,2,3,4,5"})
    stages_env = hp.schedule.stages
    assert [s.batch_tokens for s in stages_env] == [8, 16, 24, 32, 40] and stages_env[3].lr_mul == 4.0
    assert [s.max_seq_len for s in stages_env] == [s.max_seq_len for s in T.STAGES]
    with pytest.raises(ValueError, match="add up to 1"):
        T.check_hyperparameters(T.Hyperparameters.of(stages=stages[:1] + stages[2:], taper_fraction=0))
    with pytest.raises(ValueError, match="not divisible by 8"):
        T.check_hyperparameters(T.Hyperparameters.of(stages=T.replace_stage_columns(T.STAGES, batch_tokens=(8, 12, 16, 16, 16))))


def test_env_overrides():
    hp = T.Hyperparameters.from_env({"NUM_SCHEDULED_ITERATIONS": "1_000", "MUON_LR": "0.05", "CUDA_GRAPHS": "false",
                                     "STAGE_LR_MUL": "1,2,3,4,5", "ATTENTION_BACKEND": "flex", "UNRELATED": "x"})
    assert hp.schedule.num_scheduled_iterations == 1000 and hp.optim.muon_lr == 0.05
    assert hp.execution.cuda_graphs is False
    assert [s.lr_mul for s in hp.schedule.stages] == [1.0, 2.0, 3.0, 4.0, 5.0] and hp.execution.attention_backend == "flex"
    assert T.Hyperparameters.from_env({}) == T.Hyperparameters()
    with pytest.raises(ValueError, match="VAL_LOSS_EVERY"):
        T.Hyperparameters.from_env({"VAL_LOSS_EVERY": "often"})
    with pytest.raises(ValueError, match="CUDA_GRAPHS"):
        T.Hyperparameters.from_env({"CUDA_GRAPHS": "maybe"})
    with pytest.raises(T.SetupError, match=r"^XSA was removed: the technique is always on; .*\(docs/TECHNIQUES.md, "
                                           r"Removed\); unset it$"):
        T.Hyperparameters.from_env({"XSA": "0"})
    with pytest.raises(ValueError, match="STAGE_MAX_SEQ_LEN has 2 entries"):
        T.Hyperparameters.from_env({"STAGE_MAX_SEQ_LEN": "1,2"})


def run_main(env, nproc=None, timeout=600):
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
               if nproc else [sys.executable]) + [os.path.join(ROOT, "train_gpt.py")]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def load_records_tool():
    spec = importlib.util.spec_from_file_location("records_tool", os.path.join(ROOT, "records", "tool.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_host_cpu_names_the_model_and_the_usable_cores(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    usable = len(os.sched_getaffinity(0))
    assert T.host_cpu(str(cpuinfo)) == f"AMD EPYC 9654 96-Core Processor ({usable} cores usable)"
    assert T.host_cpu(str(tmp_path / "missing")) == f"unknown model ({usable} cores usable)"


def test_main_learns_and_writes_the_field_log_format(tmp_path, corpus):
    env = tiny_env(tmp_path, corpus, rank_slice=True, num_scheduled_iterations=30, num_extension_iterations=2,
                   val_loss_every=10, run_id="learn")
    proc = run_main(env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "logs" / "learn.txt").read_text()
    source = open(os.path.join(ROOT, "train_gpt.py")).read()
    assert log.startswith(source.rstrip("\n") + "\n" + "=" * 100 + "\n")
    assert "Running PyTorch " in log and "mode: rank-slice" in log and "hardware: cpu" in log
    assert "\nstep runner: eager steps (CUDA graphs need a CUDA device, not cpu)\n" in log
    assert re.search(r"^Running on host CPU .+ \(\d+ cores usable\)$", log, re.M)
    overrides = re.search(r"^overrides: (.*)$", log, re.M).group(1)
    assert "RANK_SLICE=1" in overrides and "NUM_SCHEDULED_ITERATIONS=30" in overrides and "RUN_ID" not in overrides
    vals = [(int(m.group(1)), float(m.group(2))) for m in
            re.finditer(r"^step:(\d+)/32 val_loss:(\d+\.\d{4}) train_time:\d+ms step_avg:\d+\.\d{2}ms$", log, re.M)]
    assert [s for s, _ in vals] == [0, 10, 20, 30, 32]
    assert len(re.findall(r"^step:\d+/32 train_time:\d+ms step_avg:\d+\.\d{2}ms$", log, re.M)) == 32
    peak = re.search(r"^peak memory allocated: (\d+) MiB reserved: \d+ MiB \(cpu: peak resident set size\)$", log, re.M)
    assert peak and int(peak.group(1)) > 100  # the CPU process's resident memory, not a placeholder 0
    assert vals[0][1] > 10 and vals[-1][1] < 6.0  # ln(50304) = 10.8 at init; the progressions are learnable
    # the console: where the log is, no hyperparameters JSON, the first step line (then one at least every
    # CONSOLE_EVERY seconds) with the time trained and an estimate of what is left; the log's lines keep the format
    console = proc.stdout.splitlines()
    assert f"log: {tmp_path / 'logs' / 'learn.txt'}" in console and "hyperparameters:" not in proc.stdout
    assert re.match(r"^step:1/32 train_time:\d+ms step_avg:\d+\.\d{2}ms  \(\d+(ms|s) trained, about \S+ left\)$",
                    next(line for line in console if line.startswith("step:1/"))), proc.stdout[-2000:]
    assert not [line for line in log.splitlines() if line.startswith("step:") and "trained" in line]
    # the records tool parses what main() writes
    run = load_records_tool().parse_log(str(tmp_path / "logs" / "learn.txt"))
    assert abs(run.final_loss - vals[-1][1]) < 1e-9 and run.overrides == overrides


def one_line_error(proc) -> str:
    """The error line of a run that stopped at start-up: exit code 1, no traceback, one `error:` line."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_world_size_errors(tmp_path, corpus):
    env = tiny_env(tmp_path, corpus, run_id="bad")
    assert "world size 3 is not supported" in one_line_error(run_main(dict(env, WORLD_SIZE="3", RANK="0")))
    assert "RANK_SLICE=1" in one_line_error(run_main(dict(env, WORLD_SIZE="2", RANK="0", RANK_SLICE="1")))


def test_bad_settings_are_one_line(tmp_path, corpus):
    env = tiny_env(tmp_path, corpus, run_id="bad")
    assert "VAL_LOSS_EVERY='often'" in one_line_error(run_main(dict(env, VAL_LOSS_EVERY="often")))
    assert "STAGE_MAX_SEQ_LEN has 2 entries" in one_line_error(run_main(dict(env, STAGE_MAX_SEQ_LEN="128,256")))
    assert "ATTENTION_BACKEND=fast" in one_line_error(run_main(dict(env, ATTENTION_BACKEND="fast")))
    assert "DEVICE=cpu" in one_line_error(run_main(dict(env, DEVICE="cuda", CUDA_VISIBLE_DEVICES="")))


def test_missing_data_names_the_pattern_and_the_download_command(tmp_path, corpus):
    env = tiny_env(tmp_path, corpus, train_files=str(tmp_path / "nothing_*.bin"), run_id="nodata")
    error = one_line_error(run_main(env))
    assert "nothing_*.bin" in error and "cached_fineweb10B.py" in error
    assert not (tmp_path / "logs").exists()  # checked before the log folder is made: nothing left behind


def test_missing_vocabulary_names_the_fix(tmp_path, corpus):
    env = tiny_env(tmp_path, corpus, tokenizer_dir=str(tmp_path / "no_vocabulary"), run_id="novocab")
    error = one_line_error(run_main(env))
    assert "no_vocabulary/encoder.json" in error and "data/gpt2" in error and "TOKENIZER_DIR" in error


def test_short_validation_files_name_the_fix(tmp_path, corpus):
    error = one_line_error(run_main(tiny_env(tmp_path, corpus, val_tokens=1024 * 1024, run_id="short")))
    assert "VAL_TOKENS=1048576 needs 1048577" in error and "lower VAL_TOKENS" in error


@pytest.mark.multiproc
def test_start_up_errors_print_once_under_torchrun_and_run_sh_stops_before_it(tmp_path, corpus):
    env = tiny_env(tmp_path, corpus, tokenizer_dir=str(tmp_path / "no_vocabulary"), run_id="twice")
    proc = run_main(env, nproc=2)  # two gloo processes: rank 0 reports, rank 1 exits quietly
    assert proc.returncode != 0 and proc.stderr.count("error: the prefix-token loss") == 1, proc.stderr[-3000:]
    # run.sh checks in one process first: one line, and torchrun never starts
    proc = subprocess.run(["bash", os.path.join(ROOT, "run.sh")], env=dict(env, NGPU="2"), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == "" and one_line_error(proc) == proc.stderr.strip()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py"), "--check"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert "no_vocabulary" in one_line_error(proc)
    ok = dict(env, TOKENIZER_DIR=str(corpus), WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py"), "--check"], env=ok, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("settings and inputs ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("every,detected", [(1, 3), (100, 6)])
def test_non_finite_loss_stops_and_names_the_step(tmp_path, corpus, monkeypatch, every, detected):
    """every=1: the periodic check without a host sync, queued after step 2 and read after step 3;
    every=100 (longer than the run): only the blocking check before the validation at step 6."""
    monkeypatch.setattr(T, "NONFINITE_CHECK_EVERY", every)
    hp = T.Hyperparameters.of(**{**TINY, "num_scheduled_iterations": 6, "num_extension_iterations": 1},
                              rank_slice=True, muon_lr=float("inf"), val_loss_every=6, train_loss_every=1,
                              train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                              tokenizer_dir=str(corpus))
    log = T.RunLog(str(tmp_path / "nan.txt"))
    # the first step runs on the initial weights; the infinite update poisons the second one's loss,
    # and the error names the step as its step line does
    with pytest.raises(T.NonFiniteLoss, match=rf"^non-finite training loss nan at step 2 \(detected at step {detected}\)"):
        T.Trainer(hp, 0, 1, torch.device("cpu"), log).run()
    log.file.flush()
    text = (tmp_path / "nan.txt").read_text()
    assert re.search(r"^step:(\d+)/7 train_loss:nan", text, re.M).group(1) == "2"
    assert "step:6/7 val_loss" not in text


def test_val_loss_every_zero_validates_first_and_last_only(tmp_path, corpus):
    env = tiny_env(tmp_path, corpus, rank_slice=True, num_scheduled_iterations=3, num_extension_iterations=1,
                   val_loss_every=0, run_id="ends")
    proc = run_main(env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.findall(r"^step:(\d+)/4 val_loss", (tmp_path / "logs" / "ends.txt").read_text(), re.M) == ["0", "4"]


def test_stop_after_ends_the_run_early_with_the_schedule_unchanged(tmp_path, corpus):
    """STOP_AFTER=4 of a 7-step schedule: steps 1-4 with the full schedule's numbering, a
    validation at step 4 (not the final-window one), and a warm-up of the steps before it only."""
    env = tiny_env(tmp_path, corpus, rank_slice=True, warmup=True, stop_after=4, train_loss_every=1, run_id="stop")
    proc = run_main(env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "logs" / "stop.txt").read_text()
    assert "warming up kernels on steps [0, 1, 2, 3]" in log
    assert re.findall(r"^step:(\d+)/7 val_loss", log, re.M) == ["0", "3", "4"]
    assert re.findall(r"^step:(\d+)/7 train_loss:\S+ train_time", log, re.M) == ["1", "2", "3", "4"]
    tool = load_records_tool()
    stopped = tool.parse_log(str(tmp_path / "logs" / "stop.txt"), complete=False)  # what `compare` reads
    assert sorted(stopped.train_losses) == [1, 2, 3, 4] and [s for s, _, _ in stopped.val] == [0, 3, 4]
    with pytest.raises(tool.RecordsError, match=r"stopped early by STOP_AFTER=4 after 4 of 7"):
        tool.parse_log(str(tmp_path / "logs" / "stop.txt"))  # a stopped run never becomes a record
    with pytest.raises(ValueError, match="STOP_AFTER=8: must lie in 0..7"):
        T.check_hyperparameters(T.Hyperparameters.of(num_scheduled_iterations=6, num_extension_iterations=1, stop_after=8))


def test_gpu_memory_cap_settings_are_checked():
    """GPU_MEMORY_GIB: a positive cap on CUDA, 0 for the whole GPU; its enforcement is a GPU test
    (test_gpu_training.py)."""
    T.check_hyperparameters(T.Hyperparameters.of(gpu_memory_gib=78.0))
    for bad in (dict(gpu_memory_gib=-1.0), dict(gpu_memory_gib=8.0, device="cpu")):
        with pytest.raises(T.SetupError, match=r"GPU_MEMORY_GIB=\S+: give the GiB this process's CUDA allocator may hold"):
            T.check_hyperparameters(T.Hyperparameters.of(**bad))
    assert T.Hyperparameters.from_env({"GPU_MEMORY_GIB": "79.5"}).run.gpu_memory_gib == 79.5


def test_seeds_run_once_per_seed_after_one_warm_up_each_as_that_seed_alone(tmp_path, corpus):
    """SEEDS=3,4: one warm-up, then a run per seed logged as RUN_ID_s<seed>; each run's losses equal,
    step for step, those of a process that ran that SEED alone (exact on the CPU), so nothing of
    the first run (weights, optimizer state, tie, loader, checks) leaks into the second. The lone
    run skips the warm-up: nothing of the warm-up's steps leaks into the runs either."""
    def losses(log: str) -> list:
        return re.findall(r"^step:(\d+)/7 (?:val_loss|train_loss):(\S+)", log, re.M)

    common = dict(rank_slice=True, warmup=True, train_loss_every=1, untie_embed_at=0.5)
    proc = run_main(tiny_env(tmp_path, corpus, seeds="3,4", run_id="many", **common))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_main(tiny_env(tmp_path, corpus, seed=4, run_id="alone4", **dict(common, warmup=False)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, alone = ((tmp_path / "logs" / f"{name}.txt").read_text() for name in ("many_s3", "many_s4", "alone4"))
    assert len(losses(second)) == 7 + 4 and losses(second) == losses(alone)  # 7 steps, 4 validations
    assert losses(first) != losses(second)
    assert '"seed": 3,' in first and '"seed": 4,' in second and "run_id: many_s4" in second
    warmed_up = [bool(re.search(r"^Compile and warm-up took \d+s", log, re.M)) for log in (first, second)]
    assert warmed_up == [True, False]
    assert re.search(r"^warm-up validations \([1-9]\d* shapes\) done at \d+s$", first, re.M)  # where its time went
    with pytest.raises(ValueError, match="SEEDS=1,2,1 repeats a seed"):
        T.check_hyperparameters(T.Hyperparameters.of(seeds=(1, 2, 1)))


def test_readme_documents_every_hyperparameter_and_the_ci_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    missing = [name for name in T.hyperparameter_variables() if name not in readme]
    assert not missing, f"README.md does not document {missing}"
    test_command = re.search(r"^(.*?)\s+# tests", readme, re.M).group(1).strip()
    assert test_command in open(os.path.join(ROOT, ".ci", "run")).read()


def test_skipped_guard_checks_after_the_warmup_pick_the_same_graphs(corpus, monkeypatch, val_loss_every=6):
    """After the warm-up the timed run checks only the guards that tell graphs apart: every
    step's loss and the validation must equal an uncompiled run's, bit for bit, and nothing recompiles.
    Dynamo's own graphs (backend="eager") run the same ops as the uncompiled model, which keeps them
    exact and the test fast; the guards are the same as inductor's. VAL_LOSS_EVERY=6 puts a validation
    at step 12, the extension's first step (its windows, not the final's), beside one in the middle of
    stage 2 (step 6) and the final one."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f, **kw: real_compile(f, backend="eager", **kw))
    hp = T.Hyperparameters.of(**{**TINY, "compile": True, "warmup": True}, rank_slice=True, num_scheduled_iterations=12,
                           num_extension_iterations=2, val_loss_every=val_loss_every, train_files=str(corpus / "tiny_train_*.bin"),
                           val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus))
    uncompiled = T.Trainer(hp.replace(compile=False, warmup=False), 0, 1, torch.device("cpu"), T.RunLog(None))
    expected = (uncompiled.run(), uncompiled.losses.tolist())
    try:
        torch._dynamo.reset()
        trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
        trainer.warmup()
        assert torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance()
        compiled = dict(torch._dynamo.utils.counters["stats"])
        got = (trainer.run(), trainer.losses.tolist())
        assert dict(torch._dynamo.utils.counters["stats"]) == compiled  # every graph came from the warm-up
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
    assert got == expected


def test_a_compiling_trainer_allows_a_graph_per_shape(corpus, monkeypatch):
    """The compiled steps and optimizer keep one dynamo graph per stage shape and per Adam table shape
    (more than dynamo's default 8 with NGRAM_ROWS): the Trainer raises the limit itself, so tests
    and tools that build one without main() do not stop at a recompile (found on the GPU, 2026-11-27)."""
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(torch._dynamo.config, limit, 8)
    hp = T.Hyperparameters.of(**{**TINY, "compile": True}, train_files=str(corpus / "tiny_train_*.bin"),
                              val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus))
    T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    assert getattr(torch._dynamo.config, limit) == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_check_without_a_gpu_is_one_line_before_torchrun(tmp_path, corpus):
    """run.sh's --check fails on a machine without CUDA GPUs (DEVICE is cuda by default): one line,
    exit 1, and torchrun never starts (it would print the error inside dozens of lines)."""
    env = tiny_env(tmp_path, corpus)
    env.pop("DEVICE")
    proc = subprocess.run(["bash", os.path.join(ROOT, "run.sh")], env=dict(env, NGPU="1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "no CUDA GPU visible" in proc.stderr


def test_check_needs_as_many_gpus_as_processes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    hp = T.Hyperparameters()
    T.check_device(hp, 2)
    with pytest.raises(T.SetupError, match=r"8 processes \(NGPU\) but 2 CUDA GPU\(s\) visible: use NGPU=2"):
        T.check_device(hp, 8)
    T.check_device(hp.replace(device="cpu"), 8)  # DEVICE=cpu needs none


def test_help_prints_usage_without_starting_anything():
    for command in (["bash", os.path.join(ROOT, "run.sh"), "--help"],
                    [sys.executable, os.path.join(ROOT, "train_gpt.py"), "--help"]):
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
        assert "torchrun --standalone --nproc_per_node=8 train_gpt.py" in proc.stdout
        assert len(proc.stdout.splitlines()) < 25


def test_ctrl_c_ends_with_one_interrupted_line_and_keeps_the_log(tmp_path, corpus):
    """SIGINT while training: exit 130, `interrupted at step N` (N: the last step line) on stderr and
    at the end of the log, which keeps everything before it, and no traceback."""
    import signal
    import time
    env = tiny_env(tmp_path, corpus, rank_slice=True, num_scheduled_iterations=3000, allow_repeat=True, run_id="ctrlc")
    log_path = tmp_path / "logs" / "ctrlc.txt"
    # SIGINT's default action in the child: a pytest started in the background by a non-interactive shell
    # (`pytest &`) has SIGINT ignored, which its children inherit, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt.py")], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (log_path.exists() and "step:5/" in log_path.read_text()):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    log = log_path.read_text().splitlines()
    last_step = re.findall(r"^step:(\d+)/", "\n".join(log), re.M)[-1]
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == log[-1] == f"interrupted at step {last_step}"
    assert int(last_step) >= 5


def test_out_of_memory_at_set_up_is_one_line_naming_the_n_gram_table(tmp_path, corpus, monkeypatch, capsys):
    """The table is set-up's largest allocation on one or two GPUs (T3.19): running out there is one error line
    that gives its per-process size and that fewer rows take less, not a traceback."""
    for key, value in tiny_env(tmp_path, corpus, run_id="oom").items():
        monkeypatch.setenv(key, value)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.21 GiB")

    monkeypatch.setattr(T, "Trainer", out_of_memory)
    monkeypatch.setattr(sys, "argv", ["train_gpt.py"])
    with pytest.raises(SystemExit) as stopped:
        T.main()
    assert stopped.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: out of GPU memory. The n-gram table holds 0.0 GiB of it per "
                                                   "process (NGRAM_ROWS=4001): fewer rows take less (a row: 264 bytes)")
    hp = T.Hyperparameters.of(rank_slice=True)  # the default table where one process holds it
    assert "holds 15.2 GiB of it per process (NGRAM_ROWS=10575360)" in T.out_of_memory_hint(hp, 1)
    assert "holds 1.9 GiB" in T.out_of_memory_hint(hp, 8)
