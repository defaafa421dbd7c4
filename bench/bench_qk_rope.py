"""Microbenchmark: QK-norm + rotary + key offset between the Q/K/V projection and attend (docs/TECHNIQUES.md
T6.4) on one layer's projection (6 heads of 128) for each kind of attention layer the model has (paired
heads, key offset, extra value input; the count of such layers in brackets), each path compiled as the
model compiles it (fullgraph; inductor launches the kernels): the torch reference (QK_ROPE_KERNEL=0), the
Triton kernels (=1, the default), and the kernels at other launches (the forward's with --launch, the backward's with
--backward-launch, the other kernel at its default). First the values: each path's q, k, v and the
gradients of the projection (and of the extra value input) against the float64 reference. Then forward and
forward+backward medians (triton do_bench), their difference (the backward with autograd's own work), the
throughput at the least traffic (read the projection once, write q, k, v once; backward: read the
projection's q and k and the three gradients, write the projection's gradient), per training step (the
model's attention layers), and the backward kernel's registers, spills and shared memory at each launch.

    python bench/bench_qk_rope.py                                  # 16,384 / 32,768 / 49,152 tokens
    python bench/bench_qk_rope.py --tokens 49152 --launch 16x4,64x8 --backward-launch 16x4,32x8,64x8
"""
import argparse
import collections
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

HEADS, HEAD_DIM = 6, 128


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def layer_kinds():
    """{(paired heads, key offset, extra value input): number of layers} of the default model's attention."""
    return collections.Counter((plan.paired_heads, plan.key_offset, plan.value_input)
                               for plan in T.layer_plans(T.ModelConfig()) if plan.attn_slot is not None)


def kind_name(paired, key_offset, value_input):
    parts = ["paired" if paired else "plain"] + ["key offset"] * key_offset + ["+ value input"] * value_input
    return " ".join(parts)


def problem(tokens, paired, key_offset, value_input, seed=0):
    """The projection (bf16, as the QK-norm sees it), the extra value input, the gradients of q, k, v and
    the dispatcher's other arguments (the model's tables and a YaRN-like softmax scale)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = (torch.randn(tokens, 3 * HEADS * HEAD_DIM, device="cuda", generator=g) * 0.5).bfloat16()
    v_extra = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16() if value_input else None
    S, heads = (2 * tokens, HEADS // 2) if paired else (tokens, HEADS)
    grads = [torch.randn(S, heads, HEAD_DIM, device="cuda", generator=g).bfloat16() for _ in range(3)]
    angles = torch.arange(2 * tokens, dtype=torch.float64, device="cuda")[:, None] * T.rope_frequencies(HEAD_DIM).cuda()
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    if paired:
        cos, sin = (t.view(tokens, 2, 1, HEAD_DIM // 4) for t in (cos, sin))
    else:
        cos, sin = cos[:tokens, None], sin[:tokens, None]
    args = (cos, sin, torch.tensor(0.12, device="cuda"), HEADS, HEAD_DIM, paired, key_offset)
    return qkv, v_extra, grads, args


def dispatcher(args, kernels):
    """The dispatcher on (qkv, v_extra) with the problem's other arguments: the kernels or the reference."""
    return lambda qkv, v_extra: T.qk_norm_rope(qkv, v_extra, *args, kernels)


def outputs_and_grads(fn, qkv, v_extra, grads):
    leaves = [None if t is None else t.clone().requires_grad_() for t in (qkv, v_extra)]
    outs = fn(*leaves)
    grads = [g.to(o.dtype) for g, o in zip(grads, outs)]
    return (*outs, *torch.autograd.grad(outs, [t for t in leaves if t is not None], grads))


def least_bytes(tokens, value_input):
    """(forward, backward) bytes at the least traffic, bf16."""
    plane = tokens * HEADS * HEAD_DIM * 2  # one of q, k, v
    forward = 3 * plane + value_input * plane + 3 * plane
    backward = 2 * plane + 3 * plane + 3 * plane
    return forward, backward


