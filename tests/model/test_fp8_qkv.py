"""The FP8 Q/K/V projections (docs/TECHNIQUES.md T6.3): the bank's per-slot e4m3 copies, the e4m3
product against its fp32 reference and the bf16 product, its bf16 backward, and the model's training
forward with it on and off (CPU, where torch's _scaled_mm runs too; compiled on a GPU, gpu-marked)."""

import dataclasses

import pytest
import torch

import train_gpt as T
from helpers import rel_err

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs an sm90+ GPU (e4m3 tensor cores)")


def banks(slots=3, H=2, hd=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d = H * hd
    qk = torch.randn(slots * H, 2 * hd, d, generator=gen).bfloat16()
    vo = torch.randn(2 * slots, d, d, generator=gen).bfloat16()
    vo[0::2] *= torch.tensor([1.0, 10.0, 0.01])[:slots, None, None]  # slots of very different magnitudes
    return qk, vo


def test_qkv_bank_holds_each_slots_q_k_v_rows_at_its_own_scale():
    """One Q/K bank for all slots, then slot 1 narrow (T3.18): its Q/K rows from a bank of their own; the V
    rows of every slot from the one V/O bank."""
    qk, vo = banks()
    slots, d = 3, 64
    gen = torch.Generator().manual_seed(1)
    narrow = torch.randn(2, 32, d, generator=gen).bfloat16()
    layouts = {"wide": ([(qk, [0, 1, 2])], qk.view(slots, -1, d)),
               "narrow slot 1": ([(qk[:4], [0, 2]), (narrow, [1])],
                                 [qk[:2].reshape(-1, d), narrow.reshape(-1, d), qk[2:4].reshape(-1, d)])}
    v_rows = vo[0::2]  # each slot's V, the first of its V/O pair
    for layout, (qk_banks, qk_rows) in layouts.items():
        bank8 = T.QKVBankFP8.quantize(qk_banks, vo)
        assert len(bank8.weights) == len(bank8.scales) == slots
        for s in range(slots):
            want = torch.cat([qk_rows[s], v_rows[s]])  # what the bf16 forward multiplies
            assert bank8.weights[s].shape == want.shape and bank8.weights[s].dtype == torch.float8_e4m3fn
            assert bank8.scales[s].shape == () and bank8.scales[s].dtype == torch.float32
            got = bank8.weights[s].float() * bank8.scales[s]
            assert bank8.weights[s].float().abs().max() == T.E4M3_MAX
            assert rel_err(got, want) < 0.04, (layout, s)  # e4m3: 3 mantissa bits


def linear_inputs(M=96, N=72, d=64, seed=1, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = T.norm(torch.randn(M, d, generator=gen, device=device)).bfloat16()
    w = (torch.randn(N, d, generator=gen, device=device) * 0.05).bfloat16()
    grad = torch.randn(M, N, generator=gen, device=device).bfloat16()
    return x, w, grad


def test_fp8_normed_linear_forward_is_its_reference_and_the_bf16_product_within_rounding():
    x, w, _ = linear_inputs()
    w8, scale = T.quantize_e4m3(w, w.abs().amax())
    want = T.fp8_normed_linear_reference(x, w8, scale)
    got = T.fp8_normed_linear(x, w, w8, scale.reshape(()))
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2
    assert rel_err(got, x.double() @ w.double().t()) < 0.06  # x's and w's e4m3 rounding
    lam = torch.tensor(-0.7)  # a (negative) lambda folded into the scale scales the product
    assert rel_err(T.fp8_normed_linear(x, w, w8, scale.reshape(()) * lam), got.float() * lam) < 1e-2


def test_fp8_normed_linear_backward_is_the_bf16_products():
    x, w, grad = linear_inputs()
    w8, scale = T.quantize_e4m3(w, w.abs().amax())
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(T.fp8_normed_linear(xs, ws, w8, scale.reshape(())), (xs, ws), grad)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(xs @ ws.t(), (xs, ws), grad)
    for g, r in zip(got, want):
        assert torch.equal(g, r)


def model_and_plans(device="cpu", tokens=512):
    """A small GPT and the execution plans of its 512-token training forward with the FP8 Q/K/V
    projection forced on (resolve_execution turns it off off Hopper) and off, and of its evaluation."""
    hp = T.Hyperparameters.of(model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256, ngram_rows=101,
                              val_seq_len=1024, device=device, fp8_mlp=False, fused_mlp=device == "cuda")
    torch.manual_seed(0)
    model = T.GPT(hp.model, T.longest_forward(hp)).to(device)
    plan = T.resolve_execution(hp.execution, hp.model, torch.device(device), tokens, training=True)
    evaluation = T.resolve_execution(hp.execution, hp.model, torch.device(device), tokens, training=False)
    return model, dataclasses.replace(plan, qkv_e4m3=True), dataclasses.replace(plan, qkv_e4m3=False), evaluation


def document_batch(tokens=512, device="cpu"):
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (tokens + 1,))
    ids[[0, 200, 201]] = T.BOS_ID
    cu = torch.from_numpy(T.cu_seqlens_for([200, 1, tokens + 1 - 201], tokens, 16)).to(device)
    shape = T.ForwardShape(short_window=128, long_window=384, max_seq_len=512, n_predict=2)
    return ids[:-1].int().to(device), ids[1:].int().to(device), cu, shape


def losses_and_grads(model, plan, evaluation, batch, compile_fn=lambda f: f):
    inputs, targets, cu, shape = batch
    model.zero_grad()
    loss, _ = compile_fn(model.training_loss)(inputs, targets, cu, shape, plan,
                                              torch.tensor([1.0, 0.5], device=cu.device))
    loss.backward()
    with torch.no_grad():
        total = compile_fn(model.evaluation_loss)(inputs, targets, cu, shape, evaluation, 256)
    return loss.detach(), total, model.qk_bank.grad.clone(), model.vo_bank.grad.clone(), model.scalars.grad.clone()


def test_training_forward_takes_the_fp8_projections_and_evaluation_stays_bf16(monkeypatch):
    model, fp8, bf16, evaluation = model_and_plans()
    assert not evaluation.qkv_e4m3
    batch = document_batch()
    calls = []
    original = T.fp8_normed_linear
    monkeypatch.setattr(T, "fp8_normed_linear", lambda *a: calls.append(1) or original(*a))
    loss, total, *grads = losses_and_grads(model, fp8, evaluation, batch)
    assert len(calls) == len(model.config.attention_layers)  # the training forward only
    ref_loss, ref_total, *ref_grads = losses_and_grads(model, bf16, evaluation, batch)
    assert torch.equal(total, ref_total)
    assert rel_err(loss, ref_loss) < 1e-2
    for name, g, r in zip(("qk_bank", "vo_bank", "scalars"), grads, ref_grads):
        assert rel_err(g, r) < 0.1, name  # the attention lambdas' gradients reach through the bf16 weight


def test_fp8_qkv_is_off_without_a_hopper_gpu():
    hp = T.Hyperparameters.of(device="cpu", fp8_qkv=True)
    assert not T.resolve_execution(hp.execution, hp.model, torch.device("cpu"), 4096, training=True).qkv_e4m3


# ---- GPU --------------------------------------------------------------------------------------


@hopper
@pytest.mark.gpu
def test_fp8_normed_linear_matches_its_reference_on_gpu():
    """The model's shapes (49,152 x 768 -> 2,304), eager and compiled, called as the attention layer
    calls it: the bf16 weight is lambda times the bank's, the e4m3 copy is the bank's and lambda is
    folded into its scale. Forward against the e4m3 reference, gradients against the bf16 product's."""
    x, w, grad = linear_inputs(M=4096, N=2304, d=768, device="cuda")
    w8, scale = T.quantize_e4m3(w, w.abs().amax())
    lam = -0.5  # a power of two: lam * w is exact in bf16
    want = T.fp8_normed_linear_reference(x, w8, scale).float() * lam
    xs, ws = x.clone().requires_grad_(), (w * lam).requires_grad_()
    want_grads = torch.autograd.grad(xs @ ws.t(), (xs, ws), grad)
    fn = lambda x, w, s: T.fp8_normed_linear(x, w, w8, s)  # noqa: E731
    for f in (fn, torch.compile(fn, dynamic=False, fullgraph=True)):
        xs, ws = x.clone().requires_grad_(), (w * lam).requires_grad_()
        out = f(xs, ws, scale.reshape(()) * lam)
        assert rel_err(out, want) < 1e-2
        for g, r in zip(torch.autograd.grad(out, (xs, ws), grad), want_grads):
            assert rel_err(g, r) < 1e-2


@hopper
@pytest.mark.gpu
def test_compiled_model_with_fp8_qkv_trains_like_bf16():
    torch._dynamo.reset()
    model, fp8, bf16, evaluation = model_and_plans("cuda")
    batch = document_batch(device="cuda")
    compile_fn = lambda f: torch.compile(f, dynamic=False, fullgraph=True)  # noqa: E731
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, total, *grads = losses_and_grads(model, fp8, evaluation, batch, compile_fn)
    torch._dynamo.reset()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(initial[n])
    ref_loss, ref_total, *ref_grads = losses_and_grads(model, bf16, evaluation, batch, compile_fn)
    assert torch.equal(total, ref_total) and rel_err(loss, ref_loss) < 1e-2
    for name, g, r in zip(("qk_bank", "vo_bank", "scalars"), grads, ref_grads):
        assert rel_err(g, r) < 0.1, name
