"""The sampled (shared-negative) soft-capped cross-entropy (T4.6): the candidate set (every target once,
the budget filled, deterministic per step, a sweep that covers the vocabulary, the shortfall when the
targets exceed the budget, traced whole), the op against its definition (sampled_softcap_ce_reference)
in float64, the fused kernel on the candidates in Triton's CPU interpreter, and at full size on a GPU
(bf16 and FP8, under inductor, without host syncs; marked gpu)."""

import math
import textwrap

import pytest
import torch

import train_gpt as T
from helpers import rel_err, run_in_triton_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_targets(T_rows, N, V, device="cpu", seed=0, distinct=None):
    """Targets (T, N) as the model's: −1 past the end of the later columns, duplicates across and
    within columns; drawn from the first `distinct` token ids (default: all V)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    targets = torch.randint(0, distinct or V, (T_rows, N), device=device, generator=gen)
    for k in range(1, N):
        targets[T_rows - k:, k] = -1
    if N > 1:
        targets[::5, 1] = targets[::5, 0]
    return targets


def check_candidate_set(targets, V, budget, step):
    """candidate_set's contract: each slot a distinct token, every target among them (first, in
    token order), the remapped targets pointing at them, −1 kept; returns the candidates."""
    candidates, candidate_targets, shortfall = T.candidate_set(targets, V, budget, torch.tensor(step))
    assert candidates.shape == (budget,) and candidate_targets.shape == targets.shape
    assert candidates.min() >= 0 and candidates.max() < V and candidates.unique().numel() == budget
    valid = targets >= 0
    assert torch.equal(candidates[candidate_targets[valid]], targets[valid])
    assert (candidate_targets[~valid] == -1).all() and shortfall.item() == 0
    distinct = targets[valid].unique()  # sorted
    assert torch.equal(candidates[: distinct.numel()], distinct)
    return candidates


@pytest.mark.parametrize("V, budget, T_rows, N", [(1000, 256, 64, 3), (1000, 1000, 64, 4), (1000, 96, 8, 1),
                                                  (50304, 10240, 2048, 4)])
def test_candidates_hold_every_target_once_and_fill_the_budget(V, budget, T_rows, N):
    targets = random_targets(T_rows, N, V)
    for step in (0, 1, 7, 1269):
        check_candidate_set(targets, V, budget, step)


def test_the_same_step_gives_the_same_set_and_successive_steps_sweep_the_vocabulary():
    """GPT-2's vocabulary at the record's first budget, targets taking ~30 % of it: any ⌈V/⌊budget/4⌋⌉
    consecutive steps (20) make every token a candidate."""
    V, budget = 50304, 10240
    targets = random_targets(4096, 2, V, distinct=3000)
    sets = [check_candidate_set(targets, V, budget, step) for step in range(100, 121)]
    assert torch.equal(sets[0], T.candidate_set(targets, V, budget, torch.tensor(100))[0])
    assert not torch.equal(sets[0], sets[1])
    steps = math.ceil(V / (budget // 4))
    assert steps == 20
    for first in (0, 1):
        seen = torch.zeros(V, dtype=torch.bool)
        seen[torch.cat(sets[first: first + steps])] = True
        assert seen.all()


def test_sweep_stride_visits_every_token_once():
    for V in (50304, 1000, 997, 64):
        stride, inverse = T.sweep_stride(V)
        assert sorted((j * stride) % V for j in range(V)) == list(range(V)) and (stride * inverse) % V == 1
    assert T.sweep_stride(50304)[0] == 31091  # nearest V/φ = 31089.4 coprime with 2^7·3·131


def test_targets_beyond_the_budget_fill_it_and_count_the_rest():
    """300 distinct targets, budget 256: the 256 lowest-numbered targets, no negatives; the rest
    leave the loss (−1) and the shortfall says how many."""
    targets = torch.arange(300).view(100, 3).flip(0)
    candidates, candidate_targets, shortfall = T.candidate_set(targets, 1000, 256, torch.tensor(5))
    assert torch.equal(candidates, torch.arange(256)) and shortfall.item() == 44
    assert torch.equal(candidate_targets, torch.where(targets < 256, targets, -1))


def test_candidate_set_traces_whole_and_compiles_once_for_every_step():
    """No host sync (fullgraph: no .item(), no data-dependent branch) and the step a tensor: one graph."""
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    targets = random_targets(64, 3, 1000)
    compiled = torch.compile(T.candidate_set, backend="aot_eager", fullgraph=True, dynamic=False)
    for step in range(3):
        for got, expected in zip(compiled(targets, 1000, 256, torch.tensor(step)),
                                 T.candidate_set(targets, 1000, 256, torch.tensor(step))):
            assert torch.equal(got, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
    torch._dynamo.reset()


def plain_dense_loss(x, w, targets, weights, grad_scale):
    """The full softmax by its definition (autograd through softcap, logsumexp and gather)."""
    z = T.softcap(x @ w.t())
    valid = targets >= 0
    ce = torch.logsumexp(z, -1, keepdim=True) - z.gather(1, targets.clamp_min(0))
    return (ce * weights * valid).sum() * grad_scale, torch.where(valid[:, 0], ce[:, 0], 0).mean()


def random_head(T_rows, V, d, dtype, device="cpu", seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = T.norm(torch.randn(T_rows, d, device=device, generator=gen)).to(dtype)
    w = (torch.randn(V, d, device=device, generator=gen) * 0.05).to(dtype)
    return x, w


def grads_of(fn, x, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, ce0 = fn(x, w)[:2]
    (loss * 1.7).backward()  # the upstream gradient multiplies in
    return loss, ce0, x.grad, w.grad


def test_reference_with_every_column_is_the_full_softmax():
    x, w = random_head(23, 97, 16, torch.float64)
    targets, weights = random_targets(23, 3, 97), torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    everything = torch.randperm(97)
    sampled = grads_of(lambda x, w: T.sampled_softcap_ce_reference(x, w, targets, weights, everything, 0.25), x, w)
    dense = grads_of(lambda x, w: plain_dense_loss(x, w, targets, weights, 0.25), x, w)
    for a, b in zip(sampled, dense):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("N", [1, 3, 4])
def test_sampled_op_matches_the_reference_in_float64(N):
    """The op (lm_head_softcap_ce on the gathered rows; the kernel's torch form here) against the
    definition on the same candidates: values and gradients; W's gradient is zero off the candidates."""
    V, budget = 300, 96
    x, w = random_head(40, V, 16, torch.float64)
    targets = random_targets(40, N, V, distinct=60)
    weights = torch.tensor([1.0, 0.5, 0.25, 0.4][:N], dtype=torch.float64)
    step = torch.tensor(3)
    candidates = T.candidate_set(targets, V, budget, step)[0]
    op = grads_of(lambda x, w: T.sampled_lm_head_softcap_ce(x, w, targets, weights, budget, step, 0.5), x, w)
    ref = grads_of(lambda x, w: T.sampled_softcap_ce_reference(x, w, targets, weights, candidates, 0.5), x, w)
    assert not op[1].requires_grad
    for a, b in zip(op, ref):
        assert rel_err(a, b) < 1e-10
    off = torch.ones(V, dtype=torch.bool)
    off[candidates] = False
    assert (op[3][off] == 0).all() and (op[3][candidates].abs().sum(-1) > 0).all()
    full = grads_of(lambda x, w: plain_dense_loss(x, w, targets, weights, 0.5), x, w)
    assert op[0] < full[0]  # fewer columns in every row's normalizer


INTERPRETER_CHECK = textwrap.dedent("""
    import torch
    import train_gpt as T
    from helpers import rel_err
    T.triton_applies = lambda t: True  # the fused kernel on CPU tensors, in the interpreter
    torch.manual_seed(0)
    V, budget, rows = 600, 208, 24  # 208 = 128 + 64 + a masked 16 (T.vocab_parts)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        x = T.norm(torch.randn(rows, 32)).to(dtype)
        w = (torch.randn(V, 32) * 0.5).to(dtype)
        targets = torch.randint(0, 150, (rows, 3))
        targets[-1, 1:] = -1
        weights = torch.tensor([1.0, 0.5, 0.25])
        step = torch.tensor(11)
        candidates = T.candidate_set(targets, V, budget, step)[0]
        results = []
        for fn in (lambda x, w: T.sampled_lm_head_softcap_ce(x, w, targets, weights, budget, step, 0.5),
                   lambda x, w: T.sampled_softcap_ce_reference(x.float(), w.float(), targets, weights, candidates, 0.5)):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss, ce0 = fn(xg, wg)[:2]
            loss.backward()
            results.append((loss, ce0, xg.grad, wg.grad))
        for name, a, b in zip(("loss", "ce0", "grad x", "grad W"), *results):
            assert rel_err(a.float(), b.float()) < tol, (str(dtype), name, rel_err(a.float(), b.float()))
""")


@pytest.mark.skipif(T.triton is None, reason="Triton not installed")
def test_fused_kernel_on_the_candidates_in_the_triton_interpreter():
    """The whole sampled op with the fused kernel (Triton's CPU interpreter) against the definition:
    loss, ce0 and the gradients to x and W, fp32 and bf16."""
    run_in_triton_interpreter(INTERPRETER_CHECK, timeout=300)


# ---- GPU --------------------------------------------------------------------------------------

RECORD_BUDGET = 10_240  # the record's first-stage budget (#92)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 4])
def test_sampled_lm_head_bf16_and_fp8_match_the_reference_on_gpu(N):
    """4,096 tokens, GPT-2's vocabulary, the record's 10,240 candidates: the fused kernel (bf16 and
    FP8) against the definition in fp32 on the same candidates, values and gradients."""
    V = 50304
    x, w = random_head(4096, V, 768, torch.bfloat16, "cuda")
    targets = random_targets(4096, N, V, "cuda", distinct=8000)
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25][:N], device="cuda")
    step = torch.tensor(17, device="cuda")
    candidates = T.candidate_set(targets, V, RECORD_BUDGET, step)[0]
    ref = grads_of(lambda x, w: T.sampled_softcap_ce_reference(x.float(), w.float(), targets, weights, candidates,
                                                               0.5), x, w)
    for fp8, value_tol, grad_tol in ((False, 1e-3, 1e-2), (True, 1e-2, 8e-2)):  # e5m2 gradient: 2 mantissa bits
        out = grads_of(lambda x, w: T.sampled_lm_head_softcap_ce(x, w, targets, weights, RECORD_BUDGET, step, 0.5,
                                                                 fp8=fp8), x, w)
        assert rel_err(out[0], ref[0]) < value_tol and rel_err(out[1], ref[1]) < value_tol, fp8
        assert rel_err(out[2], ref[2]) < grad_tol and rel_err(out[3], ref[3]) < grad_tol, fp8


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_sampled_lm_head_under_inductor_without_host_syncs(fp8):
    V = 50304
    x, w = random_head(2048, V, 768, torch.bfloat16, "cuda")
    targets = random_targets(2048, 3, V, "cuda", distinct=6000)
    weights = torch.tensor([1.0, 0.5, 0.25], device="cuda")

    def step_fn(step):
        return lambda x, w: T.sampled_lm_head_softcap_ce(x, w, targets, weights, RECORD_BUDGET, step, 0.5, fp8=fp8)

    compiled = torch.compile(lambda x, w, step: step_fn(step)(x, w), dynamic=False, fullgraph=True)
    for s in range(2):  # the second step reuses the graph
        step = torch.tensor(s, device="cuda")
        out = grads_of(lambda x, w: compiled(x, w, step), x, w)
        eager = grads_of(step_fn(step), x, w)
        for a, b in zip(out, eager):
            assert torch.isfinite(a).all() and rel_err(a, b) < 1e-2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads_of(lambda x, w: compiled(x, w, torch.full((), 2, device="cuda")), x, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
@pytest.mark.gpu
def test_candidate_set_on_gpu_equals_the_cpu_one():
    targets = random_targets(16384, 4, 50304, distinct=12000)
    for step in (0, 1, 500):
        on_gpu = T.candidate_set(targets.cuda(), 50304, RECORD_BUDGET, torch.tensor(step, device="cuda"))
        on_cpu = T.candidate_set(targets, 50304, RECORD_BUDGET, torch.tensor(step))
        for a, b in zip(on_gpu, on_cpu):
            assert torch.equal(a.cpu(), b)
