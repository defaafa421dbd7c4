# shared fixtures
import importlib.util
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def shards():
    """The data/shards.py module, imported by path (data/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("shards", REPO_ROOT / "data" / "shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shards):
    """Tiny train/val shards of learnable synthetic documents: arithmetic progressions of token
    ids, each after a BOS (the TINY configuration of test_training.py trains on them)."""
    import json

    import numpy as np

    from train_gpt import BOS_ID, GPT2_SPECIAL_TOKEN

    folder = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)

    def documents(n):
        out = []
        for _ in range(n):
            start, step, length = rng.integers(0, 1000), rng.integers(1, 5), rng.integers(20, 400)
            out += [BOS_ID] + [int((start + step * i) % 1000) for i in range(length)]
        return out

    for i in range(1, 4):
        shards.write_shard(str(folder / f"tiny_train_{i:06d}.bin"), documents(300))
    shards.write_shard(str(folder / "tiny_val_000000.bin"), documents(60))

    # A vocabulary for the prefix-token loss: token i spells i in base 26 (letters), so the prefix of
    # token i >= 26 is token i // 26.
    def spelling(i):
        return chr(ord("a") + i) if i < 26 else spelling(i // 26) + chr(ord("a") + i % 26)
    vocabulary = {spelling(i): i for i in range(1000)} | {GPT2_SPECIAL_TOKEN: BOS_ID}
    (folder / "encoder.json").write_text(json.dumps(vocabulary))
    return folder


@pytest.fixture
def damaged_shard(shards):
    """damaged_shard(path, kind): write a 10-token shard at path, then damage it as kind names."""
    import numpy as np

    def make(path, kind):
        shards.write_shard(path, np.arange(10, dtype=np.uint16))
        data = bytearray(path.read_bytes())
        if kind == "magic":
            data[0:4] = (12345).to_bytes(4, "little")
        elif kind == "version":
            data[4:8] = (7).to_bytes(4, "little")
        elif kind == "shorter_than_header":
            data = data[:100]
        elif kind == "empty_file":
            data = b""
        elif kind == "truncated_tokens":
            data = data[:-4]
        elif kind == "extra_bytes":
            data += b"\0\0"
        elif kind == "count_too_big":
            data[8:12] = (11).to_bytes(4, "little")
        elif kind == "negative_count":
            data[8:12] = (-3).to_bytes(4, "little", signed=True)
        path.write_bytes(bytes(data))

    return make
