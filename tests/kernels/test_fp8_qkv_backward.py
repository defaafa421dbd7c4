"""The FP8 Q/K/V backward (docs/TECHNIQUES.md T6.3, FP8_QKV_BACKWARD=1): the QK-norm + rotary backward kernel that
writes the projection's gradient in e5m2 (both layouts) and its amax, through Triton's CPU interpreter against its
torch reference and compiled ahead of time for sm_90; the autograd Function on the CPU (the reference's arithmetic,
torch's _scaled_mm) against the bf16 backward, its delayed scale and saturation count; the model with it forced on;
where the plan takes it. On a GPU (gpu-marked): the kernel against the reference at the model's shapes, eager and
compiled, and the compiled model's step, whose backward refreshes the layers' scales."""

import dataclasses
import textwrap

import pytest
import torch
from helpers import cpu_execution, random_batch, rel_err, rope_tables, run_in_triton_interpreter

import train_gpt as T

hopper = pytest.mark.skipif(not torch.cuda.is_available() or T.triton is None
                            or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm90+ GPU and Triton")

# Triton's interpreter drops the carry when an fp8 cast rounds up into the next binade (126.2 -> 64 for 128;
# triton-lang/triton #8322, PR #11897): there it gives half of the power of two torch's cast gives. Every other
# element must match torch's round-to-nearest-even cast of the reference's fp32 gradient byte for byte.
FP8_BACKWARD_INTERPRETER_CHECK = textwrap.dedent("""
    import torch, train_gpt as T
    from helpers import rope_tables

    def same_e5m2(got, want):
        a, b = got.float(), want.float()
        differ = a != b
        dropped_carry = (2 * a == b) & (torch.log2(b.abs()).frac() == 0)
        assert bool(dropped_carry[differ].all()), (a[differ & ~dropped_carry][:8], b[differ & ~dropped_carry][:8])
        return differ.float().mean().item()

    T.QK_ROPE_BACKWARD_FP8_LAUNCH = {"BLOCK_T": 16, "num_warps": 4}  # 37 tokens: a partial last block
    # (tokens, heads, Q/K head width, paired, key offset, V head width); narrow Q/K heads (T3.18) without the offset
    cases = [(37, 2, 64, True, True, 64), (48, 6, 64, False, True, 64), (37, 6, 64, True, False, 64),
             (37, 6, 32, True, False, 64), (37, 2, 32, False, False, 64), (48, 6, 32, False, True, 32)]
    for tokens, H, qk_hd, paired, key_offset, vd in cases:
        torch.manual_seed(tokens * H + qk_hd)
        cos, sin = rope_tables(tokens, 64, paired)
        S, heads = (2 * tokens, H // 2) if paired else (tokens, H)
        grads = [torch.randn(S, heads, width).bfloat16() for width in (qk_hd, qk_hd, vd)]
        qkv = (torch.randn(tokens, H * (2 * qk_hd + vd)) * 0.5).bfloat16()
        qkv[3] *= 1e-3  # a row of tiny norm: large gradients, the amax
        for amax in (2000.0, 20.0):  # within the scale's reach, then saturating
            grad_scale = torch.tensor(amax / T.E5M2_MAX)
            args = (torch.tensor(0.12), grad_scale, H, qk_hd, paired, key_offset)
            want8, want8_t, want_amax = T.qk_norm_rope_backward_fp8_reference(qkv, *grads, cos, sin, *args)
            got8, got8_t, got_amax = T.qk_norm_rope_backward_fp8(qkv, *grads, cos, sin, *args)
            assert got8.dtype == got8_t.dtype == torch.float8_e5m2
            assert got8.shape == want8.shape and got8_t.shape == want8_t.shape == want8.t().shape
            assert torch.equal(got8_t.view(torch.uint8), got8.t().contiguous().view(torch.uint8))
            torch.testing.assert_close(got_amax, want_amax, rtol=1e-5, atol=0)
            share = same_e5m2(got8, want8)
            saturated = (want8.float().abs() == T.E5M2_MAX).sum().item()
            assert (saturated > 0) == (want_amax > amax), (saturated, want_amax, amax)
            print(tokens, H, qk_hd, paired, key_offset, vd, amax, "dropped carries %.3f" % share, saturated)
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_fp8_backward_kernel_matches_its_reference_in_the_triton_interpreter():
    run_in_triton_interpreter(FP8_BACKWARD_INTERPRETER_CHECK, timeout=300)


@pytest.mark.skipif(T.triton is None or T.TRITON_INTERPRETER, reason="needs Triton's compiler")
@pytest.mark.parametrize("paired, key_offset, qk_hd", [(False, True, 128), (True, False, 64)])
def test_fp8_backward_kernel_compiles_for_hopper(paired, key_offset, qk_hd):
    """The kernel compiled ahead of time for sm_90 (no GPU needed) at the model's shapes (wide and narrow Q/K
    heads) with its launch's options and aligned pointers, as the launcher passes them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, bf16 = T._qk_norm_rope_backward_fp8_kernel, "*bf16"
    pointers = {"qkv_ptr": bf16, "grad_q_ptr": bf16, "grad_k_ptr": bf16, "grad_v_ptr": bf16, "cos_ptr": bf16,
                "sin_ptr": bf16, "scale_ptr": "*fp32", "grad_scale_ptr": "*fp32", "grad8_ptr": "*fp8e5",
                "grad8_t_ptr": "*fp8e5", "amax_ptr": "*fp32"}
    fixed = {"H": 6, "HD": qk_hd, "VD": 128, "PAIRS": qk_hd // 4, "SEQ_HEADS": 3 if paired else 6,
             "KEY_OFFSET": key_offset, "EPS": torch.finfo(torch.float32).eps,
             "BLOCK_T": T.QK_ROPE_BACKWARD_FP8_LAUNCH["BLOCK_T"]}
    index = kernel.arg_names.index
    source = ASTSource(kernel, signature={**pointers, "T": "i32", **dict.fromkeys(fixed, "constexpr")},
                       constexprs={(index(name),): value for name, value in fixed.items()},
                       attrs={(index(name),): [["tt.divisibility", 16]] for name in pointers})
    compiled = T.triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": T.QK_ROPE_BACKWARD_FP8_LAUNCH["num_warps"]})
    assert "atom" in compiled.asm["ptx"]  # the amax's atomic max


def projection_inputs(tokens=64, H=2, qk_hd=64, hd=64, d=128, paired=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = T.norm(torch.randn(tokens, d, generator=gen)).bfloat16()
    w = (torch.randn(H * (2 * qk_hd + hd), d, generator=gen) * 0.05).bfloat16()
    v_extra = torch.randn(tokens, H, hd, generator=gen).bfloat16()
    S, heads = (2 * tokens, H // 2) if paired else (tokens, H)
    grads = [torch.randn(S, heads, width, generator=gen).bfloat16() for width in (qk_hd, qk_hd, hd)]
    return x, w, v_extra, grads


def fp8_and_bf16_backwards(paired, key_offset, amax, qk_hd=64):
    """(outputs, (dx, dW, dv_extra)) of fp8_qkv_norm_rope (the reference's arithmetic) and of the e4m3 forward with
    the bf16 backward, on one slot with lambda 0.8, the layer's amax buffer `amax` and a fresh saturation counter."""
    tokens, H, hd = 64, 2, 64
    x, w, v_extra, grads = projection_inputs(tokens, H, qk_hd, hd, paired=paired)
    cos, sin = rope_tables(tokens, hd, paired)
    scale, lam, saturations = torch.tensor(0.12), torch.tensor(0.8), torch.zeros(())
    bank = T.QKVBankFP8.quantize([(w[:2 * H * qk_hd][None], [0])], torch.stack([w[2 * H * qk_hd:], w[:hd * H]]),
                                 transposed=True)
    w8, w_scale = bank.weights[0], bank.scales[0]
    layer = (cos, sin, scale, H, qk_hd, paired, key_offset)

    def fp8(x, w, v):
        return T.fp8_qkv_norm_rope(x, w, bank, 0, lam, v, *layer, amax, saturations, False)

    def bf16(x, w, v):
        return T.qk_norm_rope_reference(T.fp8_normed_linear(x, w, w8, w_scale * lam), v, *layer)

    results = []
    for f in (fp8, bf16):
        leaves = [t.clone().requires_grad_() for t in (x, w * lam, v_extra)]
        outputs = f(*leaves)
        results.append((outputs, torch.autograd.grad(outputs, leaves, grads)))
    return results, saturations


@pytest.mark.parametrize("paired, key_offset, qk_hd", [(True, True, 64), (False, False, 32)])
def test_fp8_backward_is_the_bf16_backward_within_e5m2_rounding(paired, key_offset, qk_hd):
    amax = torch.ones(())
    ((outputs, grads), (bf16_outputs, bf16_grads)), saturations = fp8_and_bf16_backwards(paired, key_offset, amax,
                                                                                         qk_hd)
    assert all(torch.equal(a, b) for a, b in zip(outputs, bf16_outputs))  # the same e4m3 forward
    dx, dw, dv = grads
    assert dx.dtype == dw.dtype == torch.bfloat16
    assert rel_err(dx, bf16_grads[0]) < 0.1 and rel_err(dw, bf16_grads[1]) < 0.1  # e5m2: 2 mantissa bits
    assert torch.equal(dv, bf16_grads[2])  # v's extra input takes v's gradient as it is
    # the backward left the gradient's amax (~9 on these unit gradients) in the layer's buffer, for the next
    # backward's scale; it clipped nothing (16 x the buffer's 1 was within reach)
    assert 1 < amax.item() < 16 and saturations.item() == 0


def test_fp8_backward_counts_a_clipping_backward():
    """A scale far below the gradient (amax 1e-6): the backward saturates, counts it, and the buffer now holds
    the gradient's amax, so the next backward does not clip."""
    amax = torch.full((), 1e-6)
    ((_, fp8_grads), (_, bf16_grads)), saturations = fp8_and_bf16_backwards(True, True, amax)
    assert saturations.item() == 1 and amax.item() > 1e-3
    assert rel_err(fp8_grads[0], bf16_grads[0]) > 0.5  # clipped at ±57344 x 16 x 1e-6 / 57344
    ((_, fp8_grads), (_, bf16_grads)), saturations = fp8_and_bf16_backwards(True, True, amax)
    assert saturations.item() == 0 and rel_err(fp8_grads[0], bf16_grads[0]) < 0.1


def test_fp8_backward_reference_is_exact_autograd_quantized():
    """The reference's e5m2 gradient is float64 autograd's through qk_norm_rope_reference, rounded once: each
    element within half an e5m2 step (2 mantissa bits: 1/8 relative) of the exact one."""
    tokens, H, qk_hd = 48, 2, 64
    _, _, _, grads = projection_inputs(tokens, H, qk_hd, 64, paired=False)
    qkv = (torch.randn(tokens, H * 3 * qk_hd, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16()
    cos, sin = rope_tables(tokens, 64, False)
    layer = (torch.tensor(0.12), H, qk_hd, False, True)
    leaf = qkv.double().requires_grad_()
    exact, = torch.autograd.grad(T.qk_norm_rope_reference(leaf, None, cos.double(), sin.double(), *layer), leaf,
                                 [g.double() for g in grads])
    grad_scale = exact.abs().amax().float() * 16 / T.E5M2_MAX
    grad8, grad8_t, amax = T.qk_norm_rope_backward_fp8_reference(qkv, *grads, cos, sin, layer[0], grad_scale,
                                                                 *layer[1:])
    assert torch.equal(grad8_t.view(torch.uint8), grad8.t().contiguous().view(torch.uint8))
    torch.testing.assert_close(amax.double(), exact.abs().amax(), rtol=1e-5, atol=0)
    got = grad8.double() * grad_scale.double()
    normal = exact.abs() > 2.0 ** -14 * grad_scale.double()
    assert ((got - exact).abs()[normal] <= exact.abs()[normal] / 8 + 1e-12).all()


def test_model_with_the_fp8_backward_forced_on_trains_like_the_bf16_backward():
    """The tiny model's training step (CPU: the reference's arithmetic) with the FP8 backward against the e4m3
    forward's bf16 backward: the same loss, the banks' gradients within e5m2's rounding, and every attention layer's
    amax buffer refreshed by its backward."""
    hp = T.Hyperparameters.of(model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256, vocab_size=1024,
                              copy_pointer=False, ngram_rows=1001, narrow_qk_layers=T.ModelConfig.narrow_qk_layers)
    torch.manual_seed(0)
    model = T.GPT(hp.model, 256)
    inputs, targets, cu = random_batch(vocab=1024)
    shape = T.ForwardShape(short_window=32, long_window=96, max_seq_len=256)
    e4m3 = dataclasses.replace(cpu_execution(hp), qkv_e4m3=True)
    results = []
    for plan in (dataclasses.replace(e4m3, qkv_fp8_backward=True), e4m3):
        model.zero_grad(set_to_none=True)
        loss, _ = model.training_loss(inputs, targets, cu, shape, plan, torch.tensor([1.0]))
        loss.backward()
        results.append((loss.detach(), model.qk_bank.grad, model.qk_narrow_bank.grad, model.vo_bank.grad))
        if plan.qkv_fp8_backward:
            amaxes = [getattr(model, f"fp8_qkv_grad_amax{i}").item() for i in hp.model.attention_layers]
            assert all(0 < a < 1 for a in amaxes), amaxes  # each layer's, from 1 at the start
            assert model.fp8_qkv_grad_saturations.item() == 0
    (loss, *grads), (ref_loss, *ref_grads) = results
    assert torch.equal(loss, ref_loss)
    for name, got, want in zip(("qk_bank", "qk_narrow_bank", "vo_bank"), grads, ref_grads):
        assert rel_err(got, want) < 0.1, name


def test_plan_takes_the_fp8_backward_only_where_it_is_set_and_runs():
    hp = T.Hyperparameters.of(device="cpu", fp8_qkv_backward=True)
    assert not T.resolve_execution(hp.execution, hp.model, torch.device("cpu"), 4096, training=True).qkv_fp8_backward
    assert T.Hyperparameters.of().execution.fp8_qkv_backward is False  # off by default: awaiting its A/B
    assert T.Hyperparameters.from_env({"FP8_QKV_BACKWARD": "1"}).execution.fp8_qkv_backward is True


# ---- GPU --------------------------------------------------------------------------------------


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("paired, key_offset, qk_hd", [(False, True, 128), (True, False, 64), (True, True, 128)])
def test_fp8_backward_kernel_matches_its_reference_on_gpu(paired, key_offset, qk_hd):
    """At the model's shapes (49,152 tokens, 6 heads; wide and narrow Q/K), eager and compiled (fullgraph): the
    e5m2 gradient byte for byte as the reference's cast except where the two fp32 sums round apart (under 0.1 %
    of the elements, one e5m2 step), both layouts, the amax to fp32 rounding; compiled as eager, bit for bit."""
    tokens, H, hd = 49152, 6, 128
    torch.manual_seed(0)
    S, heads = (2 * tokens, H // 2) if paired else (tokens, H)
    qkv = (torch.randn(tokens, H * (2 * qk_hd + hd), device="cuda") * 0.5).bfloat16()
    grads = [torch.randn(S, heads, w, device="cuda").bfloat16() for w in (qk_hd, qk_hd, hd)]
    cos, sin = rope_tables(tokens, hd, paired, "cuda")
    args = (torch.tensor(0.12, device="cuda"), torch.tensor(30.0 * 16 / T.E5M2_MAX, device="cuda"), H, qk_hd,
            paired, key_offset)
    want8, want8_t, want_amax = T.qk_norm_rope_backward_fp8_reference(qkv, *grads, cos, sin, *args)

    def kernel(qkv, gq, gk, gv):
        return T.qk_norm_rope_backward_fp8(qkv, gq, gk, gv, cos, sin, *args)

    got8, got8_t, got_amax = kernel(qkv, *grads)
    torch._dynamo.reset()
    traced = torch.compile(kernel, dynamic=False, fullgraph=True)(qkv, *grads)
    torch.testing.assert_close(got_amax, want_amax, rtol=1e-5, atol=0)
    differ = got8.view(torch.uint8) != want8.view(torch.uint8)
    assert differ.float().mean().item() < 1e-3
    one_step = (want8.float().abs() / 4).clamp_min(2.0 ** -16)  # e5m2's step: a quarter of a binade, 2^-16 subnormal
    assert ((got8.float() - want8.float()).abs() <= one_step)[differ].all()
    assert torch.equal(got8_t.view(torch.uint8), got8.t().contiguous().view(torch.uint8))
    for a, b in zip(traced, (got8, got8_t, got_amax)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e5m2 else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e5m2 else b)


@hopper
@pytest.mark.gpu
def test_compiled_model_with_the_fp8_backward_trains_like_the_bf16_backward_on_gpu():
    """The model compiled (fullgraph) with FP8_QKV_BACKWARD 1 and 0 (e4m3 forward both): inductor launches the FP8
    kernel only with it, the loss is the same, the banks' gradients agree within e5m2's rounding, and the compiled
    backward refreshes every attention layer's amax buffer (a mutation inside the backward graph)."""
    from torch._inductor.utils import run_and_get_code
    tokens = 2048
    torch.manual_seed(0)
    ids = torch.randint(0, 50000, (tokens + 1,))
    ids[[0, 300, 301, 1200]] = T.BOS_ID
    cu = torch.from_numpy(T.cu_seqlens_for([300, 1, 899, tokens + 1 - 1200], tokens, 16)).cuda()
    inputs, targets = ids[:-1].int().cuda(), ids[1:].int().cuda()
    shape = T.ForwardShape(short_window=128, long_window=384, max_seq_len=1024, n_predict=2)
    results = []
    for setting in (True, False):
        hp = T.Hyperparameters.of(model_dim=384, num_heads=6, head_dim=64, mlp_hidden=1024, ngram_rows=1001,
                                  val_seq_len=2048, fp8_qkv_backward=setting)
        torch.manual_seed(0)
        model = T.GPT(hp.model, T.longest_forward(hp)).cuda()
        plan = T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), tokens, training=True)
        assert plan.qkv_e4m3 and plan.qkv_fp8_backward == setting
        torch._dynamo.reset()
        compiled = torch.compile(model.training_loss, dynamic=False, fullgraph=True)

        def step():
            loss, _ = compiled(inputs, targets, cu, shape, plan, torch.tensor([1.0, 0.5], device="cuda"))
            loss.backward()
            return loss.detach()

        loss, codes = run_and_get_code(step)
        assert ("_qk_norm_rope_backward_fp8_kernel" in "\n".join(codes)) == setting
        if setting:
            amaxes = torch.stack([getattr(model, f"fp8_qkv_grad_amax{i}") for i in hp.model.attention_layers])
            assert ((amaxes > 0) & (amaxes < 1)).all(), amaxes
            assert model.fp8_qkv_grad_saturations.item() == 0
        results.append((loss, model.qk_bank.grad, model.qk_narrow_bank.grad, model.vo_bank.grad))
    (loss, *grads), (ref_loss, *ref_grads) = results
    assert torch.equal(loss, ref_loss)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 0.1
