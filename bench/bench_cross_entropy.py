"""Microbenchmark: the fused soft-capped cross-entropy and the lm_head + loss.

(a) the fused kernel (e5m2 and bf16 gradient) against torch.compile'd references of the same
    forward+backward: the closed-form reference and autograd through the previous formulation; at each of
    --widths (logits per row: the vocabulary, or a sampled budget's candidates, T4.6);
(b) the whole lm_head + loss forward+backward (compiled as in training), FP8 against bf16, with a
    breakdown of the FP8 path's pieces;
(c) the transpose copy of the e5m2 gradient;
(d) the sampled lm_head + loss (T4.6) at candidate budgets against the full softmax, FP8 as in training.
Each problem is checked against a float64 reference first. Floors: bytes / 3.0 TB/s (one read of the
logits, one write of the gradient).

    python bench/bench_cross_entropy.py                         # defaults of train_gpt.py
    python bench/bench_cross_entropy.py --num-warps 8,16,32 --programs-per-sm 1,2
    python bench/bench_cross_entropy.py --widths 10240,14336 --num-warps 4,8,16 --programs-per-sm 1,2,3 \
        --prefetch 0,1 --grad-dtypes e5m2 --skip-references --skip-lm-head --skip-transpose
    python bench/bench_cross_entropy.py --tokens 49152 --fast-tanh 0,1 --transpose-blocks 64x128,128x128 --skip-lm-head
    python bench/bench_cross_entropy.py --candidates 10240,14336,24576 --skip-kernel --skip-lm-head --skip-transpose
"""
import argparse
import itertools
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

V, D = 50304, 768
HBM_BYTES_PER_MS = 3.0e12 / 1e3
MTP_COLUMNS = {16384: 3, 32768: 2, 49152: 1}  # targets per row at each stage's tokens per rank


def ints(text):
    return [int(v) for v in text.split(",")]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def problem(tokens, width=V, device="cuda"):
    """Logits ~ N(0, 3) in bf16, `width` a row; token-like targets (t+k columns, −1 past the end); stage weights."""
    N = MTP_COLUMNS.get(tokens, 1)
    logits = (torch.randn(tokens, width, device=device) * 3).bfloat16()
    ids = torch.randint(0, min(width, 50257), (tokens,), device=device)  # GPT-2 ids; the rest is padding
    ahead = torch.arange(tokens, device=device)[:, None] + torch.arange(N, device=device)
    targets = torch.where(ahead < tokens, ids[ahead.clamp_max(tokens - 1)], -1)
    weights = torch.tensor([1.0, 0.5, 0.125][:N], device=device)
    return logits, targets, weights


def previous_formulation(logits, targets, weights):
    z = T.softcap(logits)
    lse = torch.logsumexp(z, -1, keepdim=True)
    valid = targets >= 0
    ce = lse - z.gather(1, targets.clamp_min(0))
    return (ce * weights * valid).sum()


def kernel_rows(tokens, width, args, ref_closed_form, ref_autograd):
    """Section (a)'s rows at one token count and row width. Its problem's tensors are freed when it returns (a
    function per size rather than `del` in the loop: the timed lambdas close over them)."""
    rows = []
    logits, targets, weights = problem(tokens, width)
    check = slice(0, 2048)  # rows are independent: a slice against the float64 reference
    grads = {"e5m2": (torch.float8_e5m2, 1 / T.FP8_GRAD_SCALE), "bf16": (torch.bfloat16, 1.0)}
    trained = T.ce_launch(width)  # what train_gpt.py launches at this width, where the sweep is not given
    launches = [given or [default] for given, default in
                zip((args.num_warps, args.programs_per_sm, args.prefetch), trained)]
    for grad_dtype, grad_mul in (grads[name] for name in args.grad_dtypes):
        ref = T.softcap_ce_reference(logits[check].double(), targets[check], weights, grad_mul, torch.float64)
        for warps, per_sm, ahead, fast in itertools.product(*launches, args.fast_tanh):
            config = dict(num_warps=warps, programs=per_sm * T._sm_count(logits.device), fast_tanh=bool(fast),
                          prefetch=bool(ahead))
            out = T.softcap_ce(logits, targets, weights, grad_mul, grad_dtype, **config)
            errors = [rel(out[0][check], ref[0]), rel(out[1][check], ref[1]),
                      rel(out[2][check].float(), ref[2].float())]
            ms = bench(lambda: T.softcap_ce(logits, targets, weights, grad_mul, grad_dtype, **config))
            floor = tokens * width * (2 + out[2].element_size()) / HBM_BYTES_PER_MS
            rows.append((tokens, width, targets.size(1), str(grad_dtype).split(".")[1], warps, per_sm, fast, int(ahead),
                         ms, floor, *errors))
            del out
    if args.skip_references:
        return rows
    ms_closed = bench(lambda: ref_closed_form(logits, targets, weights, 1.0, torch.bfloat16))
    leaf = logits.clone().requires_grad_()

    def autograd_step():
        leaf.grad = None
        ref_autograd(leaf, targets, weights).backward()
    ms_autograd = bench(autograd_step)
    rows.append((tokens, width, targets.size(1), "compiled closed-form reference (bf16 grad)", ms_closed))
    rows.append((tokens, width, targets.size(1), "compiled autograd, previous formulation", ms_autograd))
    return rows


