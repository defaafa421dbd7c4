"""Microbenchmark (BENCH.md mode 3): batched Polar Express, Triton symmetric kernels vs plain torch,
on the real bank shapes. Checks both against a float64 run of the same iteration first.

    python bench/bench_orthogonalize.py
"""
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

SHAPES = [(24, 768, 768), (24, 3072, 768), (12, 3072, 768), (64, 256, 768)]
REFERENCE_MS = {(24, 768, 768): (0.91, 0.78), (24, 3072, 768): (2.59, 2.00),
                (12, 3072, 768): (1.34, 1.07), (64, 256, 768): (0.42, 0.86)}  # BENCH.md: torch, reference Triton


def float64_iteration(G):
    coeffs, safety, eps = T.ORTHOGONALIZERS["polar_express"]
    X = G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * safety + eps)
    tall = X.size(-2) > X.size(-1)
    for a, b, c in coeffs:
        A = X.mT @ X if tall else X @ X.mT
        X = a * X + (X @ (b * A + c * A @ A) if tall else (b * A + c * A @ A) @ X)
    return X


def main():
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = []
    for shape in SHAPES:
        G = torch.randn(shape, device="cuda")
        ref = float64_iteration(G)
        errors = {}
        for use_triton in (False, True):
            out = T.orthogonalize(G, use_triton=use_triton)
            errors[use_triton] = ((out.double() - ref).norm() / ref.norm()).item()
        inputs = [torch.randn(shape, device="cuda") for _ in range(4)]  # rotate: no cache effects
        times = {}
        for use_triton in (False, True):
            i = iter(range(10 ** 9))
            times[use_triton] = do_bench(lambda: T.orthogonalize(inputs[next(i) % 4], use_triton=use_triton),
                                         warmup=50, rep=300, return_mode="median")
        rows.append((shape, times[False], times[True], errors[False], errors[True]))
    print(f"{'shape':>18} | {'torch ms':>8} | {'triton ms':>9} | {'ref torch':>9} | {'ref triton':>10} | err torch | err triton")
    for shape, t_torch, t_triton, e_torch, e_triton in rows:
        ref_torch, ref_triton = REFERENCE_MS[shape]
        print(f"{str(shape):>18} | {t_torch:8.3f} | {t_triton:9.3f} | {ref_torch:9.2f} | {ref_triton:10.2f} | {e_torch:.2e} | {e_triton:.2e}")


if __name__ == "__main__":
    main()
