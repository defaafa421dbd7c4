"""Fast paths against their references: the symmetric Triton kernels (through Triton's CPU
interpreter here, compiled on a GPU in the gpu-marked tests) and attention backends. The fused
cross-entropy and the FP8 lm_head: test_cross_entropy.py."""

import textwrap

import pytest
import torch

import train_gpt as T
from helpers import rel_err, run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

INTERPRETER_CHECK = textwrap.dedent("""
    import torch, train_gpt as T
    torch.manual_seed(int.from_bytes(__import__('os').urandom(4), 'little'))
    from helpers import rel_err as rel
    results = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for shape, block in (((2, 40, 70), 16), ((3, 33, 16), 16), ((2, 64, 128), 32), ((1, 100, 48), None)):
            A = torch.randn(shape, dtype=dtype)
            config = (block, 16, 4, 2) if block else None  # None: the default tiles
            results.append(("xxt", shape, block, rel(T.xxt(A, config), A.float() @ A.float().mT), tol))
            results.append(("xtx", shape, block, rel(T.xtx(A, config), A.float().mT @ A.float()), tol))
            S = A.float() @ A.float().mT / shape[-1]
            S = S.to(dtype)
            out = T.ba_plus_caa(S, alpha=0.7, beta=-1.3, config=config)
            results.append(("ba_plus_caa", shape, block, rel(out, -1.3 * S.float() + 0.7 * S.float() @ S.float()), tol))
    bad = [r for r in results if not r[3] < r[4]]
    for r in results:
        print(*r)
    assert not bad, bad
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_symmetric_kernels_in_the_triton_interpreter():
    """Every tile path (diagonal, mirrored, wrapped odd sizes, masked reduction) on the CPU."""
    run_in_triton_interpreter(INTERPRETER_CHECK, timeout=600)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(24, 768, 768), (12, 3072, 768), (64, 256, 768), (3, 100, 300), (5, 257, 129)])
def test_triton_orthogonalize_matches_torch_path(shape):
    G = torch.randn(shape, device="cuda")
    fast = T.orthogonalize(G, "polar_express", use_triton=True)
    ref = T.orthogonalize(G, "polar_express", use_triton=False)
    assert torch.isfinite(fast).all()
    assert rel_err(fast, ref) < 1e-2  # bf16 tolerance (METHOD.md)
    A = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    assert rel_err(T.xxt(A), A.float() @ A.float().mT) < 1e-2
    assert rel_err(T.xtx(A), A.float().mT @ A.float()) < 1e-2
    S = T.xxt(A) / shape[-1]
    assert rel_err(T.ba_plus_caa(S, 2.0, -3.0), -3.0 * S.float() + 2.0 * S.float() @ S.float()) < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "varlen"])
@pytest.mark.parametrize("window", [T.NO_WINDOW, 96])
def test_attention_backends_match_sdpa(backend, window):
    torch.manual_seed(0)
    S, H, D = 1024, 3, 128
    cu = torch.tensor([0, 100, 130, 600, 1024, 1024, 1024], device="cuda", dtype=torch.int32)
    doc_ids = torch.searchsorted(cu, torch.arange(S, device="cuda", dtype=torch.int32), right=True)
    q, k, v = (torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16) * 0.3 for _ in range(3))
    out = T.attend(q, k, v, cu, doc_ids, window, 600, backend, {})
    ref = T.attend(q, k, v, cu, doc_ids, window, 600, "sdpa", {})
    assert rel_err(out, ref) < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(22, 3072, 768), (20, 768, 768), (60, 256, 768)])
def test_compiled_triton_bank_step_matches_eager_torch(shape):
    """The optimizer's compiled NorMuon bank step (Triton kernels traced into one graph) against the
    eager torch path: same fp32 master-weight update at bf16 tolerance."""
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    weight0 = (torch.randn(shape, device="cuda") * 0.02).bfloat16()
    momentum0 = torch.randn(shape, device="cuda") * 0.1
    rows, cols = shape[1:]
    axis = -1 if rows >= cols else -2
    updates = []
    compiled = torch.compile(T.normuon_bank_step, dynamic=False, fullgraph=True)
    for fn, use_triton in ((T.normuon_bank_step, False), (compiled, True)):
        weight, momentum = weight0.clone(), momentum0.clone()
        second_moment = torch.zeros((shape[0], rows, 1) if axis == -1 else (shape[0], 1, cols), device="cuda")
        mantissa = torch.zeros(shape, dtype=torch.int16, device="cuda")
        fn(grad, momentum, second_moment, weight, mantissa, torch.tensor(0.9), torch.tensor(0.02),
           torch.ones(shape[0], 1, 1, device="cuda"), torch.tensor(0.01), 1.0, 0.9, axis, "polar_express", use_triton)
        updates.append(T._fp32_from_bf16_and_mantissa(weight, mantissa) - weight0.float())
    assert torch.isfinite(updates[1]).all()
    assert rel_err(updates[1], updates[0]) < 2e-2
