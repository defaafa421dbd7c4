"""The momentum rails (T2.9): two EMA rails of the bank gradients blended into the Nesterov look-ahead, which run
Muon's single EMA (T2.2) until the schedule engages them."""

import dataclasses

import pytest
import torch

import train_gpt as T

RAILS = dataclasses.replace(T.Hyperparameters.of(compile=False).optim, muon_rails_slow_beta=0.9)
SPECS = {
    "qk_bank": T.ParamSpec("normuon", "sharded", matrix_shape=(8, 12), wd_mul=1.0),
    "lm_head": T.ParamSpec("adam", "sharded", wd_mul=150.0, betas=(0.5, 0.95)),
    "embed": T.ParamSpec("adam", "sharded", wd_mul=150.0, betas=(0.5, 0.95)),
}
# (momentum, fast beta, fast weight) per step: before the engage step (fast beta = momentum, weight 1), then after
SCHEDULE = [(0.85, 0.85, 1.0), (0.9, 0.9, 1.0), (0.95, 0.8, 0.4), (0.93, 0.7, 0.25), (0.9, 0.7, 0.25)]


def make_params(dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(0)
    lm_head = (torch.randn(10, 12, generator=g) * 0.1).to(dtype)
    return {"qk_bank": torch.nn.Parameter((torch.randn(5, 8, 12, generator=g) * 0.1).to(dtype)),
            "lm_head": torch.nn.Parameter(lm_head), "embed": torch.nn.Parameter(lm_head.clone())}


def grads_of(params: dict, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()}


def single_ema(grad: torch.Tensor, momentum: torch.Tensor, mu: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """Muon's Nesterov momentum in EMA form (#3, T2.2), the reference the rails reduce to: m ← μm + (1−μ)g in
    place, returns (1−μ)g + μm."""
    g = grad.float() * grad_scale
    momentum.lerp_(g, 1 - mu)
    return g.lerp(momentum, mu)


def spy_updates(monkeypatch) -> list:
    """The updates the banks' steps orthogonalize, in float64, as each step hands them to the normalization."""
    updates, normalize = [], T.polar_normalize
    monkeypatch.setattr(T, "polar_normalize", lambda X, *args: (updates.append(X.double()), normalize(X, *args))[1])
    return updates


def test_rails_update_matches_the_float64_formula(monkeypatch):
    """The update a bank orthogonalizes, and both rails, over steps before and after the engage step."""
    params = make_params()
    opt = T.NorMuonAdam(params, SPECS, RAILS, tied=("embed", "lm_head"))
    updates = spy_updates(monkeypatch)
    fast = slow = torch.zeros(5, 8, 12, dtype=torch.float64)
    for step, (mu, fast_beta, weight) in enumerate(SCHEDULE):
        grads = grads_of(params, step)
        for k, p in params.items():
            p.grad = grads[k]
        opt.step(1.0, mu, adam=step % 2 == 1, fast_rail=(fast_beta, weight))
        g = grads["qk_bank"].double()
        fast = fast_beta * fast + (1 - fast_beta) * g
        slow = 0.9 * slow + 0.1 * g
        expected = (1 - mu) * g + mu * (weight * fast + (1 - weight) * slow)
        torch.testing.assert_close(updates[-1], expected, rtol=1e-5, atol=1e-6)
    assert len(updates) == len(SCHEDULE)
    torch.testing.assert_close(opt.state["qk_bank"]["momentum"].double(), fast, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state["qk_bank"]["slow_momentum"].double(), slow, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_beta_at_momentum_and_weight_one_are_the_single_ema_bit_for_bit(dtype):
    """twin_rail_momentum with β_f = μ and w = 1 returns Muon's single-EMA update and leaves its buffer in the fast
    rail, bit for bit, whatever the slow rail holds (it still runs on its own beta)."""
    g = torch.Generator().manual_seed(1)
    fast, slow, momentum = torch.zeros(3, 8, 12), torch.zeros(3, 8, 12), torch.zeros(3, 8, 12)
    for step, (mu, _, _) in enumerate(SCHEDULE):
        grad = torch.randn(3, 8, 12, generator=g).to(dtype)
        mu = torch.tensor(mu)  # the optimizer's scalars: float32 on the device
        update = T.twin_rail_momentum(grad, fast, slow, mu, mu, torch.tensor(1.0), 0.9, 0.5)
        expected = single_ema(grad, momentum, mu, 0.5)
        assert torch.equal(update, expected), step
        assert torch.equal(fast, momentum), step
    assert slow.abs().sum() > 0 and not torch.equal(slow, fast)


def test_the_optimizer_runs_the_single_ema_until_the_rails_engage(monkeypatch):
    """On bf16 banks with their mantissa: the default fast_rail (None) is (momentum, 1), and the updates it
    orthogonalizes are the single EMA's, bit for bit; the scalars keep the rails' two slots throughout."""
    default, given = make_params(torch.bfloat16), make_params(torch.bfloat16)
    opt_default = T.NorMuonAdam(default, SPECS, RAILS, tied=("embed", "lm_head"))
    opt_given = T.NorMuonAdam(given, SPECS, RAILS, tied=("embed", "lm_head"))
    assert list(opt_default.scalar_views["qk_bank"]) == ["momentum", "lr", "wd_lr", "fast_beta", "fast_weight"]
    assert {"momentum", "slow_momentum", "second_moment", "mantissa"} <= set(opt_default.state["qk_bank"])
    updates = spy_updates(monkeypatch)
    momentum = torch.zeros(5, 8, 12)
    for step, (mu, _, _) in enumerate(SCHEDULE):
        for params in (default, given):
            for k, g in grads_of(params, step).items():
                params[k].grad = g
        expected = single_ema(default["qk_bank"].grad, momentum, torch.tensor(mu), 1.0)
        opt_default.step(1.0 - 0.1 * step, mu, adam=step % 2 == 1)
        opt_given.step(1.0 - 0.1 * step, mu, adam=step % 2 == 1, fast_rail=(mu, 1.0))
        assert torch.equal(updates[-2], expected.double()) and torch.equal(updates[-1], expected.double()), step
    for k in default:
        assert torch.equal(default[k], given[k]), k
    for key in ("momentum", "slow_momentum", "second_moment", "mantissa"):
        assert torch.equal(opt_default.state["qk_bank"][key], opt_given.state["qk_bank"][key]), key
    assert torch.equal(opt_default.state["qk_bank"]["momentum"], momentum)


def test_reset_and_state_round_trip_cover_the_slow_rail():
    params = make_params()
    opt = T.NorMuonAdam(params, SPECS, RAILS, tied=("embed", "lm_head"))
    for k, g in grads_of(params, 0).items():
        params[k].grad = g
    opt.step(1.0, 0.9, adam=False, fast_rail=(0.8, 0.5))
    saved = opt.state_dict()
    assert saved["state"]["qk_bank"]["slow_momentum"].abs().sum() > 0
    opt.reset()
    assert opt.state["qk_bank"]["slow_momentum"].abs().sum() == 0
    opt.load_state_dict(saved)
    assert torch.equal(opt.state["qk_bank"]["slow_momentum"], saved["state"]["qk_bank"]["slow_momentum"])


def test_schedule_engages_the_rails_at_its_fraction():
    hp = T.Hyperparameters.of(num_scheduled_iterations=100, muon_rails_engage_at=0.4, muon_rails_fast_beta=0.8,
                              muon_rails_fast_weight=0.3)
    schedule = T.Schedule(hp.schedule)
    assert schedule.plan(39).fast_rail == (schedule.momentum(39), 1.0)
    assert schedule.plan(40).fast_rail == (0.8, 0.3)
