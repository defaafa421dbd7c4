"""TAIL_EMA_FRAC (T5.4): an fp32 EMA of the weights over the last steps, blended in at the end."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

import train_gpt as T

CONFIG = T.Hyperparameters.of(compile=False).optim
SPECS = {
    "qk_bank": T.ParamSpec("normuon", "sharded", matrix_shape=(8, 12), wd_mul=1.0),  # 5 matrices: padded at 2 ranks
    "scalars": T.ParamSpec("adam", "replicated", lr_mul=5.0),
    "lm_head": T.ParamSpec("adam", "sharded", wd_mul=150.0, betas=(0.5, 0.95)),
    "embed": T.ParamSpec("adam", "sharded", wd_mul=150.0, betas=(0.5, 0.95)),
}
# 6 scheduled steps and 2 of extension; the EMA over the last 4, the embeddings untied after step 1
SCHEDULE = T.Schedule(T.Hyperparameters.of(num_scheduled_iterations=6, num_extension_iterations=2, tail_ema_frac=0.5,
                                           tail_ema_bank_blend=0.55, tail_ema_embed_blend=0.65).schedule)
BLENDS = T.tail_ema_blends(SCHEDULE.config, SPECS)


def make_params() -> dict:
    g = torch.Generator().manual_seed(0)
    lm_head = (torch.randn(10, 12, generator=g) * 0.1).bfloat16()
    return {"qk_bank": torch.nn.Parameter((torch.randn(5, 8, 12, generator=g) * 0.1).bfloat16()),
            "scalars": torch.nn.Parameter(torch.randn(6, generator=g)),
            "lm_head": torch.nn.Parameter(lm_head), "embed": torch.nn.Parameter(lm_head.clone())}


def master(opt: T.NorMuonAdam, label: str) -> torch.Tensor:
    """A label's exact fp32 weight: a bank's bf16 with its mantissa (T2.6)."""
    p = opt.params[label].detach()
    if "mantissa" not in opt.state[label]:
        return p.float()
    return T._fp32_from_bf16_and_mantissa(p.view(opt.state[label]["mantissa"].shape), opt.state[label]["mantissa"])


def run(rank: int = 0, world: int = 1, record=None) -> tuple[dict, T.NorMuonAdam]:
    """The schedule's steps on gradients every rank shares (each rank's mean micro-gradient is the
    same), the EMA ticked after each, blended in at the end; (the final weights, the optimizer)."""
    params = make_params()
    opt = T.NorMuonAdam(params, SPECS, CONFIG, rank, world, tied=("embed", "lm_head"), tail_ema_blends=BLENDS)
    for step in range(SCHEDULE.total_steps):
        plan = SCHEDULE.plan(step)
        g = torch.Generator().manual_seed(100 + step)
        for p in params.values():
            p.grad = (torch.randint(-8, 9, p.shape, generator=g) / 8).to(p.dtype)
        opt.step(plan.lr_multiplier, plan.momentum, adam=plan.adam_step)
        if step == 1:
            opt.untie()
        if plan.tail_ema_rate:
            opt.tail_ema_update(plan.tail_ema_rate)
        if record is not None:
            record(opt, plan)
    if record is not None:
        record(opt, None)
    opt.tail_ema_blend()
    return {label: p.detach().float() for label, p in params.items()}, opt


def test_schedule_rates_start_the_ema_then_tick_at_two_over_n_plus_one():
    assert [SCHEDULE.plan(step).tail_ema_rate for step in range(8)] == [0, 0, 0, 0, 1, 0.4, 0.4, 0.4]
    assert BLENDS == {"qk_bank": 0.55, "lm_head": 0.65, "embed": 0.65}  # the replicated scalars are not averaged
    assert T.tail_ema_blends(T.Hyperparameters.of(tail_ema_frac=0.0).schedule, SPECS) == {}


def test_the_default_window_is_the_measured_share_of_all_steps_and_a_bad_share_stops():
    """0.236 of all steps: measured as 300 of 1270 (and 322 of 1365), now 260 of 1100."""
    default = T.Schedule(T.Hyperparameters().schedule)
    assert (default.total_steps, default.tail_ema_steps, default.tail_ema_start) == (1100, 260, 840)
    assert [default.tail_ema_rate(step) for step in (839, 840, 841)] == [0.0, 1.0, 2 / 261]
    with pytest.raises(T.SetupError, match="TAIL_EMA_FRAC=1.5"):
        T.check_hyperparameters(T.Hyperparameters.of(tail_ema_frac=1.5))


def test_tail_ema_is_the_direct_ema_of_the_last_steps_and_is_blended_exactly():
    seen, direct = {}, {}

    def record(opt, plan):
        if plan is None:  # after the last step: the EMA, the weights the blend starts from
            seen.update(ema={k: opt.state[k]["tail_ema"].clone() for k in BLENDS},
                        last={k: master(opt, k) for k in BLENDS})
            return
        for k in BLENDS:
            w = master(opt, k).double()
            rate = plan.tail_ema_rate
            if rate:
                direct[k] = w if rate == 1 else (1 - rate) * direct[k] + rate * w
            else:
                assert not opt.state[k]["tail_ema"].any(), (k, plan.step)  # untouched before the window

    _, opt = run(record=record)
    for k, blend in BLENDS.items():
        ema = seen["ema"][k].view(direct[k].shape)
        torch.testing.assert_close(ema.double(), direct[k], rtol=1e-6, atol=1e-7)
        expected = seen["last"][k].lerp(ema, blend)  # the fp32 master blended, then stored
        if k != "qk_bank":  # an Adam table's bf16 weight: rounded once
            expected = expected.bfloat16().float()
        assert torch.equal(master(opt, k), expected), k


def test_reset_and_load_state_clear_the_ema():
    params = make_params()
    opt = T.NorMuonAdam(params, SPECS, CONFIG, tied=("embed", "lm_head"), tail_ema_blends=BLENDS)
    initial = opt.state_dict()
    opt.tail_ema_update(1.0)
    assert opt.state["qk_bank"]["tail_ema"].any()
    opt.load_state_dict(initial)  # the warm-up's restore
    assert not any(opt.state[k]["tail_ema"].any() for k in BLENDS)
    opt.tail_ema_update(1.0)
    opt.reset()  # SEEDS' start_over
    assert not any(opt.state[k]["tail_ema"].any() for k in BLENDS)
    assert "tail_ema" not in T.NorMuonAdam(make_params(), SPECS, CONFIG).state["qk_bank"]


def _worker(rank: int, world: int, port: int, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # forked after the parent's matmuls: their thread pool did not come along
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(run(rank, world)[0], f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_end_with_the_weights_of_one(tmp_path):
    """Each rank averages its own rows; after the blend's gather both hold one process's weights."""
    single, _ = run()
    out_path = str(tmp_path / "tail_ema.pt")
    # forked, the ranks start without importing torch again (a spawned rank takes seconds on two cores)
    mp.start_processes(_worker, args=(2, free_port(), out_path), nprocs=2, start_method="fork")
    for rank in range(2):
        multi = torch.load(f"{out_path}.{rank}")
        for k in single:
            # CPU bf16 matmuls round differently for other batch sizes: a rank orthogonalizes 3 of the 5 matrices
            torch.testing.assert_close(multi[k], single[k], rtol=2e-2, atol=2e-3, msg=k)
