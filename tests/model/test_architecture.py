"""The newest pieces of the model (records #81-#88) on the CPU: XSA, DC-MHA's torch path (its Triton
kernels: tests/kernels/test_dc_mha_kernels.py), MUDD connections and gates (their layouts, and that
at init they equal the static weights they replaced), the multi-target loss, the prefix-token table
and loss, the optimizer table, and that the whole model traces with torch.compile(fullgraph=True). The
n-gram table's rows (T3.19) enter a forward through its row cache: live_ngram gives them values, and
`model.ngram.load(ids)` caches a batch's rows before its forward."""

import json
import math

import numpy as np
import pytest
import torch

import train_gpt as T
from helpers import FULL_LAYOUT, cpu_execution, dc_mha_dense, rel_err

# A tiny model with a small vocabulary (the CPU is slow with 50304-row tables), so without the copy pointer (its
# <copy> column is GPT-2's first padding row; tests/model/test_copy_pointer.py).
SMALL = dict(device="cpu", compile=False, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256, vocab_size=1024,
             copy_pointer=False, ngram_rows=1001, window_block_size=16, val_tokens=2048, val_seq_len=1024,
             stages=T.replace_stage_columns(T.STAGES, batch_tokens=(2048, 4096, 4096, 4096, 4096),
                                            max_seq_len=(128, 256, 256, 256, 256),
                                            ce_candidates=(0,) * 5))  # the vocabulary: below the budgets
DOCS = (0, 40, 41, 200)  # document starts in a 256-token batch
SHAPE = T.ForwardShape(short_window=32, long_window=96, max_seq_len=256)


def small_batch(tokens=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (tokens + 1,), generator=g)
    cu = T.cu_seqlens_for(list(np.diff(list(DOCS) + [tokens + 1])), tokens, 16)
    return ids[:-1].int(), ids[1:].int(), torch.from_numpy(cu)


def make_model(seed=0, **switches):
    torch.manual_seed(seed)
    hp = T.Hyperparameters.of(**dict(SMALL, **switches))
    return T.GPT(hp.model, T.longest_forward(hp))


PLAN = cpu_execution()  # torch paths: what a 256-token forward takes on the CPU


def live_ngram(model, std=0.5, seed=2):
    """The model's n-gram table (T3.19) with its rows allocated (world size 1: every row, on the model's device)
    and given seeded values, so that the bigram injection carries signal once `load` fills the row cache."""
    table = model.ngram.shard(T.Hyperparameters.of(**SMALL).optim)
    with torch.no_grad():
        table.weight.copy_(torch.randn(table.weight.shape, generator=torch.Generator().manual_seed(seed)) * std)
    return table


# --- XSA ------------------------------------------------------------------------------------------

def test_xsa_removes_the_component_along_the_own_value():
    torch.manual_seed(0)
    y, v = torch.randn(9, 3, 16), torch.randn(9, 3, 16)
    alpha = torch.randn(9, 3)
    assert torch.equal(T.exclusive_self_attention(y, v, torch.zeros(9, 3)), y)  # α = 0: identity
    full = T.exclusive_self_attention(y, v, torch.full((3,), 30.0))  # tanh(30) = 1: y minus its projection on v
    assert (full * v).sum(-1).abs().max() < 1e-5 * (y.norm(dim=-1) * v.norm(dim=-1)).max()
    expected = torch.empty(9, 3, 16, dtype=torch.float64)
    for t in range(9):
        for h in range(3):
            yd, vd = y[t, h].double(), v[t, h].double()
            expected[t, h] = yd - math.tanh(alpha[t, h]) * (yd @ vd) / (vd @ vd) * vd
    assert rel_err(T.exclusive_self_attention(y, v, alpha), expected) < 1e-6
    out_bf16 = T.exclusive_self_attention(y.bfloat16(), v.bfloat16(), alpha)
    assert out_bf16.dtype == torch.bfloat16 and rel_err(out_bf16, expected) < 1e-2


