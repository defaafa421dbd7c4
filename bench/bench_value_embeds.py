"""Microbenchmark: the value-embedding lookup of the five value-embedding layers, forward+backward
compiled, from a layer-major table (5·V, d) (one gather per layer, V2) against the token-major
table (V, 5·d) that train_gpt.py uses (one gather for all layers, one scatter for the gradient).

    python bench/bench_value_embeds.py      # CUDA; median ms of triton.testing.do_bench
"""
import torch
from triton.testing import do_bench
V, d, L = 50304, 768, 5  # vocabulary, model width, value-embedding layers
def old(table, ids, ws):
    bank = table.view(L, V, d)
    return sum((bank[i][ids] * ws[i]).float().sum() for i in range(L))
def new(table, ids, ws):
    rows = table[ids].split(d, -1)
    return sum((rows[i] * ws[i]).float().sum() for i in range(L))
for T in (16384, 49152):
    ids = torch.randint(0, V, (T,), device="cuda")
    ws = [torch.randn(T, d, device="cuda").bfloat16() for _ in range(L)]
    for name, f, shape in (("layer-major", old, (L * V, d)), ("token-major", new, (V, L * d))):
        t = (torch.randn(shape, device="cuda") * 0.01).bfloat16().requires_grad_()
        g = torch.compile(f, dynamic=False)
        def step():
            t.grad = None
            g(t, ids, ws).backward()
        step()
        print(f"T={T} {name}: {do_bench(step, warmup=50, rep=300, return_mode='median'):.3f} ms fwd+bwd", flush=True)
