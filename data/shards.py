"""Token shard file format shared by the data scripts and the trainer (numpy only, no torch).

A shard is a 1024-byte header of 256 little-endian int32 -- [0] magic, [1] version,
[2] number of tokens, the rest zero -- followed by the tokens as little-endian uint16.
The file size is therefore exactly HEADER_BYTES + 2 * ntokens.
"""
import os

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_BYTES = 2


class ShardError(ValueError):
    """A file that is not a valid shard; the message names the file and the defect."""

    def __init__(self, path, defect):
        self.path = os.fspath(path)
        self.defect = defect
        super().__init__(f"{self.path}: {defect}")


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


def read_header(path):
    """Validate the shard at `path` and return its number of tokens; raise ShardError if invalid."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise ShardError(path, f"file is shorter than the {HEADER_BYTES}-byte header ({size} bytes)")
    magic, version, ntokens = (int(x) for x in np.frombuffer(raw, dtype="<i4", count=3))
    if magic != MAGIC:
        raise ShardError(path, f"bad magic number: expected {MAGIC}, got {magic} (not a token shard?)")
    if version != VERSION:
        raise ShardError(path, f"unsupported version {version} (expected {VERSION})")
    if ntokens < 0:
        raise ShardError(path, f"negative token count {ntokens} in header")
    expected = HEADER_BYTES + TOKEN_BYTES * ntokens
    if size != expected:
        hint = " (truncated?)" if size < expected else ""
        raise ShardError(path, f"size mismatch: header says {ntokens} tokens = {expected} bytes, "
                               f"file has {size} bytes{hint}")
    return ntokens


def read_tokens(path):
    """Return the tokens of the shard at `path` as a uint16 array (validated with read_header)."""
    ntokens = read_header(path)
    tokens = np.fromfile(path, dtype="<u2", count=ntokens, offset=HEADER_BYTES)
    return tokens.astype(np.uint16, copy=False)
