"""Microbenchmark: batched Polar Express on the real bank shapes, torch bmm vs the
symmetric Triton kernels, each eager and compiled as one graph (as the optimizer runs it). Every
variant is first checked against a float64 run of the same iteration.

    python bench/bench_orthogonalize.py            # variants per shape
    python bench/bench_orthogonalize.py --method polar_express6_l3e4   # another set of quintic_maps.MAP_SETS
    python bench/bench_orthogonalize.py --sweep    # launch configurations per kernel and size, then
                                                   # the variants again with the fastest ones

Times are do_bench medians in ms: 'events' times back-to-back calls with CUDA events (what a
launch-bound caller sees), 'graph' replays a CUDA graph of the calls (the GPU time alone).
--sweep prints the fastest (block, block_k, num_warps, num_stages) per (kernel, output size,
reduction size) as a SYMMETRIC_KERNEL_CONFIGS literal for train_gpt.py, beside torch's bmm.
"""
import argparse
import itertools
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quintic_maps as Q  # noqa: E402  the sets of maps (MAP_SETS), beside this file

# (batch, rows, cols): the reference's benchmark shapes, then the banks of one GPU in rank-slice mode (qk, vo, mlp)
SHAPES = [(24, 768, 768), (24, 3072, 768), (12, 3072, 768), (64, 256, 768),
          (60, 256, 768), (20, 768, 768), (22, 3072, 768)]
REFERENCE_MS = {(24, 768, 768): (0.91, 0.78), (24, 3072, 768): (2.59, 2.00),
                (12, 3072, 768): (1.34, 1.07), (64, 256, 768): (0.42, 0.86)}  # the reference's figures: torch, its Triton
SWEEP = [  # (kernel, batch, rows, cols) of the operand
    ("xxt", 60, 256, 768), ("ba_plus_caa", 60, 256, 256),
    ("xxt", 20, 768, 768), ("ba_plus_caa", 20, 768, 768),
    ("xtx", 22, 3072, 768), ("ba_plus_caa", 22, 768, 768),
]


def rotating(fn, inputs):
    """fn over a rotation of input sets, so repeated calls do not just hit the L2 cache."""
    state = {"i": 0}

    def call():
        state["i"] += 1
        return fn(inputs[state["i"] % len(inputs)])
    return call


def variants(method="polar_express"):
    """Set `method` through T.orthogonalize with its maps (Q.orthogonalize): torch and Triton, eager and compiled."""
    torch._dynamo.config.recompile_limit = 64  # one graph per shape and path

    def fn(G, use_triton):
        return Q.orthogonalize(G, method, use_triton)
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    return {"torch": lambda G: fn(G, False), "triton": lambda G: fn(G, True),
            "torch compiled": lambda G: compiled(G, False), "triton compiled": lambda G: compiled(G, True)}


def profile(dtype, method="polar_express"):
    """GPU time per kernel of one compiled call (torch.profiler), per reference shape and compiled path."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    compiled = {name: fn for name, fn in variants(method).items() if "compiled" in name}
    for shape in REFERENCE_MS:
        G = torch.randn(shape, device="cuda", dtype=dtype)
        for name, fn in compiled.items():
            for _ in range(3):
                fn(G)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn(G)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            events.sort(key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in events) / 10 / 1000
            print(f"{shape} {name}: {total:.3f} GPU ms per call")
            for e in events[:6]:
                print(f"    {e.device_time_total / 10 / 1000:7.4f} ms  x{e.count // 10:<3} {e.key[:90]}")


def compare_variants(dtype=torch.float32, method="polar_express"):
    rows = []
    for shape in SHAPES:
        G = torch.randn(shape, device="cuda", dtype=dtype)
        ref = Q.orthogonalize_float64(G, method)
        inputs = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4)]
        row = {"shape": shape}
        for name, fn in variants(method).items():
            out = fn(G)
            row[name] = (((out.double() - ref).norm() / ref.norm()).item(),
                         do_bench(rotating(fn, inputs), warmup=50, rep=300, return_mode="median"),
                         do_bench_cudagraph(rotating(fn, inputs), rep=300, return_mode="median"))
        rows.append(row)
    names = list(variants(method))
    print("ms per call, median; events (launch-bound caller) / graph (GPU only); rel. error vs float64 per path")
    print(f"{'shape':>16} | " + " | ".join(f"{n:>20}" for n in names) + " | ref torch / triton | error per path")
    for row in rows:
        ref = REFERENCE_MS.get(row["shape"])
        cells = [f"{row[n][1]:8.3f} / {row[n][2]:8.3f}" for n in names]
        errors = " ".join(f"{row[n][0]:.1e}" for n in names)
        print(f"{str(row['shape']):>16} | " + " | ".join(f"{c:>20}" for c in cells)
              + f" | {f'{ref[0]:.2f} / {ref[1]:.2f}' if ref else '-':>18} | {errors}")


def sweep():
    configs = [c for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (3, 4))
               if not (c[0] == 64 and c[2] == 8)]
    best_table = {}
    print(f"{'kernel':>12} {'operand':>16} | {'torch':>7} | best configs (block, block_k, warps, stages): ms")
    for kernel, batch, rows, cols in SWEEP:
        A = [torch.randn(batch, rows, cols, device="cuda").bfloat16() for _ in range(3)]
        if kernel == "ba_plus_caa":
            A = [T.xxt(a) / cols for a in A]
            fast = lambda a, cfg: T.ba_plus_caa(a, 0.5, -1.5, cfg)
            ref = lambda a: torch.baddbmm(a, a, a, beta=-1.5, alpha=0.5)
            key = (kernel, rows, rows)
        elif kernel == "xxt":
            fast, ref, key = T.xxt, (lambda a: a @ a.mT), (kernel, rows, cols)
        else:
            fast, ref, key = T.xtx, (lambda a: a.mT @ a), (kernel, cols, rows)
        torch_ms = do_bench_cudagraph(rotating(ref, A), rep=100, return_mode="median")
        results = []
        for cfg in configs:
            try:
                out = fast(A[0], cfg)
                err = ((out.float() - ref(A[0]).float()).norm() / ref(A[0]).float().norm()).item()
                if not err < 1e-2:
                    print(f"  {key} {cfg}: error {err:.1e}, skipped")
                    continue
                results.append((do_bench_cudagraph(rotating(lambda a: fast(a, cfg), A), rep=100,
                                                   return_mode="median"), cfg))
            except Exception as error:  # out of shared memory or registers for this tile shape
                print(f"  {key} {cfg}: {type(error).__name__}")
        results.sort()
        best_table[key] = results[0][1]
        top = ", ".join(f"{cfg}: {ms:.4f}" for ms, cfg in results[:3])
        print(f"{kernel:>12} {str((batch, rows, cols)):>16} | {torch_ms:7.4f} | {top}")
    print("SYMMETRIC_KERNEL_CONFIGS = {")
    for key, cfg in best_table.items():
        print(f"    {key!r}: {cfg!r},")
    print("}")
    return best_table


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time launch configurations per kernel and size")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the bank's dtype")
    parser.add_argument("--profile", action="store_true", help="GPU time per kernel of the compiled paths")
    parser.add_argument("--method", choices=list(Q.MAP_SETS), default="polar_express",
                        help="the set of maps (bench/quintic_maps.py's MAP_SETS) the variants run")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  input {args.dtype}  "
          f"method {args.method} ({len(Q.MAP_SETS[args.method][0])} maps)")
    if args.sweep:
        T.SYMMETRIC_KERNEL_CONFIGS.update(sweep())
    if args.profile:
        profile(dtype, args.method)
    compare_variants(dtype, args.method)
