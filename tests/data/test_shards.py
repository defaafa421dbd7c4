import numpy as np
import pytest


def test_round_trip(shards, tmp_path):
    path = tmp_path / "good.bin"
    tokens = np.array([50256, 0, 1, 65535, 15496, 995], dtype=np.uint16)
    shards.write_shard(path, tokens)
    assert path.stat().st_size == shards.HEADER_BYTES + 2 * tokens.size
    header = np.fromfile(path, dtype="<i4", count=shards.HEADER_INTS)
    assert header[:3].tolist() == [shards.MAGIC, shards.VERSION, tokens.size] and not header[3:].any()
    assert shards.read_header(path) == tokens.size
    got = shards.read_tokens(path)
    assert got.dtype == np.uint16 and np.array_equal(got, tokens)
    assert not (tmp_path / "good.bin.tmp").exists()


def test_empty_shard(shards, tmp_path):
    shards.write_shard(tmp_path / "empty.bin", np.array([], dtype=np.uint16))
    assert shards.read_header(tmp_path / "empty.bin") == 0
    assert shards.read_tokens(tmp_path / "empty.bin").size == 0


def test_write_rejects_ids_beyond_uint16(shards, tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        shards.write_shard(tmp_path / "x.bin", [1, 65536])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kind, fragments", [
    ("magic", ["bad magic", "expected 20240520", "got 12345"]),
    ("version", ["unsupported version 7"]),
    ("shorter_than_header", ["shorter than the 1024-byte header", "100 bytes"]),
    ("truncated_tokens", ["size mismatch", "10 tokens = 1044 bytes", "file has 1040 bytes", "truncated"]),
    ("extra_bytes", ["size mismatch", "10 tokens = 1044 bytes", "file has 1046 bytes"]),
])
def test_defects_raise_shard_error(shards, damaged_shard, tmp_path, kind, fragments):
    path = tmp_path / f"{kind}.bin"
    damaged_shard(path, kind)
    for read in (shards.read_header, shards.read_tokens):
        with pytest.raises(shards.ShardError) as info:
            read(path)
        message = str(info.value)
        assert str(path) in message and info.value.path == str(path)
        for fragment in fragments:
            assert fragment in message


@pytest.mark.parametrize("kind", ["good", "empty", "magic", "version", "shorter_than_header", "empty_file",
                                  "truncated_tokens", "extra_bytes", "count_too_big", "negative_count", "folder",
                                  "missing"])
def test_the_data_scripts_reader_is_the_trainers(shards, damaged_shard, tmp_path, kind):
    """data/shards.py reads shards without importing train_gpt (so without torch): on every file the
    two readers give the same token count or the same one-line error, and they share the format."""
    import train_gpt

    path = tmp_path / f"{kind}.bin"
    if kind == "good":
        shards.write_shard(path, np.arange(7, dtype=np.uint16))
    elif kind == "empty":
        shards.write_shard(path, np.array([], dtype=np.uint16))
    elif kind == "folder":
        path.mkdir()
    elif kind != "missing":
        damaged_shard(path, kind)
    verdicts = []
    for read in (shards.read_header, train_gpt.read_shard_header):
        try:
            verdicts.append(("tokens", read(str(path))))
        except (shards.ShardError, train_gpt.ShardError) as err:
            verdicts.append(("error", str(err), err.path, err.defect))
    assert verdicts[0] == verdicts[1]
    assert (verdicts[0][0] == "tokens") == (kind in ("good", "empty"))
    assert (shards.MAGIC, shards.VERSION, shards.HEADER_INTS, shards.HEADER_BYTES) == (
        train_gpt.SHARD_MAGIC, train_gpt.SHARD_VERSION, train_gpt.SHARD_HEADER_INTS, train_gpt.SHARD_HEADER_BYTES)


def test_the_data_scripts_do_not_import_torch():
    """A download or a tokenization starts without torch: data/shards.py and the scripts that use it."""
    import subprocess
    import sys

    from helpers import ROOT

    code = ("import sys; sys.path[:0] = ['data', 'data/smoke']; import shards, cached_fineweb10B, tokenize_docs; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
