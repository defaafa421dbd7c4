"""The attention backends' choice (resolve_attention_backend, on the CPU with the FA4 module and the
GPU's compute capability patched in), the FlashAttention-4 custom ops: their wiring on the CPU,
with a torch stand-in for FA4's functions, and on a GPU (gpu-marked) flex against SDPA and FA4
against SDPA and, compiled, against flex (skipped where FA4 is not installed)."""

import dataclasses
import subprocess
import sys
import types

import pytest
import torch

import train_gpt as T
from helpers import ROOT, rel_err

FA4_HERE = (T.fa4_interface is not None and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] in T.FA4_GPU_MAJORS)
fa4_gpu = pytest.mark.skipif(not FA4_HERE, reason="needs FlashAttention-4 (requirements-gpu.txt) on sm90/sm100")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

INSTALLED = types.SimpleNamespace()  # stands in for an importable FA4 where only its presence matters


# --- resolve_attention_backend ---------------------------------------------------------------------

@pytest.fixture
def machine(monkeypatch):
    """machine(fa4=, capability=): what the backend's resolution sees as installed, and the GPU."""
    def set_up(fa4=False, capability=(9, 0)):
        monkeypatch.setattr(T, "fa4_interface", INSTALLED if fa4 else None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return set_up


@pytest.mark.parametrize("fa4, capability, expected", [
    (True, (9, 0), "fa4"),
    (True, (10, 0), "fa4"),
    (True, (8, 0), "flex"),  # FA4's kernels target sm90 / sm100 only
    (True, (12, 0), "flex"),  # consumer Blackwell (sm120) is not among them
    (False, (9, 0), "flex"),
])
def test_auto_on_cuda_is_fa4_where_it_runs_else_flex(machine, fa4, capability, expected):
    machine(fa4=fa4, capability=capability)
    assert T.resolve_attention_backend("auto", "cuda") == expected


@pytest.mark.parametrize("tokens", [256, 49152])
def test_fa4_takes_every_forward_and_the_doubled_layout_follows(machine, tokens):
    """A forward of any size takes FA4 where it runs (no token threshold); the paired-head layers' doubled
    layout follows the plain one."""
    machine(fa4=True)
    hp = T.Hyperparameters.of(device="cpu", model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256)
    plan = T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), tokens, training=True)
    model = T.GPT(hp.model, tokens)
    cu_seqlens = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
    attn, _, attn_paired, _ = model.attention_layout(tokens, cu_seqlens, T.ForwardShape(128, 256, tokens // 2), plan)
    assert plan.attention == attn.backend == attn_paired.backend == "fa4"


def test_fa4_requested_where_it_runs(machine):
    machine(fa4=True, capability=(9, 0))
    assert T.resolve_attention_backend("fa4", "cuda") == "fa4"


@pytest.mark.parametrize("fa4, capability, device, hint", [
    (False, (9, 0), "cuda", "pip install -r requirements-gpu.txt"),
    (True, (8, 0), "cuda", "Hopper or Blackwell"),
    (True, (9, 0), "cpu", "Hopper or Blackwell"),
])
def test_fa4_requested_where_it_cannot_run_is_a_setup_error(machine, fa4, capability, device, hint):
    machine(fa4=fa4, capability=capability)
    with pytest.raises(T.SetupError, match=hint):
        T.resolve_attention_backend("fa4", device)


@pytest.mark.parametrize("requested", ["flex", "sdpa"])
def test_a_requested_torch_backend_is_taken_as_asked(machine, requested):
    machine(fa4=True)
    assert T.resolve_attention_backend(requested, "cuda") == requested


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU build of torch")
def test_a_cpu_build_of_torch_starts_without_dynamo():
    """`import train_gpt` on a CPU build of torch leaves dynamo unloaded: the processes that never compile or
    call a custom op (set-up errors, gloo optimizer ranks, the tools) start faster."""
    code = "import sys, train_gpt; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("requested", ["fa5", "fa3", "varlen"])  # fa3 and varlen: removed (#77)
def test_an_unknown_backend_names_the_choices(requested):
    with pytest.raises(T.SetupError, match=f"ATTENTION_BACKEND={requested}: use one of auto, fa4, flex, sdpa"):
        T.resolve_attention_backend(requested, "cuda")


# --- the FA4 custom ops, wired to a torch stand-in (CPU) ------------------------------------------

def doc_causal_window_mask(cu_seqlens: torch.Tensor, S: int, window: int | None) -> torch.Tensor:
    pos = torch.arange(S, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens, pos, right=True)
    mask = (pos[:, None] >= pos[None, :]) & (doc[:, None] == doc[None, :])
    return mask if window is None else mask & (pos[:, None] - pos[None, :] <= window)


def reference_attention(q, k, v, cu_seqlens, window):
    """(out (S, H, D), lse (H, S) fp32) in fp32 with an explicit mask; window None: unbounded."""
    scores = torch.einsum("shd,thd->hst", q.float(), k.float())
    scores = scores.masked_fill(~doc_causal_window_mask(cu_seqlens, q.size(0), window), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("hst,thd->shd", (scores - lse[..., None]).exp(), v.float())
    return out.to(q.dtype), lse


class StandInFA4:
    """FA4's two functions as the custom ops call them, computed by reference_attention; records the
    window sizes it was given (FA4 reads a negative left size as a local window, not unbounded)."""

    def __init__(self):
        self.left_windows = []

    def _flash_attn_fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_size_left, window_size_right, return_lse):
        assert softmax_scale == 1.0 and causal and return_lse and window_size_right == 0
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
        self.left_windows.append(window_size_left)
        return (*reference_attention(q, k, v, cu_seqlens_q, window_size_left), None, None, None)  # out, lse, p, row_max, o_lo

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, *, softmax_scale, causal, window_size_left,
                        window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        assert window_size_right == 0 and out.shape == q.shape and lse.shape == (q.size(1), q.size(0))
        self.left_windows.append(window_size_left)
        # the closed-form backward from the saved lse (custom ops run below autograd: no recording)
        scores = torch.einsum("shd,thd->hst", q.float(), k.float())
        scores = scores.masked_fill(~doc_causal_window_mask(cu_seqlens_q, q.size(0), window_size_left),
                                    float("-inf"))
        p = (scores - lse[..., None]).exp()
        dp = torch.einsum("shd,thd->hst", dout.float(), v.float())
        ds = p * (dp - (dout.float() * out.float()).sum(-1).T[..., None])
        dq = torch.einsum("hst,thd->shd", ds, k.float())
        dk = torch.einsum("hst,shd->thd", ds, q.float())
        dv = torch.einsum("hst,shd->thd", p, dout.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def multi_document_problem(S=96, H=2, D=16, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(S, H, D, generator=g, device=device, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, 10, 11, 60, S, S], device=device, dtype=torch.int32)  # a 1-token document, padding
    return q, k, v, cu


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("window", [T.NO_WINDOW, 0, 7])
def test_fa4_ops_pass_the_problem_and_the_gradients_through(monkeypatch, window, compiled):
    """The forward op, its fake and its autograd (backward op, saved tensors) against autograd through
    the reference, eager and under torch.compile(fullgraph=True), with FA4 replaced by the reference:
    NO_WINDOW must reach FA4 as None."""
    stand_in = StandInFA4()
    monkeypatch.setattr(T, "fa4_interface", stand_in)
    q, k, v, cu = multi_document_problem()
    # seeded: the stand-in's closed-form backward and autograd round apart by up to ~1e-5 in fp32, at the
    # tolerance's edge for a rare grad_out
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    args = T.AttnArgs(cu, None, 49, "fa4", {})

    def loss(q, k, v):
        return (T.attend(q, k, v, args, window) * grad_out).sum()

    run = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=False) if compiled else loss
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = run(*leaves)
    got.backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, cu, None if window == T.NO_WINDOW else window)
    (ref_out * grad_out).sum().backward()
    torch.testing.assert_close(got, (ref_out * grad_out).sum(), rtol=1e-5, atol=1e-5)
    for leaf, ref_leaf in zip(leaves, ref_leaves):  # dq is 0 at window 0 (one key per query)
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-5)
    assert stand_in.left_windows == [None if window == T.NO_WINDOW else window] * 2  # forward, backward


