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
