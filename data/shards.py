"""Token shards for the data scripts: the writer, and the trainer's reader re-exported.

A shard is a 1024-byte header of 256 little-endian int32 -- [0] magic, [1] version,
[2] number of tokens, the rest zero -- followed by the tokens as little-endian uint16, so its
size is exactly HEADER_BYTES + 2 * ntokens. train_gpt.py owns the format (records copy that one
file, so it must read shards on its own); this module writes it with the same constants.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from train_gpt import (SHARD_HEADER_BYTES as HEADER_BYTES, SHARD_HEADER_INTS as HEADER_INTS,  # noqa: E402
                       SHARD_MAGIC as MAGIC, SHARD_VERSION as VERSION, ShardError)
from train_gpt import read_shard_header as read_header  # noqa: E402,F401

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
