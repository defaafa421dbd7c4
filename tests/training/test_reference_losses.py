"""Reference losses of the tiny CPU configuration: every step's training loss, every validation loss
and a checksum of the final weights, compared with tests/reference_losses.json bit for bit.

A change that must not alter the math (a restructure, a kernel moved, a rename) keeps this test
passing unchanged. A change that alters it on purpose re-records the file,

    python tests/training/test_reference_losses.py --record

and says so in its commit message. Exactness holds on the machine kind the file was recorded on
(same torch version, CPU model and instruction set, one thread); elsewhere the test compares to 1e-3.
"""

import json
import os
import pathlib
import sys
import tempfile

import pytest
import torch

if __name__ == "__main__":  # run as a script: the repository root and tests/ importable, as under pytest
    sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[i]) for i in (2, 1)]
import train_gpt as T  # noqa: E402

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "reference_losses.json"  # tests/, beside helpers.py
TINY = dict(device="cpu", compile=False, warmup=False, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256,
            ngram_rows=4001, stages=T.replace_stage_columns(T.STAGES, batch_tokens=(2048, 4096, 4096, 4096, 4096),
                                                             max_seq_len=(128, 256, 256, 256, 256)),
            window_block_size=16, val_tokens=2048, val_seq_len=1024, muon_momentum_warmup_steps=5,
            muon_momentum_cooldown_steps=2, num_scheduled_iterations=12, num_extension_iterations=2)
# Every other setting is the default (the copy pointer included, T4.8).
# rank_slice: all 14 steps (three stages, the extension, untie at step 9, Adam on odd steps);
# accumulation: full-batch mode on one process, 8 micro-batches per step, the first two steps.
RUNS = {"rank_slice": dict(rank_slice=True, val_loss_every=7),
        "accumulation": dict(rank_slice=False, stop_after=2, val_loss_every=1)}


def tiny_hyperparameters(corpus: pathlib.Path, **run) -> T.Hyperparameters:
    return T.Hyperparameters.of(**TINY, **run, train_files=str(corpus / "tiny_train_*.bin"),
                             val_files=str(corpus / "tiny_val_*.bin"), tokenizer_dir=str(corpus))


def environment() -> dict:
    """What decides the CPU kernels' rounding: torch, the vector ISA torch picked, and the CPU model
    with its bf16 instructions (two "AVX512" CPUs with and without AVX512-BF16 round differently)."""
    model, flags = "", set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "cpu_model": model,
            "bf16_instructions": sorted(flags & {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})}


def run_tiny(hp: T.Hyperparameters) -> dict:
    """Train one tiny run in this process on one thread; its losses and weight sums as exact hex floats."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU reductions split by thread count round differently
    try:
        trainer = T.Trainer(hp, 0, 1, torch.device("cpu"), T.RunLog(None))
        val, evaluate = {}, trainer.evaluate

        def recording_evaluate(step, *args, **kwargs):
            result = val[step] = evaluate(step, *args, **kwargs)
            return result

        trainer.evaluate = recording_evaluate
        trainer.run()
        # on the one thread too: a sum over more elements than one thread's grain splits by the thread count
        sums = sorted((p.numel(), p.double().sum().item(), p.double().abs().sum().item())
                      for p in trainer.model.parameters())
    finally:
        torch.set_num_threads(threads)
    steps = hp.run.stop_after or trainer.schedule.total_steps
    return {"train_loss": [x.hex() for x in trainer.losses[:steps].tolist()],
            "val_loss": {str(step): value.hex() for step, value in sorted(val.items())},
            "weight_sums": [[n, s.hex(), a.hex()] for n, s, a in sums]}


def record():
    from helpers import write_tiny_corpus
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "data"))
    import shards
    with tempfile.TemporaryDirectory() as folder:
        corpus = write_tiny_corpus(pathlib.Path(folder), shards.write_shard)
        runs = {name: run_tiny(tiny_hyperparameters(corpus, **run)) for name, run in RUNS.items()}
    REFERENCE.write_text(json.dumps({"environment": environment(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {REFERENCE}")


def as_floats(run: dict) -> dict:
    return {"train_loss": [float.fromhex(x) for x in run["train_loss"]],
            "val_loss": {step: float.fromhex(x) for step, x in run["val_loss"].items()},
            "weight_sums": [[n, float.fromhex(s), float.fromhex(a)] for n, s, a in run["weight_sums"]]}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_tiny_run_reproduces_the_reference_losses(name, corpus):
    reference = json.loads(REFERENCE.read_text())
    got, want = as_floats(run_tiny(tiny_hyperparameters(corpus, **RUNS[name]))), as_floats(reference["runs"][name])
    if reference["environment"] == environment():
        assert got == want, "the tiny run's math changed (bit for bit against tests/reference_losses.json)"
    else:  # another torch or instruction set rounds differently; a changed formula moves losses by more
        assert got["val_loss"].keys() == want["val_loss"].keys()
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-3)
        assert list(got["val_loss"].values()) == pytest.approx(list(want["val_loss"].values()), rel=1e-3)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/training/test_reference_losses.py --record")
    record()
