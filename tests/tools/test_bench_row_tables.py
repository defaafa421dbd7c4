"""bench/bench_row_tables.py on the CPU: the micro-batches it times are consecutive stretches of the tokens, the
distinct rows it reports are torch.unique's of their n-gram rows, and every repeat is one optimizer step of
the real table."""
import os
import sys

import numpy as np
import pytest
import torch

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_row_tables as B  # noqa: E402

import train_gpt as T  # noqa: E402


def test_measure_reports_the_distinct_rows_of_each_timed_micro_batch(corpus):
    rows, per_batch, kept, repeats = 3001, 64, 2, 2
    tokens = B.token_source(str(corpus / "tiny_train_*.bin"), per_batch * kept * (B.WARMUP + repeats), 50304, 0)
    table = B.build_table(rows, per_batch, torch.device("cpu"))
    result = B.measure(table, tokens, per_batch, kept, repeats, torch.device("cpu"))
    timed = range(B.WARMUP * kept, (B.WARMUP + repeats) * kept)  # the warm-up's micro-batches come first
    expected = [torch.unique(T.ngram_ids(torch.from_numpy(tokens[b * per_batch:(b + 1) * per_batch]), rows,
                                         T.NGRAM_ORDERS)).numel() for b in timed]
    assert result["distinct_counts"] == expected and 0 < min(expected) < per_batch * 2
    assert table.step_count == B.WARMUP + repeats and table.kept == []
    assert int((table.last_step > 0).sum()) > 0  # the steps moved rows: the table's own update ran
    assert min(result["load_ms"], result["keep_ms"], result["step_ms"]) > 0
    assert result["per_step_ms"] == pytest.approx(result["load_ms"] + result["keep_ms"] + result["step_ms"] / kept)


def test_main_prints_one_row_per_size_and_reads_the_shards_it_is_given(corpus, monkeypatch, capsys):
    monkeypatch.setenv("TRAIN_FILES", str(corpus / "tiny_train_*.bin"))
    results = B.main(["--rows", "3001", "--tokens", "32,64", "--repeats", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert [r["tokens"] for r in results] == [32, 64]
    assert "tokens: the first shard of" in out and "| 32 |" in out and "| 64 |" in out
    with pytest.raises(SystemExit, match="tokens, the benchmark reads"):
        B.token_source(str(corpus / "tiny_train_*.bin"), 10**9, 50304, 0)
    with pytest.raises(FileNotFoundError, match="no token shards match"):
        B.token_source(str(corpus / "missing_*.bin"), 100, 50304, 0)
    zipf = B.token_source(None, 1000, 50304, 0)
    assert zipf.dtype == np.int64 and zipf.min() >= 0 and zipf.max() < 50304