def test_fa4_fake_gives_the_shapes_of_the_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = (torch.empty(40, 3, 128, dtype=torch.bfloat16) for _ in range(3))
        out, lse = T.fa4_varlen_attention(q, k, v, torch.zeros(5, dtype=torch.int32), 20, 128)
        dq, dk, dv = T.fa4_varlen_attention_backward(out, q, k, v, out, lse, torch.zeros(5, dtype=torch.int32),
                                                     20, 128)
    assert out.shape == (40, 3, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 40) and lse.dtype == torch.float32
    assert dq.shape == dk.shape == dv.shape == (40, 3, 128)


# --- on the GPU -------------------------------------------------------------------------------------

@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("window", [T.NO_WINDOW, 96])
def test_flex_attention_matches_sdpa(window):
    torch.manual_seed(0)
    S, H, D = 1024, 3, 128
    cu = torch.tensor([0, 100, 130, 600, 1024, 1024, 1024], device="cuda", dtype=torch.int32)
    doc_ids = torch.searchsorted(cu, torch.arange(S, device="cuda", dtype=torch.int32), right=True)
    q, k, v = (torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16) * 0.3 for _ in range(3))
    out = T.attend(q, k, v, T.AttnArgs(cu, doc_ids, 600, "flex", {}), window)
    ref = T.attend(q, k, v, T.AttnArgs(cu, doc_ids, 600, "sdpa", {}), window)
    assert rel_err(out, ref) < 1e-2


