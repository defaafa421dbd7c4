"""Microbenchmark: the attention backends on each training stage's shapes (one rank's slice).

For every stage: tokens per rank and max_seq_len from the stage table, documents packed as the
loader packs them (lengths drawn lognormal with mean --mean-doc tokens, each truncated to
max_seq_len, the last cut to fit, padded cu_seqlens), and each (layer kind, window) the model runs:
plain layers (6 heads over T tokens) and paired-head layers (3 heads over the doubled sequence 2T,
same window in positions). Per backend (ATTENTION_BACKEND's: fa4, flex, sdpa): forward and
forward+backward medians (triton do_bench), the relative error of out, dq, dk, dv against flex
attention (compiled, as the model compiles it: the reference and auto's fallback where FA4 does not
run), then the attention time of one training step (the model's attention layers) per stage. SDPA
takes a dense (S, S) mask: only on request, and only at small stages.

    python bench/bench_attention.py                     # every stage, flex and FA4 where it runs
    python bench/bench_attention.py --quick             # stage 3 only
    python bench/bench_attention.py --backends flex,fa4 --stages 1,3
"""
import argparse
import collections
import dataclasses
import os
import sys

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

HEADS, HEAD_DIM = 6, 128
DOC_LENGTH_SIGMA = 1.0  # of log(length): a long tail of documents past max_seq_len


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def available_backends():
    return ["flex", "fa4"] if T.fa4_runs_here("cuda") else ["flex"]


def document_lengths(tokens, max_seq_len, mean_doc, rng):
    """Segment lengths summing to tokens + 1, as plan_batch cuts them: documents truncated to
    max_seq_len, the last cut to fit, the max_docs-th taking all that is left."""
    max_docs, lengths = T.max_docs_per_batch(tokens), []
    while sum(lengths) < tokens + 1:
        need = tokens + 1 - sum(lengths)
        if len(lengths) == max_docs - 1:
            lengths.append(need)
            break
        doc = max(1, int(rng.lognormal(np.log(mean_doc) - DOC_LENGTH_SIGMA ** 2 / 2, DOC_LENGTH_SIGMA)))
        lengths.append(min(doc, max_seq_len, need))
    return lengths, max_docs


def layer_kinds():
    """{(paired heads, long window): number of layers} of the model's attention layers."""
    return collections.Counter((layer in T.PAIRED_HEAD_LAYERS, layer in T.LONG_WINDOW_LAYERS)
                               for layer in T.ModelConfig().attention_layers)


def problem(tokens, max_seq_len, paired, cu_seqlens, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    S, H = (2 * tokens, HEADS // 2) if paired else (tokens, HEADS)
    doc_ids = torch.searchsorted(cu_seqlens, torch.arange(tokens, device="cuda", dtype=torch.int32), right=True)
    args = T.AttnArgs(cu_seqlens, doc_ids, max_seq_len, "flex", {})
    args = args.doubled() if paired else args
    # q carries the softmax scale as in the model (QK-norm, attn_scale ~0.1-0.2); bf16 like training
    q = (torch.randn(S, H, HEAD_DIM, device="cuda", generator=g) * 0.15).bfloat16()
    k, v = (torch.randn(S, H, HEAD_DIM, device="cuda", generator=g).bfloat16() for _ in range(2))
    grad_out = torch.randn(S, H, HEAD_DIM, device="cuda", generator=g).bfloat16()
    return (q, k, v), grad_out, args


def measure(qkv, grad_out, args, window, backend):
    """(fwd ms, fwd+bwd ms, [out, dq, dk, dv]) of one backend. Flex attention compiled, as inside the
    model's compiled step (eager, it would materialize every score); FA4's custom ops and SDPA eager."""
    args = dataclasses.replace(args, backend=backend, block_masks={})
    attend = torch.compile(T.attend, dynamic=False, fullgraph=True) if backend == "flex" else T.attend
    leaves = [t.clone().requires_grad_() for t in qkv]

    def forward():
        with torch.no_grad():
            return attend(*qkv, args, window)

    def forward_backward():
        attend(*leaves, args, window).backward(grad_out)

    forward_backward()
    results = [forward(), *(t.grad.clone() for t in leaves)]
    fwd = bench(forward)
    fwd_bwd = do_bench(forward_backward, warmup=25, rep=200, grad_to_none=leaves, return_mode="median")
    return fwd, fwd_bwd, results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="1,2,3,4", help="stage rows, 1-based (4: the extension)")
    parser.add_argument("--quick", action="store_true", help="stage 3 only")
    parser.add_argument("--backends", default=None, help="comma-separated (fa4, flex, sdpa); default: flex, and fa4 "
                        "where it runs")
    parser.add_argument("--mean-doc", type=float, default=1000.0, help="mean document length in tokens")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    stages = [3] if cli.quick else [int(s) for s in cli.stages.split(",")]
    chosen = cli.backends.split(",") if cli.backends else available_backends()
    backends = ["flex"] + [b for b in chosen if b != "flex"]  # flex first: the numerical reference
    for name in ("recompile_limit", "cache_size_limit"):  # flex: three graphs per shape and window (the first
        if hasattr(torch._dynamo.config, name):  # call makes its block mask; no_grad); the name since and before 2.6
            setattr(torch._dynamo.config, name, 128)
    print(f"# attention backends on {torch.cuda.get_device_name()} (torch {torch.__version__}); "
          f"documents lognormal, mean {cli.mean_doc:.0f} tokens")
    print("| stage | tokens | docs | layer kind | window | backend | fwd ms | fwd+bwd ms | "
          "rel out | rel dq | rel dk | rel dv |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals = {}
    rng = np.random.default_rng(cli.seed)
    for index in stages:
        row = T.STAGES[index - 1]
        tokens, block = row.batch_tokens // T.RANKS_PER_STEP, T.ScheduleConfig().window_block_size
        lengths, max_docs = document_lengths(tokens, row.max_seq_len, cli.mean_doc, rng)
        cu = torch.tensor(T.cu_seqlens_for(lengths, tokens, max_docs), device="cuda")
        windows = {False: row.short_window * block, True: row.long_window * block}
        for (paired, long), layers in sorted(layer_kinds().items()):
            window = windows[long]
            qkv, grad_out, args = problem(tokens, row.max_seq_len, paired, cu, cli.seed)
            kind = f"{'paired 2T x 3 heads' if paired else 'plain T x 6 heads'} (x{layers})"
            reference = None
            for backend in backends:
                fwd, fwd_bwd, results = measure(qkv, grad_out, args, window, backend)
                reference = reference or results
                errors = " | ".join(f"{rel(got, want):.1e}" for got, want in zip(results, reference))
                print(f"| {index} | {tokens} | {len(lengths)} | {kind} | {window} | {backend} | {fwd:.3f} | "
                      f"{fwd_bwd:.3f} | {errors} |", flush=True)
                total = totals.setdefault((index, backend), [0.0, 0.0])
                total[0] += layers * fwd
                total[1] += layers * fwd_bwd
    attention_layers = len(T.ModelConfig().attention_layers)
    print(f"\n# attention per training step (one rank, the model's {attention_layers} attention layers)")
    print("| stage | backend | fwd ms | fwd+bwd ms |")
    print("|---|---|---|---|")
    for (index, backend), (fwd, fwd_bwd) in totals.items():
        print(f"| {index} | {backend} | {fwd:.2f} | {fwd_bwd:.2f} |")


if __name__ == "__main__":
    main()
