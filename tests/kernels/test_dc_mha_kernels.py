"""The DC-MHA Triton kernels (records #81-#88; the torch path: tests/model/test_architecture.py): against
the float64 definition through Triton's CPU interpreter and traced whole by torch.compile, compiled
ahead of time for sm_90 within Hopper's shared memory, the dispatch (the kernels only where their
tiling applies), and compiled on a GPU (gpu-marked) at the model's shapes."""

import textwrap

import numpy as np
import pytest
import torch

import train_gpt as T
from helpers import cpu_execution, dc_mha_dense, rel_err, run_in_triton_interpreter

# The Triton kernels in the CPU interpreter against the float64 definition: with fp32 storage they
# must reproduce it (the kernels' indexing and formulas), with bf16 (as in training: a and dS kept in
# bf16) to bf16 precision. Ragged T, one-token documents, windows at the kernels' limit (2·block + 1),
# the dispatcher's path (block DC_BLOCK, w2 applied); then fullgraph under aot_eager traces the two
# custom ops and gives the eager numbers exactly.
DC_INTERPRETER_CHECK = textwrap.dedent("""
    import torch, train_gpt as T
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from helpers import dc_mha_dense, rel_err

    def inputs(tokens, H, D, dtype):
        torch.manual_seed(tokens)
        q, k, v = (torch.randn(tokens, H, D).to(dtype).requires_grad_() for _ in range(3))
        w1, w2 = torch.randn(tokens, H, requires_grad=True), torch.randn(tokens, H).to(dtype).requires_grad_()
        doc_ids = torch.bucketize(torch.arange(tokens), torch.tensor([7, 8, tokens // 2]), right=True).int()
        return q, k, v, doc_ids, w1, w2

    def output_and_grads(fn, q, k, v, doc_ids, w1, w2, grad):
        out = fn(q, k, v, doc_ids, w1, w2)
        return (out, *torch.autograd.grad(out, (q, k, v, w1, w2), grad.to(out.dtype)))

    cases = [(300, 112, T.DC_BLOCK, 3, 16), (50, 16, 16, 2, 32), (130, 33, 16, 3, 16)]
    for (tokens, window, block, H, D), dtype, tolerance in [(c, torch.float32, 1e-5) for c in cases] + \
            [(c, torch.bfloat16, 1e-2) for c in cases]:
        args = inputs(tokens, H, D, dtype)
        if block == T.DC_BLOCK:
            kernel = lambda q, k, v, d, w1, w2: T.dc_mha(q, k, v, d, w1, w2, window, use_triton=True)
        else:
            kernel = lambda q, k, v, d, w1, w2: T.DCMHAKernel.apply(q, k, v, d, w1, window, block) * w2[..., None]
        grad = torch.randn(tokens, H, D, dtype=torch.float64)
        got = output_and_grads(kernel, *args, grad)
        want = output_and_grads(lambda *a: dc_mha_dense(*a, window), *args, grad)
        errors = [rel_err(a, b) for a, b in zip(got, want)]
        print(tokens, window, block, dtype, ["%.1e" % e for e in errors])
        assert got[0].dtype == dtype and max(errors) < tolerance, errors

    graphs = []
    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)
    fn = lambda q, k, v, d, w1, w2: T.dc_mha(q, k, v, d, w1, w2, 33, use_triton=True)
    args = inputs(130, 3, 16, torch.bfloat16)
    grad = torch.randn(130, 3, 16)
    eager = output_and_grads(fn, *args, grad)
    compiled = output_and_grads(torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                                              fullgraph=True), *args, grad)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    forward, backward = graphs
    assert "speedrun.dc_mha_forward" in forward and "speedrun.dc_mha_backward" in backward, graphs
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_dc_mha_kernels_match_the_definition_in_the_triton_interpreter():
    run_in_triton_interpreter(DC_INTERPRETER_CHECK, timeout=600)


@pytest.mark.skipif(T.triton is None or T.TRITON_INTERPRETER, reason="needs Triton's compiler")
def test_dc_mha_kernels_fit_hopper_shared_memory():
    """The three DC-MHA kernels, compiled ahead of time for sm_90 (no GPU needed) as the wrappers
    launch them at the model's shapes (aligned pointers, as at run time): each fits the 227 KB of
    shared memory an H100/H200 block may use. Pipelined head loops needed 344-515 KB."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bf16, fp32 = "*bf16", "*fp32"
    shapes = dict(H=6, D=128, BLOCK=T.DC_BLOCK, UPCAST=False)
    for docs in ("*i32", "*i64"):
        kernels = [
            ("forward", T._dc_forward_kernel,
             dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, docs_ptr=docs, w1_ptr=fp32, o_ptr=bf16, lse_ptr=fp32,
                  a_ptr=bf16, T="i32"), dict(shapes, WINDOW=T.DC_WINDOW)),
            ("backward_query", T._dc_backward_query_kernel,
             dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, docs_ptr=docs, w1_ptr=fp32, lse_ptr=fp32, do_ptr=bf16,
                  dq_ptr=bf16, dw1_ptr=fp32, da_ptr=fp32, ds_ptr=bf16, T="i32", T_pad="i32"),
             dict(shapes, WINDOW=T.DC_WINDOW)),
            ("backward_key", T._dc_backward_key_kernel,
             dict(q_ptr=bf16, do_ptr=bf16, a_ptr=bf16, ds_ptr=bf16, dk_ptr=bf16, dv_ptr=bf16, T="i32",
                  T_pad="i32"), shapes),
        ]
        for launch, kernel, args, constants in kernels:
            index = kernel.arg_names.index
            aligned = {(index(name),): [["tt.divisibility", 16]] for name in args}
            source = ASTSource(kernel, signature={**args, **{name: "constexpr" for name in constants}},
                               constexprs={(index(name),): value for name, value in constants.items()}, attrs=aligned)
            compiled = T.triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(T.DC_LAUNCH[launch]))
            assert compiled.metadata.shared <= 232_448, (kernel.__name__, docs, compiled.metadata.shared)