# --- DC-MHA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, window", [(300, 112), (50, 16), (112, 112)])
def test_dc_mha_matches_the_dense_definition(tokens, window):
    torch.manual_seed(tokens)
    H, D = 3, 16
    q, k, v = (torch.randn(tokens, H, D, requires_grad=True) for _ in range(3))
    w1, w2 = torch.randn(tokens, H, requires_grad=True), torch.randn(tokens, H, requires_grad=True)
    doc_ids = torch.bucketize(torch.arange(tokens), torch.tensor([7, 8, tokens // 2]), right=True)
    out = T.dc_mha(q, k, v, doc_ids, w1, w2, window, use_triton=False)
    ref = dc_mha_dense(q, k, v, doc_ids, w1, w2, window)
    assert out.shape == (tokens, H, D) and rel_err(out, ref) < 1e-5
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, w1, w2), grad)
    want = torch.autograd.grad(ref, (q, k, v, w1, w2), grad.double())
    for name, a, b in zip("q k v w1 w2".split(), got, want):
        assert rel_err(a, b) < 1e-5, name
    assert torch.equal(T.dc_mha(q, k, v, doc_ids, w1, torch.zeros_like(w2), window, use_triton=False),
                       torch.zeros(tokens, H, D))


# --- MUDD ------------------------------------------------------------------------------------------

def test_mudd_layouts_match_the_reference():
    """The MUDD gates' and connections' output layouts and initial biases, as the reference lays them out."""
    cfg = T.Hyperparameters.of(device="cpu", **FULL_LAYOUT).model  # every feature on, every layer
    pre, post = T.mudd_gate_outputs(cfg)
    assert all(layer < T.POST_GATE_LAYER for (_, layer), *_ in pre) and all(layer >= T.POST_GATE_LAYER for (_, layer), *_ in post)
    assert sum(width for _, width, _ in pre) == 26 and sum(width for _, width, _ in post) == 41
    offsets = np.cumsum([0] + [width for _, width, _ in post])
    at = {key: int(offsets[i]) for i, (key, _, _) in enumerate(post)}
    assert at[("xsa", 4)] == 0 and at[("xsa", 7)] == 6 and at[("out_gate", 10)] == 12 and at[("x0", 4)] == 18
    assert at[("bigram", 9)] == 27 and at[("skip", 6)] == 28 and at[("dc_w1", 10)] == 29 and at[("dc_w2", 10)] == 35
    bias = [value / T.MUDD_GATE_SCALE_INIT for part in (pre, post) for _, width, value in part for _ in range(width)]
    assert bias[12:18] == [2.5] * 6 and bias[19] == 0.5 and bias[26 + 28] == 5 and bias[26 + 29] == 10
    layer, final = T.mudd_connection_outputs()  # pre-scale biases
    b = [value / T.MUDD_SCALE for part in (layer, final) for _, _, value in part]
    assert [name for name, _, _ in layer] == list(T.MUDD_LAYER_OUTPUTS)
    assert [name for name, _, _ in final] == list(T.MUDD_FINAL_OUTPUTS)
    assert len(b) == 14 + 5 and b[6] == b[7] == 20 and b[9] == b[13] == 10 and b[10] == 0
    assert abs(b[8] - math.sqrt(1.1) / 0.1) < 1e-5 and abs(b[12] - b[8]) < 1e-9 and abs(b[11] - 0.5) < 1e-6
    assert b[14:] == [0, -5, 0, 0, 0]


def hidden(model, seed=0):
    inputs, _, cu = small_batch(seed=seed)
    with torch.no_grad():
        return model.hidden_states(inputs, cu, SHAPE, PLAN).float()


def make_live(*models):
    """Give the parameters every model shares, and the n-gram table's rows, the same non-zero values, so that
    all paths carry signal (the rows once a `load` caches a batch's)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        values = torch.randn(models[0].mlp_bank.shape, generator=g) * 0.05
        for m in models:
            m.mlp_bank.copy_(values)
            live_ngram(m)
        rows = torch.randn(models[0].ve_gate_bank.shape, generator=g)  # every gated value-embedding layer
        for m in models:
            m.ve_gate_bank.copy_(rows)
            m.mlp_bank[:, 0] *= 4  # larger activations


def test_value_embeddings_are_token_major_rows():
    """The value-embedding table is (V, layers·d): token t's row holds every layer's embedding, and
    the gradient lands in the rows of the tokens used, in every layer's block, nowhere else."""
    model = make_model()
    make_live(model)
    d, layers = SMALL["model_dim"], len(model.config.value_embed_layers)
    assert model.value_embeds.shape == (SMALL["vocab_size"], layers * d)
    inputs, _, cu = small_batch()
    model.ngram.load(inputs)
    model.hidden_states(inputs, cu, SHAPE, PLAN).float().square().sum().backward()
    grad = model.value_embeds.grad.float()
    used = torch.zeros(SMALL["vocab_size"], dtype=torch.bool)
    used[inputs.long()] = True
    assert grad[~used].abs().max() == 0
    for block in grad[used].split(d, -1):
        assert (block.abs().sum(-1) > 0).float().mean() > 0.9


def test_mudd_blocks_start_at_their_initial_values_and_then_depend_on_the_token():
    """At init (W2 = 0) both MUDD blocks output their initial values for every token: the gates their
    static gate values, the connections the residual lambdas, value-embedding gate and backout they
    replaced. Once W2 moves, the outputs vary per token."""
    model = make_model()
    x = torch.randn(5, 128).bfloat16()
    for block in (model.gates, model.mudd):
        for which in (0, 1):
            out = block(which, x)
            expected = {name: value for name, _, value in block.outputs[which]}
            assert out.keys() == expected.keys()
            for name, value in out.items():
                assert value.shape[0] == 5 and (value.float() - expected[name]).abs().max() < 2e-2 * max(1, abs(expected[name])), name
    with torch.no_grad():
        model.gates.w2.normal_()
    gate = model.gates(1, x)[("skip", T.SKIP_TARGET_LAYER)]
    assert gate.float().std() > 1e-2  # per token


# --- loss ------------------------------------------------------------------------------------------

def test_multi_target_cross_entropy_reference_matches_a_loop():
    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 4
    targets = torch.randint(0, 50, (7, 4))
    targets[5:, 1] = -1
    targets[[0, 3], 3] = -1
    targets[2, 2] = targets[2, 0]  # the same token twice in one row
    weights = torch.tensor([1.0, 0.5, 0.25, 0.3])
    loss_rows, ce0_rows, _, _ = T.softcap_ce_reference(logits, targets, weights, 1.0, torch.float32)
    loss, ce0 = loss_rows.sum(), ce0_rows.mean()
    z = 23 * torch.sigmoid((logits.double() + 5) / 7.5)
    lse = torch.logsumexp(z, -1)
    expected = sum(weights[k].item() * (lse[t] - z[t, targets[t, k]]) for t in range(7) for k in range(4)
                   if targets[t, k] >= 0)
    assert abs(loss.item() - expected.item()) < 1e-4 * expected.item()
    assert abs(ce0.item() - (lse - z[torch.arange(7), targets[:, 0]]).mean().item()) < 1e-5


def write_vocabulary(folder, tokens: dict[str, int]):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "encoder.json").write_text(json.dumps(tokens), encoding="utf-8")
    return str(folder)


