"""The execution plan: every fast-path choice resolved once per stage from the settings, the device and
the forward's size (resolve_execution), on a CPU with a Hopper GPU and the kernels' packages patched in;
and the settings tree it is resolved from (flat names, typos, removed settings). Whether the steps replay
CUDA graphs is the step runner's, not the plan's (tests/training/test_step_graphs.py)."""

import dataclasses
import types

import pytest
import torch

import train_gpt as T
from helpers import TINY


@pytest.fixture
def hopper(monkeypatch):
    """resolve_execution sees an sm90 GPU with Triton and FA4 installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(T, "triton", T.triton or types.SimpleNamespace())
    monkeypatch.setattr(T, "fa4_interface", types.SimpleNamespace())
    return torch.device("cuda", 0)


def plan(device, tokens, training=True, **settings):
    hp = T.Hyperparameters.of(**settings)
    return T.resolve_execution(hp.execution, hp.model, device, tokens, training)


def test_every_stage_gets_the_fast_paths_at_its_size(hopper):
    """The defaults' stages (16,384, 32,768 and 49,152 tokens per rank) and a forward far smaller all take
    FA4, the fused e4m3 MLP with its kernel, the e4m3 Q/K/V projection, the FP8 lm_head and DC-MHA's kernels:
    no size thresholds (#77), and the same plan whether the steps replay CUDA graphs or not. Evaluation
    stays bf16 at any size."""
    for n in (1024, 16384, 32768, 49152):
        stage = plan(hopper, n)
        assert (stage.attention, stage.mlp_fused, stage.mlp_kernel, stage.mlp_e4m3, stage.qkv_e4m3) == (
            "fa4", True, True, True, True), n
        assert stage.lm_head_fp8 and stage.dc_mha_kernel and stage.qk_rope_kernel, n
        assert plan(hopper, n, cuda_graphs=False) == stage, n
    ragged = plan(hopper, 1000)  # the FP8 MLP's transposed outputs need 16-byte rows: the bf16 fused MLP
    assert ragged.mlp_kernel and not ragged.mlp_e4m3 and ragged.qkv_e4m3
    evaluation = plan(hopper, 262144, training=False)
    assert evaluation.attention == "fa4" and evaluation.mlp_fused
    assert not (evaluation.mlp_e4m3 or evaluation.qkv_e4m3 or evaluation.lm_head_fp8)


@pytest.mark.parametrize("setting, field", [("fp8_mlp", "mlp_e4m3"), ("fp8_qkv", "qkv_e4m3"),
                                            ("fp8_lm_head", "lm_head_fp8"), ("fused_mlp", "mlp_fused")])
def test_a_switched_off_setting_turns_its_path_off_at_every_size(hopper, setting, field):
    assert getattr(plan(hopper, 49152), field)
    assert not getattr(plan(hopper, 49152, **{setting: False}), field)


def test_the_candidate_budget_applies_to_training_only(hopper):
    """The sampled cross-entropy's budget (T4.6) is the stage's in training; evaluation's softmax is full."""
    hp = T.Hyperparameters()
    for device in (hopper, torch.device("cpu")):
        assert T.resolve_execution(hp.execution, hp.model, device, 49152, True, ce_candidates=24576).ce_candidates == 24576
        assert T.resolve_execution(hp.execution, hp.model, device, 49152, False, ce_candidates=24576).ce_candidates == 0
    assert plan(hopper, 49152).ce_candidates == 0


def test_cpu_takes_the_torch_paths(hopper):
    """On the CPU device: SDPA and the torch paths, even with FA4, Triton and a Hopper GPU present."""
    cpu = plan(torch.device("cpu"), 49152)
    assert cpu.attention == "sdpa" and cpu.mlp_fused  # the fused MLP's custom backward runs in torch
    assert not (cpu.mlp_kernel or cpu.mlp_e4m3 or cpu.qkv_e4m3 or cpu.lm_head_fp8 or cpu.dc_mha_kernel or cpu.copy_kernel)


def test_the_copy_pointer_kernels_are_on_where_cuda_and_the_pointer_are(hopper):
    """The copy pointer's Triton kernels (T4.8) on CUDA at every size, training and evaluation, with COPY_POINTER=1
    (the default);
    without the pointer the plan says so (its graphs do not differ by an unused switch); never on the CPU."""
    for n in (1024, 16384, 49152):
        assert plan(hopper, n).copy_kernel and not plan(hopper, n, copy_pointer=False).copy_kernel
    assert plan(hopper, 262144, training=False, copy_pointer=True).copy_kernel
    assert not plan(torch.device("cpu"), 49152, copy_pointer=True).copy_kernel


def test_the_qk_rope_kernels_are_on_where_cuda_and_the_head_size_take_them(hopper):
    """QK_ROPE_KERNEL (T6.4): on by default, on CUDA at every size, training and evaluation, where the head
    size is a power of two; never on the CPU; 0 turns it off. Its removed `forward` value (the Triton forward
    with a torch backward, no gain measured) stops with the values a switch takes."""
    for n in (16384, 32768, 49152):
        assert plan(hopper, n).qk_rope_kernel
    assert plan(hopper, 262144, training=False).qk_rope_kernel
    assert not plan(hopper, 49152, qk_rope_kernel=False).qk_rope_kernel
    assert T.Hyperparameters.from_env({"QK_ROPE_KERNEL": "0"}).execution.qk_rope_kernel is False
    off = [plan(hopper, 49152, model_dim=576, num_heads=6, head_dim=96), plan(torch.device("cpu"), 49152)]
    assert not any(p.qk_rope_kernel for p in off)
    with pytest.raises(T.SetupError, match="QK_ROPE_KERNEL='forward' is not a valid .*expected 1/0/true/false"):
        T.Hyperparameters.from_env({"QK_ROPE_KERNEL": "forward"})
    with pytest.raises(T.SetupError, match="did you mean QK_ROPE_KERNEL"):
        T.Hyperparameters.from_env({"QK_ROPE_KERNELS": "1"})


def test_the_trainer_logs_one_line_per_distinct_plan(corpus):
    lines = []
    hp = T.Hyperparameters.of(device="cpu", compile=False, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256,
                              ngram_rows=1001, train_files=str(corpus / "tiny_train_*.bin"), val_tokens=2048,
                              val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus), val_seq_len=1024,
                              stages=T.replace_stage_columns(T.STAGES, batch_tokens=(2048, 4096, 4096, 4096, 4096),
                                                             max_seq_len=(128, 256, 256, 256, 256)))
    trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), lines.append)
    plans = [line for line in lines if line.startswith("execution plan")]
    rest = "dc_mha_kernel=0 qk_rope_kernel=0 copy_kernel=0"
    fused = "attention=sdpa mlp_fused=1 mlp_kernel=0 mlp_e4m3=0 qkv_e4m3=0 lm_head_fp8=0"
    assert plans == [f"execution plan (stage 1): {fused} ce_candidates=10240 {rest} evaluation_chunk=0",
                     f"execution plan (stage 2): {fused} ce_candidates=14336 {rest} evaluation_chunk=0",
                     f"execution plan (stage 3): {fused} ce_candidates=24576 {rest} evaluation_chunk=0",
                     f"execution plan (taper, extension): {fused} ce_candidates=0 {rest} evaluation_chunk=0",
                     # the CPU's validation takes the lm_head 64 tokens at a time
                     f"execution plan (validation): {fused} ce_candidates=0 {rest} evaluation_chunk=64"]
    assert trainer.stage_execution[3] == dataclasses.replace(trainer.validation_execution, evaluation_chunk=0)


