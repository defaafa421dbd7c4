"""Microbenchmark: the fused MLP up-projection + ReLU² Triton GEMM (docs/TECHNIQUES.md T6.1)
against cuBLAS on the real shapes (T tokens x 768 -> 3072) at the three stage batch sizes: the
forward epilogue, the backward (fused-gradient) epilogue, the whole MLP forward+backward against
the torch.compile'd plain expression, and the FP8 MLP (T6.2: e4m3 up-projection writing e4m3 post in
both layouts, e4m3 down-projection; T6.5: its backward from e5m2 dy and dpre) against the bf16 one, eager
and CUDA-graph-replayed. Every variant is checked first: bf16 against float64, FP8 against its own
reference's arithmetic.

    python bench/bench_mlp.py                                   # the comparison table
    python bench/bench_mlp.py --sweep [--epilogue relu_square]  # time a grid of GemmConfigs, best per T
"""
import argparse
import itertools
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

TOKENS = (16384, 32768, 49152)  # per-rank tokens of stages 1, 2, 3
HIDDEN, DIM = 3072, 768
EPILOGUES = ("relu_square", "relu_square_grad")
SMEM_LIMIT = 232448  # bytes of shared memory a block may use on an H100
ROTATE = 3  # input sets cycled through while timing, so T=16384 does not run from L2


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_inputs(tokens):
    """Realistic scales: normed activations, fc like its init, a trained-like proj, unit gradients."""
    x = T.norm(torch.randn(tokens, DIM, device="cuda")).bfloat16()
    fc = (torch.rand(HIDDEN, DIM, device="cuda") * 2 - 1).mul(3 ** 0.5 * 0.5 * DIM ** -0.5).bfloat16()
    proj = (torch.randn(HIDDEN, DIM, device="cuda") * 0.02).bfloat16()
    grad = torch.randn(tokens, DIM, device="cuda").bfloat16()
    pre = x @ fc.t()
    return dict(x=x, fc=fc, proj=proj, grad=grad, pre=pre, post=torch.relu(pre).square())


def float64_epilogues(v):
    pre = v["x"].double() @ v["fc"].double().t()
    return {"relu_square": pre.relu().square(),
            "relu_square_grad": (v["grad"].double() @ v["proj"].double().t()) * 2 * v["post"].double().sqrt()}


def timed(fn, inputs, warmup=50, rep=200):
    """Median ms of fn(inputs[i]) over the rotating input sets."""
    step = itertools.count()
    return do_bench(lambda: fn(inputs[next(step) % len(inputs)]), warmup=warmup, rep=rep, return_mode="median")


def graph_timed(fn, inputs, warmup=50, rep=200):
    """Median ms of fn(inputs[i]) replayed from CUDA graphs, one per input set, cycled: the GPU time without the
    host's launches, as the training step's graphs run it (below 49,152 tokens the eager calls are host-bound)."""
    graphs = []
    for v in inputs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph asks
            for _ in range(2):
                fn(v)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(v)
        graphs.append(graph)
    step = itertools.count()
    return do_bench(lambda: graphs[next(step) % len(graphs)].replay(), warmup=warmup, rep=rep, return_mode="median")


def tflops(ms, gemms, tokens):
    return gemms * 2 * tokens * HIDDEN * DIM / ms / 1e9


def shared_memory(config, epilogue):
    c_cols = config.block_n // 2 if config.split_epilogue else config.block_n
    loads = config.stages * (config.block_m + config.block_n) * config.block_k * 2
    return loads + config.block_m * c_cols * 2 * (2 if epilogue == "relu_square_grad" else 1)


def sweep_configs(epilogue):
    tiles = [(128, 256, 64, 8), (256, 128, 64, 8), (128, 128, 64, 4), (128, 128, 64, 8), (128, 128, 128, 8),
             (128, 256, 128, 8)]
    modes = [(True, True), (True, False), (False, False)]  # (persistent, flatten)
    configs = []
    for (bm, bn, bk, warps), stages, (persistent, flatten), split in itertools.product(tiles, (2, 3, 4, 5), modes, (True, False)):
        config = T.GemmConfig(bm, bn, bk, stages, warps, 8, persistent, flatten, split)
        if shared_memory(config, epilogue) <= SMEM_LIMIT and (stages > 2 or bk == 128):
            configs.append(config)
    return configs


