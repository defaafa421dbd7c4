"""The smoke preset (SMOKE=1 ./run.sh, data/smoke/preset.py) end to end on the CPU, its tokenized
cache, and the sample builder (data/smoke/make_sample.py) on a shard made here."""
import importlib.util
import json
import lzma
import os
import re
import subprocess

import numpy as np

import train_gpt as T
from helpers import ROOT

HYPERPARAMETERS = set(T.hyperparameter_variables())


def load(name, relative_path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preset = load("smoke_preset", "data/smoke/preset.py")
make_sample = load("smoke_make_sample", "data/smoke/make_sample.py")


def test_smoke_preset_trains_and_says_where_its_log_went(tmp_path):
    """The whole preset as a user runs it (the CPU here): tokenize the sample, train, print the log's path. Half
    its 22 steps (CI's time), through the override its docstring offers: a variable set in the environment wins."""
    env = {k: v for k, v in os.environ.items() if k not in HYPERPARAMETERS}
    env.update(SMOKE="1", LOG_DIR=str(tmp_path / "logs"), NUM_SCHEDULED_ITERATIONS="10", VAL_LOSS_EVERY="5")
    proc = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), "--cache-dir", str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "smoke: training a tiny model on cpu; log: " in proc.stdout
    log = re.search(r"^smoke: done; the log is (.+)$", proc.stdout, re.M).group(1)
    assert os.path.dirname(log) == str(tmp_path / "logs")
    text = open(log).read()
    vals = [float(x) for x in re.findall(r"^step:\d+/11 val_loss:(\S+) ", text, re.M)]
    assert len(vals) == 4 and vals[0] > 10.5 and vals[-1] < vals[0] - 1.5, vals  # 10.8 -> about 8.7 (22 steps: 7.5)
    assert "hardware: cpu" in text and "mode: full-batch" in text


def test_prepare_tokenizes_once_per_sample(tmp_path, shards, capsys):
    cache = tmp_path / "cache"
    preset.prepare(str(cache))
    names = sorted(p.name for p in cache.iterdir())
    assert names == ["sample.sha256"] + ["smoke_train_%06d.bin" % i for i in range(1, 5)] + ["smoke_val_000000.bin"]
    assert shards.read_header(cache / "smoke_val_000000.bin") == preset.VAL_TOKENS + 1  # what VAL_TOKENS needs
    built = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    capsys.readouterr()
    preset.prepare(str(cache))
    assert "reusing the tokenized sample" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == built
    (cache / "sample.sha256").write_text("the digest of another sample\n")  # as after the sample changed
    preset.prepare(str(cache))
    assert "reusing" not in capsys.readouterr().out
    assert (cache / "sample.sha256").read_text() == preset.sample_digest() + "\n"
    assert sorted(p.name for p in cache.iterdir()) == names


def test_preset_environment(tmp_path):
    cpu = preset.preset_env(str(tmp_path), cuda=False, environ={"NUM_SCHEDULED_ITERATIONS": "60", "PATH": "/bin"})
    assert cpu["DEVICE"] == "cpu" and cpu["COMPILE"] == "0" and cpu["NUM_SCHEDULED_ITERATIONS"] == "60"
    assert cpu["GLIBC_TUNABLES"] == preset.CPU_MALLOC and cpu["PATH"] == "/bin"
    assert cpu["TRAIN_FILES"] == str(tmp_path / "smoke_train_*.bin") and cpu["RUN_ID"].startswith("smoke_")
    assert cpu["TOKENIZER_DIR"] == os.path.join(ROOT, "data", "gpt2")
    gpu = preset.preset_env(str(tmp_path), cuda=True, environ={})
    assert gpu["DEVICE"] == "cuda" and gpu["COMPILE"] == "0" and "GLIBC_TUNABLES" not in gpu
    assert set(preset.PRESET) <= HYPERPARAMETERS  # every preset variable is one the trainer reads


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