def test_a_gpu_evaluates_32768_tokens_at_a_time(hopper):
    hp = T.Hyperparameters.of(**TINY)
    cuda = torch.device("cuda")
    assert T.resolve_execution(hp.execution, hp.model, cuda, 262144, training=False).evaluation_chunk == 32768
    assert T.resolve_execution(hp.execution, hp.model, cuda, 1024, training=False).evaluation_chunk == 1024


def test_evaluation_takes_the_lm_head_in_chunks_of_the_plan(corpus):
    """The validation's lm_head and cross-entropy run evaluation_chunk tokens at a time (a CPU's 64: its cache;
    a forward shorter than that at once); the summed loss does not depend on the chunk."""
    hp = T.Hyperparameters.of(**TINY, train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                              tokenizer_dir=str(corpus))
    cpu = torch.device("cpu")
    assert T.resolve_execution(hp.execution, hp.model, cpu, 1024, training=False).evaluation_chunk == 64
    assert T.resolve_execution(hp.execution, hp.model, cpu, 40, training=False).evaluation_chunk == 40
    assert T.resolve_execution(hp.execution, hp.model, cpu, 1024, training=True).evaluation_chunk == 0
    trainer = T.Trainer(hp, 0, 1, cpu, T.RunLog(None))
    chunks = []
    evaluation_loss = trainer.evaluation_loss
    trainer.evaluation_loss = lambda *args: chunks.append(args[-1]) or evaluation_loss(*args)
    loss = trainer.evaluate(0)
    assert chunks == [64]  # TINY's VAL_TOKENS=1024: one forward of VAL_SEQ_LEN=1024
    inputs, targets, cu_seqlens = next(iter(trainer.val_set))
    shape, _ = trainer.validation_shape(0)
    trainer.ngram.load(inputs)  # the forward's n-gram rows (T3.19)
    with torch.no_grad():
        sums = [trainer.model.evaluation_loss(inputs, targets, cu_seqlens, shape, trainer.validation_execution, chunk)
                for chunk in (64, 1024)]
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-6, atol=0)
    assert abs(sums[0].item() / inputs.numel() - loss) < 1e-6 * loss  # evaluate's mean: one float


