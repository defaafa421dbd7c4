"""Helpers shared by the test files in tests/'s capability folders (model/, kernels/, optimizer/, data/,
training/, tools/): `from helpers import ...` (pytest.ini's `pythonpath = . tests` puts tests/ on the
path). No test file imports another test file; what two of them share lives here."""
import os
import socket
import subprocess
import sys

import numpy as np
import torch

import train_gpt as T

# Every test process multiplies CPU bf16 operands as train_gpt.py's CPU runs do (cpu_16bit_gemms_in_fp32):
# pytest's (conftest imports this module) and the workers that mp.spawn starts, which import their test
# module and so this one.
T.cpu_16bit_gemms_in_fp32()

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# glibc keeps freed memory instead of mapping and zeroing each step's vocabulary-sized tensors anew
# (data/smoke/preset.py's CPU_MALLOC, which SMOKE=1 uses on the CPU): a tiny CPU run spends about half
# its time in those page faults otherwise. Speed only: the same computation, bit for bit. tiny_env
# sets it for main() subprocesses; conftest.py sets the same through mallopt in the pytest process.
CPU_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"

# The tiny CPU configuration of the training tests (and of the tools run on it). Validation takes one
# sequence of 1024 tokens: every validation pays the full 50,304-column softmax, the CPU suite's largest
# cost after the training steps' own. The copy pointer (T4.8, on by default) is off here: it changes the loss
# every other reference formulation checks, and needs GPT-2's vocabulary (tests/model/test_copy_pointer.py and
# tests/training/test_reference_losses.py run it).
TINY_STAGES = dict(batch_tokens=(2048, 4096, 4096, 4096, 4096), max_seq_len=(128, 256, 256, 256, 256))
TINY = dict(device="cpu", compile=False, warmup=False, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=256,
            ngram_rows=4001, stages=T.replace_stage_columns(T.STAGES, **TINY_STAGES), window_block_size=16,
            val_tokens=1024, val_seq_len=1024, muon_momentum_warmup_steps=5, muon_momentum_cooldown_steps=2,
            copy_pointer=False)

# The layout before the 2026-11-28 defaults: attention on every layer but 6, five value-embedding planes,
# narrow Q/K on all attention layers but 3 and 10 (tests that pin what each layer carries use it)
FULL_LAYOUT = dict(attention_layers=(0, 1, 2, 3, 4, 5, 7, 8, 9, 10), value_embed_layers=(1, 2, 8, 9, 10),
                   narrow_qk_layers=(0, 1, 2, 4, 5, 7, 8, 9))


def model_of(hp: T.Hyperparameters) -> T.GPT:
    return T.GPT(hp.model, T.longest_forward(hp))


def tiny_env(tmp_path, corpus, **overrides) -> dict:
    """Environment variables for a tiny main() run on the corpus (one process: CPU_MALLOC)."""
    values = {k: v for k, v in TINY.items() if k != "stages"}
    values.update({f"stage_{column}": value for column, value in TINY_STAGES.items()})
    values.update(train_files=str(corpus / "tiny_train_*.bin"), val_files=str(corpus / "tiny_val_*.bin"),
                  tokenizer_dir=str(corpus), log_dir=str(tmp_path / "logs"), num_scheduled_iterations=6,
                  num_extension_iterations=1, val_loss_every=3)
    values.update(overrides)
    names = set(T.hyperparameter_variables())
    env = {k: v for k, v in os.environ.items() if k.upper() not in names}
    env.setdefault("GLIBC_TUNABLES", CPU_MALLOC)
    for key, value in values.items():
        env[key.upper()] = ",".join(map(str, value)) if isinstance(value, tuple) else str(int(value) if isinstance(value, bool) else value)
    return env


def random_batch(T_tokens=256, docs=(0, 40, 41, 200), vocab=50000):
    ids = torch.randint(0, vocab, (T_tokens + 1,))
    ids[list(docs)] = min(T.BOS_ID, vocab - 1)
    cu = T.cu_seqlens_for(list(np.diff(list(docs) + [T_tokens + 1])), T_tokens, 16)
    return ids[:-1].int(), ids[1:].int(), torch.from_numpy(cu)