def section_kernel(args):
    ref_closed_form = torch.compile(T.softcap_ce_reference, dynamic=False, fullgraph=True)
    ref_autograd = torch.compile(previous_formulation, dynamic=False, fullgraph=True)
    rows = []
    for tokens, width in itertools.product(args.tokens, args.widths):
        rows += kernel_rows(tokens, width, args, ref_closed_form, ref_autograd)
        torch.cuda.empty_cache()
    print("\n(a) fused kernel, median ms (floor: logits read + gradient write at 3.0 TB/s; errors against float64,"
          " the gradient's include its rounding to e5m2 / bf16)")
    print(f"{'T':>6} {'width':>6} {'N':>2} {'grad':>10} {'warps':>5} {'prog/SM':>7} {'fast':>4} {'ahead':>5} | "
          f"{'ms':>7} | {'floor':>6} | {'GB/s':>6} | err loss | err ce0 | err grad")
    for r in rows:
        if len(r) == 5:
            print(f"{r[0]:>6} {r[1]:>6} {r[2]:>2} {r[3]:>35} | {r[4]:7.3f}")
        else:
            tokens, width, N, grad, warps, per_sm, fast, ahead, ms, floor, e0, e1, e2 = r
            gbs = floor * 3000 / ms
            print(f"{tokens:>6} {width:>6} {N:>2} {grad:>10} {warps:>5} {per_sm:>7} {fast:>4} {ahead:>5} | "
                  f"{ms:7.3f} | {floor:6.3f} | {gbs:6.0f} | {e0:.1e} | {e1:.1e} | {e2:.1e}")


