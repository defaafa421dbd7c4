"""The fused MLP (docs/TECHNIQUES.md T6.1): the ReLU² GEMM kernel's two epilogues through Triton's CPU
interpreter, the custom ops and their autograd on the torch reference path (eager and traced by
torch.compile), gradients into the banked weights, and the compiled kernels on a GPU (gpu-marked)."""

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


def test_relu_square_mlp_reference_path_matches_autograd():
    x, fc, proj, grad = mlp_inputs(37)
    reference = float_reference(x, fc, proj, grad)
    fused = output_and_grads(T.relu_square_mlp, x, fc, proj, grad)
    for name, got, want in zip(("out", "x", "fc", "proj"), fused, reference):
        assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2, name
    plain = output_and_grads(T.relu_square_mlp_reference, x, fc, proj, grad)
    assert torch.equal(plain[0], fused[0])  # the same forward ops on the reference path
    for got, want in zip(plain, reference):
        assert rel_err(got, want) < 1e-2


def test_relu_square_mlp_traces_whole_into_compiled_graphs():
    """fullgraph under aot_eager gives the eager numbers; the forward graph calls the fused GEMM
    op, the backward graph the fused-gradient op, both as opaque custom ops."""
    x, fc, proj, grad = mlp_inputs(29)
    eager = output_and_grads(T.relu_square_mlp, x, fc, proj, grad)
    torch._dynamo.reset()
    compiled = output_and_grads(torch.compile(T.relu_square_mlp, backend="aot_eager", fullgraph=True),
                                      x, fc, proj, grad)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    output_and_grads(torch.compile(T.relu_square_mlp, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                                         fullgraph=True), x, fc, proj, grad)
    forward, backward = graphs
    assert "speedrun.relu_square_matmul" in forward and "relu_square_grad_matmul" not in forward
    assert "speedrun.relu_square_grad_matmul" in backward and "relu_square_matmul.default" not in backward


def test_gradients_reach_the_mlp_bank_through_views():
    x, fc, proj, grad = mlp_inputs(41)
    bank = torch.nn.Parameter(torch.randn(3, 2, *fc.shape).bfloat16())
    with torch.no_grad():
        bank[1, 0], bank[1, 1] = fc, proj
    mlp_fc, mlp_proj = bank[1]  # as GPT.mlp_block takes them
    (T.relu_square_mlp(x, mlp_fc, mlp_proj) * grad).sum().backward()
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
    eager = output_and_grads(T.relu_square_mlp, x, fc, proj, grad)
    torch._dynamo.reset()
    compiled = output_and_grads(torch.compile(T.relu_square_mlp, dynamic=False, fullgraph=True),
                                      x, fc, proj, grad)
    for name, e, c, want in zip(("out", "x", "fc", "proj"), eager, compiled, reference):
        assert rel_err(e, want) < 1e-2, name
        assert rel_err(c, want) < 1e-2, name


@cuda
@pytest.mark.gpu
def test_compiled_model_with_the_fused_mlp_matches_the_plain_mlp():
    """The whole model compiled (fullgraph) with FUSED_MLP on and off: same loss and gradients."""
    tokens = 1024
    torch.manual_seed(0)
    ids = torch.randint(0, 50000, (tokens + 1,))
    ids[[0, 300, 301, 700]] = T.BOS_ID
    cu = torch.from_numpy(T.cu_seqlens_for([300, 1, 399, tokens + 1 - 700], tokens, 16)).cuda()
    inputs, targets = ids[:-1].int().cuda(), ids[1:].int().cuda()
    shape = T.ForwardShape(short_window=128, long_window=384, max_seq_len=512, n_predict=2)
    results = []
    for fused in (True, False):
        hp = T.Hyperparameters(model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256, bigram_rows=1001,
                               val_seq_len=1024, fused_mlp=fused, fused_mlp_min_tokens=0)
        torch.manual_seed(0)
        model = T.GPT(T.ModelConfig.from_hyperparameters(hp)).cuda()
        with torch.no_grad():
            model.mlp_bank[:, 1].normal_(0, 0.05)  # non-zero projections: every MLP gradient is live
        torch._dynamo.reset()
        compile = lambda f: torch.compile(f, dynamic=False, fullgraph=True)  # noqa: E731
        loss, _ = compile(model.training_loss)(inputs, targets, cu, shape, torch.tensor([1.0, 0.5], device="cuda"))
        loss.backward()
        with torch.no_grad():
            total = compile(model.evaluation_loss)(inputs, targets, cu, shape, 512)
        results.append((loss, total, model.mlp_bank.grad, model.qk_bank.grad))
    (loss, total, grad_mlp, grad_qk), (ref_loss, ref_total, ref_mlp, ref_qk) = results
    assert rel_err(loss, ref_loss) < 1e-2 and rel_err(total, ref_total) < 1e-2
    assert rel_err(grad_mlp, ref_mlp) < 3e-2 and rel_err(grad_qk, ref_qk) < 3e-2  # bf16 through 11 layers


def test_fused_mlp_runs_from_its_token_threshold(monkeypatch):
    """FUSED_MLP_MIN_TOKENS: forwards of fewer tokens per rank take the plain MLP (launch-bound there)."""
    calls = []
    for name, fused in (("relu_square_mlp", True), ("relu_square_mlp_reference", False)):
        monkeypatch.setattr(T, name, lambda x, fc, proj, fused=fused: calls.append(fused) or (x @ fc.t()) @ proj)
    tokens = 128
    inputs = torch.randint(0, 1000, (tokens,), dtype=torch.int32)
    cu = torch.from_numpy(T.cu_seqlens_for([tokens], tokens, 16))
    shape = T.ForwardShape(short_window=128, long_window=128, max_seq_len=tokens)
    for threshold, fused in [(tokens, True), (tokens + 1, False)]:
        hp = T.Hyperparameters(model_dim=64, num_heads=2, head_dim=32, mlp_hidden=128, vocab_size=1024,
                               bigram_rows=101, device="cpu", fused_mlp_min_tokens=threshold)
        calls.clear()
        T.GPT(T.ModelConfig.from_hyperparameters(hp)).hidden_states(inputs, cu, shape)
        assert calls == [fused] * T.NUM_LAYERS
