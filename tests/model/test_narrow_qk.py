"""Narrow attention (docs/TECHNIQUES.md T3.18, issue #51 item 3): NARROW_QK_LAYERS gives those layers
Q/K heads HEAD_DIM/2 wide in a bank of their own, rotated whole by the wide heads' rotary table, at
the softmax scale × NARROW_QK_SCALE_MUL. On the CPU: the banks and plans, every slot's gradient,
the rotation against float64, the torch attention paths with q/k narrower than v, the set-up's
refusals, and a tiny run; on a GPU (gpu-marked) the narrow model with the plan's backend (FA4 and
its backward tile where installed, else flex) and the QK-norm + rotary kernels against the torch path.
The kernels in Triton's interpreter: tests/kernels/test_qk_rope_kernels.py."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from helpers import cpu_execution, rel_err

import train_gpt as T

SMALL = {"device": "cpu", "compile": False, "model_dim": 128, "num_heads": 2, "head_dim": 64, "mlp_hidden": 256,
         "vocab_size": 1024, "copy_pointer": False, "ngram_rows": 1001, "window_block_size": 16, "val_tokens": 2048,
         "val_seq_len": 1024,
         "stages": T.replace_stage_columns(T.STAGES, batch_tokens=(2048, 4096, 4096, 4096, 4096),
                                           max_seq_len=(128, 256, 256, 256, 256),
                                           ce_candidates=(0,) * 5)}  # the vocabulary: below the budgets
NARROW = (0, 1, 2, 5, 8)  # the default, as record #92's: every attention layer but the long-window ones (3, 10)
SHAPE = T.ForwardShape(short_window=32, long_window=96, max_seq_len=256)


def small_model(seed=0, **switches):
    torch.manual_seed(seed)
    hp = T.Hyperparameters.of(**{**SMALL, **switches})
    return T.GPT(hp.model, T.longest_forward(hp))


def small_batch(tokens=256, docs=(0, 40, 41, 200), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (tokens + 1,), generator=g)
    cu = T.cu_seqlens_for(list(np.diff(list(docs) + [tokens + 1])), tokens, 16)
    return ids[:-1].int(), ids[1:].int(), torch.from_numpy(cu)


def test_narrow_layers_have_their_own_bank_and_every_slot_gets_a_gradient():
    model = small_model(narrow_qk_layers=NARROW)
    H, hd, d = SMALL["num_heads"], SMALL["head_dim"], SMALL["model_dim"]
    plans = {plan.index: plan for plan in model.layers}
    assert [i for i, plan in plans.items() if plan.narrow_qk] == list(NARROW)
    assert [plans[i].qk_slot for i in NARROW] == list(range(5)) and [plans[i].qk_slot for i in (3, 10)] == [0, 1]
    assert model.qk_bank.shape == (2 * H, 2 * hd, d) and model.qk_narrow_bank.shape == (len(NARROW) * H, hd, d)
    assert model.vo_bank.shape == (2 * len(model.config.attention_layers), d, d)  # V/O stay full width
    specs = T.param_specs(model)
    assert specs["qk_narrow_bank"].matrix_shape == (hd, d) and specs["qk_narrow_bank"].optimizer == "normuon"
    assert list(specs).index("qk_narrow_bank") < list(specs).index("mlp_bank")  # the big bank stays in the middle
    assert [slots for _, slots in model.qk_banks()] == [[3, 6], [0, 1, 2, 4, 5]]
    assert not hasattr(small_model(narrow_qk_layers=()), "qk_narrow_bank")  # full width: no narrow bank
    assert T.Hyperparameters.of().model.narrow_qk_layers == NARROW  # the default
    assert T.Hyperparameters.from_env({"NARROW_QK_LAYERS": ""}).model.narrow_qk_layers == ()
    with torch.no_grad():
        model.mlp_bank.normal_(0, 0.05)
        model.ve_gate_bank.normal_()
    inputs, _, cu = small_batch()
    model.hidden_states(inputs, cu, SHAPE, cpu_execution()).float().square().sum().backward()
    assert (model.qk_narrow_bank.grad.view(len(NARROW), -1).abs().amax(1) > 0).all()
    assert (model.qk_bank.grad.view(2, -1).abs().amax(1) > 0).all()
    assert (model.vo_bank.grad.view(model.vo_bank.size(0), -1).abs().amax(1) > 0).all()


def test_fp8_qkv_projection_takes_each_slot_at_its_width():
    """The e4m3 Q/K/V projection (T6.3, forced on: CPU) with one quantization per Q/K bank: the
    training loss within e4m3's rounding of the bf16 one."""
    model = small_model(narrow_qk_layers=NARROW)
    inputs, targets, cu = small_batch()
    losses = [model.training_loss(inputs, targets, cu, SHAPE, dataclasses.replace(cpu_execution(), qkv_e4m3=e4m3),
                                  torch.tensor([1.0]))[0] for e4m3 in (False, True)]
    assert rel_err(losses[1], losses[0]) < 1e-2