def describe(c):
    mode = ("persistent+flatten" if c.flatten else "persistent") if c.persistent else "one tile/program"
    return f"{c.block_m}x{c.block_n}x{c.block_k} s{c.stages} w{c.warps} g{c.group_m} {mode}{' split' if c.split_epilogue else ''}"


def run_gemm(epilogue, v, config=None):
    return T.relu_square_gemm(v["x"], v["fc"], config=config) if epilogue == "relu_square" \
        else T.relu_square_gemm(v["grad"], v["proj"], v["post"], config=config)


def sweep(epilogues, tokens_list, top):
    data = {t: [make_inputs(t) for _ in range(ROTATE)] for t in tokens_list}
    refs = {t: {e: r.bfloat16() for e, r in float64_epilogues(data[t][0]).items()} for t in tokens_list}
    results = {}  # (epilogue, config) -> {tokens: ms}
    for epilogue in epilogues:
        configs = sweep_configs(epilogue)
        print(f"sweep {epilogue}: {len(configs)} configs x {len(tokens_list)} token counts", flush=True)
        for i, config in enumerate(configs):
            try:
                for t in tokens_list:
                    error = rel_err(run_gemm(epilogue, data[t][0], config), refs[t][epilogue])
                    if not error < 1e-2:
                        raise ValueError(f"wrong result (rel err {error:.2e})")
                    results.setdefault((epilogue, config), {})[t] = timed(lambda v: run_gemm(epilogue, v, config), data[t], 20, 50)
            except Exception as exc:  # out of shared memory, compile failure or a wrong result: skip it
                results.pop((epilogue, config), None)
                print(f"  skipped {describe(config)}: {type(exc).__name__} {str(exc)[:40]!r}", flush=True)
            if (i + 1) % 20 == 0:
                print(f"  {i + 1}/{len(configs)} done", flush=True)
    cublas = {t: timed(lambda v: v["x"] @ v["fc"].t(), data[t]) for t in tokens_list}
    print("\nbest configs (ms, TFLOP/s); cuBLAS GEMM alone: "
          + ", ".join(f"T={t} {cublas[t]:.3f} ms {tflops(cublas[t], 1, t):.0f}" for t in tokens_list))
    for epilogue in epilogues:
        timed_configs = {c: ms for (e, c), ms in results.items() if e == epilogue}
        default = T.RELU_SQUARE_GEMM_CONFIGS[epilogue]
        for t in tokens_list:
            ranked = sorted(timed_configs, key=lambda c: timed_configs[c][t])[:top]
            print(f"{epilogue} T={t}:")
            for c in ranked + ([default] if default in timed_configs and default not in ranked else []):
                ms = timed_configs[c][t]
                print(f"  {ms:7.3f} ms {tflops(ms, 1, t):5.0f} TFLOP/s {ms / cublas[t]:5.2f}x cuBLAS  {describe(c)}"
                      f"{'  (default)' if c == default else ''}")
        overall = min(timed_configs, key=lambda c: sum(timed_configs[c].values()))
        print(f"{epilogue} best summed over T: {overall}")