# --- the settings tree ------------------------------------------------------------------------------

def test_every_setting_lives_in_exactly_one_part_and_flat_names_round_trip():
    owners = {}
    for part in dataclasses.fields(T.Hyperparameters):
        for field in dataclasses.fields(part.default_factory):
            owners.setdefault(field.name, []).append(part.name)
    assert all(len(parts) == 1 for parts in owners.values()), owners
    hp = T.Hyperparameters.of(muon_lr=0.02, seed=7, fp8_mlp=False)
    assert (hp.optim.muon_lr, hp.run.seed, hp.execution.fp8_mlp) == (0.02, 7, False)
    assert hp.flat()["muon_lr"] == 0.02 and set(hp.flat()) == set(owners)
    assert hp.replace(seed=8).run.seed == 8 and hp.run.seed == 7  # frozen: replace makes a new tree
    with pytest.raises(T.SetupError, match="unknown setting 'muon_lrr'; did you mean muon_lr"):
        T.Hyperparameters.of(muon_lrr=0.1)


@pytest.mark.parametrize("name, nearest", [("MUON_LRR", "MUON_LR"), ("SEEED", "SEED"), ("VAL_TOKEN", "VAL_TOKENS"),
                                           ("STAGE_BATCH", "STAGE_BATCH_TOKENS"), ("FP8_MLPP", "FP8_MLP")])
def test_a_mistyped_setting_stops_with_the_nearest_name(name, nearest):
    with pytest.raises(T.SetupError, match=f"unknown setting {name}='0.01'; did you mean {nearest}\\?"):
        T.Hyperparameters.from_env({name: "0.01"})


def test_other_programs_variables_pass():
    environ = {name: "1" for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                                      "NCCL_DEBUG", "TRITON_INTERPRET", "PYTORCH_ALLOC_CONF", "HF_HUB_OFFLINE",
                                      "SMOKE", "NGPU", "PATH", "HOME", "GROUP_RANK", "ROLE_WORLD_SIZE")}
    assert T.Hyperparameters.from_env(environ) == T.Hyperparameters()


def test_a_removed_setting_says_so():
    with pytest.raises(T.SetupError, match="PAIRED_ROPE_BY_HEAD was removed"):
        T.Hyperparameters.from_env({"PAIRED_ROPE_BY_HEAD": "1"})
    with pytest.raises(T.SetupError, match="VALUE_EMBED_SPARSE was removed.*measured slower"):
        T.Hyperparameters.from_env({"VALUE_EMBED_SPARSE": "1"})
    with pytest.raises(T.SetupError, match=r"TABLE_ADAM_PERIOD was removed.*\(T2.10\)"):
        T.Hyperparameters.from_env({"TABLE_ADAM_PERIOD": "4"})
    with pytest.raises(T.SetupError, match=r"E4M3_LOGITS was removed: .*more loss than time \(T4.4\)"):
        T.Hyperparameters.from_env({"E4M3_LOGITS": "1"})
    with pytest.raises(T.SetupError, match=r"FP8_QKV_BACKWARD was removed: .*wrong on Triton 3.6.*\(T6.3\)"):
        T.Hyperparameters.from_env({"FP8_QKV_BACKWARD": "1"})
    # the deletion pass (#77): a technique switch, a size threshold, a removed layout
    for name, why in (("DC_MHA", "the technique is always on"), ("FA4_MIN_TOKENS", "size thresholds"),
                      ("NARROW_VO_LAYERS", "narrow V/O heads")):
        with pytest.raises(T.SetupError, match=f"^{name} was removed: {why}.*; unset it$"):
            T.Hyperparameters.from_env({name: "1"})
