"""Microbenchmark: the value-embedding lookup of the five value-embedding layers, forward+backward
compiled, from a layer-major table (5·V, d) (one gather per layer, V2) against the token-major
table (V, 5·d) that train_gpt.py uses (one gather for all layers, one scatter for the gradient).

    python bench/bench_value_embeds.py      # CUDA; median ms of triton.testing.do_bench
"""
import torch
from triton.testing import do_bench

VOCAB, DIM, LAYERS = 50304, 768, 5
TOKENS = (16384, 49152)  # per-rank tokens of stages 1 and 3


def layer_major(table, ids, upstream):
    bank = table.view(LAYERS, VOCAB, DIM)
    return sum((bank[i][ids] * upstream[i]).float().sum() for i in range(LAYERS))


def token_major(table, ids, upstream):
    rows = table[ids].split(DIM, -1)
    return sum((rows[i] * upstream[i]).float().sum() for i in range(LAYERS))


def main():
    for tokens in TOKENS:
        ids = torch.randint(0, VOCAB, (tokens,), device="cuda")
        upstream = [torch.randn(tokens, DIM, device="cuda").bfloat16() for _ in range(LAYERS)]
        for name, lookup, shape in (("layer-major", layer_major, (LAYERS * VOCAB, DIM)),
                                    ("token-major", token_major, (VOCAB, LAYERS * DIM))):
            table = (torch.randn(shape, device="cuda") * 0.01).bfloat16().requires_grad_()
            compiled = torch.compile(lookup, dynamic=False)

            def step():
                table.grad = None
                compiled(table, ids, upstream).backward()

            ms = do_bench(step, warmup=50, rep=300, return_mode="median")
            print(f"T={tokens} {name}: {ms:.3f} ms fwd+bwd", flush=True)


if __name__ == "__main__":
    main()