def rotate_float64(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Every pair (x[2i], x[2i + 1]) of x (T, H, D) turned by −positions·freqs[i] as a complex number
    (apply_rope's sign: (a, b) -> (a·cos + b·sin, b·cos − a·sin))."""
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    turned = pairs * torch.polar(torch.ones(()).double(), -(positions[:, None, None] * freqs))
    return torch.view_as_real(turned).flatten(-2)


def test_narrow_heads_turn_whole_with_the_wide_table_preserving_norms():
    """After YaRN updates, a narrow layer's q and k: QK-norm, all 32 dims turned by the wide heads' 16
    (here head_dim/4) frequencies, which equals float64, with norms kept; q times the narrow scale."""
    model = small_model(narrow_qk_layers=NARROW)
    model.set_long_windows([1, 3, 7])
    freqs, scale = T.yarn(model.rope_base, [1, 3, 7])
    assert model.narrow_attn_scale.item() == pytest.approx(scale * math.sqrt(2))
    assert model.attn_scale.item() == pytest.approx(scale)
    tokens, H, qk_hd, hd = 96, 2, 32, 64
    _, _, cu = small_batch(tokens, docs=(0, 40))
    _, (cos, sin), _, _ = model.attention_layout(tokens, cu, SHAPE, cpu_execution())
    assert cos.size(-1) == qk_hd // 2
    qkv = torch.randn(tokens, H * (2 * qk_hd + hd), dtype=torch.float64)
    tables = cos.double(), sin.double()
    q, k, v = T.qk_norm_rope_reference(qkv, None, *tables, model.narrow_attn_scale.double(), H, qk_hd, False, False)
    assert q.shape == k.shape == (tokens, H, qk_hd) and v.shape == (tokens, H, hd)
    positions = torch.arange(tokens, dtype=torch.float64)
    q_in, k_in = (T.norm(t.view(tokens, H, qk_hd)) for t in qkv.split([H * qk_hd, H * qk_hd, H * hd], 1)[:2])
    # the tables are bf16: the float64 angles they round agree to bf16's precision
    assert rel_err(k, rotate_float64(k_in, positions, freqs)) < 1e-2
    assert rel_err(q / model.narrow_attn_scale.item(), rotate_float64(q_in, positions, freqs)) < 1e-2
    exact = T.apply_rope(k_in, *(f(positions[:, None, None] * freqs) for f in (torch.cos, torch.sin)))
    assert rel_err(exact, rotate_float64(k_in, positions, freqs)) < 1e-12
    assert torch.allclose(exact.norm(dim=-1), k_in.norm(dim=-1), rtol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_torch_attention_takes_q_and_k_narrower_than_v(backend):
    """The CPU's backends on q, k 32 wide and v 64 wide against a loop over documents, windowed."""
    torch.manual_seed(0)
    S, H, window = 64, 2, 9
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    doc_ids = torch.searchsorted(cu, torch.arange(S, dtype=torch.int32), right=True)
    q, k = torch.randn(S, H, 32) * 0.2, torch.randn(S, H, 32)
    v = torch.randn(S, H, 64)
    out = T.attend(q, k, v, T.AttnArgs(cu, doc_ids, 44, backend, {}), window)
    assert out.shape == (S, H, 64)
    for t in range(S):
        start = max(int(cu[doc_ids[t] - 1]), t - window)
        weights = torch.einsum("hd,shd->hs", q[t], k[start: t + 1]).softmax(-1)
        assert torch.allclose(out[t], torch.einsum("hs,shd->hd", weights, v[start: t + 1]), atol=1e-5), t


def test_narrow_layouts_the_set_up_refuses():
    """Not the key offset's layers (3, 10: no stationary half to shift) nor DC-MHA's (10: one width for q, k, v),
    naming only those; nor a layer without attention; the list in increasing order."""
    full_width = r"whose key offset \(T3.11\) or DC-MHA \(T3.17\) needs full-width Q/K heads"
    for env, message in (({"NARROW_QK_LAYERS": "3"}, rf"layer\(s\) 3, {full_width}"),
                         ({"NARROW_QK_LAYERS": "1,3,8,10"}, rf"layer\(s\) 3,10, {full_width}"),
                         ({"NARROW_QK_LAYERS": "6"}, r"names layer\(s\) 6 without attention"),
                         ({"NARROW_QK_LAYERS": "2,1"}, "give increasing layer indices")):
        with pytest.raises(T.SetupError, match=message):
            T.check_hyperparameters(T.Hyperparameters.from_env(env))
    T.check_hyperparameters(T.Hyperparameters.from_env({"NARROW_QK_LAYERS": ",".join(map(str, NARROW))}))


TINY_RUN = {**SMALL, "vocab_size": 50304, "warmup": False, "num_scheduled_iterations": 3, "num_extension_iterations": 1,
            "stop_after": 4, "val_loss_every": 0, "rank_slice": True, "muon_momentum_warmup_steps": 2,
            "muon_momentum_cooldown_steps": 1}


def test_tiny_narrow_model_trains(corpus):
    hp = T.Hyperparameters.of(**TINY_RUN, narrow_qk_layers=NARROW, train_files=str(corpus / "tiny_train_*.bin"),
                              val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus))
    T.check_hyperparameters(hp)
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    trainer.run()
    assert torch.isfinite(trainer.losses[:4]).all() and trainer.losses[3] < trainer.losses[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_narrow_model_on_gpu_matches_the_torch_path(monkeypatch):
    """The narrow model at real head shapes (6 heads, Q/K 64 wide, V 128) on 4096 tokens, eager: the plan's
    backend (FA4 where installed, with FA4_NARROW_BACKWARD_TILE for the (64, 128) backward; else flex) and the
    QK-norm + rotary kernels, against SDPA and the torch path (check_narrow_model_on_gpu)."""
    check_narrow_model_on_gpu(monkeypatch, narrow_qk_layers=NARROW)


def check_narrow_model_on_gpu(monkeypatch, **layout):
    """The model with `layout` at real head shapes (6 heads of 128) on 4096 tokens, eager, with the plan's
    backend and kernels against SDPA and the torch path. Loss to 1e-2; each gradient (the n-gram rows' too,
    T3.19: zero as the table starts) to 1e-1 of its norm (bf16 through 11 layers; a wrong width or a dropped
    term is off by O(1)) or within 4 times the torch path's own spread: its difference from the same path
    with the attention in fp32. A gradient that is a near-cancelling sum moves by O(1) with any rounding (on
    an H100 the smear lambda's was 0.084 by SDPA, 0.283 by FA4)."""
    tokens = 4096
    hp = T.Hyperparameters.of(**{**SMALL, "device": "cuda", "model_dim": 768, "num_heads": 6, "head_dim": 128,
                                 "mlp_hidden": 3072, "vocab_size": 50304, "fp8_lm_head": False,
                                 "qk_rope_kernel": True, **layout,
                                 "stages": T.replace_stage_columns(T.STAGES, batch_tokens=(8 * tokens,) * 5)})
    torch.manual_seed(0)
    model = T.GPT(hp.model, T.longest_forward(hp)).cuda()
    with torch.no_grad():
        for block in (model.mudd, model.gates):
            block.w2.normal_(0, 0.05)
        model.mlp_bank[:, 1].normal_(0, 0.02)
    table = model.ngram.shard(hp.optim)  # the n-gram rows (T3.19)
    plan = T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), tokens, training=True)
    torch_path = dataclasses.replace(plan, attention="sdpa", qk_rope_kernel=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (tokens + 1,), generator=g)
    cu = torch.tensor(T.cu_seqlens_for([700, 1, 1500, tokens + 1 - 2201], tokens, 16), device="cuda")
    inputs, targets = ids[:-1].int().cuda(), ids[1:].int().cuda()
    table.load(inputs)
    shape = T.ForwardShape(384, 896, 2048)
    bf16_attend = T.attend

    def fp32_attend(q, k, v, args, window):
        return bf16_attend(q.float(), k.float(), v.float(), args, window).to(q.dtype)

    results = []
    for execution, attend in ((plan, bf16_attend), (torch_path, bf16_attend), (torch_path, fp32_attend)):
        model.zero_grad(set_to_none=True)
        table.cache.grad = None
        monkeypatch.setattr(T, "attend", attend)
        loss, _ = model.training_loss(inputs, targets, cu, shape, execution, torch.tensor([1.0], device="cuda"))
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        results.append((loss.item(), {**grads, "n-gram rows": table.cache.grad.float().clone()}))
    (got, grads), (want, want_grads), (_, fp32_grads) = results
    assert math.isfinite(got) and abs(got - want) < 1e-2 * want, (plan.attention, got, want)
    for name, grad in want_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        spread = (fp32_grads[name] - grad).norm()
        assert (grads[name] - grad).norm() <= max(1e-1 * grad.norm(), 4 * spread), (plan.attention, name)


def test_fa4s_backward_tile_is_replaced_for_the_narrow_pair_only():
    """fa4_backward_tile_for_narrow_qk: for Q/K 64 with V 128 the library's tile of 128-wide heads with
    FA4_NARROW_BACKWARD_TILE's blocks and stages (the fastest that launched on an H200); every other
    pair, and block-sparse attention, keeps the library's own."""
    @dataclasses.dataclass(frozen=True)
    class Config:
        base: int
        m_block_size: int = 128
        n_block_size: int = 128
        num_stages_Q: int = 2
        num_stages_dO: int = 2

    def library_tile(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
        return Config(base=head_dim)

    tile = T.fa4_backward_tile_for_narrow_qk(library_tile)
    assert tile(64, 128, True, True) == Config(base=128, m_block_size=64, n_block_size=128, num_stages_Q=2,
                                               num_stages_dO=2)
    for pair in ((64, 64), (128, 128)):
        assert tile(*pair, True, True) == library_tile(*pair, True, True)
    assert tile(64, 128, True, False, sparse_block_size_q=128) == Config(base=64)
