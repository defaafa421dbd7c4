"""Microbenchmark: the copy pointer (docs/TECHNIQUES.md T4.8, COPY_POINTER=1) on the final hidden states of one
step's batch, each path compiled as the model compiles it (fullgraph): the blocked torch pointer (the plan off CUDA)
and the Triton kernels (the plan on CUDA). First the values: each path's p_copy, a_sink and the gradients of x and
the pointer's parameters against the other (the blocked path rounds its scores to bf16, the kernels keep them fp32).
Then each path's GPU time per call, forward and forward+backward: the kernels' device time under the torch profiler
over 20 calls, not wall time, since training replays its steps from CUDA graphs (no launch cost); the pointer's own
three kernels apart. --train-gpt loads another version of train_gpt.py (an A/B in one process's lease call).

    python bench/bench_copy_pointer.py                          # 16,384 / 32,768 / 49,152 tokens (stages 1-3)
    python bench/bench_copy_pointer.py --tokens 49152 --launch 64x32x4,128x64x8
    git show HEAD~1:train_gpt.py > /tmp/before.py && python bench/bench_copy_pointer.py --train-gpt /tmp/before.py
"""
import argparse
import os

import torch
from profile_stages import load_source
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = None  # the train_gpt module under test (main loads it)


def gpu_time(fn, calls=20):
    """(all kernels, the pointer's kernels) device ms per call of fn, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    own = sum(e.device_time for e in kernels if e.name.startswith("_copy_"))
    return total / calls / 1000, own / calls / 1000


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(tokens, window, seed=0):
    """x (bf16, unit RMS as after the final norm), the pointer's parameters as the model draws them, token ids of a
    small vocabulary (copies within the window) and documents of 1 to 3000 tokens, repeated (the token-weighted mean
    length 1,702: the proxy's train documents cut at stage 3's 3,072 tokens average 1,521 so)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = T.ModelConfig().model_dim
    x = T.norm(torch.randn(tokens, d, device="cuda", generator=g)).bfloat16()
    qk = (torch.rand(2, T.COPY_HEAD_DIM, d, device="cuda", generator=g) * 2 - 1).mul(3 ** 0.5 / d ** 0.5).bfloat16()
    gain = torch.tensor(1.0, device="cuda")
    sink = torch.randn(T.COPY_HEAD_DIM, device="cuda", generator=g) * T.COPY_HEAD_DIM ** -0.5
    ids = torch.randint(0, 2000, (tokens + 1,), device="cuda", generator=g)
    lengths = [700, 1, 3000, 130, 1500, 400, 250, 900, 300, 600]
    starts = torch.cumsum(torch.tensor([0] + lengths * (tokens // sum(lengths) + 1), device="cuda"), 0)
    docs = torch.bucketize(torch.arange(tokens, device="cuda"), starts[starts < tokens], right=True).int()
    params = [t.requires_grad_() for t in (x, qk, gain, sink)]
    upstream = torch.randn(2, tokens, device="cuda", generator=g)
    return params, (ids[:-1], ids[1:], docs, window), upstream


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 49152])
    ap.add_argument("--window", type=int, default=0, help="COPY_WINDOW (default: the file's)")
    ap.add_argument("--launch", default="", help="BLOCK_MxBLOCK_NxWARPS for all three kernels, comma-separated")
    ap.add_argument("--train-gpt", default=os.path.join(ROOT, "train_gpt.py"),
                    help="the train_gpt.py whose pointer to time (default: this checkout's)")
    args = ap.parse_args()
    global T
    T = load_source(args.train_gpt)
    launches = [tuple(int(v) for v in launch.split("x")) for launch in args.launch.split(",") if launch]
    window = args.window or T.ModelConfig().copy_window
    print(f"{args.train_gpt}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"Triton {T.triton.__version__}, window {window}; GPU ms per call (the pointer's own kernels)")
    default_launch = {name: dict(config) for name, config in T.COPY_LAUNCH.items()}
    for tokens in args.tokens:
        params, rest, upstream = problem(tokens, window)
        paths = {"blocked torch": False, "triton kernels": True}
        compiled = {name: torch.compile(lambda *p, use=use: T.copy_pointer(*p, *rest, use_triton=use),
                                        dynamic=False, fullgraph=True) for name, use in paths.items()}
        results = {}
        for name, fn in compiled.items():
            out = fn(*params)
            grads = torch.autograd.grad(out, params, tuple(upstream))
            results[name] = (*out, *grads)
        labels = ("p_copy", "a_sink", "dx", "dW_qk", "dgain", "dsink")
        diffs = ", ".join(f"{label} {rel(a, b):.1e}" for label, a, b in zip(labels, *results.values()))
        print(f"\n{tokens} tokens: kernels vs blocked: {diffs}")

        def timings(fn):
            forward = gpu_time(lambda: fn(*params))
            both = gpu_time(lambda: torch.autograd.grad(fn(*params), params, tuple(upstream)))
            return (f"forward {forward[0]:.3f} ms ({forward[1]:.3f})   "
                    f"forward+backward {both[0]:.3f} ms ({both[1]:.3f})")

        for name, fn in compiled.items():
            print(f"  {name:16s} {timings(fn)}")
        for block_m, block_n, warps in launches:
            for config in T.COPY_LAUNCH.values():
                config.update(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
            torch._dynamo.reset()
            fn = torch.compile(lambda *p: T.copy_pointer(*p, *rest, use_triton=True), dynamic=False, fullgraph=True)
            print(f"  kernels {block_m}x{block_n}x{warps:<3d} {timings(fn)}")
        for name, config in default_launch.items():
            T.COPY_LAUNCH[name] = dict(config)


if __name__ == "__main__":
    main()