def free_port() -> int:
    """A free TCP port on the loopback interface, for a gloo process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dc_mha_dense(q, k, v, doc_ids, w1, w2, window):
    """DC-MHA's definition over a T x T mask, in float64."""
    q, k, v, w1, w2 = (t.double() for t in (q, k, v, w1, w2))
    T_, H, _ = q.shape
    pos = torch.arange(T_, device=q.device)
    visible = ((pos[:, None] - pos[None, :]) >= 0) & ((pos[:, None] - pos[None, :]) < window) \
        & (doc_ids[:, None] == doc_ids[None, :])
    p = torch.einsum("thd,shd->hts", q, k).masked_fill(~visible, float("-inf")).softmax(-1)
    mix = (p * w1.T[:, :, None]).sum(0)  # (t, s)
    return torch.einsum("ts,shd->thd", mix, v) * w2[..., None]


def rope_tables(tokens: int, head_dim: int, paired: bool, device="cpu"):
    """(cos, sin) at the model's initial frequencies as attention_layout slices them: (T, 1, hd/4), or
    (T, 2, 1, hd/4) for paired heads (positions 2t and 2t + 1 of the doubled sequence)."""
    positions = torch.arange(2 * tokens, dtype=torch.float64, device=device)[:, None]
    angles = positions * T.rope_frequencies(head_dim).to(device)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    if paired:
        return cos.view(tokens, 2, 1, head_dim // 4), sin.view(tokens, 2, 1, head_dim // 4)
    return cos[:tokens, None], sin[:tokens, None]


def outputs_and_grads(fn, inputs, grads) -> tuple:
    """fn's outputs on fresh leaf copies of inputs (a None passes through), then the gradients of
    those leaves given the outputs' gradients grads (cast to the outputs' dtypes)."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    grads = [g.to(o.dtype) for g, o in zip(grads, outs)]
    return (*outs, *torch.autograd.grad(outs, [t for t in leaves if t is not None], grads))


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_in_triton_interpreter(code: str, timeout: int = 900):
    """Run a check script in a fresh interpreter with TRITON_INTERPRET=1 (the flag must be set
    before Triton is imported), from the repository root with tests/ importable; fail with its output."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def write_tiny_corpus(folder, write_shard):
    """Tiny train/val shards of learnable synthetic documents (arithmetic progressions of token ids,
    each after a BOS) and an encoder.json for the prefix-token loss, in folder (a pathlib.Path).
    The tiny training configurations of the tests train on it."""
    import json

    from train_gpt import BOS_ID, GPT2_SPECIAL_TOKEN

    rng = np.random.default_rng(0)

    def documents(n):
        out = []
        for _ in range(n):
            start, step, length = rng.integers(0, 1000), rng.integers(1, 5), rng.integers(20, 400)
            out += [BOS_ID] + [int((start + step * i) % 1000) for i in range(length)]
        return out

    for i in range(1, 4):
        write_shard(str(folder / f"tiny_train_{i:06d}.bin"), documents(300))
    write_shard(str(folder / "tiny_val_000000.bin"), documents(60))

    # Token i spells i in base 26 (letters), so the prefix of token i >= 26 is token i // 26.
    def spelling(i):
        return chr(ord("a") + i) if i < 26 else spelling(i // 26) + chr(ord("a") + i % 26)
    vocabulary = {spelling(i): i for i in range(1000)} | {GPT2_SPECIAL_TOKEN: BOS_ID}
    (folder / "encoder.json").write_text(json.dumps(vocabulary))
    return folder


def cpu_execution(hp=None, tokens: int = 256, training: bool = True):
    """The execution plan train_gpt resolves for a forward of `tokens` tokens on the CPU (hp: the
    defaults on the CPU if not given): torch paths only, and the fused MLP from its token threshold."""
    hp = hp or T.Hyperparameters.of(device="cpu")
    return T.resolve_execution(hp.execution, hp.model, torch.device("cpu"), tokens, training)