def measure(fn, qkv, v_extra, grads):
    """(fwd ms, fwd+bwd ms) of a compiled path. On its own copies of the gradients: do_bench's first
    calls keep the leaves' .grad, and v_extra's gradient is a view of v's, which autograd takes as the
    leaf's .grad and then adds into in place, doubling that copy on every call."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in (qkv, v_extra)]
    grads = [g.clone() for g in grads]

    def forward():
        with torch.no_grad():
            return fn(qkv, v_extra)

    def forward_backward():
        torch.autograd.backward(fn(*leaves), grads)

    fwd = do_bench(forward, warmup=25, rep=200, return_mode="median")
    fwd_bwd = do_bench(forward_backward, warmup=25, rep=200, grad_to_none=[t for t in leaves if t is not None],
                       return_mode="median")
    return fwd, fwd_bwd


def launches(option: str) -> list[tuple[str, dict]]:
    """("BLOCKxWARPS", launch constants) of a comma-separated option."""
    parsed = []
    for text in filter(None, option.split(",")):
        block, warps = (int(x) for x in text.split("x"))
        parsed.append((text, {"BLOCK": block, "num_warps": warps}))
    return parsed


def paths(cli) -> list[tuple[str, bool, dict, dict]]:
    """(name, kernels, forward launch, backward launch) of each timed path."""
    forward, backward = dict(T.QK_ROPE_FORWARD_LAUNCH), dict(T.QK_ROPE_BACKWARD_LAUNCH)
    return [("torch (compiled)", False, forward, backward), ("triton", True, forward, backward),
            *((f"triton, fwd {name}", True, launch, backward) for name, launch in launches(cli.launch)),
            *((f"triton, bwd {name}", True, forward, launch) for name, launch in launches(cli.backward_launch))]


def backward_resources(launch: dict, key_offset: bool) -> str:
    """Registers and spilled bytes a thread and shared memory of the backward kernel at a launch, as this
    machine's Triton compiles it for this GPU (the CPU tests compile with another Triton)."""
    qkv, _, grads, args = problem(64, False, key_offset, False)
    rows, constants = T._qk_rope_launch(qkv, (qkv, *grads), args[0], HEADS, HEAD_DIM, False, launch)
    try:
        kernel = T._qk_norm_rope_backward_kernel.warmup(qkv, *grads, *args[:3], torch.empty_like(qkv), rows,
                                                        KEY_OFFSET=key_offset, grid=(1,), **constants)
        kernel._init_handles()
        return f"{kernel.n_regs} registers and {kernel.n_spills} B spilled a thread, {kernel.metadata.shared} B shared"
    except (AttributeError, TypeError) as error:  # Triton's introspection differs between versions
        return f"n/a ({type(error).__name__}: {error})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16384,32768,49152", help="tokens per forward (one rank)")
    parser.add_argument("--launch", default="", help="also the forward kernel at these BLOCKxWARPS, e.g. 16x4,64x8")
    parser.add_argument("--backward-launch", default="", help="also the backward kernel at these BLOCKxWARPS")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    default_launches = dict(T.QK_ROPE_FORWARD_LAUNCH), dict(T.QK_ROPE_BACKWARD_LAUNCH)
    print(f"# QK-norm + rotary on {torch.cuda.get_device_name()} (torch {torch.__version__}); "
          f"{HEADS} heads of {HEAD_DIM}, triton = QK_ROPE_FORWARD_LAUNCH {default_launches[0]}, "
          f"QK_ROPE_BACKWARD_LAUNCH {default_launches[1]}; bwd = fwd+bwd − fwd")
    print("| tokens | layer kind (layers) | path | fwd ms | fwd+bwd ms | bwd ms | fwd GB/s | bwd GB/s | "
          "rel q | rel k | rel v | rel dqkv | rel dv_extra |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals = {}
    for tokens in (int(n) for n in cli.tokens.split(",")):
        for (paired, key_offset, value_input), layers in sorted(layer_kinds().items()):
            qkv, v_extra, grads, args = problem(tokens, paired, key_offset, value_input, cli.seed)
            want = outputs_and_grads(dispatcher(args, False), qkv.double(),
                                     None if v_extra is None else v_extra.double(), grads)
            forward_bytes, backward_bytes = least_bytes(tokens, value_input)
            for path, kernels, forward_launch, backward_launch in paths(cli):
                T.QK_ROPE_FORWARD_LAUNCH, T.QK_ROPE_BACKWARD_LAUNCH = forward_launch, backward_launch
                torch._dynamo.reset()
                fn = torch.compile(dispatcher(args, kernels), dynamic=False, fullgraph=True)
                errors = [rel(got, ref) for got, ref in zip(outputs_and_grads(fn, qkv, v_extra, grads), want)]
                assert max(errors) < 2e-2, f"{path} disagrees with the reference: {errors}"
                fwd, fwd_bwd = measure(fn, qkv, v_extra, grads)
                bwd = fwd_bwd - fwd
                shown = " | ".join(f"{e:.1e}" for e in errors) + (" | -" if v_extra is None else "")
                print(f"| {tokens} | {kind_name(paired, key_offset, value_input)} ({layers}) | {path} | {fwd:.3f} | "
                      f"{fwd_bwd:.3f} | {bwd:.3f} | {forward_bytes / fwd / 1e6:.0f} | "
                      f"{backward_bytes / bwd / 1e6:.0f} | {shown} |", flush=True)
                total = totals.setdefault((tokens, path), [0.0, 0.0])
                total[0] += layers * fwd
                total[1] += layers * fwd_bwd
    T.QK_ROPE_FORWARD_LAUNCH, T.QK_ROPE_BACKWARD_LAUNCH = default_launches
    print("\n# per training step (one rank, the model's attention layers)")
    print("| tokens | path | fwd ms | fwd+bwd ms | bwd ms |")
    print("|---|---|---|---|---|")
    for (tokens, path), (fwd, fwd_bwd) in totals.items():
        print(f"| {tokens} | {path} | {fwd:.2f} | {fwd_bwd:.2f} | {fwd_bwd - fwd:.2f} |")
    print("\n# the backward kernel's resources (last: a failure here leaves the timings above)")
    for name, launch in [("default", default_launches[1]), *launches(cli.backward_launch)]:
        for key_offset in (False, True):
            print(f"- {name} {launch}, key offset {int(key_offset)}: {backward_resources(launch, key_offset)}")


if __name__ == "__main__":
    main()
