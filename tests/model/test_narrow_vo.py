"""Narrow V/O heads (docs/TECHNIQUES.md T3.21, issue #51 item 3): NARROW_VO_LAYERS halves the V and O
heads of narrow layers (T3.18) too, the (64, 64) pair, their V and O in a bank of their own. On the CPU:
the banks, plans and optimizer rows, every slot's gradient, the exact equivalence with a full-width model
whose V rows beyond each narrow head are zero, the e4m3 projection, the set-up's refusals and a tiny
run; on a GPU (gpu-marked) the plan's backend and kernels against the torch path."""

import dataclasses
import math

import pytest
import torch
from helpers import cpu_execution, rel_err
from test_narrow_qk import NARROW, SHAPE, SMALL, TINY_RUN, check_narrow_model_on_gpu, small_batch, small_model

import train_gpt as T

NARROW_VO = (0, 5)  # the default layout's narrow layers without a value embedding


def test_narrow_vo_layers_have_their_own_bank_and_every_slot_gets_a_gradient():
    model = small_model(narrow_qk_layers=NARROW, narrow_vo_layers=NARROW_VO)
    H, hd, d = SMALL["num_heads"], SMALL["head_dim"], SMALL["model_dim"]
    n_attn = len(model.config.attention_layers)
    plans = {plan.index: plan for plan in model.layers}
    assert [i for i, plan in plans.items() if plan.narrow_vo] == list(NARROW_VO)
    assert [plans[i].vo_slot for i in NARROW_VO] == [0, 1]
    assert [plans[i].vo_slot for i in (1, 2, 3, 8, 10)] == [0, 1, 2, 3, 4] and plans[6].vo_slot is None
    assert model.vo_bank.shape == (2 * (n_attn - 2), d, d)
    assert model.vo_narrow_bank.shape == (2 * 2, H * hd // 2, d)
    assert [slots for _, slots in model.vo_banks()] == [[1, 2, 3, 5, 6], [0, 4]]
    specs = T.param_specs(model)
    assert specs["vo_narrow_bank"].matrix_shape == (H * hd // 2, d) and specs["vo_narrow_bank"].optimizer == "normuon"
    assert list(specs).index("vo_bank") < list(specs).index("vo_narrow_bank")
    assert not hasattr(small_model(narrow_qk_layers=NARROW), "vo_narrow_bank")  # off: no narrow V/O bank
    assert T.Hyperparameters.of().model.narrow_vo_layers == ()  # the default
    assert T.Hyperparameters.from_env({"NARROW_VO_LAYERS": "0,5"}).model.narrow_vo_layers == (0, 5)
    with torch.no_grad():
        model.mlp_bank.normal_(0, 0.05)
        model.ve_gate_bank.normal_()
    inputs, _, cu = small_batch()
    model.hidden_states(inputs, cu, SHAPE, cpu_execution()).float().square().sum().backward()
    assert (model.vo_narrow_bank.grad.view(2 * len(NARROW_VO), -1).abs().amax(1) > 0).all()
    assert (model.vo_bank.grad.view(model.vo_bank.size(0), -1).abs().amax(1) > 0).all()


def test_narrow_vo_equals_full_width_heads_whose_other_half_is_zero():
    """A narrow V/O layer is a full-width one whose V rows beyond the first half of each head are zero (the
    attention's output is then zero there, whatever O's columns): the same loss and, on the shared
    parameters, the same gradients, with the narrow bank's gradient the full one's rows and columns."""
    torch.manual_seed(0)
    narrow = small_model(narrow_qk_layers=NARROW, narrow_vo_layers=NARROW_VO)
    wide = small_model(narrow_qk_layers=NARROW)
    H, hd, d = SMALL["num_heads"], SMALL["head_dim"], SMALL["model_dim"]
    half = torch.arange(H * hd).view(H, hd)[:, : hd // 2].flatten()  # the narrow heads' dimensions in a wide one
    plans = {plan.index: plan for plan in wide.layers}
    with torch.no_grad():
        narrow.mlp_bank.normal_(0, 0.05)
        narrow.ve_gate_bank.normal_()
        state = {name: p for name, p in narrow.state_dict().items() if name != "vo_narrow_bank"}
        wide.load_state_dict({**wide.state_dict(), **{n: p for n, p in state.items() if n != "vo_bank"}})
        for name, buffer in narrow.named_buffers():  # the non-persistent ones too: the bigram table's signs
            dict(wide.named_buffers())[name].copy_(buffer)
        wide_vo = wide.vo_bank.view(-1, 2, d, d)
        narrow_vo = narrow.vo_narrow_bank.view(-1, 2, H * hd // 2, d)
        for layer in range(T.NUM_LAYERS):
            plan = plans[layer]
            if plan.attn_slot is None:
                continue
            if layer in NARROW_VO:
                v, o_stored = narrow_vo[NARROW_VO.index(layer)]
                wide_vo[plan.attn_slot, 0].zero_()[half] = v
                wide_vo[plan.attn_slot, 1].normal_()[:, half] = o_stored.t()  # the other columns meet zeros
            else:
                wide_vo[plan.attn_slot].copy_(narrow.vo_bank.view(-1, 2, d, d)[narrow.layers[layer].vo_slot])
    inputs, targets, cu = small_batch()
    losses = []
    for model in (narrow, wide):
        loss, _ = model.training_loss(inputs, targets, cu, SHAPE, cpu_execution(), torch.tensor([1.0]))
        loss.backward()
        losses.append(loss.item())
    assert math.isfinite(losses[0]) and abs(losses[0] - losses[1]) < 1e-3 * abs(losses[1])
    for name, p in narrow.named_parameters():
        if name != "vo_narrow_bank" and name != "vo_bank":
            want = dict(wide.named_parameters())[name].grad.float()
            assert (p.grad.float() - want).norm() <= 2e-2 * want.norm(), name  # zero where both are
    wide_grad = wide.vo_bank.grad.view(-1, 2, d, d)
    for i, layer in enumerate(NARROW_VO):
        v_grad, o_grad = narrow.vo_narrow_bank.grad.view(-1, 2, H * hd // 2, d)[i]
        assert rel_err(v_grad, wide_grad[plans[layer].attn_slot, 0][half]) < 2e-2, layer
        assert rel_err(o_grad, wide_grad[plans[layer].attn_slot, 1][:, half].t()) < 2e-2, layer


def test_fp8_qkv_projection_takes_narrow_values():
    """The e4m3 Q/K/V projection (T6.3, forced on: CPU) with narrow V/O slots: the training loss within
    e4m3's rounding of the bf16 one."""
    model = small_model(narrow_qk_layers=NARROW, narrow_vo_layers=NARROW_VO)
    inputs, targets, cu = small_batch()
    losses = [model.training_loss(inputs, targets, cu, SHAPE, dataclasses.replace(cpu_execution(), qkv_e4m3=e4m3),
                                  torch.tensor([1.0]))[0] for e4m3 in (False, True)]
    assert rel_err(losses[1], losses[0]) < 1e-2


def test_narrow_vo_layouts_the_set_up_refuses():
    for env, message in (({"NARROW_VO_LAYERS": "3"}, r"layer\(s\) 3 whose Q/K heads are full width"),
                         ({"NARROW_VO_LAYERS": "1"}, r"layer\(s\) 1 whose values take a full-width value embedding"),
                         ({"NARROW_VO_LAYERS": "10", "NARROW_QK_LAYERS": "10", "KEY_OFFSET": "0", "DC_MHA": "0"},
                          "names layer 10, whose values take the full-width MUDD value mix"),
                         ({"NARROW_VO_LAYERS": "5,0"}, "give increasing layer indices")):
        with pytest.raises(T.SetupError, match=message):
            T.check_hyperparameters(T.Hyperparameters.from_env(env))
    T.check_hyperparameters(T.Hyperparameters.from_env({"NARROW_VO_LAYERS": "0,5"}))
    T.check_hyperparameters(T.Hyperparameters.from_env({"NARROW_VO_LAYERS": "1,8", "VALUE_EMBED_LAYERS": "2,10"}))


def test_tiny_narrow_vo_model_trains(corpus):
    hp = T.Hyperparameters.of(**TINY_RUN, narrow_qk_layers=NARROW, narrow_vo_layers=NARROW_VO,
                              train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                              tokenizer_dir=str(corpus))
    T.check_hyperparameters(hp)
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
    before = trainer.model.vo_narrow_bank.detach().clone()
    trainer.run()
    assert torch.isfinite(trainer.losses[:4]).all() and trainer.losses[3] < trainer.losses[0]
    assert not torch.equal(trainer.model.vo_narrow_bank.detach(), before)  # NorMuon updates the narrow bank


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_narrow_vo_model_on_gpu_matches_the_torch_path(monkeypatch):
    """Real head shapes (6 heads of 128; Q/K 64 wide on NARROW, V/O 64 wide on NARROW_VO) on 4096 tokens,
    eager: the plan's backend (FA4's (64, 64) pair where installed) and the QK-norm + rotary kernels
    (v as wide as q and k) against SDPA and the torch path (check_narrow_model_on_gpu says to what)."""
    check_narrow_model_on_gpu(monkeypatch, narrow_qk_layers=NARROW, narrow_vo_layers=NARROW_VO)
