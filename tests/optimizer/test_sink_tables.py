"""Sink tables (T2.10): the value embeddings' and the bigram table's gradients summed in fp32 sinks, their Adam
on a cadence of its own. The sharded (gloo) form is in test_optimizer.py's sharded-step test (SINK_SPECS); the
taps against autograd's dense table gradient in tests/model/test_architecture.py."""

import pytest
import torch

import train_gpt as T
from test_optimizer import CONFIG, SINK_SPECS, SPECS, make_params, micro_grads

SINK = "value_table"


def sink_optimizer(dtype=torch.float32):
    params = make_params(dtype=dtype, sink_table=True)
    return params, T.NorMuonAdam(params, SINK_SPECS, CONFIG)


def test_sink_update_equals_adam_on_the_kept_gradient_sum():
    """table_adam=1: a sink table holding two steps' gradients moves exactly as the same table as a plain Adam
    parameter does over a non-Adam and an Adam step with those gradients (T2.7), in fp32."""
    params, opt = sink_optimizer()
    twin = make_params(dtype=torch.float32, sink_table=True)
    twin["value_table"].requires_grad_(True)
    plain = {**SINK_SPECS, SINK: T.ParamSpec(**{**SINK_SPECS[SINK].__dict__, "sink": False})}
    twin_opt = T.NorMuonAdam(twin, plain, CONFIG)
    assert opt.sinks == [SINK] and twin_opt.sinks == []
    for step in range(4):
        grads = micro_grads(params, step, 0)
        for k in params:
            if k == SINK:
                opt.state[k]["sink"].add_(grads[k])
            else:
                params[k].grad = grads[k].clone()
            twin[k].grad = grads[k].clone()
        before = params[SINK].detach().clone()
        opt.step(adam=step % 2 == 1)  # table_adam defaults to the Adam flag
        twin_opt.step(adam=step % 2 == 1)
        if step % 2 == 0:
            assert torch.equal(params[SINK], before) and opt.state[SINK]["sink"].ne(0).any()  # kept, not applied
        else:
            assert opt.state[SINK]["sink"].eq(0).all()  # emptied by the update
    for k in params:  # the sink's betas are fp32 device scalars, the plain rule's Python floats: an ulp apart
        assert torch.allclose(params[k], twin[k], rtol=1e-6, atol=1e-7), k
    assert not torch.equal(params[SINK], make_params(dtype=torch.float32, sink_table=True)[SINK])


def test_a_span_of_k_periods_powers_the_betas_and_multiplies_the_decay():
    """table_adam=k: one Adam step on the sink with betas**k and k times the weight decay, against textbook
    Adam with cautious decay (T2.5) computed here."""
    params, opt = sink_optimizer()
    w = params[SINK].detach().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    spec, lr_multiplier = SINK_SPECS[SINK], 0.7
    pending = torch.zeros_like(w)
    for t_step, span in enumerate([1, 2, 0, 2, 4]):
        g = micro_grads(params, t_step, 0)[SINK]
        opt.state[SINK]["sink"].add_(g)
        pending += g
        opt.step(lr_multiplier, adam=True, table_adam=span)  # no .grad anywhere: the sink table alone
        if span == 0:
            assert torch.equal(opt.state[SINK]["sink"], pending)
            continue
        b1, b2 = (beta ** span for beta in spec.betas)
        t = opt.state[SINK]["step"]
        lr = CONFIG.adam_lr * spec.lr_mul * lr_multiplier
        wd = lr * lr * CONFIG.adam_weight_decay * spec.wd_mul * span
        m = b1 * m + (1 - b1) * pending
        v = b2 * v + (1 - b2) * pending * pending
        u = lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + CONFIG.adam_eps)
        u = u + (u * w > 0) * w * wd
        w = w - u
        pending.zero_()
        assert torch.allclose(params[SINK], w, rtol=1e-5, atol=1e-6), t_step
    assert opt.state[SINK]["step"] == 4


def test_sink_tables_have_no_grad_and_a_stray_one_is_not_read():
    """The model's sink tables never take a .grad (requires_grad False), so the optimizer reads only the sink."""
    hp = T.Hyperparameters.of(device="cpu", compile=False, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256,
                              bigram_rows=1001)
    model = T.GPT(hp.model, T.longest_forward(hp))
    specs = T.param_specs(model)
    assert [label for label, spec in specs.items() if spec.sink] == ["bigram_embed", "value_embeds"]
    assert not model.value_embeds.requires_grad and not model.bigram_embed.requires_grad
    opt = T.NorMuonAdam(dict(model.named_parameters()), specs, CONFIG)
    assert opt.sinks == ["bigram_embed", "value_embeds"]
    assert opt.state["value_embeds"]["sink"].shape == model.value_embeds.shape
    assert opt.state["value_embeds"]["sink"].dtype == torch.float32


def test_sink_state_round_trips_and_resets():
    params, opt = sink_optimizer()
    opt.state[SINK]["sink"].add_(micro_grads(params, 0, 0)[SINK])
    saved = opt.state_dict()
    opt.state[SINK]["sink"].add_(1.0)
    address = opt.state[SINK]["sink"].data_ptr()
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[SINK]["sink"], micro_grads(params, 0, 0)[SINK])
    opt.reset()
    assert opt.state[SINK]["sink"].eq(0).all() and opt.state[SINK]["sink"].data_ptr() == address


def schedule(**values) -> T.Schedule:
    return T.Schedule(T.Hyperparameters.of(**values).schedule)


@pytest.mark.parametrize("period,adam_every_other_step", [(4, True), (8, True), (2, True), (4, False), (1, False)])
def test_table_cadence_covers_every_step_once(period, adam_every_other_step):
    """Until the cadence starts the sink tables update on every Adam step; from its start (a multiple of the
    period) on every period-th step; each update's span is the Adam periods its sum covers, so the spans
    add up to the steps up to the last update, each step in exactly one sum."""
    sched = schedule(table_adam_period=period, table_adam_period_from=0.3,
                     adam_every_other_step=adam_every_other_step)
    start, adam_period = sched.table_period_start, sched.adam_period
    assert start % period == 0 and abs(start - 0.3 * sched.num_scheduled) <= period
    plans = [sched.plan(step) for step in range(sched.total_steps)]
    updates = [plan.step for plan in plans if plan.table_adam]
    assert all(plans[step].adam_step for step in updates)
    assert [plan.step for plan in plans[:start] if plan.table_adam] == [plan.step for plan in plans[:start]
                                                                        if plan.adam_step]
    assert [s for s in updates if s >= start] == list(range(start + period - 1, sched.total_steps, period))
    previous = -1
    for step in updates:
        assert plans[step].table_adam * adam_period == step - previous, step
        previous = step
    if period == adam_period:  # the cadence of T2.7
        assert all(plan.table_adam == int(plan.adam_step) for plan in plans)


@pytest.mark.parametrize("env,message", [({"TABLE_ADAM_PERIOD": "3"}, "multiple of Adam's"),
                                         ({"TABLE_ADAM_PERIOD": "0"}, "multiple of Adam's"),
                                         ({"TABLE_ADAM_PERIOD_FROM": "1.5"}, "fraction of the scheduled steps")])
def test_cadence_settings_are_checked(env, message):
    with pytest.raises(T.SetupError, match=message):
        T.check_hyperparameters(T.Hyperparameters.from_env(env))


def test_plain_specs_have_no_sink():
    assert not any(spec.sink for spec in SPECS.values())
