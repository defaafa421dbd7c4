"""Token shards for the data scripts: the format's writer and a reader.

A shard is a 1024-byte header of 256 little-endian int32 -- [0] magic, [1] version,
[2] number of tokens, the rest zero -- followed by the tokens as little-endian uint16, so its
size is exactly HEADER_BYTES + 2 * ntokens. train_gpt.py reads the format on its own (records copy
that one file); this module keeps a copy of its reader so that the data scripts start without
importing torch (a download checks its shards in a fraction of a second instead of ~4 s), and
tests/data/test_shards.py holds the two readers to the same verdicts and messages on every defect.
"""
import os

import numpy as np

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256  # train_gpt.py's SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS
HEADER_BYTES = 4 * HEADER_INTS


class ShardError(ValueError):
    """A token shard that cannot be used: the message names the file and the defect (also .path, .defect)."""

    def __init__(self, path, defect: str):
        self.path, self.defect = os.fspath(path), defect
        super().__init__(f"{self.path}: {defect}")


def read_header(path) -> int:
    """Check a shard's magic, version and size; return its token count (train_gpt.read_shard_header's
    checks and messages)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise ShardError(path, f"{kind}, not a token shard: give a pattern of .bin files, e.g. "
                               f"{os.path.join(path, '*_train_*.bin')!r}")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardError(path, f"{size} bytes, shorter than the {HEADER_BYTES}-byte header (truncated download?)")
    magic, version, tokens = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    if magic != MAGIC:
        raise ShardError(path, f"bad magic number: expected {MAGIC}, got {magic} (not a token shard?)")
    if version != VERSION:
        raise ShardError(path, f"unsupported version {version} (expected {VERSION})")
    expected = HEADER_BYTES + 2 * tokens
    if size != expected:
        raise ShardError(path, f"size mismatch: header says {tokens} tokens = {expected} bytes, file has {size} bytes"
                               + (" (truncated? download it again)" if size < expected else ""))
    return tokens


TOKEN_BYTES = 2


def write_shard(path, tokens):
    """Write `tokens` (1-D, ids < 65536) as a shard; atomic: a reader never sees a partial file."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.dtype != np.uint16 and tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("token ids must fit in uint16 (0..65535)")
    if tokens.size >= 2**31:
        raise ValueError(f"too many tokens for one shard: {tokens.size}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, VERSION, tokens.size
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        tokens.astype("<u2", copy=False).tofile(f)
    os.replace(tmp, path)


def read_tokens(path):
    """Return the tokens of the shard at `path` as a uint16 array (validated with read_header)."""
    ntokens = read_header(path)
    tokens = np.fromfile(path, dtype="<u2", count=ntokens, offset=HEADER_BYTES)
    return tokens.astype(np.uint16, copy=False)


__all__ = ["HEADER_BYTES", "HEADER_INTS", "MAGIC", "VERSION", "TOKEN_BYTES", "ShardError", "read_header",
           "read_tokens", "write_shard"]
