"""Tests of train_gpt.py's data section: shard headers, the BOS-aligned planner (T1.2),
cu_seqlens, the training loader (world sizes, shard hand-over, cycling) and the validation set.

CPU only. Loader tests write small shards whose non-BOS token ids encode their own global
position (id == position across all files), so a batch can be traced back to the exact file
slices it came from without trusting the planner under test.
"""
import inspect
import pathlib
import sys
import threading

import numpy as np
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (pytest.ini puts it on the path too)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_gpt as tg  # noqa: E402

BOS = tg.BOS_ID
CPU = torch.device("cpu")
RANKS = 8  # the schedule is written for 8 ranks; world W accumulates 8 // W micro-batches


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def random_docs(seed, min_tokens, min_len=1, max_len=3000, lead=0):
    """Concatenated documents of random lengths min_len..max_len, each starting with BOS, other
    ids random below BOS; `lead` non-BOS tokens first (a document straddling from a previous
    shard). Returns (tokens uint16, BOS positions)."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, BOS, lead)] if lead else []
    total = lead
    while total < min_tokens:
        n = int(rng.integers(min_len, max_len + 1))
        parts.append(np.concatenate([[BOS], rng.integers(0, BOS, n - 1)]))
        total += n
    tokens = np.concatenate(parts).astype(np.uint16)
    return tokens, np.flatnonzero(tokens == BOS)


def plan_all(bos, shard_len, tokens, num_ranks, max_seq_len, max_docs, first_doc=0):
    """Plan batches from first_doc until the shard runs out: list of (plan, next_doc)."""
    out, cursor = [], first_doc
    while True:
        planned = tg.plan_batch(bos, cursor, shard_len, tokens, num_ranks, max_seq_len, max_docs)
        if planned is None:
            return out
        out.append(planned)
        cursor = planned[1]


def check_plan(plan, next_doc, bos, shard_len, first_doc, tokens, num_ranks, max_seq_len, max_docs):
    """Check one plan against the packing rule of docs/TECHNIQUES.md T1.2 (plus the documented max_docs overflow segment):
    consecutive documents, none skipped or repeated, each segment starts at a BOS, stays inside
    its document, is cut at max_seq_len (or to fit, for a rank's last), ranks in order and
    disjoint, exactly tokens+1 tokens per rank. Returns the number of overflow segments."""
    assert len(plan) == num_ranks
    index_of = {int(p): k for k, p in enumerate(bos)}
    doc, prev_end, overflows = first_doc, -1, 0
    for segments in plan:
        assert 1 <= len(segments) <= max_docs
        assert sum(e - s for s, e in segments) == tokens + 1
        for k, (s, e) in enumerate(segments):
            assert isinstance(s, int) and isinstance(e, int)
            assert s in index_of, f"segment {(s, e)} does not start at a BOS"
            assert index_of[s] == doc, "a document was skipped or repeated"
            assert prev_end <= s < e <= shard_len, "segments overlap or are out of order"
            last = k == len(segments) - 1
            if k == max_docs - 1:  # overflow: takes all the rank still needs, across documents
                assert last
                overflows += 1
                doc = int(np.searchsorted(bos, e))  # the first document starting at or after e
            else:
                doc_end = int(bos[doc + 1]) if doc + 1 < len(bos) else shard_len
                assert e - s <= max_seq_len
                assert e <= doc_end, "a segment crosses a document boundary"
                if not last:  # only a rank's last segment may be cut short of min(doc, cap)
                    assert e == min(doc_end, s + max_seq_len)
                doc += 1
            prev_end = e
    assert next_doc == doc
    return overflows


class Corpus:
    """Small shard files whose tokens trace back to their position: a non-BOS token's id is its
    global position over all files (so total < 50000 keeps ids unique and below BOS). Files after
    the first begin with a BOS-less fragment, as if a document straddled the boundary."""

    def __init__(self, shards_mod, directory, prefix, sizes, seed, min_len=2, max_len=300):
        assert sum(sizes) < 50000
        rng = np.random.default_rng(seed)
        self.paths, arrays, offset = [], [], 0
        for f, size in enumerate(sizes):
            pieces = [np.zeros(int(rng.integers(1, 20)) if f else 0, dtype=bool)]
            length = len(pieces[0])
            while length < size:
                n = int(rng.integers(min_len, max_len + 1))
                pieces.append(np.arange(n) == 0)
                length += n
            doc_start = np.concatenate(pieces)[:size]
            positions = offset + np.arange(size)
            ids = np.where(doc_start, BOS, positions)
            # a doc cut by the file end can't be shorter than 2 (keeps every segment decodable)
            if ids[-1] == BOS:
                ids[-1] = positions[-1]
            path = directory / f"{prefix}_{f:06d}.bin"
            shards_mod.write_shard(path, ids.astype(np.uint16))
            self.paths.append(str(path))
            arrays.append(ids)
            offset += size
        self.arrays = arrays
        self.all = np.concatenate(arrays)
        self.file_start = np.cumsum([0] + list(sizes))
        self.bos = np.flatnonzero(self.all == BOS)
        self.pattern = str(directory / f"{prefix}_*.bin")

    def file_of(self, g):
        return int(np.searchsorted(self.file_start, g, side="right")) - 1

    def next_bos(self, g):
        """First BOS strictly after global position g (any file), or None."""
        k = int(np.searchsorted(self.bos, g, side="right"))
        return int(self.bos[k]) if k < len(self.bos) else None

    def first_bos_of_file(self, f):
        k = int(np.searchsorted(self.bos, self.file_start[f]))
        return int(self.bos[k])

    def decode(self, inputs, targets, cu, max_seq_len, max_docs):
        """Trace one training batch back to the files: returns [(global start, length)] of its
        segments, after checking each is a whole-or-capped document slice of one file."""
        inputs, targets, cu = inputs.numpy(), targets.numpy(), cu.numpy()
        T = len(inputs)
        buf = np.concatenate([inputs, targets[-1:]]).astype(np.int64)
        bounds = sorted(set(cu.tolist()))
        ranges = [[a, b] for a, b in zip(bounds, bounds[1:])]
        ranges[-1][1] = T + 1  # the last segment's final token is only a target
        if buf[T] == BOS and ranges[-1][1] - ranges[-1][0] > 1:  # last segment cut to its BOS
            ranges[-1][1] = T
            ranges.append([T, T + 1])
        assert len(ranges) < max_docs, "test data hit the max_docs overflow segment"
        segs = []
        for a, b in ranges:
            vals = buf[a:b]
            assert vals[0] == BOS, "a segment does not start at a BOS"
            assert not (vals[1:] == BOS).any(), "a segment crosses a document boundary"
            if b - a >= 2:
                start = int(vals[1]) - 1
                assert np.array_equal(vals[1:], np.arange(start + 1, start + (b - a))), "not one file slice"
            else:  # a lone BOS: the document after the previous segment's
                start = self.next_bos(segs[-1][0])
            segs.append((start, b - a))
        file = self.file_of(segs[0][0])
        for k, (start, n) in enumerate(segs):
            assert self.all[start] == BOS
            assert self.file_of(start) == file and self.file_of(start + n - 1) == file
            assert n <= max_seq_len
            nb = self.next_bos(start)
            doc_end = min(nb if nb is not None else len(self.all), int(self.file_start[file + 1]))
            assert start + n <= doc_end
            if k < len(segs) - 1:
                assert n == min(doc_end - start, max_seq_len), "a document was cut short"
                assert segs[k + 1][0] == nb, "a document was skipped"
        return segs


def batch_tokens(batch):
    """The T+1 tokens of a training batch (inputs and the final target)."""
    inputs, targets, _ = batch
    return np.concatenate([inputs.numpy(), targets.numpy()[-1:]])


def make_loader(pattern, rank, world, log):
    """A TrainLoader for one rank of `world`, told its accumulation steps where it accepts them
    (the fix proposed for the cross-shard test below plans a whole 8-rank step at once)."""
    kwargs = {"grad_accum": RANKS // world} if "grad_accum" in inspect.signature(tg.TrainLoader).parameters else {}
    return tg.TrainLoader(pattern, rank, world, CPU, log=log, **kwargs)


def gather_steps(pattern, world, schedule, log=None):
    """One TrainLoader per rank of `world`; for each (tokens, max_seq_len) step, 8 // world
    micro-batches per rank, in (micro-batch, rank) order -- the order of 8 ranks' slices."""
    loaders = [make_loader(pattern, r, world, log or (lambda _: None)) for r in range(world)]
    out = []
    for tokens, max_seq_len in schedule:
        for _ in range(RANKS // world):
            for loader in loaders:
                out.append(loader.next_batch(tokens, max_seq_len))
    return out, loaders


# ---------------------------------------------------------------------------------------------
# shard headers and find_shards
# ---------------------------------------------------------------------------------------------

def test_read_shard_header_good(shards, tmp_path):
    path = tmp_path / "good.bin"
    shards.write_shard(path, np.array([BOS, 0, 65535, 32768, 7], dtype=np.uint16))
    assert tg.read_shard_header(str(path)) == 5
    shards.write_shard(tmp_path / "empty.bin", np.array([], dtype=np.uint16))
    assert tg.read_shard_header(str(tmp_path / "empty.bin")) == 0


@pytest.mark.parametrize("kind, fragments", [
    ("magic", ["magic", "12345", "20240520"]),
    ("version", ["version 7", "expected 1"]),
    ("shorter_than_header", [": 100 bytes", "1024-byte header"]),
    ("empty_file", [": 0 bytes", "1024-byte header"]),
    ("truncated_tokens", ["10 tokens", "1044 bytes", "1040 bytes", "truncated"]),
    ("count_too_big", ["11 tokens", "1046 bytes", "1044 bytes"]),
    ("extra_bytes", ["10 tokens", "1044 bytes", "1046 bytes"]),
    ("negative_count", ["-3 tokens", "1044 bytes"]),
])
def test_read_shard_header_defects(damaged_shard, tmp_path, kind, fragments):
    path = tmp_path / f"{kind}.bin"
    damaged_shard(path, kind)
    with pytest.raises(tg.ShardError) as info:
        tg.read_shard_header(str(path))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_find_shards_sorted_and_missing(shards, tmp_path):
    for name in ["d_000002.bin", "d_000000.bin", "d_000001.bin", "other.bin"]:
        shards.write_shard(tmp_path / name, np.array([BOS, 1], dtype=np.uint16))
    assert tg.find_shards(str(tmp_path / "d_*.bin")) == [str(tmp_path / f"d_00000{i}.bin") for i in range(3)]
    pattern = str(tmp_path / "nothing_*.bin")
    with pytest.raises(FileNotFoundError) as info:
        tg.find_shards(pattern)
    assert pattern in str(info.value) and "cached_fineweb10B.py" in str(info.value)
    with pytest.raises(FileNotFoundError):
        tg.TrainLoader(pattern, 0, 1, CPU)


def test_a_folder_matching_the_pattern_is_named_not_read(shards, tmp_path):
    """A folder as TRAIN_FILES (or among a pattern's matches) is a one-line ShardError: its size
    (4096 bytes on most file systems) would otherwise pass the header's size check."""
    shards.write_shard(tmp_path / "d_000000.bin", np.array([BOS, 1], dtype=np.uint16))
    (tmp_path / "d_000001.bin").mkdir()
    for pattern in (str(tmp_path / "d_*.bin"), str(tmp_path)):
        with pytest.raises(tg.ShardError, match="a folder, not a token shard") as info:
            tg.find_shards(pattern)
        assert "*_train_*.bin" in str(info.value)
    with pytest.raises(tg.ShardError, match="a folder"):
        tg.ValidationSet(str(tmp_path / "d_*.bin"), 64, 64, 0, 1, CPU)


def test_corrupt_file_among_good_fails_fast(shards, damaged_shard, tmp_path):
    for i in range(3):
        shards.write_shard(tmp_path / f"d_{i:06d}.bin", np.array([BOS, 1, 2, 3] * 200, dtype=np.uint16))
    bad = tmp_path / "d_000003.bin"  # the last file: only reached after a full pass if not checked up front
    damaged_shard(bad, "truncated_tokens")
    pattern = str(tmp_path / "d_*.bin")
    for construct in (lambda: tg.find_shards(pattern),
                      lambda: tg.TrainLoader(pattern, 0, 1, CPU),
                      lambda: tg.ValidationSet(pattern, 64, 64, 0, 1, CPU)):
        with pytest.raises(tg.ShardError, match="truncated") as info:
            construct()
        assert str(bad) in str(info.value)


def test_shard_reads_all_uint16_ids(shards, tmp_path):
    tokens = np.array([7, BOS, 65535, 32768, 32767, 0, BOS, BOS, 50255, 50257], dtype=np.uint16)
    shards.write_shard(tmp_path / "s.bin", tokens)
    shard = tg.Shard(str(tmp_path / "s.bin"), pin_memory=False)
    assert shard.tokens.dtype == np.uint16 and np.array_equal(shard.tokens, tokens)
    assert shard.bos.tolist() == [1, 6, 7]
    assert shard.path == str(tmp_path / "s.bin")


# ---------------------------------------------------------------------------------------------
# planner
# ---------------------------------------------------------------------------------------------

SEEDS = [0, 1, 2]
COMBOS = [(1024, 2048), (2048, 256), (4096, 896), (1023, 1023), (777, 100)]  # (tokens, max_seq_len)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_plan_properties(seed, num_ranks):
    shard, bos = random_docs(seed, 500_000, lead=37)
    for tokens, max_seq_len in COMBOS:
        max_docs = tg.max_docs_per_batch(tokens)
        plans = plan_all(bos, len(shard), tokens, num_ranks, max_seq_len, max_docs)
        assert len(plans) >= 2
        cursor = 0
        for plan, next_doc in plans:
            assert check_plan(plan, next_doc, bos, len(shard), cursor, tokens, num_ranks,
                              max_seq_len, max_docs) == 0
            for segments in plan:
                assert all(e - s <= max_seq_len for s, e in segments)
                assert shard[segments[0][0]] == BOS
            cursor = next_doc
        # the shard ran out: not enough documents left after the last plan
        assert tg.plan_batch(bos, cursor, len(shard), tokens, num_ranks, max_seq_len, max_docs) is None
        # deterministic: same input, same plan (on fresh copies)
        again = plan_all(bos.copy(), len(shard), tokens, num_ranks, max_seq_len, max_docs)
        assert again == plans


@pytest.mark.parametrize("seed", SEEDS)
def test_plan_truncates_and_cuts(seed):
    """The combos above really exercise truncation at max_seq_len and the cut-to-fit last
    segment (so the properties are not vacuous)."""
    shard, bos = random_docs(seed, 200_000)
    plans = plan_all(bos, len(shard), 2048, 4, 256, tg.max_docs_per_batch(2048))
    lengths = [e - s for plan, _ in plans for segments in plan for s, e in segments]
    doc_lengths = dict(zip(bos.tolist(), np.diff(np.append(bos, len(shard))).tolist()))
    starts = [s for plan, _ in plans for segments in plan for s, _ in segments]
    assert lengths.count(256) > 10
    assert any(n < doc_lengths[s] and n < 256 for s, n in zip(starts, lengths))  # cut to fit
    assert any(n == doc_lengths[s] for s, n in zip(starts, lengths))  # whole documents


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tokens, max_seq_len", COMBOS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_plan_same_tokens_for_every_world_size(seed, tokens, max_seq_len, world):
    """8 ranks in one plan == `world` ranks planned 8 // world times in sequence."""
    shard, bos = random_docs(seed, 500_000, lead=5)
    max_docs = tg.max_docs_per_batch(tokens)
    steps = plan_all(bos, len(shard), tokens, RANKS, max_seq_len, max_docs)
    assert len(steps) >= 2
    cursor = 0
    for plan8, next8 in steps:
        slices = []
        for _ in range(RANKS // world):
            planned = tg.plan_batch(bos, cursor, len(shard), tokens, world, max_seq_len, max_docs)
            assert planned is not None
            slices += planned[0]
            cursor = planned[1]
        assert slices == plan8 and cursor == next8


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("max_docs", [1, 2, 3, 5])
@pytest.mark.parametrize("num_ranks", [1, 4])
def test_plan_overflow_segment(seed, max_docs, num_ranks):
    """With few cu_seqlens slots the (max_docs)-th segment takes all the rank still needs, across
    documents and beyond max_seq_len; the rank still gets exactly tokens+1 tokens."""
    shard, bos = random_docs(seed, 150_000, max_len=600)
    tokens, max_seq_len = 2048, 64
    plans = plan_all(bos, len(shard), tokens, num_ranks, max_seq_len, max_docs)
    assert len(plans) >= 3
    cursor = 0
    for plan, next_doc in plans:
        overflows = check_plan(plan, next_doc, bos, len(shard), cursor, tokens, num_ranks, max_seq_len, max_docs)
        assert overflows == num_ranks  # 2049 tokens never fit in max_docs - 1 segments of <= 64
        for segments in plan:
            assert len(segments) == max_docs
            s, e = segments[-1]
            assert e - s > max_seq_len and (shard[s + 1:e] == BOS).any()  # spans documents
        cursor = next_doc
    assert tg.plan_batch(bos, cursor, len(shard), tokens, num_ranks, max_seq_len, max_docs) is None


def test_plan_returns_none_when_the_shard_runs_out():
    def doc(n):
        return [BOS] + [1] * (n - 1)

    def plan(tokens_list, first_doc, tokens, num_ranks=1, max_seq_len=10_000, max_docs=16):
        arr = np.array(tokens_list)
        return tg.plan_batch(np.flatnonzero(arr == BOS), first_doc, len(arr), tokens, num_ranks,
                             max_seq_len, max_docs)

    shard = [5, 5] + doc(30) + doc(20) + doc(11)  # 2 straddling tokens, BOS at 2, 32, 52
    assert plan(shard, 3, 10) is None  # cursor past the last document
    assert plan([5] * 50, 0, 10) is None  # no BOS at all
    assert plan(shard, 2, 10) == ([[(52, 63)]], 3)  # last document exactly tokens+1 long
    assert plan(shard, 2, 11) is None  # one token short
    assert plan(shard, 0, 60) == ([[(2, 32), (32, 52), (52, 63)]], 3)  # exactly the rest
    assert plan(shard, 0, 61) is None
    # a second rank that doesn't fit discards the whole plan (no half plan)
    assert plan(shard, 0, 29, num_ranks=2) == ([[(2, 32)], [(32, 52), (52, 62)]], 3)
    assert plan(shard, 0, 30, num_ranks=2) is None
    # truncated documents waste their tail: 3 docs capped at 8 give 24 tokens, not 61
    assert plan(shard, 0, 23, max_seq_len=8) == ([[(2, 10), (32, 40), (52, 60)]], 3)
    assert plan(shard, 0, 24, max_seq_len=8) is None
    # overflow segment: runs to the shard end at most
    assert plan(shard, 0, 34, max_seq_len=4, max_docs=2) == ([[(2, 6), (32, 63)]], 3)
    assert plan(shard, 0, 35, max_seq_len=4, max_docs=2) is None  # would end past the shard
    assert plan(shard, 1, 26, max_seq_len=4, max_docs=2) is None  # overflow starts at 52, not 36
    assert plan(shard, 0, 29, max_docs=1) == ([[(2, 32)]], 1)  # ends exactly at a BOS: not skipped
    assert plan(shard, 0, 60, max_seq_len=4, max_docs=1) == ([[(2, 63)]], 3)
    assert plan(shard, 0, 40, max_seq_len=4, max_docs=1) == ([[(2, 43)]], 2)  # next doc at 52


# ---------------------------------------------------------------------------------------------
# cu_seqlens
# ---------------------------------------------------------------------------------------------

def test_cu_seqlens_example():
    cu = tg.cu_seqlens_for([3, 4, 2], 8, 5)
    assert cu.dtype == np.int32 and cu.tolist() == [0, 3, 7, 8, 8, 8]
    assert tg.cu_seqlens_for([9], 8, 1).tolist() == [0, 8]
    assert tg.cu_seqlens_for([5, 3, 1], 8, 4).tolist() == [0, 5, 8, 8, 8]  # 1-token last segment


def test_max_docs_per_batch():
    assert [tg.max_docs_per_batch(t) for t in (16384, 32768, 49152)] == [64, 96, 128]
    assert tg.max_docs_per_batch(262144) == 896  # validation chunks (T1.1)
    assert tg.max_docs_per_batch(8192) == 128 and tg.max_docs_per_batch(64) == 16


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tokens, max_seq_len, max_docs", [(1024, 2048, None), (2048, 256, None),
                                                           (4096, 896, None), (2048, 64, 3)])
def test_cu_seqlens_matches_segments(seed, tokens, max_seq_len, max_docs):
    shard, bos = random_docs(seed, 100_000)
    max_docs = max_docs or tg.max_docs_per_batch(tokens)
    for plan, _ in plan_all(bos, len(shard), tokens, 2, max_seq_len, max_docs):
        for segments in plan:
            lengths = [e - s for s, e in segments]
            cu = tg.cu_seqlens_for(lengths, tokens, max_docs)
            n = len(lengths)
            assert cu.dtype == np.int32 and cu.shape == (max_docs + 1,)
            assert cu[0] == 0 and cu[-1] == tokens and (np.diff(cu) >= 0).all()
            assert (cu[n:] == tokens).all()
            assert np.diff(cu[: n + 1]).tolist() == lengths[:-1] + [lengths[-1] - 1]


# ---------------------------------------------------------------------------------------------
# TrainLoader
# ---------------------------------------------------------------------------------------------

def test_train_batches_format_content_and_shape_changes(shards, tmp_path):
    corpus = Corpus(shards, tmp_path, "train", [30000], seed=3)
    loader = tg.TrainLoader(corpus.pattern, 0, 1, CPU)
    prev = None
    for tokens, max_seq_len in [(256, 128), (256, 128), (512, 300), (128, 64), (1000, 1000), (256, 128)]:
        inputs, targets, cu = batch = loader.next_batch(tokens, max_seq_len)
        max_docs = tg.max_docs_per_batch(tokens)
        assert inputs.dtype == torch.int32 and targets.dtype == torch.int32 and cu.dtype == torch.int32
        assert inputs.shape == (tokens,) and targets.shape == (tokens,) and cu.shape == (max_docs + 1,)
        assert inputs.device.type == "cpu"
        assert inputs[0] == BOS
        assert torch.equal(targets[:-1], inputs[1:])
        assert cu[0] == 0 and cu[-1] == tokens and (cu.diff() >= 0).all()
        assert all(inputs[int(c)] == BOS for c in cu if c < tokens)  # boundaries at BOS
        segs = corpus.decode(inputs, targets, cu, max_seq_len, max_docs)
        if prev is not None:  # consecutive documents across calls, even when the shape changes
            assert segs[0][0] == corpus.next_bos(prev[-1][0])
        prev = segs
        assert np.array_equal(batch_tokens(batch), np.concatenate([corpus.all[s:s + n] for s, n in segs]))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_ranks_are_ordered_slices(shards, tmp_path, world):
    corpus = Corpus(shards, tmp_path, "train", [20000], seed=4)
    loaders = [tg.TrainLoader(corpus.pattern, r, world, CPU) for r in range(world)]
    for _ in range(2):
        segs = [corpus.decode(*loader.next_batch(200, 150), 150, tg.max_docs_per_batch(200)) for loader in loaders]
        for a, b in zip(segs, segs[1:]):  # rank r+1 starts at the document after rank r's last
            assert b[0][0] == corpus.next_bos(a[-1][0])


def test_world_sizes_see_the_same_tokens_within_a_shard(shards, tmp_path):
    """World W with 8 // W micro-batches gathers exactly world 8's batches, in order, step after
    step, across batch-size / max_seq_len changes."""
    corpus = Corpus(shards, tmp_path, "train", [45000, 3000], seed=5)
    schedule = [(256, 128), (512, 200), (384, 384), (128, 128), (256, 128)]
    reference, _ = gather_steps(corpus.pattern, 8, schedule)
    for k, batch in enumerate(reference):  # sanity: all from the first file, valid batches
        tokens, max_seq_len = schedule[k // RANKS]
        segs = corpus.decode(*batch, max_seq_len, tg.max_docs_per_batch(tokens))
        assert corpus.file_of(segs[0][0]) == 0
    for world in (1, 2, 4):
        batches, _ = gather_steps(corpus.pattern, world, schedule)
        assert len(batches) == len(reference)
        for got, want in zip(batches, reference):
            for a, b in zip(got, want):
                assert torch.equal(a, b)


def test_world_sizes_see_the_same_tokens_across_shards(shards, tmp_path):
    corpus = Corpus(shards, tmp_path, "train", [5000, 5000, 5000], seed=6)
    schedule = [(128, 100)] * 12  # several shard boundaries and wraps
    reference, _ = gather_steps(corpus.pattern, 8, schedule)
    files = [corpus.file_of(corpus.decode(*b, 100, tg.max_docs_per_batch(128))[0][0]) for b in reference]
    if [f for k, f in enumerate(files) if k == 0 or f != files[k - 1]][:4] != [0, 1, 2, 0]:
        pytest.fail(f"test data should cross shard boundaries and wrap, got files {files}")  # not an xfail
    for world in (1, 2, 4):
        batches, _ = gather_steps(corpus.pattern, world, schedule)
        for k, (got, want) in enumerate(zip(batches, reference)):
            assert np.array_equal(batch_tokens(got), batch_tokens(want)), (world, k)


def test_next_shard_is_loaded_in_the_background(shards, tmp_path, monkeypatch):
    corpus = Corpus(shards, tmp_path, "train", [3000, 3000, 3000], seed=7)
    built = []
    real_shard = tg.Shard

    class RecordingShard(real_shard):
        def __init__(self, path, pin_memory, vocab_size=None):
            built.append((path, threading.current_thread() is threading.main_thread()))
            super().__init__(path, pin_memory, vocab_size)

    monkeypatch.setattr(tg, "Shard", RecordingShard)
    loader = tg.TrainLoader(corpus.pattern, 0, 1, CPU)
    assert loader._next_shard.result().path == corpus.paths[1]
    assert built == [(corpus.paths[0], True), (corpus.paths[1], False)]
    files = []
    while not files or files[-1] == 0:
        segs = corpus.decode(*loader.next_batch(256, 200), 200, tg.max_docs_per_batch(256))
        files.append(corpus.file_of(segs[0][0]))
        first = segs[0][0]
    assert len(files) >= 3 and set(files[:-1]) == {0} and files[-1] == 1
    assert first == corpus.first_bos_of_file(1)  # file 2 is planned from its first document
    assert loader.shard.path == corpus.paths[1]
    assert loader._next_shard.result().path == corpus.paths[2]
    assert built[2] == (corpus.paths[2], False)


@pytest.mark.parametrize("sizes, world", [([2500, 2000, 3000], 1), ([2500, 2000, 3000], 2), ([2600], 1)])
def test_cycles_over_files_and_logs_each_pass(shards, tmp_path, sizes, world):
    corpus = Corpus(shards, tmp_path, "train", sizes, seed=8)
    logs = []
    loaders = [tg.TrainLoader(corpus.pattern, r, world, CPU, log=logs.append) for r in range(world)]
    tokens, max_seq_len = 200, 150
    max_docs = tg.max_docs_per_batch(tokens)
    history = []  # (file, pass messages so far, rank 0's batch tokens)
    while len(logs) < 3 * world:  # until pass 4 starts
        per_rank = [loader.next_batch(tokens, max_seq_len) for loader in loaders]
        files = {corpus.file_of(corpus.decode(*b, max_seq_len, max_docs)[0][0]) for b in per_rank}
        assert len(files) == 1  # all ranks on the same shard, every batch valid
        history.append((files.pop(), len(logs), batch_tokens(per_rank[0])))
        assert len(history) < 500
    n = len(sizes)
    assert logs == [f"data: starting pass {p} over {n} train files" for p in (2, 3, 4) for _ in range(world)]
    # files in order, wrapping; each loader's message comes with the first batch of a new pass
    for (f0, l0, _), (f1, l1, _) in zip(history, history[1:]):
        assert f1 in (f0, (f0 + 1) % n)
        assert l1 - l0 in (0, world)
        if n > 1:
            assert (l1 != l0) == (f1 == 0 and f0 != 0)
    assert history[-1][0] == 0
    # each pass replays the same batches (each file planned from its first document)
    per_pass = {}
    for f, logged, toks in history:
        per_pass.setdefault(logged // world, []).append(toks)
    assert len(per_pass[0]) > n
    for p in (1, 2):
        assert len(per_pass[p]) == len(per_pass[0])
        assert all(np.array_equal(a, b) for a, b in zip(per_pass[p], per_pass[0]))


def test_too_small_shards_raise(shards, tmp_path):
    corpus = Corpus(shards, tmp_path, "train", [300, 300], seed=9)
    loader = tg.TrainLoader(corpus.pattern, 0, 1, CPU, log=lambda _: None)
    with pytest.raises(tg.SetupError, match="train files are too small"):
        loader.next_batch(1024, 1024)


# ---------------------------------------------------------------------------------------------
# ValidationSet
# ---------------------------------------------------------------------------------------------

def val_corpus(shards, tmp_path):
    """Three val files: 1000 + 1000 + 500 tokens; a document longer than two chunks at 1200."""
    rng = np.random.default_rng(11)
    tokens, _ = random_docs(11, 3000, min_len=2, max_len=150, lead=3)
    tokens = tokens[:2500].copy()
    tokens[1200:1800] = rng.integers(0, BOS, 600)
    tokens[1200] = BOS
    paths = []
    for f, (a, b) in enumerate([(0, 1000), (1000, 2000), (2000, 2500)]):
        paths.append(tmp_path / f"val_{f:06d}.bin")
        shards.write_shard(paths[-1], tokens[a:b])
    return tokens, str(tmp_path / "val_*.bin")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_validation_chunks(shards, tmp_path, world):
    tokens, pattern = val_corpus(shards, tmp_path)
    val_tokens, seq_len = 1536, 256  # spans the first two files (1537 tokens)
    max_docs = tg.max_docs_per_batch(seq_len)
    seen = {}
    for rank in range(world):
        vs = tg.ValidationSet(pattern, val_tokens, seq_len, rank, world, CPU)
        assert vs.tokens.dtype == np.int32 and np.array_equal(vs.tokens, tokens[: val_tokens + 1])
        assert vs.chunks == list(range(rank, 6, world))
        assert vs.rounds == max(len(range(r, 6, world)) for r in range(world))  # 6 chunks: 2 of 4 ranks get one fewer
        batches = list(vs)
        assert len(batches) == len(vs.chunks)
        for chunk, (inputs, targets, cu) in zip(vs.chunks, batches):
            lo = chunk * seq_len
            assert inputs.dtype == torch.int32 and targets.dtype == torch.int32 and cu.dtype == torch.int32
            assert np.array_equal(inputs.numpy(), tokens[lo: lo + seq_len])
            assert np.array_equal(targets.numpy(), tokens[lo + 1: lo + seq_len + 1])
            starts = [int(p) for p in np.flatnonzero(inputs.numpy() == BOS) if p > 0]
            expected = [0] + starts + [seq_len] * (max_docs + 1 - 1 - len(starts))
            assert cu.tolist() == expected
            assert chunk not in seen
            seen[chunk] = inputs.numpy().tobytes() + targets.numpy().tobytes()
    assert sorted(seen) == list(range(6))  # every chunk exactly once, whatever the world size


def test_validation_no_truncation_and_mid_document_chunks(shards, tmp_path):
    tokens, pattern = val_corpus(shards, tmp_path)
    vs = tg.ValidationSet(pattern, 1536, 256, 0, 1, CPU)
    # chunk 5 (1280..1536) lies inside the 600-token document starting at 1200: one segment
    inputs, targets, cu = vs.batch(5)
    assert inputs[0] != BOS and cu.tolist() == [0] + [256] * tg.max_docs_per_batch(256)
    assert targets[-1] == tokens[1536]  # the +1 token comes from the second file
    # chunk 4 (1024..1280) holds the document's first 80 tokens: boundary exactly at 1200 - 1024
    inputs, _, cu = vs.batch(4)
    assert 176 in cu.tolist() and inputs[176] == BOS
    assert not (inputs[177:] == BOS).any()


def test_validation_folds_excess_documents(shards, tmp_path):
    tokens, _ = random_docs(12, 2000, min_len=2, max_len=6)
    shards.write_shard(tmp_path / "v_000000.bin", tokens)
    seq_len = 256
    max_docs = tg.max_docs_per_batch(seq_len)
    vs = tg.ValidationSet(str(tmp_path / "v_*.bin"), 1024, seq_len, 0, 1, CPU)
    for chunk in vs.chunks:
        inputs, _, cu = vs.batch(chunk)
        starts = [int(p) for p in np.flatnonzero(inputs.numpy() == BOS) if p > 0]
        assert len(starts) > max_docs
        assert cu.tolist() == [0] + starts[: max_docs - 1] + [seq_len]


def test_validation_last_target_from_the_next_file(shards, tmp_path):
    """val_tokens ending exactly at a file boundary: the final target is the next file's first token."""
    tokens, pattern = val_corpus(shards, tmp_path)
    vs = tg.ValidationSet(pattern, 2000, 250, 1, 2, CPU)
    assert np.array_equal(vs.tokens, tokens[:2001]) and vs.chunks == [1, 3, 5, 7]
    _, targets, _ = vs.batch(7)
    assert targets[-1] == tokens[2000]


def test_validation_errors(shards, tmp_path):
    tokens, pattern = val_corpus(shards, tmp_path)
    with pytest.raises(ValueError, match="VAL_TOKENS=1000") as info:
        tg.ValidationSet(pattern, 1000, 256, 0, 1, CPU)
    assert not isinstance(info.value, tg.ShardError)
    with pytest.raises(tg.SetupError, match="VAL_TOKENS") as info:
        tg.ValidationSet(pattern, 2560, 256, 0, 1, CPU)
    assert "2500" in str(info.value) and "lower VAL_TOKENS" in str(info.value)
    with pytest.raises(tg.SetupError, match="needs 2501"):  # exactly val_tokens: the last target is missing
        tg.ValidationSet(pattern, 2500, 250, 0, 1, CPU)
    assert len(tg.ValidationSet(pattern, 2499, 833, 0, 1, CPU).tokens) == 2500
    with pytest.raises(FileNotFoundError, match="cached_fineweb10B.py"):
        tg.ValidationSet(str(tmp_path / "missing_*.bin"), 256, 256, 0, 1, CPU)