def test_prefix_table_from_a_vocabulary(tmp_path):
    # "Ġ" spells the space byte in GPT-2's alphabet
    folder = write_vocabulary(tmp_path / "v", {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "abc": 4, "Ġa": 5, "abcd": 6,
                                               "bcd": 7, T.GPT2_SPECIAL_TOKEN: 9})
    token_bytes = T.gpt2_token_bytes(folder)
    assert token_bytes[5] == b" a" and 9 not in token_bytes
    table = T.prefix_token_ids(token_bytes, 12)
    assert table.tolist() == [-1, -1, -1, 0, 3, 2, 4, 1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="VOCAB_SIZE"):
        T.prefix_token_ids(token_bytes, 7)


def test_prefix_table_of_gpt2(repo_root):
    folder = repo_root / "data" / "gpt2"  # the repository's copy of GPT-2's vocabulary
    token_bytes = T.gpt2_token_bytes(str(folder))
    table = T.prefix_token_ids(token_bytes, 50304)
    assert token_bytes[262] == b" the" and table[262] == 294 and token_bytes[294] == b" th"
    assert (table[:256] == -1).all() and (table[50256:] == -1).all() and (table[256:50256] >= 0).all()
    by_bytes = set(token_bytes.values())
    for i in np.random.default_rng(0).choice(np.arange(256, 50256), 3000, replace=False):
        b, p = token_bytes[int(i)], token_bytes[int(table[i])]
        assert b.startswith(p) and len(p) < len(b)
        assert not any(b[:n] in by_bytes for n in range(len(p) + 1, len(b)))  # the longest one


