"""Host (CPU) microseconds per call against GPU microseconds per call for the MLP's launch paths
(cuBLAS, the fused ReLU² GEMM directly and through its custom op, the compiled MLP fwd+bwd plain and
fused) at stage-1 and stage-3 token counts: where host time approaches GPU time, a step of such
calls is launch-bound. GPU time here includes queueing: once the launch queue fills, host time
equals GPU time.

    python bench/launch_overhead.py     # CUDA
"""
import os
import sys
import time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import train_gpt as T
from triton.tools.tensor_descriptor import TensorDescriptor

def host_and_gpu(fn, n=200):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); t0 = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t0) / n * 1e6
    e1.record(); torch.cuda.synchronize()
    return host, e0.elapsed_time(e1) / n * 1e3

for tokens in (16384, 49152):
    x = torch.randn(tokens, 768, device="cuda").bfloat16().requires_grad_()
    fc = (torch.randn(3072, 768, device="cuda") * 0.02).bfloat16().requires_grad_()
    proj = (torch.randn(3072, 768, device="cuda") * 0.02).bfloat16().requires_grad_()
    g = torch.randn(tokens, 768, device="cuda").bfloat16()
    post = torch.relu(x @ fc.t()).square().detach()
    xd, fcd = x.detach(), fc.detach()
    plain = torch.compile(lambda x, fc, proj: torch.relu(x @ fc.t()).square() @ proj)
    fused = torch.compile(lambda x, fc, proj: T.relu_square_mlp(x, fc, proj, fused=True))
    cases = {
        "cuBLAS x@fc.T": lambda: xd @ fcd.t(),
        "relu_square_gemm direct": lambda: T.relu_square_gemm(xd, fcd),
        "relu_square_gemm grad direct": lambda: T.relu_square_gemm(g, proj.detach(), post),
        "op speedrun.relu_square_matmul": lambda: torch.ops.speedrun.relu_square_matmul(xd, fcd),
        "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(xd, [128, 64]),
        "get_device_capability": lambda: torch.cuda.get_device_capability(xd.device),
        "MLP fwd+bwd compiled plain": lambda: plain(x, fc, proj).backward(g),
        "MLP fwd+bwd compiled fused": lambda: fused(x, fc, proj).backward(g),
    }
    for name, fn in cases.items():
        h, d = host_and_gpu(fn)
        print(f"T={tokens:6d} {name:34s} host {h:8.1f} us/call  gpu {d:8.1f} us/call", flush=True)