def lm_head_rows(tokens):
    """Section (b)'s rows and (b')'s pieces at one token count, its tensors freed when it returns (a function per
    size rather than `del` in the loop: the timed closures read them)."""
    rows, parts = [], []
    _, targets, weights = problem(tokens)
    x = T.norm(torch.randn(tokens, D, device="cuda")).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device="cuda") * 0.05).bfloat16().requires_grad_()
    results = {}
    for fp8 in (False, True):
        step = torch.compile(lambda x, w, t, wt: T.lm_head_softcap_ce(x, w, t, wt, 0.5, fp8=fp8),
                             dynamic=False, fullgraph=True)

        def run():
            x.grad = w.grad = None
            loss, ce0 = step(x, w, targets, weights)
            loss.backward()
            return loss, ce0
        loss, ce0 = run()
        results[fp8] = (loss.detach(), ce0, x.grad.clone(), w.grad.clone())
        ms = bench(run)
        # bytes per logit: bf16 logits written and read (4), then the gradient: bf16 written, read by dx
        # and dW (6); e5m2 written, read by dx, transposed (read + write), read by dW (5)
        traffic = tokens * V * (4 + (5 if fp8 else 6))
        gemm_tflop = 3 * 2 * tokens * V * D / 1e12
        rows.append((tokens, "fp8" if fp8 else "bf16", ms, traffic / HBM_BYTES_PER_MS, gemm_tflop / ms * 1e3))
    errors = [rel(a, b) for a, b in zip(results[True], results[False])]
    rows.append((tokens, "fp8 vs bf16 rel. error: loss {:.1e} ce0 {:.1e} dx {:.1e} dW {:.1e}".format(*errors)))
    # FP8 pieces, each alone
    with torch.no_grad():
        quantize = torch.compile(lambda x, w: (T.to_e4m3(x, T.FP8_X_SCALE), T.to_e4m3(w, T.FP8_W_SCALE)))
        x8, w8 = quantize(x, w)
        sx, sw, sg = (T._scale_tensor(v, x.device) for v in (T.FP8_X_SCALE, T.FP8_W_SCALE, T.FP8_GRAD_SCALE * 0.5))
        logits = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
        g8 = T.softcap_ce(logits, targets, weights, 1 / T.FP8_GRAD_SCALE, torch.float8_e5m2)[2]
        w8t, g8t, x8t = T.transpose_copy(w8), T.transpose_copy(g8), T.transpose_copy(x8)
        pieces = [
            ("quantize x, W (compiled)", lambda: quantize(x, w)),
            ("logits = x8·W8ᵀ", lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw,
                                                        out_dtype=torch.bfloat16, use_fast_accum=True)),
            ("fused CE (e5m2 grad)", lambda: T.softcap_ce(logits, targets, weights, 1 / T.FP8_GRAD_SCALE,
                                                           torch.float8_e5m2)),
            ("transpose g8", lambda: T.transpose_copy(g8)),
            ("transpose x8, W8", lambda: (T.transpose_copy(x8), T.transpose_copy(w8))),
            ("dx = g8·W8", lambda: torch._scaled_mm(g8, w8t.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16)),
            ("dW = g8ᵀ·x8", lambda: torch._scaled_mm(g8t, x8t.t(), scale_a=sg, scale_b=sx,
                                                     out_dtype=torch.bfloat16)),
        ]
        parts += [(tokens, name, bench(fn)) for name, fn in pieces]
    return rows, parts


def section_lm_head(args):
    rows, parts = [], []
    for tokens in args.tokens:
        more_rows, more_parts = lm_head_rows(tokens)
        rows += more_rows
        parts += more_parts
        torch.cuda.empty_cache()
    print("\n(b) lm_head + loss forward+backward (compiled), median ms")
    print(f"{'T':>6} {'path':>5} | {'ms':>7} | {'bytes floor':>11} | 3 GEMMs' FLOP / time (TFLOP/s)")
    for r in rows:
        if len(r) == 2:
            print(f"{r[0]:>6} {r[1]}")
        else:
            print(f"{r[0]:>6} {r[1]:>5} | {r[2]:7.3f} | {r[3]:11.3f} | {r[4]:6.0f}")
    print("\n(b') FP8 path, pieces alone, median ms")
    for tokens, name, ms in parts:
        print(f"{tokens:>6} {name:>28} | {ms:7.3f}")


def transpose_rows(tokens, blocks):
    """Section (c)'s rows at one token count, its tensors freed when it returns."""
    rows = []
    src = (torch.randn(tokens, V, device="cuda") * 100).to(torch.float8_e5m2)
    expected = src.view(torch.uint8).t().contiguous()
    for block in blocks:
        bm, bn = (int(v) for v in block.split("x"))
        for warps in (4, 8):
            out = T.transpose_copy(src, block_m=bm, block_n=bn, num_warps=warps)
            ok = torch.equal(out.view(torch.uint8), expected)
            ms = bench(lambda: T.transpose_copy(src, block_m=bm, block_n=bn, num_warps=warps))
            rows.append((tokens, block, warps, ms, 2 * tokens * V / HBM_BYTES_PER_MS, ok))
            del out
    return rows


def section_transpose(args):
    rows = []
    for tokens in args.tokens:
        rows += transpose_rows(tokens, args.transpose_blocks)
        torch.cuda.empty_cache()
    print("\n(c) transpose copy of the (T, 50304) e5m2 gradient, median ms (floor: read + write at 3.0 TB/s)")
    print(f"{'T':>6} {'block':>8} {'warps':>5} | {'ms':>7} | {'floor':>6} | exact")
    for tokens, block, warps, ms, floor, ok in rows:
        print(f"{tokens:>6} {block:>8} {warps:>5} | {ms:7.3f} | {floor:6.3f} | {ok}")


