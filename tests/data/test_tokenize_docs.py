"""End-to-end tests of data/tokenize_docs.py with the repository's GPT-2 BPE files (no network)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

EOT = 50256
DOCS_TXT = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\nSecond line, with trailing spaces   \n",
    "sub/b.txt": "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂🚀 and Ελληνικά.\r\n"
                 "Windows line end kept.",
    "sub/deeper/c.txt": "A literal <|endoftext|> inside a document stays plain text. " * 3,
}
DOCS_JSONL = ["First JSON document: numbers 12345 and 3.14159.", "Zweites Dokument – mit Umlauten: äöüß.",
              "Third one\nspans\nlines.\tTabbed."]
EXTRA_JSONL = ["Extra file given by path, " * 8, "last document"]


@pytest.fixture(scope="module")
def bpe_dir(repo_root):
    return repo_root / "data" / "gpt2"


@pytest.fixture(scope="module")
def decode_bytes(bpe_dir):
    """Token ids -> UTF-8 bytes, with GPT-2's byte table written as in openai/gpt-2 (independent of the script)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    byte_of = dict(zip(map(chr, chars), printable + [b for b in range(256) if b not in printable]))
    token_of = {i: t for t, i in json.loads((bpe_dir / "encoder.json").read_text(encoding="utf-8")).items()}
    return lambda ids: bytes(byte_of[c] for i in ids for c in token_of[int(i)])


