"""Microbenchmark: one attention layer's Q/K/V projection with its QK-norm + rotary, forward + backward, as the
training step runs it (docs/TECHNIQUES.md T6.3): the e4m3 forward with the bf16 backward (main: fp8_normed_linear,
then the T6.4 kernels) against the FP8 backward (FP8_QKV_BACKWARD=1: fp8_qkv_norm_rope, the norm + rotary backward
writing e5m2 dqkv in both layouts, dx and dW as e5m2 x e4m3 products). Wide (Q/K heads of 128) and narrow (64,
T3.18) layers, paired heads with the key offset (the kernels' every branch), each path compiled (fullgraph) and
timed as CUDA-graph replays (the step's graphs; eager calls are host-bound below 49,152 tokens), median of
triton's do_bench. First the values: each path's dx and dW against the float64 product of the bf16 backward.

    python bench/bench_qkv.py                       # 16,384 / 32,768 / 49,152 tokens
    python bench/bench_qkv.py --tokens 49152 --launch 32x4,64x4,64x8,128x8
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt as T  # noqa: E402
from bench_mlp import graph_timed as graph_timed_inputs  # noqa: E402

HEADS, HEAD_DIM, DIM = 6, 128, 768


def graph_timed(fn):
    """Median ms of fn() replayed from CUDA graphs (bench_mlp.graph_timed on two captures of it)."""
    return graph_timed_inputs(lambda _: fn(), [None, None])


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(tokens, qk_hd, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = T.norm(torch.randn(tokens, DIM, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(HEADS * (2 * qk_hd + HEAD_DIM), DIM, device="cuda", generator=g) * 0.03).bfloat16()
    grads = [(torch.randn(2 * tokens, HEADS // 2, width, device="cuda", generator=g) * 1e-4).bfloat16()
             for width in (qk_hd, qk_hd, HEAD_DIM)]
    angles = torch.arange(2 * tokens, dtype=torch.float64, device="cuda")[:, None] * T.rope_frequencies(HEAD_DIM).cuda()
    cos, sin = (t.bfloat16().view(tokens, 2, 1, HEAD_DIM // 4) for t in (angles.cos(), angles.sin()))
    bank = T.QKVBankFP8.quantize([(w[:2 * HEADS * qk_hd][None], [0])],
                                 torch.stack([w[2 * HEADS * qk_hd:], w[2 * HEADS * qk_hd:]]), transposed=True)
    return x, w, grads, (cos, sin, torch.tensor(0.12, device="cuda"), HEADS, qk_hd, True, qk_hd == HEAD_DIM), bank


def paths(x, w, grads, layer, bank):
    """{name: fn() -> (dx, dW)}: each path's forward and backward, compiled."""
    lam = torch.tensor(1.0, device="cuda")
    amax = torch.ones((), device="cuda")  # the model's start: the first backward's scale is loose, then its own
    saturations = torch.zeros((), device="cuda")

    def bf16_backward(x, w):
        qkv = T.fp8_normed_linear(x, w, bank.weights[0], bank.scales[0] * lam)
        return T.qk_norm_rope(qkv, None, *layer, kernels=True)

    def fp8_backward(x, w):
        return T.fp8_qkv_norm_rope(x, w, bank, 0, lam, None, *layer, amax, saturations, True)

    def step(forward):
        compiled = torch.compile(forward, dynamic=False, fullgraph=True)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()

        def run():
            return torch.autograd.grad(compiled(xs, ws), (xs, ws), grads)
        return run
    return {"e4m3 fwd, bf16 bwd (main)": step(bf16_backward), "FP8 bwd (T6.3)": step(fp8_backward)}, saturations


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 49152])
    p.add_argument("--launch", default="", help="the FP8 backward kernel's launches (BLOCK_TxWARPS) to time too")
    args = p.parse_args()
    launches = [dict(zip(("BLOCK_T", "num_warps"), map(int, s.split("x")))) for s in args.launch.split(",") if s]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {T.triton.__version__}")
    layers = {"wide": HEAD_DIM, "narrow": HEAD_DIM // 2}
    counts = {"wide": len(T.ModelConfig.attention_layers) - len(T.ModelConfig.narrow_qk_layers),
              "narrow": len(T.ModelConfig.narrow_qk_layers)}
    print("| tokens | layer | path | dx rel err | dW rel err | fwd+bwd ms (graphs) |")
    print("|---:|---|---|---:|---:|---:|")
    per_step = {}
    for tokens in args.tokens:
        for kind, qk_hd in layers.items():
            x, w, grads, layer, bank = problem(tokens, qk_hd)
            xs, ws = x.double().requires_grad_(), w.double().requires_grad_()
            qkv = xs @ ws.t()
            want = torch.autograd.grad(T.qk_norm_rope_reference(qkv, None, *(t.double() if torch.is_tensor(t) else t
                                                                                 for t in layer)), (xs, ws),
                                       [g.double() for g in grads])
            fns, saturations = paths(x, w, grads, layer, bank)
            for name, fn in fns.items():
                got = fn()
                ms = graph_timed(fn)
                per_step[tokens, name] = per_step.get((tokens, name), 0.0) + counts[kind] * ms
                print(f"| {tokens} | {kind} | {name} | {rel(got[0], want[0]):.2e} | {rel(got[1], want[1]):.2e} "
                      f"| {ms:.3f} |")
            default = dict(T.QK_ROPE_BACKWARD_FP8_LAUNCH)
            for launch in launches:
                T.QK_ROPE_BACKWARD_FP8_LAUNCH = launch
                torch._dynamo.reset()
                fn = paths(x, w, grads, layer, bank)[0]["FP8 bwd (T6.3)"]
                fn()
                print(f"| {tokens} | {kind} | FP8 bwd, kernel {launch['BLOCK_T']}x{launch['num_warps']} | | "
                      f"| {graph_timed(fn):.3f} |")
            T.QK_ROPE_BACKWARD_FP8_LAUNCH = default
            assert saturations.item() == 0
    print("\nper training step (the model's wide and narrow attention layers):")
    for (tokens, name), ms in per_step.items():
        print(f"  {tokens} tokens, {name}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