def test_dc_mha_dispatch():
    """The torch path off CUDA (the execution plan's choice); the kernels only where their tiling applies."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(40, 2, 16) for _ in range(3))
    w1, w2 = torch.randn(40, 2), torch.randn(40, 2)
    doc_ids = torch.zeros(40, dtype=torch.int32)
    assert not cpu_execution().dc_mha_kernel
    assert torch.equal(T.dc_mha(q, k, v, doc_ids, w1, w2, 16, use_triton=False),
                       T.dc_mha_torch(q, k, v, doc_ids, w1, w2, 16))
    if T.triton is not None:
        assert T.dc_mha_kernel_supports(40, 2, 16, T.DC_WINDOW) and T.dc_mha_kernel_supports(40, 2, 16, 2 * T.DC_BLOCK + 1)
        assert not T.dc_mha_kernel_supports(40, 2, 16, 2 * T.DC_BLOCK + 2)
        assert not T.dc_mha_kernel_supports(4, 2, 24, 16)  # head_dim not a power of two
        huge = torch.empty(3_000_000, 6, 128, device="meta")  # 2.3e9 elements: past int32 indexing
        assert T.dc_mha_kernel_supports(1_500_000, 6, 128, T.DC_WINDOW)
        assert not T.dc_mha_kernel_supports(3_000_000, 6, 128, T.DC_WINDOW)
        with pytest.raises(ValueError, match="int32"):
            T._dc_launch(huge, T.DC_BLOCK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [4096, 49152 + 17])
def test_dc_mha_kernels_on_gpu(tokens):
    """The compiled Triton kernels at the model's shapes (6 heads of 128, window 112) against the
    float64 definition on the first 4096 tokens, and the torch path over all tokens, output and
    gradients to bf16 precision."""
    torch.manual_seed(0)
    H, D = 6, 128
    q, k, v = (T.norm(torch.randn(tokens, H, D, device="cuda")).bfloat16() for _ in range(3))
    q = (q * 0.12).bfloat16()
    w1 = torch.randn(tokens, H, device="cuda")
    w2 = torch.randn(tokens, H, device="cuda").bfloat16()
    lengths = []
    while sum(lengths) < tokens:  # documents of 700, 1, 1500 and 130 tokens, repeated
        lengths.append((700, 1, 1500, 130)[len(lengths) % 4])
    lengths[-1] -= sum(lengths) - tokens
    cu = torch.tensor([0] + list(np.cumsum(lengths)), device="cuda", dtype=torch.int32)
    doc_ids = torch.searchsorted(cu, torch.arange(tokens, device="cuda", dtype=torch.int32), right=True)
    grad = torch.randn(tokens, H, D, device="cuda").bfloat16()

    def run(fn, n):
        args = [t[:n].clone().requires_grad_(t.is_floating_point()) for t in (q, k, v, doc_ids, w1, w2)]
        out = fn(*args)
        float_args = [a for a in args if a.is_floating_point()]
        return (out, *torch.autograd.grad(out, float_args, grad[:n].to(out.dtype)))

    kernel = lambda *a: T.dc_mha(*a, T.DC_WINDOW, use_triton=True)
    n = 4096
    for got, want in zip(run(kernel, n), run(lambda *a: dc_mha_dense(*a, T.DC_WINDOW), n)):
        assert rel_err(got, want) < 2e-2
    for got, want in zip(run(kernel, tokens), run(lambda *a: T.dc_mha(*a, T.DC_WINDOW, use_triton=False), tokens)):
        assert rel_err(got, want) < 2e-2
