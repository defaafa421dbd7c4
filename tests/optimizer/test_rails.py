"""MUON_RAILS (T2.9): two EMA rails of the bank gradients blended into the Nesterov look-ahead."""

import dataclasses

import torch

import train_gpt as T

CONFIG = T.Hyperparameters.of(compile=False, muon_rails=False).optim  # T2.2's single EMA
RAILS = dataclasses.replace(CONFIG, muon_rails=True, muon_rails_slow_beta=0.9)
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


def test_rails_update_matches_the_float64_formula(monkeypatch):
    """The update a bank orthogonalizes, and both rails, over steps before and after the engage step."""
    params = make_params()
    opt = T.NorMuonAdam(params, SPECS, RAILS, tied=("embed", "lm_head"))
    updates, normalize = [], T.polar_normalize
    monkeypatch.setattr(T, "polar_normalize", lambda X, method: (updates.append(X.double()), normalize(X, method))[1])
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
    torch.testing.assert_close(opt.state["qk_bank"]["momentum"].double(), fast, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state["qk_bank"]["slow_momentum"].double(), slow, rtol=1e-5, atol=1e-6)


def test_rails_before_engaging_and_rails_off_are_todays_momentum_bit_for_bit():
    """Fast beta = momentum and weight 1 (before the engage step) give the single EMA's weights and
    moments exactly, on bf16 banks with their mantissa; with rails off the scalars keep their layout."""
    single, rails = make_params(torch.bfloat16), make_params(torch.bfloat16)
    opt_single = T.NorMuonAdam(single, SPECS, CONFIG, tied=("embed", "lm_head"))
    opt_rails = T.NorMuonAdam(rails, SPECS, RAILS, tied=("embed", "lm_head"))
    assert "slow_momentum" not in opt_single.state["qk_bank"]
    assert list(opt_single.scalar_views["qk_bank"]) == ["momentum", "lr", "wd_lr"]
    for step, (mu, _, _) in enumerate(SCHEDULE):
        for params in (single, rails):
            for k, g in grads_of(params, step).items():
                params[k].grad = g
        opt_single.step(1.0 - 0.1 * step, mu, adam=step % 2 == 1)
        opt_rails.step(1.0 - 0.1 * step, mu, adam=step % 2 == 1, fast_rail=(mu, 1.0))
    for k in single:
        assert torch.equal(single[k], rails[k]), k
    for key in ("momentum", "second_moment", "mantissa"):
        assert torch.equal(opt_single.state["qk_bank"][key], opt_rails.state["qk_bank"][key]), key


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
