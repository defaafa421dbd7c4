"""Host (CPU) microseconds per call against GPU microseconds per call for the MLP's launch paths
(cuBLAS, the fused ReLU² GEMM directly and compiled, the compiled MLP fwd+bwd plain and fused) at
stage-1 and stage-3 token counts: where host time approaches GPU time, a step of such calls is
launch-bound. GPU time here includes queueing: once the launch queue fills, host time
equals GPU time.

    python bench/launch_overhead.py     # CUDA
"""
import os
import sys
import time

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

TOKENS = (16384, 49152)  # per-rank tokens of stages 1 and 3
HIDDEN, DIM = 3072, 768


def host_and_gpu_us(fn, calls=200):
    """Microseconds per call: host time of issuing `calls` calls, GPU time between two events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def main():
    for tokens in TOKENS:
        x = torch.randn(tokens, DIM, device="cuda").bfloat16().requires_grad_()
        fc = (torch.randn(HIDDEN, DIM, device="cuda") * 0.02).bfloat16().requires_grad_()
        proj = (torch.randn(HIDDEN, DIM, device="cuda") * 0.02).bfloat16().requires_grad_()
        grad = torch.randn(tokens, DIM, device="cuda").bfloat16()
        post = torch.relu(x @ fc.t()).square().detach()
        x_, fc_, proj_ = x.detach(), fc.detach(), proj.detach()
        plain = torch.compile(T.relu_square_mlp_reference)
        kernel = T.tma_gemm_applies(x_)  # the fused MLP's Triton GEMMs (Hopper or newer), else its torch products
        fused = torch.compile(lambda x, fc, proj: T.relu_square_mlp(x, fc, proj, kernel))
        gemm = torch.compile(lambda a, b: T.relu_square_matmul(a, b, True))  # inductor launches the kernel
        cases = {
            "cuBLAS x@fc.T": lambda: x_ @ fc_.t(),
            "relu_square_gemm direct": lambda: T.relu_square_gemm(x_, fc_),
            "relu_square_gemm grad direct": lambda: T.relu_square_gemm(grad, proj_, post),
            "relu_square_matmul compiled": lambda: gemm(x_, fc_),
            "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(x_, [128, 64]),
            "get_device_capability": lambda: torch.cuda.get_device_capability(x_.device),
            "MLP fwd+bwd compiled plain": lambda: plain(x, fc, proj).backward(grad),
            "MLP fwd+bwd compiled fused": lambda: fused(x, fc, proj).backward(grad),
        }
        for name, fn in cases.items():
            host, gpu = host_and_gpu_us(fn)
            print(f"T={tokens:6d} {name:34s} host {host:8.1f} us/call  gpu {gpu:8.1f} us/call", flush=True)


if __name__ == "__main__":
    main()
