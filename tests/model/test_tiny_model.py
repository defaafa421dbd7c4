"""The model on the tiny configuration (CPU): a forward and backward with each execution switch flipped
(and all on, all off; the techniques themselves have no switches since #77), the multi-token prediction
weights, causal and document masking, YaRN's scales, and the validation loss against a dense reference."""

import dataclasses

import pytest
import torch

import train_gpt as T
from helpers import TINY, cpu_execution, model_of, random_batch

DEFAULTS = T.Hyperparameters().flat()
# the execution switches; COPY_POINTER needs GPT-2's vocabulary (its <copy> row): tests/model/test_copy_pointer.py
SWITCHES = [name for name, part in T.Hyperparameters.part_of_field().items()
            if part in ("model", "schedule", "execution") and isinstance(DEFAULTS[name], bool)
            and name not in ("compile", "copy_pointer")]


def live_ngram(model, hp, std=0.5, seed=2):
    """The model's n-gram table (T3.19) with every row allocated (world size 1) and given seeded values, so that
    the bigram injection carries signal once `load` fills the row cache."""
    table = model.ngram.shard(hp.optim)
    with torch.no_grad():
        table.weight.copy_(torch.randn(table.weight.shape, generator=torch.Generator().manual_seed(seed)) * std)
    return table


@pytest.mark.parametrize("switch", ["defaults", "all on", "all off"] + SWITCHES)
def test_forward_backward_with_each_switch(switch):
    """Each switch flipped from its default (and all on, all off); a small vocabulary for speed. Every
    technique is in the model: its parameters, its gates, the prefix-token target and the n-gram rows."""
    base = dict(TINY, vocab_size=1024)
    if switch in ("all on", "all off"):
        base.update({name: switch == "all on" for name in SWITCHES}, untie_embed_at=2 / 3 if switch == "all on" else 0.0)
    elif switch != "defaults":
        base[switch] = not DEFAULTS[switch]
    hp = T.Hyperparameters.of(**base)
    torch.manual_seed(0)
    model = model_of(hp)
    model.prefix_ids.copy_(torch.arange(1024) // 3 - 1)
    for name, spec in T.param_specs(model).items():
        assert dict(model.named_parameters())[name] is not None and spec.optimizer in ("normuon", "adam")
    inputs, targets, cu = random_batch(vocab=1024)
    live_ngram(model, hp).load(inputs)
    shape = T.ForwardShape(short_window=32, long_window=96, max_seq_len=128, n_predict=3, prefix_target=True)
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25])
    plan = cpu_execution(hp, tokens=inputs.numel())
    loss, ce = model.training_loss(inputs, targets, cu, shape, plan, weights, grad_scale=0.5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(ce) and 6 < ce.item() < 8  # ~ln(1024) at init
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    rows_grad = model.ngram.cache.grad  # the n-gram rows' gradient: one sum per distinct row (T3.19)
    assert torch.isfinite(rows_grad).all() and rows_grad.abs().amax() > 0
    params = dict(model.named_parameters())
    for param in ("value_embeds", "smear_gate", "resid_lambdas", "post_lambdas", "scalars", "mudd.w1", "gates.w1"):
        assert param in params, param
    gate_kinds = {kind for part in model.gates.outputs for (kind, _), _, _ in part}
    assert {"xsa", "out_gate", "dc_w1", "skip", "bigram"} <= gate_kinds
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
    """The key offset, smear gate and n-gram rows look back across a BOS by design (docs/TECHNIQUES.md T3.4,
    T3.6, T3.11, T3.19): the smear and the rows read the token ids, so they carry a token's change at most
    two positions on, inside its document here; the key offset takes the previous position's key, made from a
    hidden state that attention mixed, so it would carry the change into the next document through its first
    position's key. With the key offset off (in the model's layer plans; its switch is gone) and the smear
    and the rows live, nothing may cross a document boundary."""
    hp = T.Hyperparameters.of(**TINY)
    torch.manual_seed(0)
    model = model_of(hp)
    model.layers = tuple(dataclasses.replace(layer, key_offset=False) for layer in model.layers)
    with torch.no_grad():
        model.lm_head.normal_(0, 0.5)
        model.mlp_bank[:, 1].normal_(0, 0.05)  # non-zero MLP outputs so every path is live
        model.named_scalars()["smear_lambda"].fill_(0.5)  # a live smear (0 at init)
    table = live_ngram(model, hp)
    inputs, targets, cu = random_batch()
    shape = T.ForwardShape(NO := T.NO_WINDOW, NO, 256)
    changed = inputs.clone()
    changed[100] = (changed[100] + 1) % 50000  # inside the third document [41, 200)
    states = []
    with torch.no_grad():
        for ids in (inputs, changed):
            table.load(ids)
            states.append(model.hidden_states(ids, cu, shape, cpu_execution(hp)))
    differs = (states[0] - states[1]).abs().amax(-1) > 0
    # positions before 100 are untouched (causal); the next document (from 200) never sees it
    assert not differs[:100].any()
    assert differs[100:200].any() and not differs[200:].any()


def test_yarn_scales_match_the_recipe():
    freqs, scale = T.yarn(T.rope_frequencies(128), [384, 896, 1408, 1664])
    assert abs(scale - 0.13178) < 2e-4
    base = T.rope_frequencies(128)
    assert torch.equal(freqs[:3], base[:3])  # fast rotations are kept
    assert (freqs[-5:] < base[-5:]).all()  # slow ones are interpolated


def test_validation_loss_matches_a_dense_reference():
    """evaluation_loss (the lm_head 100 tokens at a time) against -log_softmax over the whole soft-capped
    logits in float64, summed over the positions."""
    hp = T.Hyperparameters.of(**dict(TINY, vocab_size=1024))
    torch.manual_seed(0)
    model = model_of(hp)
    with torch.no_grad():
        model.lm_head.normal_(0, 0.5)  # spread logits
    inputs, targets, cu = random_batch(vocab=1024)
    shape, execution = T.ForwardShape(32, 96, 256), cpu_execution(hp, tokens=inputs.numel(), training=False)
    with torch.no_grad():
        total = model.evaluation_loss(inputs, targets, cu, shape, execution, 100)
        z = T.softcap(model.hidden_states(inputs, cu, shape, execution) @ model.lm_head.t()).double()
        expected = -torch.log_softmax(z, -1).gather(1, targets.long()[:, None]).sum()
    assert total.dtype == torch.float32 and abs(total.item() - expected.item()) < 1e-5 * expected.item()
