"""The symmetric Triton kernels against their references (through Triton's CPU interpreter here,
compiled on a GPU in the gpu-marked tests): the products, the orthogonalization built on them
against float64 and the torch path, and the optimizer's compiled bank step. The fused
cross-entropy and the FP8 lm_head: test_cross_entropy.py; the attention backends against SDPA:
tests/model/test_attention_backends.py."""

import importlib.util
import os
import textwrap

import pytest
import torch

import train_gpt as T
from helpers import ROOT, rel_err, run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the orthogonalizer's other sets of maps live in the bench tool: a six-map set, normalized as Polar Express's
_SPEC = importlib.util.spec_from_file_location("quintic_maps", os.path.join(ROOT, "bench", "quintic_maps.py"))
Q = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(Q)
MAPS = {"polar_express": T.POLAR_EXPRESS_COEFFS, "polar_express6_l3e4": Q.GREEDY6_FLOOR_3E4_COEFFS}

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
            out = T.ba_plus_caa(S, alpha=0.7, beta=-1.3, config=config, identity=2.5)
            ref = -1.3 * S.float() + 0.7 * S.float() @ S.float() + 2.5 * torch.eye(shape[1])
            results.append(("ba_plus_caa + I", shape, block, rel(out, ref), tol))
    # The whole folded iteration (X·(B + a·I)) on tall, wide, square and odd banks against float64,
    # held to the torch path's accuracy as on the GPU (the kernels round their bf16 stores to nearest
    # here too): a wrong coefficient, transpose or missing a·I errs by order 1, a worse rounding
    # placement by more than the 1.3x.
    for shape in ((2, 96, 64), (2, 64, 96), (2, 64, 64), (3, 100, 300)):
        G = torch.randn(shape)
        ref = T.orthogonalize_float64(G)
        torch_err = rel(T.orthogonalize(G, use_triton=False), ref)
        triton_err = rel(T.orthogonalize(G, use_triton=True), ref)
        results.append(("orthogonalize", shape, None, triton_err, min(2e-2, 1.3 * torch_err)))
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
@pytest.mark.parametrize("method", ["polar_express", "polar_express6_l3e4"])  # five and six maps
@pytest.mark.parametrize("shape", [(24, 768, 768), (12, 3072, 768), (64, 256, 768), (3, 100, 300), (5, 257, 129)])
def test_triton_orthogonalize_is_as_accurate_as_the_torch_path(shape, method):
    """Both paths against the float64 iteration. Five (or six) chained bf16 iterations land near 1e-2 from it
    whichever way they round, and the two paths round differently (Triton: B + a·I once, in the
    kernel; torch: B, then a·X + X·B), so they differ from each other by about as much (1.3-1.4e-2)
    as from float64: each is held to float64, the Triton path to the torch path's accuracy."""
    assert Q.MAP_SETS[method][1:] == (T.POLAR_SAFETY, T.POLAR_EPS)  # the default normalization applies
    G = torch.randn(shape, device="cuda")
    ref = T.orthogonalize_float64(G, MAPS[method])
    fast = T.orthogonalize(G, use_triton=True, coeffs=MAPS[method])
    assert torch.isfinite(fast).all()
    fast_err, torch_err = rel_err(fast, ref), rel_err(T.orthogonalize(G, use_triton=False, coeffs=MAPS[method]), ref)
    assert fast_err < 2e-2 and torch_err < 2e-2
    assert fast_err < 1.3 * torch_err
    A = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    assert rel_err(T.xxt(A), A.float() @ A.float().mT) < 1e-2
    assert rel_err(T.xtx(A), A.float().mT @ A.float()) < 1e-2
    S = T.xxt(A) / shape[-1]
    assert rel_err(T.ba_plus_caa(S, 2.0, -3.0), -3.0 * S.float() + 2.0 * S.float() @ S.float()) < 1e-2
    eye = torch.eye(shape[1], device="cuda")
    assert rel_err(T.ba_plus_caa(S, 2.0, -3.0, identity=4.0), -3.0 * S.float() + 2.0 * S.float() @ S.float() + 4.0 * eye) < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(22, 3072, 768), (20, 768, 768), (60, 256, 768)])
def test_compiled_triton_bank_step_matches_the_eager_steps(shape):
    """The optimizer's compiled NorMuon bank step (Triton kernels traced into one graph) against the
    same step run eagerly (the same kernels: a tight match) and against the eager torch path (which
    rounds differently, see above: about 1.4e-2 apart in the orthogonalized update); the momentum rails
    engaged (T2.9: the fast rail's beta and weight as the schedule sets them, the slow rail's beta)."""
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    weight0 = (torch.randn(shape, device="cuda") * 0.02).bfloat16()
    fast0, slow0 = torch.randn(shape, device="cuda") * 0.1, torch.randn(shape, device="cuda") * 0.1
    rows, cols = shape[1:]
    axis = -1 if rows >= cols else -2
    updates = []
    compiled = torch.compile(T.normuon_bank_step, dynamic=False, fullgraph=True)
    for fn, use_triton in ((T.normuon_bank_step, False), (T.normuon_bank_step, True), (compiled, True)):
        weight, rails = weight0.clone(), (fast0.clone(), slow0.clone(), torch.tensor(0.85), torch.tensor(0.4385), 0.98)
        second_moment = torch.zeros((shape[0], rows, 1) if axis == -1 else (shape[0], 1, cols), device="cuda")
        mantissa = torch.zeros(shape, dtype=torch.int16, device="cuda")
        fn(grad, rails, second_moment, weight, mantissa, torch.tensor(0.9), torch.tensor(0.02),
           torch.ones(shape[0], 1, 1, device="cuda"), torch.tensor(0.01), 1.0, 0.9, axis, use_triton)
        updates.append(T._fp32_from_bf16_and_mantissa(weight, mantissa) - weight0.float())
    assert torch.isfinite(updates[2]).all()
    assert rel_err(updates[2], updates[1]) < 1e-2
    assert rel_err(updates[2], updates[0]) < 3e-2
