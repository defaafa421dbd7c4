"""Microbenchmark: the token tables' lookups with their gradients (docs/TECHNIQUES.md T6.6), compiled as the model
compiles them (fullgraph): embed (V, d) and the token-major value embeddings (V, layers·d) gathered at one forward's
ids, their gradients by autograd's index_put (inductor's atomic scatter into a zero-filled table; `index_put`) and by
the sorted row-sum kernel (token_order, then token_rows_backward; `row kernel`). Per path: the two gradients against
float64 sums, then median ms of triton.testing.do_bench of forward+backward (the sort included), and the kernels'
device time under the torch profiler (bench_copy_pointer.gpu_time), the row kernel's apart. The layer-major table
(V2) lost to the token-major one in record V3.

    python bench/bench_value_embeds.py                          # 16,384 / 32,768 / 49,152 tokens (stages 1-3)
    python bench/bench_value_embeds.py --tokens 49152 --launch 16x64x256x4,32x32x256x8

Ids: the first shard of TRAIN_FILES (the environment of a run, which bench/lease.sh exports), each size a stretch of
it; without TRAIN_FILES, Zipf(1.2) ids (bench_row_tables.token_source). --launch: ROWSxCHUNKxBLOCK_DxWARPS
settings of TOKEN_ROWS_LAUNCH to time besides the file's.
"""
import argparse
import os
import sys

import torch
from bench_copy_pointer import gpu_time
from bench_row_tables import token_source
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402


def lookups(embed, value_embeds, ids, upstream, order):
    """The model's two lookups (GPT.context) and a loss reading every gathered value once."""
    x = T.token_rows(embed, ids, order)
    rows = T.token_rows(value_embeds, ids, order)
    return (x * upstream[0]).float().sum() + (rows * upstream[1]).float().sum()


def step_fn(compiled, embed, value_embeds, ids, upstream, kernel: bool):
    def step():
        embed.grad = value_embeds.grad = None
        order = T.token_order(ids, embed.size(0)) if kernel else None
        compiled(embed, value_embeds, ids, upstream, order).backward()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16384,32768,49152")
    parser.add_argument("--launch", default="", help="ROWSxCHUNKxBLOCK_DxWARPS,... besides TOKEN_ROWS_LAUNCH")
    args = parser.parse_args()
    cfg = T.ModelConfig()
    V, d, layers = cfg.vocab_size, cfg.model_dim, len(cfg.value_embed_layers)
    sizes = [int(n) for n in args.tokens.split(",")]
    ids_all = torch.from_numpy(token_source(os.environ.get("TRAIN_FILES"), sum(sizes), V, 0))
    keys = ("ROWS", "CHUNK", "BLOCK_D", "num_warps")
    launches = [dict(T.TOKEN_ROWS_LAUNCH)]
    launches += [dict(zip(keys, map(int, s.split("x")))) for s in args.launch.split(",") if s]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {T.triton.__version__}; ids: "
          f"{'the first shard of ' + os.environ['TRAIN_FILES'] if os.environ.get('TRAIN_FILES') else 'Zipf(1.2)'}")
    g = torch.Generator(device="cuda").manual_seed(0)
    embed = (torch.randn(V, d, device="cuda", generator=g) * 0.005).bfloat16().requires_grad_()
    value_embeds = (torch.randn(V, layers * d, device="cuda", generator=g) * 0.01).bfloat16().requires_grad_()
    start = 0
    for tokens in sizes:
        ids = ids_all[start: start + tokens].cuda()
        start += tokens
        upstream = [torch.randn(tokens, n, device="cuda", generator=g).bfloat16() for n in (d, layers * d)]
        want = [torch.zeros(V, n, dtype=torch.float64, device="cuda").index_add_(0, ids, u.double())
                for n, u in zip((d, layers * d), upstream)]
        top = torch.bincount(ids, minlength=V).max().item()
        print(f"T={tokens}: {ids.unique().numel()} distinct ids, the most frequent {top} times")
        paths = [("index_put", False, T.TOKEN_ROWS_LAUNCH)] + [("row kernel", True, launch) for launch in launches]
        for name, kernel, launch in paths:
            T.TOKEN_ROWS_LAUNCH = launch
            torch._dynamo.reset()
            compiled = torch.compile(lookups, dynamic=False, fullgraph=True)
            step = step_fn(compiled, embed, value_embeds, ids, upstream, kernel)
            step()
            errors = [rel(p.grad, w) for p, w in zip((embed, value_embeds), want)]
            ms = do_bench(step, warmup=25, rep=200, return_mode="median")
            total, own = gpu_time(step, own_prefix="_token_rows_")
            label = name if not kernel else f"{name} {launch}"
            print(f"  {label}: {ms:.3f} ms fwd+bwd, kernels {total:.3f} ms (the row kernel's {own:.3f}); grad error "
                  f"embed {errors[0]:.1e}, value_embeds {errors[1]:.1e}", flush=True)
        T.TOKEN_ROWS_LAUNCH = launches[0]


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


if __name__ == "__main__":
    main()