@pytest.fixture(scope="module")
def decode(decode_bytes):
    """Token ids -> text."""
    return lambda ids: decode_bytes(ids).decode("utf-8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder (.txt files, a .jsonl with a blank line) and a separate .jsonl: returns (inputs, documents)."""
    root = tmp_path_factory.mktemp("corpus")
    for name, text in DOCS_TXT.items():
        (root / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / name).write_bytes(text.encode("utf-8"))
    lines = [json.dumps({"text": t, "id": i}, ensure_ascii=i % 2 == 0) for i, t in enumerate(DOCS_JSONL)]
    (root / "docs" / "j.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n", encoding="utf-8")
    (root / "extra.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in EXTRA_JSONL), encoding="utf-8")
    # folder contents in sorted path order: docs/a.txt, docs/j.jsonl, docs/sub/b.txt, docs/sub/deeper/c.txt
    documents = [DOCS_TXT["a.txt"], *DOCS_JSONL, DOCS_TXT["sub/b.txt"], DOCS_TXT["sub/deeper/c.txt"], *EXTRA_JSONL]
    return [str(root / "docs"), str(root / "extra.jsonl")], documents


def tokenize(repo_root, bpe_dir, inputs, out_dir, *args, env=None):
    """Run the script; bpe_dir=None leaves --bpe-dir at its default."""
    command = [sys.executable, str(repo_root / "data" / "tokenize_docs.py"), *inputs, "--prefix", "mydata",
               "--out-dir", str(out_dir), *(["--bpe-dir", str(bpe_dir)] if bpe_dir else []), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


SHARD, VAL = 40, 50


@pytest.fixture(scope="module")
def outputs(repo_root, bpe_dir, corpus, tmp_path_factory):
    """Output folders of the same run with 1 and with 3 workers."""
    folders = {}
    for workers in (1, 3):
        folders[workers] = tmp_path_factory.mktemp(f"out{workers}")
        result = tokenize(repo_root, bpe_dir, corpus[0], folders[workers], "--shard-tokens", str(SHARD),
                          "--val-tokens", str(VAL), "--workers", str(workers))
        assert result.returncode == 0, result.stderr
        assert f"{len(corpus[1])} documents" in result.stdout
    return folders


def split_documents(stream):
    """The documents of a token stream, each without its leading EOT."""
    starts = np.flatnonzero(stream == EOT)
    assert starts[0] == 0
    return [doc[1:] for doc in np.split(stream, starts[1:])]


def read_splits(shards, folder):
    """(val documents, train documents) of a tokenize_docs output folder, as token arrays without EOT."""
    names = sorted(p.name for p in folder.iterdir())
    assert names[-1] == "mydata_val_000000.bin"
    train = names[:-1]
    assert train == [f"mydata_train_{i:06d}.bin" for i in range(1, len(train) + 1)]
    train_stream = np.concatenate([shards.read_tokens(folder / name) for name in train])
    return split_documents(shards.read_tokens(folder / names[-1])), split_documents(train_stream)


def check_split(documents, val, train, decode, decode_bytes):
    """val: whole documents, then one cut short; train: every other document, in input order.
    Returns the indices of val's whole documents."""
    drawn = [documents.index(decode(doc)) for doc in val[:-1]]
    kept = [documents.index(decode(doc)) for doc in train]
    assert len(set(drawn)) == len(drawn) and not set(drawn) & set(kept)
    assert kept == sorted(set(kept))  # input order, each once
    rest = set(range(len(documents))) - set(drawn) - set(kept)
    assert len(rest) == 1  # the truncated document: its start in val, the rest dropped
    cut = decode_bytes(val[-1])
    assert documents[rest.pop()].encode("utf-8").startswith(cut)  # may be empty: only its EOT fitted
    return drawn


def test_val_is_a_sample_of_whole_documents_and_train_the_rest_in_order(shards, outputs, corpus, decode, decode_bytes):
    val, train = read_splits(shards, outputs[1])
    check_split(corpus[1], val, train, decode, decode_bytes)
    assert len(list(outputs[1].iterdir())) >= 4  # at least three train shards besides val


def test_val_sample_is_drawn_across_inputs_and_follows_the_seed(repo_root, bpe_dir, tmp_path, shards, decode,
                                                                decode_bytes):
    """Many one-line documents in many files: the val sample is not the first documents, and --seed picks it."""
    texts = [f"Document number {i} says hello to the world." for i in range(40)]
    (tmp_path / "docs").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    drawn = []  # the same seed gives the same sample: test_output_independent_of_workers
    for k, seed in enumerate(("1337", "7")):
        out = tmp_path / f"out{k}"
        result = tokenize(repo_root, bpe_dir, [str(tmp_path / "docs")], out, "--val-tokens", "60", "--seed", seed,
                          "--workers", "1")
        assert result.returncode == 0, result.stderr
        val, train = read_splits(shards, out)
        assert sum(len(doc) + 1 for doc in val) == 61
        drawn.append(check_split(texts, val, train, decode, decode_bytes))
        assert drawn[-1] != list(range(len(drawn[-1])))  # not the first documents of the sorted files
    assert drawn[0] != drawn[1]


@pytest.mark.parametrize("case", ["corpus shorter than val", "one document longer than val"])
def test_corpus_without_train_tokens_is_an_error_that_leaves_nothing(repo_root, bpe_dir, corpus, tmp_path, case):
    if case == "corpus shorter than val":
        inputs, val_tokens = corpus[0], "100000"
    else:
        (tmp_path / "one.txt").write_text("A single document that is longer than the val shard. " * 5, encoding="utf-8")
        inputs, val_tokens = [str(tmp_path / "one.txt")], "10"
    out = tmp_path / "new" / "out"
    result = tokenize(repo_root, bpe_dir, inputs, out, "--val-tokens", val_tokens, "--workers", "1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "too small" in errors[0] and "--val-tokens" in errors[0], result.stderr
    assert not (tmp_path / "new").exists()  # neither the output folder nor its new parent is left


def test_shard_sizes(shards, outputs):
    sizes = {p.name: shards.read_header(p) for p in outputs[1].iterdir()}
    assert sizes.pop("mydata_val_000000.bin") == VAL + 1  # VAL inputs and the last one's target
    train = [sizes[name] for name in sorted(sizes)]
    assert all(size == SHARD for size in train[:-1]) and 0 < train[-1] <= SHARD


def test_output_independent_of_workers(outputs):
    one, three = (sorted(outputs[w].iterdir()) for w in (1, 3))
    assert [p.name for p in one] == [p.name for p in three]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, three))


def test_existing_shards_need_overwrite(repo_root, bpe_dir, corpus, outputs, tmp_path):
    result = tokenize(repo_root, bpe_dir, corpus[0], outputs[1], "--workers", "1")
    assert result.returncode == 1 and "--overwrite" in result.stderr
    fresh = tmp_path / "fresh"
    result = tokenize(repo_root, bpe_dir, corpus[0], fresh, "--val-tokens", "0", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in fresh.iterdir()] == ["mydata_train_000001.bin"]  # default shard size holds it all


def test_bad_jsonl_line_is_reported_and_leaves_nothing(repo_root, bpe_dir, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n', encoding="utf-8")
    result = tokenize(repo_root, bpe_dir, [str(tmp_path / "bad.jsonl")], tmp_path / "out", "--val-tokens", "1",
                      "--workers", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'bad.jsonl'}:2" in result.stderr and "'text'" in result.stderr
    assert not (tmp_path / "out").exists()  # the folder this run made is removed with its temporary file


def test_val_shard_serves_val_tokens_of_the_same_number(shards, outputs):
    """--val-tokens N pairs with the trainer's VAL_TOKENS=N (which reads N + 1 tokens), at any VAL_SEQ_LEN dividing N."""
    import torch

    import train_gpt as T

    for seq_len in (VAL, VAL // 5):
        val_set = T.ValidationSet(str(outputs[1] / "mydata_val_*.bin"), VAL, seq_len, 0, 1, torch.device("cpu"))
        assert val_set.tokens.tolist() == shards.read_tokens(outputs[1] / "mydata_val_000000.bin").tolist()


def test_default_bpe_dir_works_without_network(repo_root, corpus, tmp_path):
    """No --bpe-dir: the repository's data/gpt2, with any network attempt failing (dead proxy, empty tiktoken cache)."""
    dead = "http://127.0.0.1:9"
    env = dict(os.environ, HTTP_PROXY=dead, HTTPS_PROXY=dead, http_proxy=dead, https_proxy=dead, NO_PROXY="",
               no_proxy="", TIKTOKEN_CACHE_DIR=str(tmp_path / "tiktoken_cache"))
    result = tokenize(repo_root, None, corpus[0], tmp_path / "out", "--val-tokens", "0", "--workers", "1", env=env)
    assert result.returncode == 0, result.stderr
    assert f"{len(corpus[1])} documents" in result.stdout


@pytest.mark.parametrize("damage", ["missing", "truncated", "one byte changed"])
def test_unusable_bpe_files_are_one_line_that_names_the_fix(repo_root, bpe_dir, corpus, tmp_path, damage):
    broken = tmp_path / "gpt2"
    shutil.copytree(bpe_dir, broken)
    vocab = broken / "vocab.bpe"
    if damage == "missing":
        vocab.unlink()
    elif damage == "truncated":
        vocab.write_bytes(vocab.read_bytes()[:1000])
    else:
        data = bytearray(vocab.read_bytes())
        data[5000] ^= 1
        vocab.write_bytes(bytes(data))
    result = tokenize(repo_root, broken, corpus[0], tmp_path / "out", "--workers", "1")
    assert result.returncode == 1 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    reason = {"missing": "missing", "truncated": "1,000 bytes, GPT-2's has 456,318", "one byte changed": "sha256 "}[damage]
    assert f"{vocab} {reason}" in result.stderr
    assert "git checkout -- data/gpt2" in result.stderr and "--bpe-dir" in result.stderr
    assert not (tmp_path / "out").exists()
