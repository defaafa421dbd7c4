"""The smoke preset (SMOKE=1 ./run.sh, data/smoke/preset.py) end to end on the CPU, its tokenized
cache, its one-line errors, Ctrl-C, and the sample builder (data/smoke/make_sample.py) on a shard made here."""
import importlib.util
import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

import train_gpt as T
from helpers import ROOT

HYPERPARAMETERS = set(T.hyperparameter_variables())
RUN_SH = os.path.join(ROOT, "run.sh")
RECORD = os.path.join("records", "2026-11-22_V1ProxyRankSliceH100", "train_gpt.py")  # 4 stages; the preset: 5


def load(name, relative_path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preset = load("smoke_preset", "data/smoke/preset.py")
make_sample = load("smoke_make_sample", "data/smoke/make_sample.py")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The sample tokenized once for the module's runs (--cache-dir)."""
    return preset.prepare(str(tmp_path_factory.mktemp("smoke") / "cache"))


def smoke_env(tmp_path, **overrides):
    """A user's environment for `SMOKE=1 ./run.sh`: no hyperparameter variables but overrides, logs in tmp_path."""
    env = {k: v for k, v in os.environ.items() if k not in HYPERPARAMETERS}
    env.update(SMOKE="1", LOG_DIR=str(tmp_path / "logs"), **overrides)
    return env


def in_process(monkeypatch, tmp_path):
    """os.environ as smoke_env has it (SMOKE aside), for preset.main() called here."""
    for name in HYPERPARAMETERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOG_DIR", str(tmp_path / "logs"))


def test_smoke_preset_trains_and_says_where_its_log_went(cache, tmp_path):
    """The whole preset as a user runs it (the CPU here): train, print the log's path. Half its 22 steps and one
    validation sequence at the start and the end (CI's time), through the override its docstring offers: a
    variable set in the environment wins."""
    env = smoke_env(tmp_path, NUM_SCHEDULED_ITERATIONS="10", VAL_LOSS_EVERY="0", VAL_TOKENS="1024")
    proc = subprocess.run(["bash", RUN_SH, "--cache-dir", cache], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "smoke: training a tiny model on cpu; log: " in proc.stdout
    log = re.search(r"^smoke: done; the log is (.+)$", proc.stdout, re.M).group(1)
    assert os.path.dirname(log) == str(tmp_path / "logs")
    text = open(log).read()
    vals = [float(x) for x in re.findall(r"^step:\d+/11 val_loss:(\S+) ", text, re.M)]
    assert len(vals) == 2 and vals[0] > 10.5 and vals[-1] < vals[0] - 1.5, vals  # 10.8 -> about 8.5 (22 steps: 7.5)
    assert "hardware: cpu" in text and "mode: full-batch" in text


def test_ctrl_c_lets_training_log_where_it_stopped(cache, tmp_path):
    """Ctrl-C in a terminal signals the whole process group: the wrapper waits while train_gpt.py logs where it
    stopped (not killed 0.25 s later, as subprocess.run would). Exit code 130, no traceback: train_gpt.py's lines
    and the wrapper's two. 41 steps (one pass over the sample), so that the signal lands mid-run, after the first
    step line; one validation sequence."""
    env = smoke_env(tmp_path, NUM_SCHEDULED_ITERATIONS="40", VAL_LOSS_EVERY="0", VAL_TOKENS="1024")
    proc = subprocess.Popen(["bash", RUN_SH, "--cache-dir", cache], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    logs, deadline = tmp_path / "logs", time.monotonic() + 300
    try:
        while not any(re.search(r"^step:\d+/41 ", p.read_text(), re.M) for p in logs.glob("*.txt")):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no step line in 300 s"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:  # the test failed: no run left behind
            os.killpg(proc.pid, signal.SIGKILL)
    [log] = logs.glob("*.txt")
    stopped = re.search(r"^interrupted at step \d+$", log.read_text(), re.M)
    assert proc.returncode == 130 and stopped and "Traceback" not in out, out[-3000:]
    lines = out.splitlines()  # train_gpt.py's, and the wrapper's two: before and after them
    assert [line for line in lines if line.startswith("smoke:")] == [
        f"smoke: training a tiny model on cpu; log: {log}", f"smoke: interrupted; the log is {log}"], out[-3000:]
    assert lines[0].startswith("smoke:") and lines[-2:] == [stopped.group(), f"smoke: interrupted; the log is {log}"]


def fake_trainer(tmp_path, check_error="", run_error="error: no CUDA GPU visible"):
    """A script in train_gpt.py's place: `--check` prints check_error (then fails) or passes; a run prints
    run_error and fails before writing a log."""
    path = tmp_path / "fake_train_gpt.py"
    path.write_text("import sys\n"
                    f"error = {check_error!r} if sys.argv[1:] == ['--check'] else {run_error!r}\n"
                    "print(error, file=sys.stderr) if error else None\n"
                    "sys.exit(1 if error else 0)\n")
    return str(path)


def test_a_failure_before_the_log_names_no_log(cache, tmp_path, monkeypatch, capfd):
    """Training that stops at set-up (DEVICE=cuda without a GPU, say) writes no log: its own error line, then the
    wrapper's one line saying so. So does a setting train_gpt.py's check turns down (the user's: passed on as is)."""
    in_process(monkeypatch, tmp_path)
    assert preset.main(["--cache-dir", cache, "--script", fake_trainer(tmp_path)]) == 1
    out, err = capfd.readouterr()
    assert err == "error: no CUDA GPU visible\n" and out.startswith("smoke: training a tiny model on ")
    assert out.splitlines()[1:] == ["smoke: failed (exit code 1); training stopped before writing a log"]
    assert not (tmp_path / "logs").exists()

    monkeypatch.setenv("MUON_LR", "abc")
    for error in ("error: environment variable MUON_LR='abc' is not a valid float",  # a setting the user set
                  "error: smoke_train_000001.bin: token id 60000 at position 3 is outside the vocabulary of 50304 "
                  "(VOCAB_SIZE): not GPT-2 tokens? re-tokenize it"):  # the input files, not one of the preset's settings
        monkeypatch.setattr(preset, "TRAIN_GPT", fake_trainer(tmp_path, check_error=error))
        assert preset.main(["--cache-dir", cache, "--script", preset.TRAIN_GPT]) == 1
        out, err = capfd.readouterr()
        assert (err, out) == (error + "\n", "smoke: failed (exit code 1); training stopped before writing a log\n")


def test_with_seeds_the_wrapper_names_each_seeds_log(cache, tmp_path, monkeypatch, capfd):
    """SEEDS=1,2: train_gpt.py logs RUN_ID_s1.txt and RUN_ID_s2.txt, and the wrapper names both (it once looked for
    RUN_ID.txt and said no log was written)."""
    in_process(monkeypatch, tmp_path)
    monkeypatch.setenv("SEEDS", "1,2")
    monkeypatch.setenv("RUN_ID", "seeded")
    script = tmp_path / "seeded_train_gpt.py"
    script.write_text("import os, sys\n"
                      "if sys.argv[1:] != ['--check']:\n"
                      "    os.makedirs(os.environ['LOG_DIR'], exist_ok=True)\n"
                      "    for seed in os.environ['SEEDS'].split(','):\n"
                      "        open(os.path.join(os.environ['LOG_DIR'], f\"{os.environ['RUN_ID']}_s{seed}.txt\"), 'w').write('x')\n")
    assert preset.main(["--cache-dir", cache, "--script", str(script)]) == 0
    logs = [str(tmp_path / "logs" / f"seeded_s{seed}.txt") for seed in (1, 2)]
    out = capfd.readouterr().out.splitlines()
    assert out[0].endswith(f"; logs: {logs[0]}, {logs[1]}") and out[1] == f"smoke: done; the logs are {', '.join(logs)}"


def test_a_script_that_turns_down_a_preset_setting_is_one_line(cache, tmp_path, monkeypatch, capfd):
    """A record's older train_gpt.py under today's preset: its check's ValueError (a traceback) becomes one line
    naming the setting; so does any script's check that names a setting the preset set (not the user)."""
    in_process(monkeypatch, tmp_path)
    assert preset.main(["--cache-dir", cache, "--script", os.path.join(ROOT, RECORD)]) == 1
    out, err = capfd.readouterr()
    fits = "error: the smoke preset's settings fit the repository's current train_gpt.py; "
    stages = preset.PRESET["STAGE_BATCH_TOKENS"]
    assert out == "" and err == (f"{fits}{RECORD} did not accept STAGE_BATCH_TOKENS={stages} "
                                 "(ValueError: STAGE_SHORT_WINDOW has 4 entries, STAGE_BATCH_TOKENS has 5)\n")

    script = fake_trainer(tmp_path, check_error="error: unknown setting NGRAM_ROWS='4001'")
    monkeypatch.setattr(preset, "TRAIN_GPT", script)  # the repository's own, once it drops a setting
    assert preset.main(["--cache-dir", cache, "--script", script]) == 1
    assert capfd.readouterr() == ("", f"{fits}{script} did not accept NGRAM_ROWS=4001 "
                                      f"(unknown setting NGRAM_ROWS='4001')\n")


def test_user_errors_before_training_are_one_line(tmp_path):
    """An unwritable --cache-dir and a missing --script: one `error:` line each; a bad argument: argparse's two."""
    (tmp_path / "file").write_text("")
    env = smoke_env(tmp_path)
    for args, rc, lines in ((["--cache-dir", str(tmp_path / "file" / "cache")], 1, [
                                f"error: --cache-dir {tmp_path / 'file' / 'cache'}: cannot write the tokenized "
                                "sample there (Not a directory); give a folder you can write"]),
                            (["--script", "nope.py"], 1, [
                                "error: --script nope.py: no such file (default: the repository's train_gpt.py)"]),
                            (["--bogus"], 2, ["usage: preset.py [-h] [--cache-dir CACHE_DIR] [--script SCRIPT]",
                                              "preset.py: error: unrecognized arguments: --bogus"])):
        proc = subprocess.run(["bash", RUN_SH, *args], env=env, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout, proc.stderr.splitlines()) == (rc, "", lines)


def test_prepare_tokenizes_once_per_sample(cache, tmp_path, shards):
    """The module's cache, as prepare() tokenized it: reused while the sample is the same, made anew after."""
    names = sorted(os.listdir(cache))
    assert names == ["sample.sha256"] + ["smoke_train_%06d.bin" % i for i in range(1, 5)] + ["smoke_val_000000.bin"]
    assert shards.read_header(os.path.join(cache, "smoke_val_000000.bin")) == preset.VAL_TOKENS + 1  # VAL_TOKENS'
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    built = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    preset.prepare(str(copy))
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == built
    (copy / "sample.sha256").write_text("the digest of another sample\n")  # as after the sample changed
    preset.prepare(str(copy))
    assert (copy / "sample.sha256").read_text() == preset.sample_digest() + "\n"
    assert sorted(p.name for p in copy.iterdir()) == names
    assert (copy / "smoke_val_000000.bin").stat().st_mtime_ns != built["smoke_val_000000.bin"]  # made anew


def test_preset_environment(tmp_path):
    cpu = preset.preset_env(str(tmp_path), cuda=False, environ={"NUM_SCHEDULED_ITERATIONS": "60", "PATH": "/bin"})
    assert cpu["DEVICE"] == "cpu" and cpu["COMPILE"] == "0" and cpu["NUM_SCHEDULED_ITERATIONS"] == "60"
    assert cpu["GLIBC_TUNABLES"] == preset.CPU_MALLOC and cpu["PATH"] == "/bin"
    assert cpu["TRAIN_FILES"] == str(tmp_path / "smoke_train_*.bin") and cpu["RUN_ID"].startswith("smoke_")
    assert cpu["TOKENIZER_DIR"] == os.path.join(ROOT, "data", "gpt2")
    gpu = preset.preset_env(str(tmp_path), cuda=True, environ={})
    assert gpu["DEVICE"] == "cuda" and gpu["COMPILE"] == "0" and "GLIBC_TUNABLES" not in gpu
    assert set(preset.PRESET) <= HYPERPARAMETERS  # every preset variable is one the trainer reads
    assert "BIGRAM_ROWS" not in preset.PRESET  # the bigram table leaves train_gpt.py (NGRAM_ROWS stays)


PROSE = ("It was a bright cold day in April, and the clocks were striking one\n"
         "as the old man walked slowly down the lane towards the village green,\n") * 6 + "\n" + \
        ("where the children had gathered beside the pond to watch the ducks, and\n"
         "nobody noticed the stranger who stood in the shadow of the churchyard.\n") * 3
WIKI = "Village green\n\n" + "A village green is a common open area within a village or other settlement. " * 8 + "\n"
REVIEW = "I watched this film twice and it is still the worst thing I have seen in years. " * 5
VERSE = "Know then thyself, presume not God to scan;\nThe proper study of mankind is man.\n" * 8


def test_only_hard_wrapped_prose_is_kept():
    assert make_sample.is_wrapped_prose(PROSE)
    for text in (WIKI, REVIEW, VERSE, "Too short\nto judge\n"):
        assert not make_sample.is_wrapped_prose(text)


def test_pieces_cut_at_blank_lines_within_the_limit():
    text = "\n\n".join(f"Paragraph {i}. " + "x" * (40 * i) for i in range(1, 9))
    parts = make_sample.pieces(text, 300)
    assert "\n\n".join(parts) == text and len(parts) > 3
    assert all(len(p) <= 300 or "\n\n" not in p for p in parts)


def test_make_sample_keeps_the_prose_documents_of_a_shard(tmp_path, shards):
    encoding = make_sample.tokenize_docs.load_gpt2(os.path.join(ROOT, "data", "gpt2"))
    tokens = [t for text in (WIKI, PROSE, REVIEW, VERSE, PROSE.upper()) for t in [50256, *encoding.encode(text)]]
    shards.write_shard(tmp_path / "proxy_val_000000.bin", np.array(tokens, dtype=np.uint16))
    out = tmp_path / "sample.jsonl.xz"
    assert make_sample.main([str(tmp_path / "proxy_val_000000.bin"), "--out", str(out), "--piece-chars", "600"]) == 0
    texts = [json.loads(line)["text"] for line in lzma.open(out, "rt", encoding="utf-8")]
    assert "\n\n".join(texts) == PROSE + "\n\n" + PROSE.upper()  # the prose documents, cut into pieces
    assert len(texts) == 4 and all(len(t) <= 600 or "\n\n" not in t for t in texts)


def test_committed_sample_is_small_wrapped_text():
    assert os.path.getsize(preset.SAMPLE) < 2_000_000
    texts = [json.loads(line)["text"] for line in lzma.open(preset.SAMPLE, "rt", encoding="utf-8")]
    assert sum(map(len, texts)) > 1_000_000
    assert all(max(map(len, t.split("\n"))) <= make_sample.WRAP_MAX for t in texts)
