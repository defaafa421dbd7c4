"""Cost of the newest architecture pieces on the real shapes (a microbenchmark): forward +
backward median time, compiled like training, at the three stages' tokens per rank, of

- xsa:   gated XSA on one layer (docs/TECHNIQUES.md T3.13; the model runs it on 4 layers)
- dc:    lightweight DC-MHA on one layer, 112-key window (T3.17; layer 10 only), the Triton
         kernels (the default on CUDA) and the blocked torch form

Both are always on in the model (XSA and DC_MHA are no longer settings), so what they cost is timed
here, one layer at a time.

    python bench/bench_arch.py [--tokens 16384,32768,49152] [--dc-warps 4,8]

Correctness of each piece against its definition is checked first (tests/model/test_architecture.py
and tests/kernels/test_dc_mha_kernels.py hold the full checks). Prints a table last.
"""
import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

H, D = 6, 128


def bench(fn, inputs, profiled_steps=20, kernel_prefix=None):
    """(median wall ms of a forward + backward, GPU kernel ms of one: the device time the profiler
    records, so host and launch overhead excluded). With kernel_prefix, also prints the GPU ms of each
    kernel whose name starts with it."""
    def step():
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
    wall = triton.testing.do_bench(step, warmup=10, rep=50)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled_steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels_us = sum(e.self_device_time_total for e in events)
    for event in events if kernel_prefix else ():
        if event.key.startswith(kernel_prefix):
            print(f"  kernel {event.key}: {event.self_device_time_total / profiled_steps / 1e3:.3f} GPU ms", flush=True)
    return wall, kernels_us / profiled_steps / 1e3


def piece_rows(tokens, dc_warps):
    default_launch = T.DC_LAUNCH
    q, k, v = (T.norm(torch.randn(tokens, H, D, device="cuda")).bfloat16().requires_grad_() for _ in range(3))
    y = torch.randn(tokens, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    alpha = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(tokens, H, device="cuda", requires_grad=True)
    w2 = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor(T.cu_seqlens_for([tokens // 3, tokens // 3, tokens - 2 * (tokens // 3)], tokens, 16), device="cuda")
    doc_ids = torch.searchsorted(cu, torch.arange(tokens, device="cuda", dtype=cu.dtype), right=True)
    xsa = torch.compile(T.exclusive_self_attention, dynamic=False, fullgraph=True)
    dcs = {name: torch.compile(lambda *a, use_triton=use_triton: T.dc_mha(*a, T.DC_WINDOW, use_triton),
                               dynamic=False, fullgraph=True)
           for name, use_triton in (("triton", True), ("torch", False))}
    # correctness on the first 4096 tokens against the float64 definition
    n = 4096
    pos = torch.arange(n, device="cuda")
    dist = pos[:, None] - pos[None, :]
    mask = (dist >= 0) & (dist < T.DC_WINDOW) & (doc_ids[:n, None] == doc_ids[None, :n])
    p = torch.einsum("thd,shd->hts", q[:n].double() * 0.12, k[:n].double()).masked_fill(~mask, float("-inf")).softmax(-1)
    ref = torch.einsum("ts,shd->thd", (p * w1[:n].double().T[:, :, None]).sum(0), v[:n].double()) * w2[:n].double()[..., None]
    for name, dc in dcs.items():
        out = dc((q[:n] * 0.12).bfloat16(), k[:n], v[:n], doc_ids[:n], w1[:n], w2[:n]).double()
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2, f"dc_mha ({name}) disagrees with its definition"
    rows = [("xsa (1 layer)", tokens, bench(xsa, (y, v, alpha))),
            ("dc_mha torch (1 layer)", tokens, bench(dcs["torch"], (q, k, v, doc_ids, w1, w2)))]
    print(f"dc_mha triton, DC_LAUNCH warps, {tokens} tokens:", flush=True)
    rows.append(("dc_mha triton (1 layer)", tokens, bench(dcs["triton"], (q, k, v, doc_ids, w1, w2), kernel_prefix="_dc")))
    for warps in dc_warps:  # every kernel at this many warps (the kernels read T.DC_LAUNCH at launch)
        T.DC_LAUNCH = {kernel: dict(options, num_warps=warps) for kernel, options in default_launch.items()}
        print(f"dc_mha triton, {warps} warps, {tokens} tokens:", flush=True)
        rows.append((f"dc_mha triton, {warps} warps", tokens,
                     bench(dcs["triton"], (q, k, v, doc_ids, w1, w2), kernel_prefix="_dc")))
    T.DC_LAUNCH = default_launch
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16384,32768,49152", help="tokens per rank for the pieces")
    parser.add_argument("--dc-warps", default="", help="also time the DC-MHA kernels all at these warps, e.g. 4,8")
    args = parser.parse_args()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for row in piece_rows(tokens, [int(w) for w in args.dc_warps.split(",") if w]):
            rows.append(row)
            print(*row, flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}: forward + backward, median wall ms "
          "and GPU kernel ms (profiler)")
    print(f"| {'what':<28} | {'tokens':>6} | {'wall ms':>8} | {'GPU ms':>8} |\n|---|---:|---:|---:|")
    for name, tokens, (wall, gpu) in rows:
        print(f"| {name:<28} | {tokens:>6} | {wall:>8.3f} | {gpu:>8.3f} |")


if __name__ == "__main__":
    main()
