"""CPU runs multiply bf16/fp16 operands as fp32 and round once (train_gpt.cpu_16bit_gemms_in_fp32): the
products, their gradients, the dtypes it leaves alone, and who installs it."""
import subprocess
import sys

import pytest
import torch

import train_gpt as T
from helpers import ROOT


def active_cpu_kernel(op: str) -> str:
    """Where the dispatcher's active CPU kernel of aten::<op> was registered."""
    return next(line for line in torch._C._dispatch_dump(f"aten::{op}").splitlines() if line.startswith("CPU:"))


def test_the_cpu_kernels_are_ours():
    """The products below would pass with torch's own kernels too (they round the same on these sizes):
    this is what tells the registration took (only speed would tell otherwise)."""
    for op in ("mm", "bmm"):
        assert "train_gpt.py" in active_cpu_kernel(op), active_cpu_kernel(op)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_products_are_fp32_products_rounded_once(dtype):
    T.cpu_16bit_gemms_in_fp32()  # conftest installed it already: a second call is a no-op
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(67, 300, generator=g).to(dtype), torch.randn(300, 45, generator=g).to(dtype)
    assert torch.equal(a @ b, (a.float() @ b.float()).to(dtype))
    batch_a, batch_b = torch.randn(3, 17, 64, generator=g).to(dtype), torch.randn(3, 64, 9, generator=g).to(dtype)
    assert torch.equal(torch.bmm(batch_a, batch_b), torch.bmm(batch_a.float(), batch_b.float()).to(dtype))
    assert torch.equal(batch_a @ b[:64, :9], (batch_a.float() @ b[:64, :9].float()).to(dtype))  # matmul's fold
    assert (a @ b).dtype == dtype and torch.mm(a.t().contiguous().t(), b).shape == (67, 45)


def test_gradients_come_from_the_same_products():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(33, 128, generator=g).bfloat16().requires_grad_()
    w = torch.randn(64, 128, generator=g).bfloat16().requires_grad_()
    upstream = torch.randn(33, 64, generator=g).bfloat16()
    (a @ w.t()).backward(upstream)
    assert torch.equal(a.grad, (upstream.float() @ w.float()).bfloat16())
    assert torch.equal(w.grad, (upstream.float().t() @ a.float()).bfloat16())


def test_other_dtypes_keep_their_kernels():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(20, 30, generator=g, dtype=torch.float64), torch.randn(30, 7, generator=g, dtype=torch.float64)
    assert torch.allclose(a @ b, torch.einsum("ik,kj->ij", a, b), rtol=0, atol=1e-12) and (a @ b).dtype == torch.float64
    ints = torch.arange(12).view(3, 4) @ torch.arange(8).view(4, 2)
    assert ints.dtype == torch.int64 and ints.tolist() == [[28, 34], [76, 98], [124, 162]]
    with pytest.raises(RuntimeError):  # mixed dtypes stay an error, as without the override
        torch.randn(2, 3).bfloat16() @ torch.randn(3, 2)


def test_importing_leaves_torch_alone_and_a_cpu_process_installs_it():
    """Importing train_gpt changes nothing; init_process on the CPU (every CPU run) installs the kernels."""
    code = ("import torch, train_gpt as T\n"
            "assert T._CPU_GEMMS is None\n"
            "T.init_process(T.Hyperparameters.from_env())\n"
            "assert T._CPU_GEMMS is not None\n"
            "assert 'train_gpt.py' in [l for l in torch._C._dispatch_dump('aten::mm').splitlines() if l.startswith('CPU:')][0]\n"
            "a = torch.randn(8, 16).bfloat16(); b = torch.randn(16, 4).bfloat16()\n"
            "assert torch.equal(a @ b, (a.float() @ b.float()).bfloat16())\n")
    env = {"PATH": "/usr/bin:/bin", "DEVICE": "cpu", "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
