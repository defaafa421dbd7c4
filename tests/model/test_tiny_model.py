"""The model on the tiny configuration (CPU): a forward and backward with each technique switch flipped
(and all on, all off), the multi-token prediction weights, causal and document masking, and YaRN's
scales."""

import numpy as np
import pytest
import torch

import train_gpt as T
from helpers import TINY, cpu_execution, model_of, random_batch

DEFAULTS = T.Hyperparameters().flat()
SWITCHES = [name for name, part in T.Hyperparameters.part_of_field().items()  # the technique switches
            if part in ("model", "schedule", "execution") and isinstance(DEFAULTS[name], bool)
            and name not in ("compile", "skip_guard_checks")]


@pytest.mark.parametrize("switch", ["defaults", "all on", "all off"] + SWITCHES)
def test_forward_backward_with_each_switch(switch):
    """Each switch flipped from its default (and all on, all off); a small vocabulary for speed."""
    base = dict(TINY, vocab_size=1024)
    if switch in ("all on", "all off"):
        base.update({name: switch == "all on" for name in SWITCHES}, untie_embed_at=2 / 3 if switch == "all on" else 0.0)
    elif switch != "defaults":
        base[switch] = not DEFAULTS[switch]
    hp = T.Hyperparameters.of(**base)
    torch.manual_seed(0)
    model = model_of(hp)
    on = hp.flat()
    if on["prefix_loss"]:
        model.prefix_ids.copy_(torch.arange(1024) // 3 - 1)
    for name, spec in T.param_specs(model).items():
        assert dict(model.named_parameters())[name] is not None and spec.optimizer in ("normuon", "adam")
    inputs, targets, cu = random_batch(vocab=1024)
    shape = T.ForwardShape(short_window=32, long_window=96, max_seq_len=128, n_predict=3, prefix_target=on["prefix_loss"])
    weights = torch.tensor([1.0, 0.5, 0.25] + [0.25] * on["prefix_loss"])
    plan = cpu_execution(hp, tokens=inputs.numel())
    loss, ce = model.training_loss(inputs, targets, cu, shape, plan, weights, grad_scale=0.5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(ce) and 6 < ce.item() < 8  # ~ln(1024) at init
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    params = dict(model.named_parameters())
    learned_scalars = on["attn_lambdas"] or on["smear_gate"] or on["skip_connection"]
    for present, param in [(on["value_embeds"], "value_embeds"),
                           (on["bigram_embed"] and not hp.model.ngram_rows, "bigram_embed"),  # else the table (T3.19)
                           (on["smear_gate"], "smear_gate"), (on["residual_lambdas"], "resid_lambdas"),
                           (learned_scalars, "scalars"), (True, "mudd.w1"), (True, "gates.w1")]:
        assert (param in params) == present, param
    gate_kinds = {kind for part in model.gates.outputs for (kind, _), _, _ in part}
    for switch, kind in [("xsa", "xsa"), ("attn_output_gates", "out_gate"), ("dc_mha", "dc_w1"),
                         ("skip_connection", "skip"), ("bigram_embed", "bigram")]:
        assert (kind in gate_kinds) == on[switch], kind
    with torch.no_grad():
        total = model.evaluation_loss(inputs, targets, cu, shape, cpu_execution(hp, training=False), chunk=100)
    assert torch.isfinite(total) and total.ndim == 0


def test_multi_token_prediction_weights_the_later_targets():
    hp = T.Hyperparameters.of(**TINY)
    torch.manual_seed(0)
    model = model_of(hp)
    inputs, targets, cu = random_batch()
    one = T.ForwardShape(32, 96, 128, n_predict=1)
    two = T.ForwardShape(32, 96, 128, n_predict=2)
    with torch.no_grad():
        l1, ce1 = model.training_loss(inputs, targets, cu, one, cpu_execution(hp), torch.tensor([1.0]))
        l2, ce2 = model.training_loss(inputs, targets, cu, two, cpu_execution(hp), torch.tensor([1.0, 0.0]))
        l3, _ = model.training_loss(inputs, targets, cu, two, cpu_execution(hp), torch.tensor([1.0, 0.5]))
    assert torch.allclose(l1, l2) and torch.allclose(ce1, ce2)
    assert l3 > l1 * 1.3  # the t+2 term adds about half as much again


def test_attention_is_causal_and_document_masked():
    # The key offset, smear gate and bigram hash look one token back across a BOS by design
    # (docs/TECHNIQUES.md T3.4, T3.6, T3.11); without them nothing may cross a document boundary.
    hp = T.Hyperparameters.of(**dict(TINY, key_offset=False, smear_gate=False, bigram_embed=False))
    torch.manual_seed(0)
    model = model_of(hp)
    with torch.no_grad():
        model.lm_head.normal_(0, 0.5)
        model.mlp_bank[:, 1].normal_(0, 0.05)  # non-zero MLP outputs so every path is live
    inputs, targets, cu = random_batch()
    shape = T.ForwardShape(NO := T.NO_WINDOW, NO, 256)
    changed = inputs.clone()
    changed[100] = (changed[100] + 1) % 50000  # inside the third document [41, 200)
    with torch.no_grad():
        a = model.hidden_states(inputs, cu, shape, cpu_execution(hp))
        b = model.hidden_states(changed, cu, shape, cpu_execution(hp))
    differs = (a - b).abs().amax(-1) > 0
    # positions before 100 are untouched (causal); the next document (from 200) never sees it
    assert not differs[:100].any()
    assert differs[100:200].any() and not differs[200:].any()


def test_yarn_scales_match_the_recipe():
    freqs, scale = T.yarn(T.rope_frequencies(128), [384, 896, 1408, 1664])
    assert abs(scale - 0.13178) < 2e-4
    base = T.rope_frequencies(128)
    assert torch.equal(freqs[:3], base[:3])  # fast rotations are kept
    assert (freqs[-5:] < base[-5:]).all()  # slow ones are interpolated


def test_masked_validation_loss_matches_a_dense_reference():
    """masked_evaluation_loss (validation masking, T4.5) against -log_softmax over the whole soft-capped
    logits with -inf at the banned next tokens, in float64, on a random table that leaves the true next
    tokens allowed; its second sum is evaluation_loss's. A banned true next token costs an infinite loss."""
    hp = T.Hyperparameters.of(**dict(TINY, vocab_size=1024))
    torch.manual_seed(0)
    model = model_of(hp)
    with torch.no_grad():
        model.lm_head.normal_(0, 0.5)  # spread logits, so that the mask moves the loss
    inputs, targets, cu = random_batch(vocab=1024)
    banned = torch.rand(1024, 1024) < 0.3
    banned[inputs.long(), targets.long()] = False
    table = torch.from_numpy(np.packbits(banned.numpy(), axis=1, bitorder="little"))
    assert torch.equal(T.banned_next(table, inputs, 1024), banned[inputs.long()])
    shape, execution = T.ForwardShape(32, 96, 256), cpu_execution(hp, tokens=inputs.numel(), training=False)
    with torch.no_grad():
        masked, plain = model.masked_evaluation_loss(inputs, targets, cu, shape, execution, 100, table)
        z = T.softcap(model.hidden_states(inputs, cu, shape, execution) @ model.lm_head.t()).double()
        dense = -torch.log_softmax(z.masked_fill(banned[inputs.long()], float("-inf")), -1)
        expected = dense.gather(1, targets.long()[:, None]).sum()
        assert plain == model.evaluation_loss(inputs, targets, cu, shape, execution, 100)
        assert abs(masked.item() - expected.item()) < 1e-5 * expected.item() and masked < plain
        banned[inputs[7].long(), targets[7].long()] = True
        table = torch.from_numpy(np.packbits(banned.numpy(), axis=1, bitorder="little"))
        assert model.masked_evaluation_loss(inputs, targets, cu, shape, execution, 100, table)[0] == float("inf")