def test_prefix_loss_adds_the_weighted_prefix_term():
    model = make_model()
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, SMALL["vocab_size"], (SMALL["vocab_size"],), generator=g)
    prefix[::3] = -1  # tokens without a prefix
    model.prefix_ids.copy_(prefix)
    inputs, targets, cu = small_batch()
    with torch.no_grad():
        x = model.hidden_states(inputs, cu, SHAPE, PLAN)
        plain, ce = model.training_loss(inputs, targets, cu, SHAPE, PLAN, torch.tensor([1.0]))
        with_prefix, ce_p = model.training_loss(inputs, targets, cu, T.ForwardShape(32, 96, 256, 1, True),
                                                PLAN, torch.tensor([1.0, 0.25]))
    z = T.softcap(x @ model.lm_head.t()).double()
    p = prefix[targets.long()]
    valid = p >= 0
    term = (torch.logsumexp(z, -1) - z.gather(1, p.clamp_min(0)[:, None])[:, 0])[valid].sum()
    assert 0 < valid.sum() < len(p) and torch.equal(ce, ce_p)
    assert abs(with_prefix.item() - plain.item() - 0.25 * term.item()) < 1e-4 * with_prefix.item()


def test_prefix_weight_schedule():
    """0.25 in stage 1, 0.25 -> 0 over stage 2, then no prefix column (the plan's last target weight);
    at the reference's 1270 scheduled steps, where stage 2 is steps 423-846."""
    plan = T.Schedule(T.Hyperparameters.of(num_scheduled_iterations=1270).schedule).plan
    prefix = lambda step: plan(step).target_weights[-1] if plan(step).shape.prefix_target else None  # noqa: E731
    assert prefix(0) == 0.25 and prefix(422) == 0.25 and prefix(423) == 0.25
    assert abs(prefix(635) - 0.125) < 1e-12 and 0 < prefix(846) < 1e-3
    assert prefix(847) is None and prefix(1284) is None
    assert plan(0).target_weights == (1.0, 0.5, 0.25, 0.25) and plan(900).target_weights == (1.0,)


# --- optimizer table and compile --------------------------------------------------------------------

REFERENCE_TABLE = {  # label: (optimizer, comm, betas, lr_mul, wd_mul), as the reference optimizes them
    "qk_bank": ("normuon", "sharded", None, 1, 1), "qk_narrow_bank": ("normuon", "sharded", None, 1, 1),
    "vo_bank": ("normuon", "sharded", None, 1, 1),
    "mlp_bank": ("normuon", "sharded", None, 1, 1),
    "scalars": ("adam", "replicated", (0.9, 0.99), 5, 0), "smear_gate": ("adam", "replicated", (0.9, 0.99), 0.01, 0),
    "ve_gate_bank": ("adam", "replicated", (0.9, 0.99), 1, 1), "lm_head": ("adam", "sharded", (0.5, 0.95), 1, 150),
    "post_lambdas": ("adam", "replicated", (0.9, 0.95), 1, 0),
    "resid_lambdas": ("adam", "replicated", (0.9, 0.95), 5, 0),
    "value_embeds": ("adam", "sharded", (0.75, 0.95), 75, 5), "embed": ("adam", "sharded", (0.5, 0.95), 1, 150),
    "mudd.w1": ("adam", "replicated", (0.9, 0.99), 0.25, 1), "mudd.w2": ("adam", "replicated", (0.9, 0.99), 0.25, 1),
    "mudd.b2": ("adam", "replicated", (0.9, 0.99), 0.25, 0),
    "gates.w1": ("adam", "replicated", (0.9, 0.99), 0.1, 1), "gates.w2": ("adam", "replicated", (0.9, 0.99), 0.1, 1),
    "gates.b2": ("adam", "replicated", (0.9, 0.99), 0.1, 0), "gates.scale": ("adam", "replicated", (0.9, 0.99), 0.1, 0),
}


def test_param_specs_match_the_reference_table():
    specs = T.param_specs(make_model())
    assert set(specs) == set(REFERENCE_TABLE)
    for label, spec in specs.items():
        optimizer, comm, betas, lr_mul, wd_mul = REFERENCE_TABLE[label]
        assert (spec.optimizer, spec.comm, spec.lr_mul, spec.wd_mul) == (optimizer, comm, lr_mul, wd_mul), label
        assert optimizer == "normuon" or spec.betas == betas, label


