# shared fixtures
import ctypes
import ctypes.util
import importlib.util
import os
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

# Under pytest-xdist (`-n 2`, the README's test command) the cores are shared out among the workers:
# each worker, and every process its tests start (main() runs, Triton interpreter scripts), gets its
# share of OpenMP threads. Set before helpers imports torch. Two workers with torch's default of one
# thread per core oversubscribe the cores, and OpenMP's spinning threads then take turns (README, Tests).
# The numbers do not depend on it: the tests that compare two runs bit for bit run both in one process,
# and tests/reference_losses.json is recorded and checked on one thread.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                      // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

from torch._library.custom_ops import CustomOpDef  # noqa: E402  (after the thread count: torch reads it)


def pytest_configure(config):
    """helpers' set-up before any test module is collected: CPU bf16/fp16 GEMMs as fp32 products rounded
    once, as every CPU run of train_gpt.py has them (train_gpt.cpu_16bit_gemms_in_fp32)."""
    import helpers  # noqa: F401


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)


@pytest.fixture(autouse=True)
def keep_freed_memory():
    """helpers.CPU_MALLOC in this process for each test (the in-process tiny runs take about half the
    time), then glibc's defaults again and the kept memory returned, so that the processes the next
    test starts (gloo world sizes) have it. A no-op without glibc."""
    if _LIBC is None:
        yield
        return
    _LIBC.mallopt(M_MMAP_MAX, 0)
    _LIBC.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # an int: the tunable's 16 GiB does not fit
    try:
        yield
    finally:
        _LIBC.mallopt(M_MMAP_MAX, 65536)
        _LIBC.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
        _LIBC.malloc_trim(0)


def replaced_custom_ops() -> list[str]:
    """The custom ops of the imported train_gpt that the dispatcher no longer holds as this module's: a
    second execution of a train_gpt.py in the process (a copy loaded by path) registers the same names
    again and torch drops the first registrations, so the first module's ops call a freed operator (a
    segfault or a nonsense error in some later test). Empty while train_gpt is not imported."""
    module = sys.modules.get("train_gpt")
    if module is None:
        return []
    return [op._qualname for op in vars(module).values() if isinstance(op, CustomOpDef)
            and getattr(getattr(module.torch.ops, op._namespace), op._name).default is not op._opoverload]


@pytest.fixture(autouse=True)
def train_gpt_keeps_its_custom_ops():
    """Fail the test that replaced train_gpt's custom ops (replaced_custom_ops), not the later ones that
    would crash on them: load other train_gpt.py files in a subprocess."""
    before = replaced_custom_ops()
    yield
    replaced = replaced_custom_ops()
    who = "an earlier test in this process" if before else "this test"
    assert not replaced, (f"{who} registered train_gpt's custom ops again ({', '.join(replaced)}): "
                          "load another train_gpt.py in a subprocess")


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
    """Tiny train/val shards of learnable synthetic documents and a vocabulary (helpers.write_tiny_corpus)."""
    from helpers import write_tiny_corpus

    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"), shards.write_shard)


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
