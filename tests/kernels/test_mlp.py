"""The fused MLP (docs/TECHNIQUES.md T6.1): the ReLU² GEMM kernel's epilogues through Triton's CPU
interpreter, the custom ops and their autograd on the torch reference path (eager and traced by
torch.compile), gradients into the banked weights, and the compiled kernels on a GPU (gpu-marked).
The FP8 forward (T6.2): the bank's e4m3 copies, its e4m3 reference against the bf16 MLP, the kernel's
e4m3 epilogue in the interpreter and on a GPU, and the model's FP8 training forward on a GPU."""

import math
import textwrap

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import train_gpt as T
from helpers import rel_err, run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Shapes (M, N, K) and configs cover: several tiles per persistent program (4 programs in the
# interpreter), a partial last tile-group, ragged M, N and K, split and whole epilogues.
INTERPRETER_CHECK = textwrap.dedent("""
    import torch, train_gpt as T
    torch.manual_seed(int.from_bytes(__import__('os').urandom(4), 'little'))
    from helpers import rel_err as rel
    cases = [((70, 48, 40), T.GemmConfig(32, 32, 16, stages=2, warps=4, group_m=2)),
             ((70, 48, 40), T.GemmConfig(16, 16, 16, stages=2, warps=4, group_m=1, persistent=False,
                                         flatten=False, split_epilogue=False)),
             ((33, 24, 72), T.GemmConfig(16, 16, 32, stages=2, warps=4, group_m=8, flatten=False))]
    results = []
    for (M, N, K), config in cases:
        a, b = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16()
        post = torch.rand(M, N).bfloat16() + 0.01
        product = a.double() @ b.double().T
        for aux, ref in ((None, product.relu().square()), (post, product * 2 * post.double().sqrt())):
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)  # unwritten elements stay NaN
            T.relu_square_gemm(a, b, aux, config=config, out=out)
            results.append(((M, N, K), config, aux is None, rel(out, ref)))
    bad = [r for r in results if not r[-1] < 1e-2]  # bf16 output: ~2e-3
    for r in results:
        print(*r)
    assert not bad, bad
""")



TMA_GPU = torch.cuda.is_available() and T.triton is not None and torch.cuda.get_device_capability()[0] >= 9


def fused_mlp(x, fc, proj):
    """The fused MLP as the model's execution plan runs it: the TMA kernels for CUDA tensors on
    Hopper or newer, else the same custom backward with torch products."""
    return T.relu_square_mlp(x, fc, proj, use_triton=TMA_GPU and x.is_cuda)

def mlp_inputs(M, d=64, hidden=96, device="cpu"):
    """Realistic scales: normed activations, fc like the init (U(±d^-0.5/2·√3)), a trained-like proj."""
    torch.manual_seed(M)
    x = T.norm(torch.randn(M, d, device=device)).bfloat16()
    bound = 3 ** 0.5 * 0.5 * d ** -0.5
    fc = torch.empty(hidden, d, device=device).uniform_(-bound, bound).bfloat16()
    proj = (torch.randn(hidden, d, device=device) * 0.02).bfloat16()
    grad = torch.randn(M, d, device=device).bfloat16()
    return x, fc, proj, grad


def float_reference(x, fc, proj, grad):
    """Output and gradients (x, fc, proj) of the plain expression in fp32 autograd."""
    x, fc, proj = (t.float().requires_grad_() for t in (x, fc, proj))
    out = torch.relu(x @ fc.t()).square() @ proj
    return (out, *torch.autograd.grad(out, (x, fc, proj), grad.float()))


def output_and_grads(fn, x, fc, proj, grad):
    x, fc, proj = (t.clone().requires_grad_() for t in (x, fc, proj))
    out = fn(x, fc, proj)
    return (out, *torch.autograd.grad(out, (x, fc, proj), grad))


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_relu_square_gemm_epilogues_in_the_triton_interpreter():
    run_in_triton_interpreter(INTERPRETER_CHECK, timeout=600)


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_relu_square_gemm_rejects_shapes_tma_cannot_stride():
    a, b = torch.randn(16, 40).bfloat16(), torch.randn(20, 40).bfloat16()  # N = 20: 40-byte rows
    with pytest.raises(ValueError, match="multiples of 8"):
        T.relu_square_gemm(a, b)
    with pytest.raises(ValueError, match="bf16"):
        T.relu_square_gemm(a.float(), torch.randn(24, 40))


def test_tma_operands_are_copied_only_when_tma_cannot_read_them_eager_and_traced():
    """Eager: an aligned row-major view is passed as it is; a view 2 bytes into its storage and a
    transposed view are copied. Traced (fullgraph, as the model's compiled graph traces the launch):
    the check compiles (it may not read the address, which dynamo cannot trace) and still copies
    the non-contiguous view."""
    bank = torch.randn(3, 16, 8).bfloat16()
    aligned, odd = bank[1], torch.randn(129).bfloat16()[1:].view(16, 8)
    assert T._tma_operand(aligned) is aligned
    for view in (odd, bank[1].t()):
        copy = T._tma_operand(view)
        assert copy.data_ptr() % 16 == 0 and copy.is_contiguous() and torch.equal(copy, view)
    torch._dynamo.reset()
    traced = torch.compile(lambda t: T._tma_operand(t).stride(), backend="eager", fullgraph=True)
    assert traced(aligned) == (8, 1) and traced(bank[1].t()) == (16, 1)


FP8_INTERPRETER_CHECK = textwrap.dedent("""
    import torch, train_gpt as T
    from helpers import rel_err as rel
    torch.manual_seed(0)
    # the interpreter's fp32 -> FP8 casts do not round as the GPU does (some values land a step or more
    # low): layouts, amax and scales are checked exactly here, FP8 values loosely (on the GPU: tightly)
    for (M, N, K), config in [((64, 96, 64), T.GemmConfig(32, 32, 16, stages=2, warps=4, group_m=2)),
                              ((48, 32, 80), T.GemmConfig(16, 32, 16, stages=2, warps=4, split_epilogue=False))]:
        a, b = torch.randn(M, K).to(torch.float8_e4m3fn), (torch.randn(N, K) * 0.5).to(torch.float8_e4m3fn)
        product_scale, post_scale = torch.tensor(0.01), torch.tensor(0.05)
        post8, post8_t, amax = T.relu_square_fp8_gemm(a, b, product_scale, post_scale, config)
        post_ref = torch.relu(a.double() @ b.double().T * 0.01).square()
        assert post8.dtype == torch.float8_e4m3fn
        assert torch.equal(post8_t.view(torch.uint8), post8.t().contiguous().view(torch.uint8))
        assert abs(amax.item() / post_ref.max().item() - 1) < 1e-6, amax
        assert rel(post8.float() * 0.05, post_ref) < 0.15, rel(post8.float() * 0.05, post_ref)
        grad8 = (torch.randn(M, K) * 100).to(torch.float8_e5m2)
        scales = torch.tensor(0.02), post_scale, torch.tensor(0.004)
        dpre8, dpre8_t, dpre_amax = T.relu_square_grad_fp8_gemm(grad8, b, post8, *scales, config, amax=True)
        dpre_ref = (grad8.double() @ b.double().T * 0.02) * 2 * (post8.double() * 0.05).sqrt()
        assert dpre8.dtype == dpre8_t.dtype == torch.float8_e5m2
        assert torch.equal(dpre8_t.view(torch.uint8), dpre8.t().contiguous().view(torch.uint8))
        assert abs(dpre_amax.item() / dpre_ref.abs().max().item() - 1) < 1e-5, dpre_amax
        assert rel(dpre8.float() * 0.004, dpre_ref) < 0.25, rel(dpre8.float() * 0.004, dpre_ref)
    # the FP8 MLP, forward and backward end to end (cuBLAS's products: torch's CPU _scaled_mm)
    M, d, H = 64, 64, 96
    x = T.norm(torch.randn(M, d)).bfloat16()
    fc = (torch.rand(H, d) * 2 - 1).mul(0.1).bfloat16()
    proj, grad = (torch.randn(H, d) * 0.02).bfloat16(), (torch.randn(M, d) * 1e-3).bfloat16()
    post_scale = (torch.relu(x.float() @ fc.float().t()).square().max() * T.FP8_POST_MARGIN / T.E4M3_MAX).reshape(())
    bank8 = T.MLPBankFP8.quantize(torch.stack([fc, proj])[None])
    fc_scale, proj_scale = bank8.scales[0, 0, 0], bank8.scales[0, 1, 0]
    x8, x_scale = T.quantize_normed_e4m3(x)
    post8, post8_t, _ = T.relu_square_fp8_gemm(x8, bank8.fc[0], x_scale * fc_scale, post_scale)
    # the backward's scales, layouts and products, against its own dpre kernel's output (deterministic here)
    got = T.fp8_relu_square_mlp_backward(grad, x8.t().contiguous(), x_scale, post8, post8_t, post_scale,
                                         bank8.proj[0], bank8.fc_t[0], fc_scale, proj_scale)
    grad_scale, dpre_scale = T.fp8_mlp_backward_scales(grad.abs().amax(), post_scale, proj_scale, d)
    grad8 = T.to_e5m2(grad, grad_scale)
    dpre8 = T.relu_square_grad_fp8_gemm(grad8, bank8.proj[0], post8, grad_scale * proj_scale, post_scale,
                                        dpre_scale)[0]
    dpre_q = dpre8.float() * dpre_scale
    want = (dpre_q @ (bank8.fc[0].float() * fc_scale), dpre_q.t() @ (x8.float() * x_scale),
            (post8.float() * post_scale).t() @ (grad8.float() * grad_scale))
    errors = [rel(g, w) for g, w in zip(got, want)]
    assert all(g.dtype == torch.bfloat16 for g in got) and max(errors) < 1e-2, errors
    # through autograd: the same gradients; against the reference's arithmetic loosely (the casts)
    xs, fcs, projs = (t.clone().requires_grad_() for t in (x, fc, proj))
    out, _ = T.fp8_relu_square_mlp(xs, fcs, projs, bank8, 0, post_scale)
    through = torch.autograd.grad(out, (xs, fcs, projs), grad)
    assert all(torch.equal(a, b) for a, b in zip(through, got))
    reference = T.fp8_relu_square_mlp_backward_reference(grad, x, fc, proj, post_scale)
    assert max(rel(g, w) for g, w in zip(got, reference)) < 0.3
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_fp8_mlp_kernels_in_the_triton_interpreter():
    run_in_triton_interpreter(FP8_INTERPRETER_CHECK, timeout=600)


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_fp8_gemms_reject_shapes_tma_cannot_stride():
    """Both layouts of the FP8 output need 16-byte rows: M, N and K multiples of 16 (the plan keeps other forwards
    on the bf16 MLP); operands of the wrong FP8 format are refused too."""
    a, b = torch.randn(40, 32).to(torch.float8_e4m3fn), torch.randn(48, 32).to(torch.float8_e4m3fn)
    scale = torch.ones(())
    with pytest.raises(ValueError, match="multiples of 16"):
        T.relu_square_fp8_gemm(a, b, scale, scale)  # M = 40: 40-byte rows of the transposed output
    with pytest.raises(ValueError, match="e5m2 a"):
        T.relu_square_grad_fp8_gemm(a[:32], b, torch.zeros(32, 48, dtype=torch.float8_e4m3fn), scale, scale, scale)


def test_fp8_backward_dpre_scale_is_a_bound_no_input_exceeds():
    """The worst case for dpre's bound: every grad element at ±amax with proj's signs, every proj element at ±its
    amax, post8 at 448: dpre reaches the bound / FP8_BACKWARD_MARGIN, so the e5m2 values stay within ±57344
    (no clipping), and the reference's dpre is finite."""
    K, N = 64, 32
    proj = torch.where(torch.rand(N, K) < 0.5, -0.03, 0.03)
    grad_amax, proj_scale, post_scale = torch.tensor(2e-3), torch.tensor(0.03 / T.E4M3_MAX), torch.tensor(0.01)
    grad = grad_amax * torch.sign(proj[:1]).expand(4, K)
    grad_scale, dpre_scale = T.fp8_mlp_backward_scales(grad.abs().amax(), post_scale, proj_scale, K)
    assert grad_scale.item() == pytest.approx(grad_amax.item() / T.E5M2_MAX)
    dpre = (grad @ proj.t()) * 2 * (T.E4M3_MAX * post_scale).sqrt()
    ratio = dpre.abs().max() / dpre_scale / T.E5M2_MAX
    assert ratio.item() == pytest.approx(1 / T.FP8_BACKWARD_MARGIN, rel=1e-5)


def test_fp8_backward_reference_is_the_fp32_backward_within_fp8_rounding():
    """The FP8 backward's arithmetic against the fp32 MLP's gradients: e5m2 grad and dpre (2 mantissa bits), e4m3 x,
    post and weights; and its dpre's amax sits a few binades under the bound, far above e5m2's subnormals."""
    x, fc, proj, grad = mlp_inputs(256)
    post_amax = torch.relu(x.float() @ fc.float().t()).square().max()
    post_scale = (post_amax * T.FP8_POST_MARGIN / T.E4M3_MAX).reshape(())
    got = T.fp8_relu_square_mlp_backward_reference(grad, x, fc, proj, post_scale)
    want = float_reference(x, fc, proj, grad)[1:]
    for name, g, w in zip(("x", "fc", "proj"), got, want):
        assert g.dtype == torch.bfloat16 and rel_err(g, w) < 0.12, (name, rel_err(g, w))
    bank8 = T.MLPBankFP8.quantize(torch.stack([fc, proj])[None])
    _, dpre_scale = T.fp8_mlp_backward_scales(grad.abs().amax(), post_scale, bank8.scales[0, 1, 0], x.size(1))
    dpre = (grad.float() @ proj.float().t()) * 2 * torch.relu(x.float() @ fc.float().t())
    headroom = math.log2(T.E5M2_MAX * dpre_scale / dpre.abs().max())
    assert 1 <= headroom < 14, headroom  # e5m2's normal range spans ~30 binades


def test_fp8_bank_copies_round_trip_with_aligned_scales():
    """Each layer's fc and proj in e4m3 at its own amax scale (the largest value maps to 448), proj
    transposed; the scales cuBLASLt reads sit 16 bytes apart."""
    torch.manual_seed(0)
    bank = (torch.randn(3, 2, 96, 64) * torch.tensor([0.03, 0.3, 3.0])[:, None, None, None]).bfloat16()
    bank8 = T.MLPBankFP8.quantize(bank)
    assert bank8.fc.shape == (3, 96, 64) and bank8.proj_t.shape == (3, 64, 96)
    assert torch.equal(bank8.proj.float(), bank8.proj_t.transpose(1, 2).float())  # the FP8 backward's layouts
    assert torch.equal(bank8.fc_t.float(), bank8.fc.transpose(1, 2).float()) and bank8.fc_t[1].is_contiguous()
    assert bank8.fc.dtype == bank8.proj_t.dtype == torch.float8_e4m3fn and bank8.proj_t[1].is_contiguous()
    for i in range(3):
        fc = bank8.fc[i].float() * bank8.scales[i, 0, 0]
        proj = bank8.proj_t[i].t().float() * bank8.scales[i, 1, 0]
        assert rel_err(fc, bank[i, 0]) < 0.04 and rel_err(proj, bank[i, 1]) < 0.04  # e4m3: 3 mantissa bits
        assert bank8.fc[i].float().abs().max() == 448 and bank8.proj_t[i].float().abs().max() == 448
        for j in range(2):
            assert bank8.scales[i, j, 0].storage_offset() * 4 % 16 == 0


def test_fp8_mlp_reference_is_the_bf16_mlp_within_e4m3_rounding():
    x, fc, proj, _ = mlp_inputs(64)
    want = torch.relu(x.double() @ fc.double().t()).square() @ proj.double()
    post_amax = torch.relu(x.float() @ fc.float().t()).square().max()
    out, amax = T.fp8_relu_square_mlp_reference(x, fc, proj, post_amax * T.FP8_POST_MARGIN / T.E4M3_MAX)
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < 0.06 and rel_err(amax, post_amax.view(1)) < 0.05
    saturated, _ = T.fp8_relu_square_mlp_reference(x, fc, proj, post_amax / 4 / T.E4M3_MAX)  # post clamps at 448
    assert torch.isfinite(saturated).all() and rel_err(saturated, want) > 0.05


def test_normed_activations_take_a_static_e4m3_scale():
    """An RMS-normalized row's elements are bounded by √d: the static scale √d/448 maps the most
    extreme row (one non-zero element) to 448 exactly, and typical rows round as well as with
    their own amax's scale."""
    d = 768
    x = T.norm(torch.randn(256, d)).bfloat16()
    x[0] = T.norm(torch.nn.functional.one_hot(torch.tensor(5), d).float()).bfloat16()
    x8, scale = T.quantize_normed_e4m3(x)
    assert x8.float()[0, 5] == T.E4M3_MAX and torch.isfinite(x8.float()).all()
    static = rel_err(x8.float() * scale, x)
    own8, own_scale = T.quantize_e4m3(x[1:], x[1:].abs().amax())
    assert static < 0.04 and static < 1.05 * rel_err(own8.float() * own_scale, x[1:])


def test_fp8_mlp_is_off_without_a_hopper_gpu():
    hp = T.Hyperparameters.of(device="cpu", fp8_mlp=True)
    plan = T.resolve_execution(hp.execution, hp.model, torch.device("cpu"), 4096, training=True)
    assert not plan.mlp_e4m3


def test_relu_square_mlp_reference_path_matches_autograd():
    x, fc, proj, grad = mlp_inputs(37)
    reference = float_reference(x, fc, proj, grad)
    fused = output_and_grads(fused_mlp, x, fc, proj, grad)
    for name, got, want in zip(("out", "x", "fc", "proj"), fused, reference):
        assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2, name
    plain = output_and_grads(T.relu_square_mlp_reference, x, fc, proj, grad)
    assert torch.equal(plain[0], fused[0])  # the same forward ops on the reference path
    for got, want in zip(plain, reference):
        assert rel_err(got, want) < 1e-2


def test_relu_square_mlp_traces_whole_into_compiled_graphs():
    """fullgraph under aot_eager gives the eager numbers; the forward graph holds the up-projection
    with its ReLU² and the down-projection, the backward graph the four products from the saved post
    (the gradient's ReLU² from √post: no ReLU, no recomputed up-projection)."""
    x, fc, proj, grad = mlp_inputs(29)
    eager = output_and_grads(fused_mlp, x, fc, proj, grad)
    torch._dynamo.reset()
    compiled = output_and_grads(torch.compile(fused_mlp, backend="aot_eager", fullgraph=True),
                                      x, fc, proj, grad)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    output_and_grads(torch.compile(fused_mlp, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                                         fullgraph=True), x, fc, proj, grad)
    forward, backward = graphs
    assert forward.count("aten.mm.default(") == 2 and "aten.relu.default(" in forward
    assert backward.count("aten.mm.default(") == 4 and "aten.sqrt.default(" in backward
    assert "aten.relu.default(" not in backward


def test_gradients_reach_the_mlp_bank_through_views():
    x, fc, proj, grad = mlp_inputs(41)
    bank = torch.nn.Parameter(torch.randn(3, 2, *fc.shape).bfloat16())
    with torch.no_grad():
        bank[1, 0], bank[1, 1] = fc, proj
    mlp_fc, mlp_proj = bank[1]  # as GPT.mlp takes them
    (T.relu_square_mlp(x, mlp_fc, mlp_proj, use_triton=False) * grad).sum().backward()
    _, _, grad_fc, grad_proj = float_reference(x, fc, proj, grad)
    assert rel_err(bank.grad[1, 0], grad_fc) < 1e-2 and rel_err(bank.grad[1, 1], grad_proj) < 1e-2
    assert not bank.grad[0].any() and not bank.grad[2].any()


GPU_CONFIGS = {  # the defaults and the other launch modes (the sweep's alternatives)
    "default": None,
    "one tile per program": T.GemmConfig(128, 128, 64, stages=4, warps=4, persistent=False, flatten=False,
                                         split_epilogue=False),
    "persistent, not flattened": T.GemmConfig(128, 256, 64, stages=3, warps=8, group_m=1, flatten=False),
}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("M,N,K", [(4096, 3072, 768), (3001, 3072, 768), (1000, 200, 136)])
def test_relu_square_gemm_on_gpu(M, N, K, config):
    torch.manual_seed(0)
    a = T.norm(torch.randn(M, K, device="cuda")).bfloat16()
    b = (torch.rand(N, K, device="cuda") * 2 - 1).mul(0.036).bfloat16()
    post = torch.rand(M, N, device="cuda").bfloat16()
    product = a.float() @ b.float().T
    for aux, ref in ((None, product.relu().square()), (post, product * 2 * post.float().sqrt())):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        T.relu_square_gemm(a, b, aux, config=GPU_CONFIGS[config], out=out)
        assert rel_err(out, ref) < 1e-2


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("M", [4096, 3001])
def test_fused_mlp_matches_the_reference_on_gpu(M):
    x, fc, proj, grad = mlp_inputs(M, d=768, hidden=3072, device="cuda")
    reference = float_reference(x, fc, proj, grad)
    eager = output_and_grads(fused_mlp, x, fc, proj, grad)
    torch._dynamo.reset()
    compiled = output_and_grads(torch.compile(fused_mlp, dynamic=False, fullgraph=True),
                                      x, fc, proj, grad)
    for name, e, c, want in zip(("out", "x", "fc", "proj"), eager, compiled, reference):
        assert rel_err(e, want) < 1e-2, name
        assert rel_err(c, want) < 1e-2, name


@cuda
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm90+ GPU (TMA)")
def test_compiled_fused_mlp_launches_the_gemm_kernels_from_inductor():
    """The compiled graph launches the fused GEMMs itself (no custom op around them: their Python
    path cost ~0.25 ms of host time per call), forward and backward."""
    from torch._inductor.utils import run_and_get_code
    x, fc, proj, grad = mlp_inputs(4096, d=768, hidden=3072, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(fused_mlp, dynamic=False, fullgraph=True)
    _, codes = run_and_get_code(lambda: output_and_grads(compiled, x, fc, proj, grad))
    code = "\n".join(codes)
    assert code.count("_relu_square_gemm_kernel") >= 2 and "torch.ops.speedrun" not in code


def four_document_batch(tokens: int = 1024):
    """(inputs, targets, cu_seqlens, shape) on the GPU: 1,024 tokens in four documents, one of length 1."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50000, (tokens + 1,))
    ids[[0, 300, 301, 700]] = T.BOS_ID
    cu = torch.from_numpy(T.cu_seqlens_for([300, 1, 399, tokens + 1 - 700], tokens, 16)).cuda()
    shape = T.ForwardShape(short_window=128, long_window=384, max_seq_len=512, n_predict=2)
    return ids[:-1].int().cuda(), ids[1:].int().cuda(), cu, shape


@cuda
@pytest.mark.gpu
def test_compiled_model_with_the_fused_mlp_matches_the_plain_mlp():
    """The whole model compiled (fullgraph) with FUSED_MLP on and off: same loss and gradients."""
    inputs, targets, cu, shape = four_document_batch()
    results = []
    for fused in (True, False):
        hp = T.Hyperparameters.of(model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256, ngram_rows=1001,
                               val_seq_len=1024, fused_mlp=fused, fp8_mlp=False)
        torch.manual_seed(0)
        model = T.GPT(hp.model, T.longest_forward(hp)).cuda()
        plans = [T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), inputs.numel(), training)
                 for training in (True, False)]
        assert plans[0].mlp_fused == fused
        with torch.no_grad():
            model.mlp_bank[:, 1].normal_(0, 0.05)  # non-zero projections: every MLP gradient is live
        torch._dynamo.reset()
        compile = lambda f: torch.compile(f, dynamic=False, fullgraph=True)  # noqa: E731
        loss, _ = compile(model.training_loss)(inputs, targets, cu, shape, plans[0],
                                               torch.tensor([1.0, 0.5], device="cuda"))
        loss.backward()
        with torch.no_grad():
            total = compile(model.evaluation_loss)(inputs, targets, cu, shape, plans[1], 512)
        results.append((loss, total, model.mlp_bank.grad, model.qk_bank.grad))
    (loss, total, grad_mlp, grad_qk), (ref_loss, ref_total, ref_mlp, ref_qk) = results
    assert rel_err(loss, ref_loss) < 1e-2 and rel_err(total, ref_total) < 1e-2
    assert rel_err(grad_mlp, ref_mlp) < 3e-2 and rel_err(grad_qk, ref_qk) < 3e-2  # bf16 through 11 layers


@cuda
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm90+ GPU (TMA, e4m3)")
@pytest.mark.parametrize("M", [4096, 3008])
def test_fp8_mlp_matches_its_reference_on_gpu(M):
    """Forward against the e4m3 reference (T6.2); gradients against the fp32 MLP and against the FP8 backward's
    reference arithmetic (T6.5); the same under torch.compile."""
    x, fc, proj, grad = mlp_inputs(M, d=768, hidden=3072, device="cuda")
    post_amax = torch.relu(x.float() @ fc.float().t()).square().max()
    post_scale = (post_amax * T.FP8_POST_MARGIN / T.E4M3_MAX).float()
    want_out, want_amax = T.fp8_relu_square_mlp_reference(x, fc, proj, post_scale)
    reference = float_reference(x, fc, proj, grad)

    def fp8_mlp(x, fc, proj):
        bank8 = T.MLPBankFP8.quantize(torch.stack([fc, proj])[None])
        return T.fp8_relu_square_mlp(x, fc, proj, bank8, 0, post_scale)

    fp8_grads = T.fp8_relu_square_mlp_backward_reference(grad, x, fc, proj, post_scale)
    for fn in (fp8_mlp, torch.compile(fp8_mlp, dynamic=False, fullgraph=True)):
        torch._dynamo.reset()
        xs, fcs, projs = (t.clone().requires_grad_() for t in (x, fc, proj))
        out, amax = fn(xs, fcs, projs)
        assert rel_err(out, want_out) < 1e-2 and rel_err(amax, want_amax) < 1e-2
        assert rel_err(out, reference[0]) < 0.06  # e4m3 rounding of x, fc, post and proj
        for i, got in enumerate(torch.autograd.grad(out, (xs, fcs, projs), grad)):
            # e5m2 grad and dpre, e4m3 post8 (~9 % against fp32); a flipped rounding here and there
            assert rel_err(got, fp8_grads[i]) < 3e-2 and rel_err(got, reference[1 + i]) < 0.12, i


@cuda
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm90+ GPU (TMA, e4m3)")
@pytest.mark.parametrize("M,N,K", [(4096, 3072, 768), (3008, 3072, 768), (1008, 208, 144)])
def test_fp8_mlp_gemms_on_gpu(M, N, K):
    """The FP8 MLP's kernels (T6.2, T6.5): the up-projection's e4m3 post in both layouts, and the dpre GEMM's e5m2
    dpre in both layouts: each the saturated rounding of its own fp32 value, the amax exact; post clamps at 448."""
    torch.manual_seed(0)
    x, w = T.norm(torch.randn(M, K, device="cuda")), (torch.rand(N, K, device="cuda") * 2 - 1) * 0.036
    x8, x_scale = T.quantize_e4m3(x, x.abs().amax())
    w8, w_scale = T.quantize_e4m3(w, w.abs().amax())
    post_ref = torch.relu(x8.double() @ w8.double().t() * (x_scale * w_scale).double()).square()
    post_scale = (post_ref.max() * 1.5 / T.E4M3_MAX).float()
    post8, post8_t, amax = T.relu_square_fp8_gemm(x8, w8, x_scale * w_scale, post_scale)
    assert torch.equal(post8_t.view(torch.uint8), post8.t().contiguous().view(torch.uint8))
    assert abs(amax.item() / post_ref.max().item() - 1) < 1e-2
    # post above half its max clamps at 448
    clamped = T.relu_square_fp8_gemm(x8, w8, x_scale * w_scale, post_scale / 3)[0].float()
    assert clamped.max() == T.E4M3_MAX and torch.isfinite(clamped).all()

    def one_step(got8, want, fp8_max, mantissa_bits, tiny):
        want8 = (want / (want.abs().amax() / fp8_max)).clamp(-fp8_max, fp8_max)
        step = torch.maximum(want8.abs() / 2 ** mantissa_bits, torch.full_like(want8, tiny))
        return ((got8.double() - want8).abs() <= step * 1.001).float().mean().item()

    # Hopper's FP8 accumulation keeps fewer bits than fp32: a value rounds differently now and then (T6.5)
    assert one_step(post8.float() * post_scale / (post_ref.max() / T.E4M3_MAX), post_ref, T.E4M3_MAX, 3, 2.0 ** -9) > 0.995
    grad = torch.randn(M, K, device="cuda") * 1e-3
    grad_scale = grad.abs().amax() / T.E5M2_MAX
    grad8 = T.to_e5m2(grad, grad_scale)
    dpre_ref = (grad8.double() @ w8.double().t() * (grad_scale * w_scale).double()) * 2 * (
        post8.double() * post_scale.double()).sqrt()
    dpre_scale = (dpre_ref.abs().max() * 4 / T.E5M2_MAX).float()
    dpre8, dpre8_t, dpre_amax = T.relu_square_grad_fp8_gemm(grad8, w8, post8, grad_scale * w_scale, post_scale,
                                                            dpre_scale, amax=True)
    assert torch.equal(dpre8_t.view(torch.uint8), dpre8.t().contiguous().view(torch.uint8))
    assert abs(dpre_amax.item() / dpre_ref.abs().max().item() - 1) < 1e-2
    assert rel_err(dpre8.float() * dpre_scale, dpre_ref) < 0.06  # e5m2: 2 mantissa bits
    assert one_step(dpre8.float() * dpre_scale / (dpre_ref.abs().max() / T.E5M2_MAX), dpre_ref, T.E5M2_MAX, 2,
                    2.0 ** -16) > 0.995


@cuda
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs an sm90+ GPU (TMA, e4m3)")
@pytest.mark.parametrize("layout", [{}, {"attention_layers": (0, 1, 2, 3, 5, 8, 10), "narrow_qk_layers": (0, 1, 2, 5, 8),
                                         "mlp_layers": (0, 1, 2, 3, 4, 5, 6, 8, 9, 10)}], ids=["all", "no_layer_7"])
def test_compiled_model_with_the_fp8_mlp_trains_like_the_bf16_mlp(layout):
    """FP8_MLP on and off, the whole model compiled: the loss and gradients agree within e4m3 and (the backward's,
    T6.5) e5m2 rounding, the per-layer scales of post follow each forward, evaluation
    stays bf16; with every layer, and with layer 7 dropped whole (MLP slots then differ from layer indices, T3.1)."""
    inputs, targets, cu, shape = four_document_batch()
    results = []
    for fp8 in (True, False):
        hp = T.Hyperparameters.of(model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256, ngram_rows=1001,
                               val_seq_len=1024, fp8_mlp=fp8, **layout)
        torch.manual_seed(0)
        model = T.GPT(hp.model, T.longest_forward(hp)).cuda()
        plan, evaluation = (T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), inputs.numel(), training)
                            for training in (True, False))
        assert plan.mlp_e4m3 == fp8 and not evaluation.mlp_e4m3
        with torch.no_grad():
            model.mlp_bank[:, 1].normal_(0, 0.05)
        torch._dynamo.reset()
        compile = lambda f: torch.compile(f, dynamic=False, fullgraph=True)  # noqa: E731
        train = compile(model.training_loss)
        weights = torch.tensor([1.0, 0.5], device="cuda")
        for _ in range(2):  # the second forward uses the first one's delayed scales
            model.zero_grad()
            loss, _ = train(inputs, targets, cu, shape, plan, weights)
            loss.backward()
        with torch.no_grad():
            total = compile(model.evaluation_loss)(inputs, targets, cu, shape, evaluation, 512)
        scales = [b.item() for n, b in model.named_buffers() if n.startswith("fp8_post_scale")]
        scales = scales if fp8 else [s for s in scales if s != 1.0]  # untouched without the e4m3 forward
        results.append((loss, total, model.mlp_bank.grad, scales))
    (loss, total, grad, scales), (ref_loss, ref_total, ref_grad, ref_scales) = results
    assert len(scales) == len(hp.model.mlp_layers) and all(0 < s < 1 for s in scales) and ref_scales == []
    assert rel_err(loss, ref_loss) < 2e-2 and rel_err(grad, ref_grad) < 0.2
    assert torch.equal(total, ref_total)  # evaluation runs the bf16 MLP


def test_every_mlp_follows_the_fused_mlp_setting_at_any_size(monkeypatch):
    """Every MLP layer's forward takes the fused MLP with FUSED_MLP=1 and the plain expression with 0, whatever
    the forward's size (no token threshold since #77: a 128-token forward was below the old one)."""
    calls = []
    for name, fused in (("relu_square_mlp", True), ("relu_square_mlp_reference", False)):
        monkeypatch.setattr(T, name, lambda x, fc, proj, *_, fused=fused: calls.append(fused) or (x @ fc.t()) @ proj)
    tokens = 128
    inputs = torch.randint(0, 1000, (tokens,), dtype=torch.int32)
    cu = torch.from_numpy(T.cu_seqlens_for([tokens], tokens, 16))
    shape = T.ForwardShape(short_window=128, long_window=128, max_seq_len=tokens)
    for fused in (True, False):
        hp = T.Hyperparameters.of(model_dim=64, num_heads=2, head_dim=32, mlp_hidden=128, vocab_size=1024,
                               ngram_rows=101, device="cpu", fused_mlp=fused)
        calls.clear()
        plan = T.resolve_execution(hp.execution, hp.model, torch.device("cpu"), tokens, training=True)
        T.GPT(hp.model, T.longest_forward(hp)).hidden_states(inputs, cu, shape, plan)
        assert calls == [fused] * len(hp.model.mlp_layers)