def test_model_with_every_feature_traces_whole_with_torch_compile():
    """GPU runs compile the model with fullgraph=True; aot_eager traces forward and backward the same
    way on the CPU (no graph breaks) and must give the eager result: the loss, every parameter's gradient
    and the n-gram rows' (the row cache's, T3.19)."""
    model = make_model()
    model.prefix_ids.copy_(torch.arange(SMALL["vocab_size"]) // 2 - 1)
    inputs, targets, cu = small_batch()
    table = live_ngram(model)
    table.load(inputs)
    shape = T.ForwardShape(32, 96, 256, 3, True)
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25])
    eager, _ = model.training_loss(inputs, targets, cu, shape, PLAN, weights)
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    eager_rows, table.cache.grad = table.cache.grad, None
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model.training_loss, backend="aot_eager", fullgraph=True)
    loss, _ = compiled(inputs, targets, cu, shape, PLAN, weights)
    loss.backward()
    assert abs(loss.item() - eager.item()) < 1e-3 * eager.item()
    for name, p in model.named_parameters():
        assert rel_err(p.grad, eager_grads[name]) < 2e-2 or eager_grads[name].norm() == 0, name
    assert eager_rows.norm() > 0 and rel_err(table.cache.grad, eager_rows) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_model_with_every_feature_matches_eager_on_cuda():
    """Inductor (as in training) against eager on the GPU, model width 768 and real head shapes,
    every feature on: loss to 1e-2; gradients to 1e-1 (bf16 rounding in different places, amplified
    through 11 layers; a wrong formula or a dropped term is off by O(1)), the n-gram rows' too (T3.19: zero
    as the table starts, so the bigram injection adds nothing here, as the zero bigram table did)."""
    tokens = 4096  # per forward: one eighth of the step's batch (sizes the rotary tables)
    hp = T.Hyperparameters.of(**dict(SMALL, device="cuda", model_dim=768, num_heads=6, head_dim=128, mlp_hidden=3072,
                                  vocab_size=50304, fp8_lm_head=False,
                                  stages=T.replace_stage_columns(T.STAGES, batch_tokens=(8 * tokens,) * 5)))
    torch.manual_seed(0)
    model = T.GPT(hp.model, T.longest_forward(hp)).cuda()
    table = model.ngram.shard(hp.optim)
    plan = T.resolve_execution(hp.execution, hp.model, torch.device("cuda"), tokens, training=True)
    model.prefix_ids.copy_(torch.arange(50304, device="cuda") // 2 - 1)
    with torch.no_grad():
        # live dynamic coefficients; at std 0.5 the untrained net is chaotic (loss ~21/token, eager vs
        # inductor gradients 50% apart while the loss agrees to 4e-6), at 0.05 they agree to 2-5e-2
        for block in (model.mudd, model.gates):
            block.w2.normal_(0, 0.05)
        model.mlp_bank[:, 1].normal_(0, 0.02)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (tokens + 1,), generator=g)
    cu = torch.tensor(T.cu_seqlens_for([700, 1, 1500, tokens + 1 - 2201], tokens, 16), device="cuda")
    inputs, targets = ids[:-1].int().cuda(), ids[1:].int().cuda()
    table.load(inputs)
    shape = T.ForwardShape(384, 896, 2048, 3, True)
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25], device="cuda")
    results = []
    for forward in (model.training_loss, torch.compile(model.training_loss, dynamic=False, fullgraph=True)):
        model.zero_grad(set_to_none=True)
        table.cache.grad = None
        loss, _ = forward(inputs, targets, cu, shape, plan, weights)
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        results.append((loss.item(), {**grads, "n-gram rows": table.cache.grad.float().clone()}))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert math.isfinite(compiled) and abs(compiled - eager) < 1e-2 * eager
    for name, grad in eager_grads.items():
        assert torch.isfinite(compiled_grads[name]).all(), name
        assert grad.norm() == 0 or rel_err(compiled_grads[name], grad) < 1e-1, name


# --- paired-head rotary positions -------------------------------------------------------------------