def zipf_targets(tokens, device="cuda"):
    """Targets as problem()'s, the ids drawn with probability ∝ 1/rank (text-like: a forward's distinct
    targets are a fraction of its tokens, as the candidate budgets assume)."""
    N = MTP_COLUMNS.get(tokens, 1)
    ids = torch.multinomial(1 / torch.arange(1.0, 50258, device=device), tokens, replacement=True)
    ahead = torch.arange(tokens, device=device)[:, None] + torch.arange(N, device=device)
    return torch.where(ahead < tokens, ids[ahead.clamp_max(tokens - 1)], -1), torch.tensor([1.0, 0.5, 0.125][:N],
                                                                                           device=device)


def sampled_rows(tokens, candidates):
    """Section (d)'s rows at one token count, its tensors freed when it returns."""
    rows = []
    targets, weights = zipf_targets(tokens)
    distinct = targets[targets >= 0].unique().numel()
    x = T.norm(torch.randn(tokens, D, device="cuda")).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device="cuda") * 0.05).bfloat16().requires_grad_()
    step = torch.zeros((), dtype=torch.long, device="cuda")
    for budget in [0, *candidates]:
        if budget:
            loss_fn = torch.compile(lambda x, w, t, wt, budget=budget: T.sampled_lm_head_softcap_ce(
                x, w, t, wt, budget, step, 0.5, fp8=True)[:2], dynamic=False, fullgraph=True)
        else:
            loss_fn = torch.compile(lambda x, w, t, wt: T.lm_head_softcap_ce(x, w, t, wt, 0.5, fp8=True),
                                    dynamic=False, fullgraph=True)

        def run():
            x.grad = w.grad = None
            step.add_(1)  # a new sweep each call, as each training step
            loss_fn(x, w, targets, weights)[0].backward()
        run()
        rows.append((tokens, distinct, budget or "full", bench(run)))
        if budget:
            candidate_set = torch.compile(T.candidate_set, dynamic=False, fullgraph=True)
            rows.append((tokens, distinct, f"{budget}: candidate_set alone",
                         bench(lambda: candidate_set(targets, V, budget, step))))
    return rows


def section_sampled(args):
    rows = []
    for tokens in args.tokens:
        rows += sampled_rows(tokens, args.candidates)
        torch.cuda.empty_cache()
    print("\n(d) sampled lm_head + loss forward+backward (FP8, compiled; text-like targets), median ms")
    print(f"{'T':>6} {'distinct':>8} {'candidates':>29} | {'ms':>7}")
    for tokens, distinct, budget, ms in rows:
        print(f"{tokens:>6} {distinct:>8} {budget:>29} | {ms:7.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=ints, default=[16384, 32768, 49152])
    parser.add_argument("--widths", type=ints, default=[V])  # (a): logits per row (sampled budgets' candidates)
    # (a)'s launch sweep; each left out: train_gpt.ce_launch's at the row width
    parser.add_argument("--num-warps", type=ints, default=[])
    parser.add_argument("--programs-per-sm", type=ints, default=[])
    parser.add_argument("--fast-tanh", type=ints, default=[1])
    parser.add_argument("--grad-dtypes", type=lambda s: s.split(","), default=["e5m2", "bf16"])  # (a): e5m2 trains
    parser.add_argument("--prefetch", type=ints, default=[])  # (a): the next row's loads ahead (softcap_ce's prefetch)
    parser.add_argument("--transpose-blocks", type=lambda s: s.split(","), default=["64x128", "128x128", "64x256"])
    parser.add_argument("--candidates", type=ints, default=[])  # (d): sampled budgets, e.g. 10240,14336,24576
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-references", action="store_true", help="(a) without the compiled references' times")
    parser.add_argument("--skip-lm-head", action="store_true")
    parser.add_argument("--skip-transpose", action="store_true")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}  SMs {T._sm_count(torch.device('cuda'))}")
    torch.manual_seed(0)
    if not args.skip_transpose:
        section_transpose(args)
    if not args.skip_lm_head:
        section_lm_head(args)
    if not args.skip_kernel:
        section_kernel(args)
    if args.candidates:
        section_sampled(args)


if __name__ == "__main__":
    main()
