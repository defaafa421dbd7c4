"""Helpers shared by the test files (`from helpers import ...`; pytest puts tests/ on the path)."""
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def float64_orthogonalize(G, method: str = "polar_express"):
    """The optimizer's polynomial iteration in float64: the function the bf16 paths approximate."""
    import train_gpt as T
    coeffs, safety, eps = T.ORTHOGONALIZERS[method]
    X = G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * safety + eps)
    tall = X.size(-2) > X.size(-1)
    for a, b, c in coeffs:
        A = X.mT @ X if tall else X @ X.mT
        B = b * A + c * A @ A
        X = a * X + (X @ B if tall else B @ X)
    return X


def run_in_triton_interpreter(code: str, timeout: int = 900):
    """Run a check script in a fresh interpreter with TRITON_INTERPRET=1 (the flag must be set
    before Triton is imported), from the repository root with tests/ importable; fail with its output."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def write_tiny_corpus(folder, write_shard):
    """Tiny train/val shards of learnable synthetic documents (arithmetic progressions of token ids,
    each after a BOS) and an encoder.json for the prefix-token loss, in folder (a pathlib.Path).
    The tiny training configurations of the tests train on it."""
    import json

    import numpy as np

    from train_gpt import BOS_ID, GPT2_SPECIAL_TOKEN

    rng = np.random.default_rng(0)

    def documents(n):
        out = []
        for _ in range(n):
            start, step, length = rng.integers(0, 1000), rng.integers(1, 5), rng.integers(20, 400)
            out += [BOS_ID] + [int((start + step * i) % 1000) for i in range(length)]
        return out

    for i in range(1, 4):
        write_shard(str(folder / f"tiny_train_{i:06d}.bin"), documents(300))
    write_shard(str(folder / "tiny_val_000000.bin"), documents(60))

    # Token i spells i in base 26 (letters), so the prefix of token i >= 26 is token i // 26.
    def spelling(i):
        return chr(ord("a") + i) if i < 26 else spelling(i // 26) + chr(ord("a") + i % 26)
    vocabulary = {spelling(i): i for i in range(1000)} | {GPT2_SPECIAL_TOKEN: BOS_ID}
    (folder / "encoder.json").write_text(json.dumps(vocabulary))
    return folder


def cpu_execution(hp=None, tokens: int = 256, training: bool = True):
    """The execution plan train_gpt resolves for a forward of `tokens` tokens on the CPU (hp: the
    defaults on the CPU if not given): torch paths only, and the fused MLP from its token threshold."""
    import torch

    import train_gpt as T
    hp = hp or T.Hyperparameters.of(device="cpu")
    return T.resolve_execution(hp.execution, hp.model, torch.device("cpu"), tokens, training)