def test_paired_rope_tables_rotate_each_head_at_its_doubled_position():
    """The model rotates a paired layer's q and k as (T, 2, H/2, hd) views of the projection with
    attention_layout's (T, 2, 1, hd/4) tables, then interleaves them into the doubled sequence: the
    same as rotating the doubled sequence (2T, H/2, hd) at its own positions, bit for bit."""
    model = make_model(num_heads=6, head_dim=32, model_dim=192)
    tokens, H, hd = 40, 6, 32
    _, _, cu = small_batch(tokens)
    _, _, _, rope_paired = model.attention_layout(tokens, cu, T.ForwardShape(max_seq_len=tokens, short_window=1,
                                                  long_window=1, n_predict=1, prefix_target=False), PLAN)
    q = torch.randn(tokens, 3 * H, hd).bfloat16().split(H, dim=1)[0]  # a strided view, as in the model
    rotated = T.apply_rope(q.view(tokens, 2, H // 2, hd), *rope_paired).reshape(2 * tokens, H // 2, hd)
    positions = torch.arange(2 * tokens)[:, None].expand(2 * tokens, H // 2)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]  # (2T, H/2, hd/4)
    expected = T.apply_rope(q.reshape(2 * tokens, H // 2, hd), cos, sin)
    assert torch.equal(rotated, expected)


# --- fewer attention layers (#51 item 4) -----------------------------------------------------------

def test_attention_and_value_embeddings_can_be_dropped_from_layers(corpus):
    """ATTENTION_LAYERS=0,1,2,3,5,7,8,10 VALUE_EMBED_LAYERS=1,2,8,10 (record #92 drops the attention of
    layers 4 and 9 and one value-embedding plane): those layers run their MLP only, the banks hold 8
    attention slots, the table 4 planes, the gates nothing for the dropped layers, and the model
    trains; a layout that drops a layer whose attention has a role of its own stops at set-up."""
    layout = {"attention_layers": (0, 1, 2, 3, 5, 7, 8, 10), "value_embed_layers": (1, 2, 8, 10),
              "narrow_qk_layers": ()}  # every head full width: the attention slots in one bank
    model = make_model(**layout)
    plans = {plan.index: plan for plan in model.layers}
    assert [i for i, plan in plans.items() if plan.attn_slot is None] == [4, 6, 9]
    assert [plans[i].attn_slot for i in layout["attention_layers"]] == list(range(8))
    assert [plans[i].value_embed for i in (1, 2, 8, 10)] == [0, 1, 2, 3] and plans[9].value_embed is None
    assert not plans[4].xsa and not plans[9].paired_heads and not plans[9].bigram
    H, d = SMALL["num_heads"], SMALL["model_dim"]
    assert model.qk_bank.size(0) == 8 * H and model.vo_bank.size(0) == 16 and model.ve_gate_bank.size(0) == 3
    assert model.value_embeds.size(1) == 4 * d
    gate_keys = {key for part in T.mudd_gate_outputs(model.config) for key, _, _ in part}
    assert ("xsa", 4) not in gate_keys and ("x0", 9) not in gate_keys and ("x0", 8) in gate_keys
    with torch.no_grad():
        model.mlp_bank.normal_(0, 0.05)
        model.ve_gate_bank.normal_()
    inputs, _, cu = small_batch()
    model.hidden_states(inputs, cu, SHAPE, PLAN).float().square().sum().backward()
    assert (model.qk_bank.grad.view(8, -1).abs().amax(1) > 0).all()  # every slot serves a layer
    used = model.value_embeds.grad[inputs.long()].float()
    assert (used.view(len(inputs), 4, d).abs().amax((0, 2)) > 0).all()  # and every plane
    hp = T.Hyperparameters.of(**TINY_RUN, **layout, train_files=str(corpus / "tiny_train_*.bin"),
                              val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus))
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    trainer.run()
    assert torch.isfinite(trainer.losses[:4]).all() and trainer.losses[3] < trainer.losses[0]
    for env, message in (({"ATTENTION_LAYERS": "0,1,2,4,5,7,8,9,10"}, r"drops the attention of layer\(s\) 3"),
                         ({"VALUE_EMBED_LAYERS": "1,2,6"}, r"names layer\(s\) 6 without attention"),
                         ({"ATTENTION_LAYERS": "0,3,2,10"}, "give increasing layer indices from 0 to 10"),
                         ({"ATTENTION_LAYERS": "0,1,2,3,5,7,8,10", "NARROW_QK_LAYERS": "0,1,2,4,5,7,8,9"},
                          r"NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 names layer\(s\) 4,9 without attention .*: set NARROW_QK_LAYERS")):
        with pytest.raises(T.SetupError, match=message):
            T.check_hyperparameters(T.Hyperparameters.from_env(env))


# record #92's layer 7, dropped whole: attention and MLP
WHOLE_LAYER_7_DROPPED = {"attention_layers": (0, 1, 2, 3, 5, 8, 10), "mlp_layers": (0, 1, 2, 3, 4, 5, 6, 8, 9, 10),
                         "narrow_qk_layers": (0, 1, 2, 5, 8)}


def test_a_layer_without_its_mlp_equals_one_whose_mlp_adds_nothing():
    """MLP_LAYERS without 7 (T3.1): the bank holds 10 MLP slots, layer 7 none and no e4m3 scale, and the
    model equals the full one whose layer-7 MLP projection is zero and residual weight after it 1 (loss
    and every shared gradient; layer 7's own fc then gets none)."""
    dropped = make_model(**WHOLE_LAYER_7_DROPPED)
    plans = {plan.index: plan for plan in dropped.layers}
    assert plans[7].mlp_slot is None and plans[7].attn_slot is None
    assert [plans[i].mlp_slot for i in (6, 8, 10)] == [6, 7, 9]
    assert dropped.mlp_bank.shape == (10, 2, SMALL["mlp_hidden"], SMALL["model_dim"])
    assert not hasattr(dropped, "fp8_post_scale7") and hasattr(dropped, "fp8_post_scale8")
    full = make_model(**{**WHOLE_LAYER_7_DROPPED, "mlp_layers": tuple(range(11))})
    with torch.no_grad():
        dropped.mlp_bank.normal_(0, 0.05)
        dropped.ve_gate_bank.normal_()
        dropped.resid_lambdas.normal_(1, 0.1)
        full.load_state_dict({**full.state_dict(),
                              **{n: p for n, p in dropped.state_dict().items() if n != "mlp_bank"}}, strict=False)
        for name, buffer in dropped.named_buffers():
            dict(full.named_buffers())[name].copy_(buffer)
        slots = [plans[i].mlp_slot for i in range(11) if i != 7]
        full.mlp_bank[[i for i in range(11) if i != 7]] = dropped.mlp_bank[slots]
        full.mlp_bank[7, 0].normal_(0, 0.05)
        full.mlp_bank[7, 1].zero_()  # adds nothing
        full.resid_lambdas[7, 1] = 1.0
    inputs, targets, cu = small_batch()
    losses = []
    for model in (dropped, full):
        loss, _ = model.training_loss(inputs, targets, cu, SHAPE, PLAN, torch.tensor([1.0]))
        loss.backward()
        losses.append(loss.item())
    assert math.isfinite(losses[0]) and abs(losses[0] - losses[1]) < 1e-4 * abs(losses[1])
    full_params = dict(full.named_parameters())
    for name, p in dropped.named_parameters():
        want = full_params[name].grad.float()
        if name == "mlp_bank":
            want = want[[i for i in range(11) if i != 7]]
        elif name == "resid_lambdas" or name == "post_lambdas":
            want[7, 1] = 0  # layer 7's MLP weights: no gradient without the MLP
        assert (p.grad.float() - want).norm() <= 1e-2 * want.norm(), name
    with pytest.raises(T.SetupError, match=r"MLP_LAYERS=0,1,2 drops the MLP of layer 10"):
        T.check_hyperparameters(T.Hyperparameters.from_env({"MLP_LAYERS": "0,1,2"}))
    with pytest.raises(T.SetupError, match=r"MLP_LAYERS=8,7,10: give increasing layer indices"):
        T.check_hyperparameters(T.Hyperparameters.from_env({"MLP_LAYERS": "8,7,10"}))
    default = T.Hyperparameters.of().model  # the layout since the second session of 2026-11-28
    assert {name: getattr(default, name) for name in WHOLE_LAYER_7_DROPPED} == WHOLE_LAYER_7_DROPPED


def test_a_model_without_layer_7_trains(corpus):
    hp = T.Hyperparameters.of(**TINY_RUN, **WHOLE_LAYER_7_DROPPED, train_files=str(corpus / "tiny_train_*.bin"),
                              val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus))
    T.check_hyperparameters(hp)
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    trainer.run()
    assert torch.isfinite(trainer.losses[:4]).all() and trainer.losses[3] < trainer.losses[0]


TINY_RUN = {**SMALL, "vocab_size": 50304, "warmup": False, "num_scheduled_iterations": 3, "num_extension_iterations": 1,
            "stop_after": 4, "val_loss_every": 0, "rank_slice": True, "muon_momentum_warmup_steps": 2,
            "muon_momentum_cooldown_steps": 1}
