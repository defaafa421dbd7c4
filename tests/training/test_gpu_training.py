"""The training step on a CUDA GPU (tiny configuration): it must never make the host wait for the
GPU, so the CPU can queue the next kernels while the current ones run (launch gaps otherwise
show as idle GPU time, most in stage 1 where kernels are short)."""

import pytest
import torch

import train_gpt as T

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TINY = dict(device="cuda", compile=False, warmup=False, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256,
            ngram_rows=4001, window_block_size=16,
            stages=T.replace_stage_columns(T.STAGES, batch_tokens=(2048, 4096, 4096, 4096, 4096), max_seq_len=(128, 256, 256, 256, 256)), val_tokens=2048, val_seq_len=1024, num_scheduled_iterations=12,
            num_extension_iterations=2, rank_slice=True)


def test_training_steps_never_synchronize_with_the_host(corpus):
    hp = T.Hyperparameters.of(**TINY, train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                           tokenizer_dir=str(corpus))
    trainer = T.Trainer(hp, 0, 1, torch.device("cuda"), T.RunLog(None))
    loader = T.TrainLoader(hp.data.train_files, 0, 1, torch.device("cuda"))
    for step in range(2):  # first calls allocate, initialize handles and load kernels
        trainer.train_step(trainer.schedule.plan(step), loader)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, 12):  # stage changes, Adam and non-Adam steps, the untie step
            trainer.train_step(trainer.schedule.plan(step), loader)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(trainer.losses[:12]).all()


def test_gpu_memory_cap_holds_the_allocator_to_it():
    """GPU_MEMORY_GIB: the allocator frees its cache and then refuses past the cap (what an 80 GB H100 would refuse,
    checked on a larger GPU); more than the GPU has is a set-up error. The cap here: 1 GiB above what this process
    already holds (earlier GPU tests in the same pytest process leave memory behind)."""
    device = torch.device("cuda")  # no index: the current device, as torch.device("cuda") means elsewhere
    total = torch.cuda.get_device_properties(device).total_memory
    with pytest.raises(T.SetupError, match=r"GPU_MEMORY_GIB=\S+ is more than this GPU's"):
        T.limit_gpu_memory(total / 2**30 + 1, device)
    torch.cuda.empty_cache()
    try:
        T.limit_gpu_memory(torch.cuda.memory_reserved(device) / 2**30 + 1.0, device)
        kept = torch.empty(600 * 2**20, dtype=torch.uint8, device=device)  # under the cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(600 * 2**20, dtype=torch.uint8, device=device)  # 1.2 GiB with the first
        del kept
        torch.empty(600 * 2**20, dtype=torch.uint8, device=device)  # the freed block is reused
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