def gpu_problem(doubled: bool, seed=0):
    """The model's layouts at bf16: 6 heads over S tokens, or (paired-head layers) 3 heads over the
    doubled sequence; documents of 300, 1, 1000 and 700 tokens, then the loader's empty padding."""
    S, H = 2048, 6
    cu = torch.tensor([0, 300, 301, 1301, 2001, S, S, S], device="cuda", dtype=torch.int32)
    doc_ids = torch.searchsorted(cu, torch.arange(S, device="cuda", dtype=torch.int32), right=True)
    args = T.AttnArgs(cu, doc_ids, 1000, "sdpa", {})
    if doubled:
        S, H, args = 2 * S, H // 2, args.doubled()
    g = torch.Generator(device="cuda").manual_seed(seed)
    # q carries the softmax scale, as in the model (QK-norm, then attn_scale ~0.1-0.2)
    q = torch.randn(S, H, 128, device="cuda", generator=g) * 0.15
    k, v = (torch.randn(S, H, 128, device="cuda", generator=g) for _ in range(2))
    return [t.bfloat16() for t in (q, k, v)], args


def attention_and_grads(q, k, v, args, window, grad_out, backend):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = T.attend(*leaves, dataclasses.replace(args, backend=backend), window)
    out.backward(grad_out)
    return [out.detach(), *(t.grad for t in leaves)]


@fa4_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("doubled", [False, True])
@pytest.mark.parametrize("window", [T.NO_WINDOW, 128, 384, 896])
def test_fa4_matches_sdpa(window, doubled):
    """Output and dq, dk, dv of FA4 against SDPA with the dense mask at bf16, with windows shorter and
    longer than the documents, the 1-token document and empty padding."""
    (q, k, v), args = gpu_problem(doubled)
    grad_out = torch.randn_like(q)
    fa4 = attention_and_grads(q, k, v, args, window, grad_out, "fa4")
    ref = attention_and_grads(q, k, v, args, window, grad_out, "sdpa")
    for name, got, want in zip(("out", "dq", "dk", "dv"), fa4, ref):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 1e-2, name
    # on the rows whose keys the window cuts it changes the answer, so a window FA4 ignored fails above
    if window != T.NO_WINDOW:
        position = torch.arange(q.size(0), device="cuda")
        cut = position - args.cu_seqlens[args.doc_ids - 1] > window
        unbounded = attention_and_grads(q, k, v, args, T.NO_WINDOW, grad_out, "sdpa")
        assert cut.any() and rel_err(unbounded[0][cut], ref[0][cut]) > 5e-2


@fa4_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("window", [T.NO_WINDOW, 384])
def test_fa4_under_torch_compile_matches_eager(window):
    """The custom ops in a fullgraph compiled function (with the ops around attention the model has:
    a scale before, a reshape after) against the same function compiled with flex attention (auto's
    backend where FA4 does not run). Not against eager: inductor rounds the scaled q differently (~4e-3
    relative on an H100, the same for both backends), which alone moves the output by ~6e-3."""
    (q, k, v), layout = gpu_problem(doubled=True)
    grad_out = torch.randn(q.size(0) // 2, 6 * 128, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("fa4", "flex"):
        args = T.AttnArgs(layout.cu_seqlens, layout.doc_ids, layout.max_seqlen, backend, {})

        def layer(q, k, v, scale):
            return T.attend((q * scale).to(v.dtype), k, v, args, window).reshape(-1, 6 * 128)

        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = torch.compile(layer, fullgraph=True, dynamic=False)(*leaves, torch.tensor(1.3, device="cuda"))
        out.backward(grad_out)
        results[backend] = [out.detach(), *(t.grad for t in leaves)]
    for name, got, want in zip(("out", "dq", "dk", "dv"), results["fa4"], results["flex"]):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 5e-3, name
