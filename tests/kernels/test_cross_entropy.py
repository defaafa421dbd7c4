"""The fused soft-capped multi-target cross-entropy and the lm_head + loss op: the Triton kernels
against their torch references (Triton's CPU interpreter here, compiled in the gpu-marked tests),
the op's gradients against autograd through the plain formulation, the whole model against the
previous formulation, tracing under torch.compile, and the FP8 path on a GPU."""

import textwrap

import pytest
import torch

import train_gpt as T
from helpers import TINY, cpu_execution, model_of, random_batch, rel_err, run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Every empty tensor starts as NaN (floats) or 0xFF (bytes), so elements a kernel leaves unwritten fail.
POISON = textwrap.dedent("""
    import torch
    _empty = torch.empty
    def poisoned_empty(*args, **kwargs):
        out = _empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1 if out.is_signed() else 255)
""")

# Triton 3.9's interpreter narrows floats without the carry into the exponent (e.g. 7687.5 -> 4096
# in e5m2) and truncates to bf16; the GPU rounds to nearest even, as torch does. The check routes
# float narrowing through torch so that it tests the kernel, not the interpreter's conversion.
INTERPRETER_CHECK = POISON + textwrap.dedent("""
    import itertools
    import numpy as np
    import triton.runtime.interpreter as interpreter
    import train_gpt as T
    FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
              "fp8e5": torch.float8_e5m2, "fp8e4nv": torch.float8_e4m3fn}
    BITS = {8: (np.uint8, torch.uint8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}
    convert_float = interpreter._convert_float
    def round_to_nearest_even(data, src, dst, rounding_mode):
        narrowing = src.name in FLOATS and dst.name in FLOATS and dst.primitive_bitwidth < src.primitive_bitwidth
        if not narrowing or rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ:
            return convert_float(data, src, dst, rounding_mode)
        bits = torch.from_numpy(np.ascontiguousarray(data).view(BITS[src.primitive_bitwidth][0]).copy())
        out = bits.view(FLOATS[src.name]).to(FLOATS[dst.name]).view(BITS[dst.primitive_bitwidth][1]).numpy()
        return out.view(f"uint{dst.primitive_bitwidth}").reshape(data.shape)
    interpreter._convert_float = round_to_nearest_even
    torch.empty = poisoned_empty

    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    from helpers import rel_err as rel
    results = []
    # (rows, vocab, targets per row, programs, grad multiplier): the row's parts (T.vocab_parts) with
    # a masked rest (300: 256 + 32 + 16; 200: 128 + 64 + 8; 50: 32 + 16 + 2), without one (257: 256 + 1;
    # 130: 128 + 2) and a single part (256); persistent programs taking several rows
    for T_rows, V, N, programs, grad_mul in ((9, 300, 1, 4, 0.5), (7, 257, 2, 7, 3.0), (6, 200, 3, 2, 1 / T.FP8_GRAD_SCALE),
                                             (5, 130, 4, 3, 1e6), (4, 256, 2, 3, 1.0), (3, 50, 1, 2, 2.0)):
        logits = (torch.randn(T_rows, V) * 3).bfloat16()
        targets = torch.randint(0, V, (T_rows, N))
        targets[-1, 1:] = -1  # past the end
        targets[0, -1] = targets[0, 0]  # a duplicate (N = 1: the same column)
        if N > 2:
            targets[1, 1] = -1
        weights = torch.rand(N) + 0.1
        # the copy pointer's mixture (T4.8): <copy> a column of the row, a row without a next-token target
        copy_targets = targets.clone()
        copy_targets[1, 0] = -1
        copy = (torch.tensor([V - 2]), torch.rand(T_rows) * 0.5, torch.rand(T_rows) * 0.3)
        for (grad_dtype, tol), mixture, prefetch in itertools.product(
                ((torch.bfloat16, 2e-3), (torch.float8_e5m2, 8e-2)), (False, True), (False, True)):
            args = (logits, copy_targets if mixture else targets, weights, grad_mul, grad_dtype)
            pointer = copy if mixture else None
            ref = T.softcap_ce(*args, use_triton=False, copy=pointer)
            out = T.softcap_ce(*args, use_triton=True, programs=programs, copy=pointer, prefetch=prefetch)
            case = (T_rows, V, N, programs, grad_mul, str(grad_dtype), mixture, prefetch)
            assert out[2].dtype == grad_dtype and torch.isfinite(out[2].float()).all(), case
            results.append(("loss_rows", case, rel(out[0], ref[0]), 1e-5))
            results.append(("ce0_rows", case, rel(out[1], ref[1]), 1e-5))
            results.append(("grad", case, rel(out[2].float(), ref[2].float()), tol))
            if mixture:
                results.append(("copy_grad", case, rel(out[3], ref[3]), 1e-5))
            else:
                assert out[3] is None and ref[3] is None
    for dtype in (torch.uint8, torch.float8_e5m2, torch.bfloat16):
        for shape, blocks in (((37, 70), (16, 32)), ((64, 128), (64, 128)), ((33, 129), (16, 64))):
            src = (torch.randn(shape) * 100).to(dtype) if dtype != torch.uint8 else torch.randint(0, 255, shape, dtype=dtype)
            out = T.transpose_copy(src, use_triton=True, block_m=blocks[0], block_n=blocks[1])
            same = torch.equal(out.view(torch.uint8) if out.element_size() == 1 else out,
                               src.t().contiguous().view(torch.uint8) if out.element_size() == 1 else src.t())
            results.append(("transpose", (str(dtype), shape, blocks), 0.0 if same else 1.0, 0.5))
    bad = [r for r in results if not r[2] < r[3]]
    for r in results:
        print(*r)
    assert not bad, bad
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_kernels_in_the_triton_interpreter():
    """Loss rows, ce0 rows and bf16/e5m2 gradients of the fused kernel (N = 1..4, −1 and duplicate
    targets, each layout of a row's parts, persistent programs, saturation; with and without the copy
    pointer's mixture, T4.8; with and without the next row's loads ahead, `prefetch`) and the transpose copy."""
    run_in_triton_interpreter(INTERPRETER_CHECK, timeout=900)


def test_vocab_parts_cover_a_row_with_whole_powers_of_two_and_a_small_masked_rest():
    """The kernel's register parts: A and B whole (A + B <= V), C the masked rest, under 2x its
    columns (GPT-2's row wastes 896 masked columns of 51,200)."""
    assert T.vocab_parts(50304) == (32768, 16384, 2048)
    for V in [*range(1, 600), 50257, 65536, 65537, 100_000]:
        a, b, c = T.vocab_parts(V)
        powers = [p for p in (a, b, c) if p]
        assert all(p & (p - 1) == 0 for p in powers) and a >= b and a + b <= V <= a + b + c, V
        rest = V - a - b
        assert (c == 0) == (rest == 0) and (rest == 0 or rest <= c < 2 * rest), V


def plain_loss(x, w, targets, weights, grad_scale):
    """The formulation the op replaces: autograd through softcap, logsumexp and gather."""
    z = T.softcap(x @ w.t())
    lse = torch.logsumexp(z, -1, keepdim=True)
    valid = targets >= 0
    ce = lse - z.gather(1, targets.clamp_min(0))
    return (ce * weights * valid).sum() * grad_scale, torch.where(valid[:, 0], ce[:, 0], 0).mean()


def random_problem(T_rows, V, d, N, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = T.norm(torch.randn(T_rows, d, device=device, generator=gen)).to(dtype)
    w = (torch.randn(V, d, device=device, generator=gen) * 0.05).to(dtype)
    targets = torch.randint(0, V, (T_rows, N), device=device, generator=gen)
    for k in range(1, N):
        targets[T_rows - k:, k] = -1  # multi-token prediction: no target past the end
    if N > 1:
        targets[::7, 1] = targets[::7, 0]  # duplicates
    weights = torch.tensor([1.0, 0.5, 0.25, 0.4][:N], device=device)
    return x, w, targets, weights


@pytest.mark.parametrize("N", [1, 3, 4])
def test_op_gradients_match_autograd_in_float64(N):
    x, w, targets, weights = random_problem(23, 97, 16, N, torch.float64)
    g = 1.7  # the upstream gradient multiplies in exactly
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, ce0 = T.lm_head_softcap_ce(x1, w1, targets, weights, grad_scale=0.25)
    (loss * g).backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_loss, ref_ce0 = plain_loss(x2, w2, targets, weights, 0.25)
    (ref_loss * g).backward()
    assert loss.dtype == torch.float64 and not ce0.requires_grad
    assert abs(loss.item() - ref_loss.item()) < 1e-12 * abs(ref_loss.item())
    assert abs(ce0.item() - ref_ce0.item()) < 1e-12 * abs(ref_ce0.item())
    assert rel_err(x1.grad, x2.grad) < 1e-10 and rel_err(w1.grad, w2.grad) < 1e-10


def test_model_loss_and_gradients_match_the_previous_formulation():
    torch.manual_seed(0)
    model = model_of(T.Hyperparameters.of(**TINY))
    with torch.no_grad():  # away from the zero initializations, so that every gradient is non-zero
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        model.lm_head.normal_(0, 0.1)  # logits of a trained scale
    inputs, targets, cu = random_batch()
    shape = T.ForwardShape(32, 96, 128, n_predict=3)
    mtp = torch.tensor([1.0, 0.5, 0.125])
    plan = cpu_execution(tokens=inputs.numel())
    loss, ce = model.training_loss(inputs, targets, cu, shape, plan, mtp, grad_scale=0.5)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    x = model.hidden_states(inputs, cu, shape, plan)  # the previous forward's tail, with the model's GEMM rounding
    z = T.softcap(x @ model.lm_head.t())  # the model's product (conftest: CPU bf16 GEMMs in fp32)
    lse = torch.logsumexp(z, -1)
    Tn = z.size(0)
    ahead = torch.arange(Tn)[:, None] + torch.arange(3)
    ce_prev = lse[:, None] - z.gather(1, targets.long()[ahead.clamp_max(Tn - 1)])
    loss_prev = (ce_prev * mtp * (ahead < Tn)).sum() * 0.5
    loss_prev.backward()
    assert abs(loss.item() - loss_prev.item()) < 1e-5 * loss_prev.item()
    assert abs(ce.item() - ce_prev[:, 0].mean().item()) < 1e-5 * ce.item()
    assert grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    # the same logit gradient up to fp32 rounding, which flips a few of the bf16 gradient's roundings
    assert rel_err(grads["lm_head"], model.lm_head.grad) < 1e-3
    for name, grad in grads.items():  # deeper, bf16 rounding flips spread: a few bf16 ulps, which do
        # not average out in a single scalar (e.g. the MUDD gate scale)
        assert rel_err(grad, model.get_parameter(name).grad) < (1e-2 if grad.numel() > 64 else 5e-2), name


def test_fp8_op_math_on_cpu():
    """The FP8 path's scales, operand layouts and upstream-scalar folding, through torch's CPU
    _scaled_mm (the model never takes this path off CUDA), against the plain bf16 formulation."""
    x, w, targets, weights = random_problem(256, 1000, 64, 3, torch.bfloat16)
    results = []
    for fn in (lambda x, w: T._LMHeadSoftcapCE.apply(x, w, targets, weights, 0.5, True, None, None, None),
               lambda x, w: plain_loss(x.float(), w.float(), targets, weights, 0.5)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, ce0 = fn(xg, wg)
        (loss * 0.3).backward()
        results.append((loss, ce0, xg.grad, wg.grad))
    (loss8, ce8, dx8, dw8), (loss, ce0, dx, dw) = results
    assert dx8.dtype == dw8.dtype == torch.bfloat16
    assert rel_err(loss8, loss) < 1e-2 and rel_err(ce8, ce0) < 1e-2  # e4m3 logits
    assert rel_err(dx8, dx) < 8e-2 and rel_err(dw8, dw) < 8e-2  # e5m2 gradient: 2 mantissa bits
    for dtype in (torch.float32, torch.bfloat16):
        x, w, targets, weights = random_problem(32, 101, 16, 2, dtype)
        torch.library.opcheck(torch.ops.speedrun.lm_head_softcap_ce.default, (x, w, targets, weights, 0.5))
        copy = (torch.tensor([7]), torch.rand(32, dtype=dtype), torch.rand(32, dtype=dtype) * 0.3)  # T4.8
        torch.library.opcheck(torch.ops.speedrun.lm_head_softcap_ce.default, (x, w, targets, weights, 0.5, *copy))
        grad = torch.ops.speedrun.lm_head_softcap_ce(x, w, targets, weights, 0.5)[2]
        torch.library.opcheck(torch.ops.speedrun.lm_head_softcap_ce_backward.default,
                              (torch.tensor(1.3), grad, x, w, 0.5))


@pytest.mark.parametrize("fp8", [False, True])
def test_op_traces_under_torch_compile(fp8):
    """Both branches (the FP8 one through torch's CPU _scaled_mm) trace whole, forward and backward."""
    x, w, targets, weights = random_problem(32, 101, 16, 2, torch.bfloat16)

    def step(x, w, targets, weights):
        loss, ce0 = T._LMHeadSoftcapCE.apply(x, w, targets, weights, 0.5, fp8, None, None, None)
        return loss * 3.0, ce0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, step):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, ce0 = fn(xg, wg, targets, weights)
        loss.backward()
        results.append((loss, ce0, xg.grad, wg.grad))
    for a, b in zip(*results):
        assert torch.isfinite(a).all() and rel_err(a, b) < 1e-6
    loss, _ = torch.compile(T.lm_head_softcap_ce, backend="aot_eager", fullgraph=True)(x, w, targets, weights, 0.5,
                                                                                       fp8=True)
    assert rel_err(loss, T.lm_head_softcap_ce(x, w, targets, weights, 0.5)[0]) < 1e-6  # fp8 ignored off CUDA


def test_kernel_launcher_names_what_it_cannot_take():
    """More than MAX_TARGETS columns: the launcher refuses, the reference computes them."""
    logits = torch.randn(4, 50).bfloat16()
    with pytest.raises(ValueError, match="N <= 4"):
        T.softcap_ce(logits, torch.zeros(4, 5, dtype=torch.long), torch.ones(5), 1.0, torch.bfloat16, use_triton=True)
    loss_rows, ce0_rows, grad, _ = T.softcap_ce(logits, torch.zeros(4, 5, dtype=torch.long), torch.ones(5), 1.0,
                                             torch.bfloat16)
    assert loss_rows.shape == (4,) and grad.shape == (4, 50) and torch.allclose(loss_rows, 5 * ce0_rows)


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_kernel_launch_follows_the_row_width_table(monkeypatch):
    """softcap_ce launches as ce_launch(row width) says (the first CE_LAUNCH entry at least as wide as the row:
    num_warps, programs per SM, prefetch) unless the caller gives them; every width has an entry, and the full
    vocabulary keeps 16 warps and one program an SM (its row fills an SM's registers, T4.1)."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs["num_warps"], kwargs["PREFETCH"]))

    monkeypatch.setattr(T, "_softcap_ce_kernel", Kernel())
    monkeypatch.setattr(T, "TRITON_INTERPRETER", False)
    monkeypatch.setattr(T, "_sm_count", lambda device: 10)
    monkeypatch.setattr(T, "CE_LAUNCH", ((96, 4, 3, True), (200, 8, 2, False), (1 << 62, 16, 1, False)))
    targets, weights = torch.zeros(1000, 1, dtype=torch.long), torch.ones(1)

    def launch(width, rows=1000, **given):
        T.softcap_ce(torch.zeros(rows, width).bfloat16(), targets[:rows], weights, 1.0, torch.bfloat16,
                     use_triton=True, **given)
        return launches.pop()
    assert launch(64) == ((30,), 4, True) and launch(96) == ((30,), 4, True)
    assert launch(97) == ((20,), 8, False) and launch(200) == ((20,), 8, False) and launch(50304) == ((10,), 16, False)
    assert launch(64, rows=7) == ((7,), 4, True)  # never more programs than rows
    assert launch(64, num_warps=16, programs=5, prefetch=False) == ((5,), 16, False)
    monkeypatch.undo()
    assert T.ce_launch(50304)[:2] == (16, 1)  # GPT-2's padded vocabulary
    assert all(len(T.ce_launch(width)) == 3 for width in (1, 10240, 14336, 50304, 1 << 20))
    assert [entry[0] for entry in T.CE_LAUNCH] == sorted(entry[0] for entry in T.CE_LAUNCH)


# ---- GPU --------------------------------------------------------------------------------------


@pytest.fixture
def poisoned(monkeypatch):
    scope = {}
    exec(POISON, scope)
    monkeypatch.setattr(torch, "empty", scope["poisoned_empty"])


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 3])
def test_fused_kernel_matches_reference_at_full_vocab(N, poisoned):
    torch.manual_seed(0)
    logits = (torch.randn(4096, 50304, device="cuda") * 3).bfloat16()
    _, _, targets, weights = random_problem(4096, 50304, 8, N, torch.float32, "cuda")
    for grad_dtype, grad_mul, tol in ((torch.bfloat16, 0.5, 1e-2), (torch.float8_e5m2, 1 / T.FP8_GRAD_SCALE, 8e-2)):
        ref = T.softcap_ce(logits, targets, weights, grad_mul, grad_dtype, use_triton=False)
        out = T.softcap_ce(logits, targets, weights, grad_mul, grad_dtype)
        assert rel_err(out[0], ref[0]) < 1e-3 and rel_err(out[1], ref[1]) < 1e-3
        assert torch.isfinite(out[2].float()).all() and rel_err(out[2].float(), ref[2].float()) < tol


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("V,N,num_warps,per_sm", [(10240, 3, 4, 3), (14336, 1, 16, 1), (14336, 1, 4, 2)])
def test_fused_kernel_at_sampled_widths_with_and_without_prefetch(V, N, num_warps, per_sm, poisoned):
    """The sampled budgets' row widths (T4.6) at launches bench_cross_entropy.py sweeps, several rows a program,
    with the next row's loads ahead (`prefetch`) and without: the same rows as the reference's, and prefetch changes
    no bit (each row's arithmetic is the same)."""
    torch.manual_seed(0)
    logits = (torch.randn(8192, V, device="cuda") * 3).bfloat16()
    _, _, targets, weights = random_problem(8192, V, 8, N, torch.float32, "cuda")
    programs = per_sm * T._sm_count(logits.device)
    for grad_dtype, grad_mul, tol in ((torch.bfloat16, 0.5, 1e-2), (torch.float8_e5m2, 1 / T.FP8_GRAD_SCALE, 8e-2)):
        ref = T.softcap_ce(logits, targets, weights, grad_mul, grad_dtype, use_triton=False)
        plain, ahead = (T.softcap_ce(logits, targets, weights, grad_mul, grad_dtype, num_warps=num_warps,
                                     programs=programs, prefetch=prefetch) for prefetch in (False, True))
        assert rel_err(plain[0], ref[0]) < 1e-3 and rel_err(plain[1], ref[1]) < 1e-3
        assert torch.isfinite(plain[2].float()).all() and rel_err(plain[2].float(), ref[2].float()) < tol
        bits = [t.view(torch.uint8) if t.element_size() == 1 else t for t in (*plain[:3], *ahead[:3])]
        assert all(torch.equal(a, b) for a, b in zip(bits[:3], bits[3:]))


@cuda
@pytest.mark.gpu
def test_transpose_copy_on_gpu(poisoned):
    for dtype in (torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16):
        for shape in ((4096, 50304), (768, 4096), (1000, 333)):
            src = torch.randn(shape, device="cuda").to(dtype)
            out = T.transpose_copy(src)
            assert torch.equal(out.view(torch.uint8) if out.element_size() == 1 else out,
                               src.t().contiguous().view(torch.uint8) if out.element_size() == 1 else src.t())


def lm_head_grads(fn, x, w, targets, weights, grad_scale, upstream):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, ce0 = fn(x, w, targets, weights, grad_scale)
    (loss * upstream).backward()
    return loss, ce0, x.grad, w.grad


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 3])
def test_lm_head_op_bf16_and_fp8_match_the_plain_formulation(N, poisoned):
    x, w, targets, weights = random_problem(4096, 50304, 768, N, torch.bfloat16, "cuda")
    ref = lm_head_grads(lambda *a: plain_loss(a[0].float(), a[1].float(), *a[2:]), x, w, targets, weights, 0.5, 0.3)
    bf16 = lm_head_grads(lambda *a: T.lm_head_softcap_ce(*a, fp8=False), x, w, targets, weights, 0.5, 0.3)
    fp8 = lm_head_grads(lambda *a: T.lm_head_softcap_ce(*a, fp8=True), x, w, targets, weights, 0.5, 0.3)
    assert rel_err(bf16[0], ref[0]) < 1e-3 and rel_err(bf16[1], ref[1]) < 1e-3
    assert rel_err(bf16[2], ref[2]) < 1e-2 and rel_err(bf16[3], ref[3]) < 1e-2
    assert rel_err(fp8[0], ref[0]) < 1e-2 and rel_err(fp8[1], ref[1]) < 1e-2  # e4m3 logits
    assert rel_err(fp8[2], ref[2]) < 8e-2 and rel_err(fp8[3], ref[3]) < 8e-2  # e5m2 gradient: 2 mantissa bits


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_lm_head_op_under_inductor(fp8):
    x, w, targets, weights = random_problem(2048, 50304, 768, 2, torch.bfloat16, "cuda")

    def step(x, w, targets, weights, grad_scale):
        return T.lm_head_softcap_ce(x, w, targets, weights, grad_scale, fp8=fp8)

    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    eager = lm_head_grads(step, x, w, targets, weights, 0.5, 1.0)
    for _ in range(2):
        out = lm_head_grads(compiled, x, w, targets, weights, 0.5, 1.0)
    for a, b in zip(out, eager):
        assert torch.isfinite(a).all() and rel_err(a, b) < 1e-2


@cuda
@pytest.mark.gpu
def test_compiled_tiny_model_trains_on_gpu():
    torch.manual_seed(0)
    hp = T.Hyperparameters.of(**dict(TINY, device="cuda"))
    model = model_of(hp).cuda()
    plan = T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), 256, training=True)
    compiled = torch.compile(model.training_loss, dynamic=False, fullgraph=True)
    inputs, targets, cu = (t.cuda() for t in random_batch())
    shape = T.ForwardShape(32, 96, 256, n_predict=3)  # max_seq_len: the longest document is 159 tokens
    mtp = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    losses = []
    for fn in (model.training_loss, compiled):
        model.zero_grad()
        loss, ce = fn(inputs, targets, cu, shape, plan, mtp, 0.5)
        loss.backward()
        losses.append((loss.item(), ce.item(), model.lm_head.grad.clone()))
    assert 9 < losses[1][1] < 12 and abs(losses[0][0] - losses[1][0]) < 1e-2 * losses[0][0]
    assert rel_err(losses[1][2], losses[0][2]) < 5e-2