def compare(tokens_list):
    rows = []
    kernel = T.tma_gemm_applies(torch.empty(1, device="cuda"))  # the fused MLP's Triton GEMMs (Hopper or newer)
    fused_mlp = torch.compile(lambda x, fc, proj: T.relu_square_mlp(x, fc, proj, kernel), dynamic=False, fullgraph=True)
    plain_mlp = torch.compile(lambda x, fc, proj: T.relu_square_mlp_reference(x, fc, proj), dynamic=False, fullgraph=True)
    plain_up = torch.compile(lambda x, fc: torch.relu(x @ fc.t()).square(), dynamic=False, fullgraph=True)
    plain_grad = torch.compile(lambda grad, proj, pre: (grad @ proj.t()) * (2 * torch.relu(pre)), dynamic=False, fullgraph=True)

    def fwd_bwd(mlp, v):
        x, fc, proj = (v[k].detach().requires_grad_() for k in ("x", "fc", "proj"))
        return torch.autograd.grad(mlp(x, fc, proj), (x, fc, proj), v["grad"])

    post_scale = torch.ones((), device="cuda")

    def fp8_mlp(x, fc, proj):  # one layer's share of the per-forward bank quantization included
        bank8 = T.MLPBankFP8.quantize(torch.stack([fc, proj])[None])
        return T.fp8_relu_square_mlp(x, fc, proj, bank8, 0, post_scale)[0]

    fp8_mlp = torch.compile(fp8_mlp, dynamic=False, fullgraph=True)
    fused_fwd = torch.compile(lambda x, fc, proj: T.relu_square_mlp(x, fc, proj, kernel), dynamic=False, fullgraph=True)

    for t in tokens_list:
        data = [make_inputs(t) for _ in range(ROTATE)]
        v = data[0]
        ref = float64_epilogues(v)
        errors = {"cuBLAS+torch up": rel_err(plain_up(v["x"], v["fc"]), ref["relu_square"]),
                  "fused up": rel_err(run_gemm("relu_square", v), ref["relu_square"]),
                  "cuBLAS+torch grad": rel_err(plain_grad(v["grad"], v["proj"], v["pre"]), ref["relu_square_grad"]),
                  "fused grad": rel_err(run_gemm("relu_square_grad", v), ref["relu_square_grad"])}
        x, fc, proj = (v[k].double().requires_grad_() for k in ("x", "fc", "proj"))
        grads64 = torch.autograd.grad(torch.relu(x @ fc.t()).square() @ proj, (x, fc, proj), v["grad"].double())
        for name, mlp in (("fused MLP", fused_mlp), ("compiled MLP", plain_mlp)):
            errors[name] = max(rel_err(g, g64) for g, g64 in zip(fwd_bwd(mlp, v), grads64))
        print(f"T={t} rel. errors vs float64: " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()), flush=True)
        bad = {k: e for k, e in errors.items() if not e < 1e-2}
        post_scale.fill_(ref["relu_square"].max().item() * T.FP8_POST_MARGIN / T.E4M3_MAX)
        fp8_ref, _ = T.fp8_relu_square_mlp_reference(v["x"], v["fc"], v["proj"], post_scale)
        out64 = ref["relu_square"] @ v["proj"].double()
        fp8_out = fp8_mlp(v["x"], v["fc"], v["proj"])
        fp8_errors = {"FP8 MLP vs its e4m3 reference": rel_err(fp8_out, fp8_ref),
                      "FP8 MLP vs float64": rel_err(fp8_out, out64)}
        print(f"T={t} " + ", ".join(f"{k} {e:.1e}" for k, e in fp8_errors.items()), flush=True)
        fp8_grads = T.fp8_relu_square_mlp_backward_reference(v["grad"], v["x"], v["fc"], v["proj"], post_scale)
        fp8_errors["FP8 backward vs its reference"] = max(
            rel_err(g, want) for g, want in zip(fwd_bwd(fp8_mlp, v), fp8_grads))
        fp8_errors["FP8 backward vs float64"] = max(
            rel_err(g, g64) for g, g64 in zip(fwd_bwd(fp8_mlp, v), grads64))
        print(f"T={t} " + ", ".join(f"{k} {e:.1e}" for k, e in list(fp8_errors.items())[2:]), flush=True)
        if not (fp8_errors["FP8 MLP vs its e4m3 reference"] < 1e-2
                and fp8_errors["FP8 backward vs its reference"] < 3e-2):
            bad.update(fp8_errors)
        if bad:
            raise SystemExit(f"wrong results at T={t}: {bad}")
        x8, x_scale = T.quantize_normed_e4m3(v["x"])
        fc8, fc_scale = T.quantize_e4m3(v["fc"], v["fc"].abs().amax())
        proj8_t, proj_scale = T.quantize_e4m3(v["proj"].t().contiguous(), v["proj"].abs().amax())
        product_scale = x_scale * fc_scale
        post8 = T.relu_square_fp8_gemm(x8, fc8, product_scale, post_scale)[0]
        grad_scale = v["grad"].abs().amax().float() / T.E5M2_MAX
        grad8, proj8 = T.to_e5m2(v["grad"], grad_scale), proj8_t.t().contiguous()
        dpre_scale = torch.ones((), device="cuda")  # the timing does not depend on it
        rows += [
            (t, "up-proj GEMM alone (cuBLAS)", timed(lambda v: v["x"] @ v["fc"].t(), data), 1),
            (t, "up-proj + ReLU² (cuBLAS + compiled elementwise)", timed(lambda v: plain_up(v["x"], v["fc"]), data), 1),
            (t, "up-proj + ReLU² (fused Triton)", timed(lambda v: run_gemm("relu_square", v), data), 1),
            (t, "grad GEMM alone (cuBLAS)", timed(lambda v: v["grad"] @ v["proj"].t(), data), 1),
            (t, "grad GEMM + ReLU² grad (cuBLAS + compiled)", timed(lambda v: plain_grad(v["grad"], v["proj"], v["pre"]), data), 1),
            (t, "grad GEMM + ReLU² grad (fused Triton)", timed(lambda v: run_gemm("relu_square_grad", v), data), 1),
            (t, "MLP fwd+bwd (compiled plain expression)", timed(lambda v: fwd_bwd(plain_mlp, v), data), 6),
            (t, "MLP fwd+bwd (fused, compiled)", timed(lambda v: fwd_bwd(fused_mlp, v), data), 6),
            (t, "up-proj + ReLU² (fused Triton, e4m3 in, e4m3 + e4m3ᵀ out)",
             timed(lambda v: T.relu_square_fp8_gemm(x8, fc8, product_scale, post_scale), data), 1),
            (t, "down-proj (cuBLAS bf16)", timed(lambda v: v["post"] @ v["proj"], data), 1),
            (t, "down-proj (cuBLAS e4m3 _scaled_mm)", timed(lambda v: torch._scaled_mm(
                post8, proj8_t.t(), scale_a=post_scale, scale_b=proj_scale, out_dtype=torch.bfloat16,
                use_fast_accum=True), data), 1),
            (t, "MLP fwd (fused bf16, compiled)", timed(lambda v: fused_fwd(v["x"], v["fc"], v["proj"]), data), 2),
            (t, "MLP fwd (FP8 with quantizations, compiled)", timed(lambda v: fp8_mlp(v["x"], v["fc"], v["proj"]), data), 2),
            (t, "grad GEMM + ReLU² grad (fused Triton, e5m2 + e4m3 in, e5m2 + e5m2ᵀ out)", timed(
                lambda v: T.relu_square_grad_fp8_gemm(grad8, proj8, post8, grad_scale * proj_scale, post_scale,
                                                      dpre_scale), data), 1),
            (t, "MLP fwd+bwd (FP8, compiled)", timed(lambda v: fwd_bwd(fp8_mlp, v), data), 6),
            (t, "MLP fwd+bwd (fused bf16, compiled, graphed)", graph_timed(lambda v: fwd_bwd(fused_mlp, v), data), 6),
            (t, "MLP fwd+bwd (FP8, compiled, graphed)", graph_timed(lambda v: fwd_bwd(fp8_mlp, v), data), 6),
        ]
        del data, v
        torch.cuda.empty_cache()
    print("\ndefault configs: " + "; ".join(f"{e} {describe(c)}" for e, c in T.RELU_SQUARE_GEMM_CONFIGS.items()))
    print(f"{'T':>6} | {'variant':<72} | {'ms':>7} | {'TFLOP/s':>7}")
    for t, name, ms, gemms in rows:
        print(f"{t:>6} | {name:<72} | {ms:7.3f} | {tflops(ms, gemms, t):7.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of GemmConfigs instead of the comparison")
    parser.add_argument("--epilogue", choices=EPILOGUES + ("both",), default="both", help="sweep only this epilogue")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts (M)")
    parser.add_argument("--top", type=int, default=5, help="configs shown per token count in the sweep")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {T.triton.__version__}")
    torch.manual_seed(0)
    if args.sweep:
        sweep(EPILOGUES if args.epilogue == "both" else (args.epilogue,), args.tokens, args.top)
    else:
        compare(args.tokens)


if __name__ == "__main__":
    main()
