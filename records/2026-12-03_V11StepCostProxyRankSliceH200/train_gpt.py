"""speedrun: train a GPT-2-small-class model to a target validation loss as fast as possible.

    torchrun --standalone --nproc_per_node=8 train_gpt.py      # also 1, 2 or 4 GPUs (same math)

Read top-down: config (every hyperparameter, the stage table), model, optimizer, the n-gram table, data, schedule
(with the log's lines and the settings' checks), the CUDA graphs of a step, training, the processes and main(), then
the fast paths (Triton kernels, each beside its torch reference). Every field of `Hyperparameters` is overridable by
the environment variable of its name in upper case (VAL_LOSS_EVERY=125). Comments cite techniques by section of
docs/TECHNIQUES.md (T3.4) and by the NanoGPT-speedrun record that introduced them (#62)."""

import os

os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
# FlashAttention-4 keeps its JIT-compiled kernels on disk, so later runs skip the compile (read at import)
os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")

import atexit
import copy
import dataclasses
import difflib
import functools
import gc
import glob
import json
import math
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import typing
import unicodedata
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs may lack Triton; every kernel has a torch path
    triton = None
try:
    from flash_attn.cute import interface as fa4_interface  # FlashAttention-4 (CuTe DSL): requirements-gpu.txt
except ImportError:
    fa4_interface = None

warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated.*")
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated.*")

# =============================================================================================
# Config
# =============================================================================================

RANKS_PER_STEP = 8  # the schedule is written for 8 ranks; fewer GPUs accumulate gradients


class SetupError(ValueError):
    """A problem with the run's settings, machine or input files: main() reports it as one line
    naming the fix (on rank 0 only, and in the run's log once it is open) and exits with 1."""


@dataclass(frozen=True)
class Stage:
    """One row of the schedule (T5.1). `fraction`: its share of the scheduled steps, None for the extension after them
    (NUM_EXTENSION_ITERATIONS steps at the lr floor). Weights given as (start, end) move linearly across the stage."""
    fraction: float | None
    batch_tokens: int  # global tokens per step; each of the RANKS_PER_STEP ranks takes 1/8
    max_seq_len: int  # documents are truncated to this length
    short_window: int  # sliding attention windows, in blocks of WINDOW_BLOCK_SIZE tokens (T3.8)
    long_window: int
    lr_mul: float  # learning-rate multiplier before the cooldown
    mtp_weights: tuple[tuple[float, float], ...]  # loss weight of targets t+1, t+2, ... (T4.2)
    prefix_weight: tuple[float, float] | None  # prefix-token loss weight (T4.3); None: no such target
    ce_candidates: int  # columns of the training cross-entropy per forward (T4.6); 0: the full softmax
    attention_cap: int  # training attention sees at most this many tokens of a document (T5.5); 0: no cap
    taper: bool = False  # the taper row TAPER_FRACTION cuts from the stage before it (T5.5)


TAPER = 0.08  # the scheduled steps' last 8 %: a taper row of stage 3's with the full softmax (TAPER_FRACTION, T5.5)
# From stage 3 on, documents of up to 3072 tokens under a 2560-token attention cap (record #92, PR #360; T5.5)
#       fraction  batch    seq   short long  lr    MTP weights: t+1, t+2, t+3          prefix        CE cands  cap
STAGES = (
    Stage(1 / 3, 131_072, 896, 1, 3, 1.00, ((1.0, 1.0), (0.5, 0.5), (0.25, 0.0)), (0.25, 0.25), 10_240, 0),
    Stage(1 / 3, 262_144, 2048, 3, 7, 1.52, ((1.0, 1.0), (0.5, 0.0)), (0.25, 0.0), 14_336, 0),
    Stage(1 / 3 - TAPER, 393_216, 3072, 5, 11, 1.73, ((1.0, 1.0),), None, 24_576, 2560),
    Stage(TAPER, 393_216, 3072, 5, 11, 1.73, ((1.0, 1.0),), None, 0, 2560, taper=True),
    Stage(None, 393_216, 3072, 6, 13, 1.73, ((1.0, 1.0),), None, 0, 2560),
)
# Columns that STAGE_<COLUMN> overrides, one comma-separated entry per row (STAGE_FRACTION: every row but the extension)
STAGE_COLUMNS = ("batch_tokens", "max_seq_len", "short_window", "long_window", "lr_mul", "ce_candidates",
                 "attention_cap")


def stage_names(stages: tuple[Stage, ...]) -> list[str]:
    """What the log calls each row: stage 1, stage 2, ..., the taper (T5.5), the extension."""
    return [("taper" if stage.taper else f"stage {i + 1}") if stage.fraction is not None else "extension"
            for i, stage in enumerate(stages)]


def set_taper(stages: tuple[Stage, ...], fraction: float) -> tuple[Stage, ...]:
    """The table with its taper row (record #92, PR #360; T5.5) holding the last `fraction` of the scheduled
    steps, cut from the stage before it: a stage boundary late in the run where the batch or the candidate
    budget can change. A table with a taper row keeps that row's columns and moves the boundary; one without
    gets a copy of its last stage's row; 0 removes the row, its steps going back to that stage."""
    *rows, extension = stages
    if rows[-1].taper:
        *rows, taper = rows
        rows[-1] = dataclasses.replace(rows[-1], fraction=rows[-1].fraction + taper.fraction)
    else:
        taper = dataclasses.replace(rows[-1], taper=True)
    if not fraction:
        return (*rows, extension)
    last = rows[-1]
    if not 0 < fraction < last.fraction:
        raise SetupError(f"TAPER_FRACTION={fraction}: give a share of the scheduled steps in [0, {last.fraction:.6g}) "
                         f"(stage {len(rows)}'s fraction, which the taper row is cut from; 0: no taper row)")
    return (*rows[:-1], dataclasses.replace(last, fraction=last.fraction - fraction),
            dataclasses.replace(taper, fraction=fraction), extension)


def replace_stage_columns(stages: tuple[Stage, ...], **columns: tuple) -> tuple[Stage, ...]:
    """The table with whole columns replaced (batch_tokens=(2048, 4096, 4096, 4096)); `fraction` skips the extension."""
    names = stage_names(stages)
    tapered = any(stage.taper for stage in stages)
    taper_hint = "; TAPER_FRACTION=0 removes the taper row" if tapered else "; TAPER_FRACTION>0 adds a taper row"
    for name, values in columns.items():
        if name not in ("fraction", *STAGE_COLUMNS):
            raise SetupError(f"unknown stage column {name!r} (one of fraction, {', '.join(STAGE_COLUMNS)})")
        rows = names[:-1] if name == "fraction" else names
        if len(values) != len(rows):
            which = "rows with a fraction" if name == "fraction" else "rows"
            raise SetupError(f"STAGE_{name.upper()} has {len(values)} entries; the stage table has {len(rows)} "
                             f"{which} ({', '.join(rows)}{taper_hint}): give one entry per row")
    return tuple(dataclasses.replace(stage, **{name: values[i] for name, values in columns.items()
                                               if i < len(values)})  # fraction: the extension keeps None
                 for i, stage in enumerate(stages))


@dataclass(frozen=True)
class DataConfig:
    """The token shards (T1.1) and the validation set."""
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760  # proxy runs use 3_932_160
    val_seq_len: int = 262_144  # tokens per validation forward on one rank
    tokenizer_dir: str = "data/gpt2"  # GPT-2's encoder.json (the prefix-token loss)
    # 1: a run whose steps need more than the train files hold reads them again (the smoke preset); 0: it stops in
    # --check and at start, naming the shards it needs (a second pass measures memorization, not learning)
    allow_repeat: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """The architecture (T3): its sizes and which layers carry what; the techniques are always on (the
    ablations of those that had switches: docs/TECHNIQUES.md, Removed)."""
    vocab_size: int = 50304
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_hidden: int = 3072
    # the others are MLP only (4, 6, 9) or skipped whole (7), as in record #92 (T3.1)
    attention_layers: tuple[int, ...] = (0, 1, 2, 3, 5, 8, 10)
    value_embed_layers: tuple[int, ...] = (1, 2, 8, 10)  # attention layers given a value-embedding plane (T3.3)
    mlp_layers: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 9, 10)  # the layers with an MLP: all but 7 (T3.1)
    # attention layers with Q/K heads HEAD_DIM/2 wide, fully rotated (T3.18, record #92): all but layers 3 and 10
    narrow_qk_layers: tuple[int, ...] = (0, 1, 2, 5, 8)
    # the bigram injection's rows from a hashed bigram + trigram table this large (T3.19; record #92's rows per rank)
    ngram_rows: int = 10_575_360
    # >0: the table holds this many rows per process, NGRAM_ROWS = it × the world size (T3.19): 8 GPUs hold record
    # #92's 84.6M rows while rank-slice (world size 1) holds one rank's share; the math then differs by world size
    ngram_rows_per_rank: int = 0
    ngram_token_classes: bool = False  # the n-gram hashes read each token's normalization class (T3.22, PR #375)
    copy_pointer: bool = True  # the next-token term mixed with a pointer over the document's recent tokens (T4.8)
    copy_window: int = 2048  # ... the tokens it looks back over in training and the validations on the way
    final_copy_window: int = 8192  # ... and at the final validation (PR #379's)


@dataclass(frozen=True)
class OptimConfig:
    """NorMuon on the banks, Adam on the rest (T2); the per-parameter table is NorMuonAdam's."""
    muon_lr: float = 0.017  # the reference: 0.023 (tuned on the proxy, docs/TECHNIQUES.md T2.4)
    muon_beta2: float = 0.9
    muon_weight_decay: float = 1.2
    muon_rails_slow_beta: float = 0.98  # the slow momentum rail's constant beta (T2.9, record #92)
    adam_lr: float = 0.008
    adam_eps: float = 1e-10
    adam_weight_decay: float = 0.005


@dataclass(frozen=True)
class ScheduleConfig:
    """The stage table and what changes along the run (T5, T2.8, T2.9, T4)."""
    num_scheduled_iterations: int = 1085  # the reference: 1270 in all (T5.1)
    num_extension_iterations: int = 15
    stages: tuple[Stage, ...] = STAGES  # environment: STAGE_BATCH_TOKENS=131072,262144,393216,393216,393216 etc.
    taper_fraction: float = TAPER  # the taper row's share of the scheduled steps, set before the STAGE_<COLUMN>
    # overrides (set_taper, T5.5); 0: no taper row, and the columns take an entry fewer
    final_long_window: int = 32  # long window of the last validation, in blocks (no YaRN update); the reference: 20
    window_block_size: int = 128
    cooldown_frac: float = 0.55  # the reference: 0.60 (T5.1)
    lr_floor: float = 0.15
    untie_embed_at: float = 2 / 3  # fraction of the scheduled steps; 0 keeps them tied (T3.15)
    muon_momentum_min: float = 0.85
    muon_momentum_max: float = 0.95
    muon_momentum_warmup_steps: int = 300
    muon_momentum_cooldown_steps: int = 50
    muon_rails_engage_at: float = 0.44  # from this fraction of the scheduled steps the fast momentum rail's beta
    # is MUON_RAILS_FAST_BETA and the blend weighs it MUON_RAILS_FAST_WEIGHT (T2.9); before it, Muon's single EMA
    muon_rails_fast_beta: float = 0.85
    muon_rails_fast_weight: float = 0.4385
    # an fp32 EMA of the weights over this share of all steps, blended in before the final validation; 0: off (T5.4)
    tail_ema_frac: float = 0.236
    tail_ema_bank_blend: float = 0.55  # the EMA's share of the NorMuon banks after the blend (0: not averaged)
    tail_ema_embed_blend: float = 0.65  # the EMA's share of embed and lm_head after the blend (0: not averaged)


@dataclass(frozen=True)
class ExecutionConfig:
    """How the math runs, not what it computes: the fast paths, each with its reference (0), resolved once
    per stage into an ExecutionPlan (see resolve_execution)."""
    attention_backend: str = "auto"  # auto | fa4 | flex | sdpa
    fp8_lm_head: bool = True  # CUDA only
    fused_mlp: bool = True  # fused MLP GEMM + ReLU² (Triton kernels on CUDA)
    fp8_mlp: bool = True  # fused MLP layers' training forward in e4m3 and backward in e4m3/e5m2 (sm90+ GPUs)
    fp8_qkv: bool = True  # attention layers' Q/K/V projection, training forward in e4m3 (sm90+; backward bf16)
    qk_rope_kernel: bool = True  # QK-norm + rotary as Triton kernels, forward and backward (CUDA, T6.4)
    compile: bool = True
    cuda_graphs: bool = True  # each training step's forward and backward replayed from a CUDA graph (CUDA; WARMUP)


@dataclass(frozen=True)
class RunConfig:
    """One process's runs: where, how many, what is logged."""
    val_loss_every: int = 250  # 0: only at the start and the end
    stop_after: int = 0  # >0: end the run after this many steps, schedule unchanged (quick comparisons)
    rank_slice: bool = False  # one GPU computes one rank's share of each 8-GPU step
    seed: int = 0
    seeds: tuple[int, ...] = ()  # e.g. 1,2,3: one compile, then one timed run per seed, logged as RUN_ID_s<seed>
    device: str = "cuda"  # "cpu" runs the same code on the CPU (tests, smoke runs)
    # >0: this process's CUDA caching allocator holds at most this many GiB (graph pools included), so that a
    # larger GPU checks what fits a smaller one (77 on an H200: inside what an 80 GB H100's allocator gets)
    gpu_memory_gib: float = 0.0
    warmup: bool = True  # compile every shape before the clock, then restore the initial state
    run_id: str = ""
    log_dir: str = "logs"
    train_loss_every: int = 0  # >0: add train_loss to every N-th step line (costs a sync)


@dataclass(frozen=True)
class Hyperparameters:
    """Every setting, one tree of parts. Each field of a part is also a flat name: the environment
    variable of that name in upper case overrides it (MUON_LR=0.02), and `of(muon_lr=0.02)` and
    `replace(...)` take the flat names; the stage table's columns are STAGE_<COLUMN>."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    @staticmethod
    def part_of_field() -> dict[str, str]:
        """Flat field name -> the part that holds it."""
        return {f.name: part.name for part in dataclasses.fields(Hyperparameters)
                for f in dataclasses.fields(part.default_factory)}

    @classmethod
    def of(cls, **values) -> "Hyperparameters":
        """The defaults with the given flat fields replaced."""
        return cls().replace(**values)

    def replace(self, **values) -> "Hyperparameters":
        parts, owner = {}, self.part_of_field()
        for name, value in values.items():
            if name not in owner:
                raise SetupError(f"unknown setting {name!r}{nearest_hint(name, list(owner))}")
            parts.setdefault(owner[name], {})[name] = value
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **fields)
                                            for part, fields in parts.items()})

    def flat(self) -> dict:
        """{flat name: value} of every field (the log's `hyperparameters:` JSON)."""
        return {name: value for part in dataclasses.fields(self)
                for name, value in dataclasses.asdict(getattr(self, part.name)).items()}

    @classmethod
    def from_env(cls, environ=os.environ) -> "Hyperparameters":
        """Defaults overridden by environment variables named like the fields in upper case; the stage table's columns
        by STAGE_<COLUMN>. A misspelled setting (MUON_LRR) stops with the nearest name."""
        check_unknown_settings(environ)
        if "SEED" in environ and "SEEDS" in environ:
            raise SetupError("SEED and SEEDS are both set: SEEDS=1,2,3 makes one run per seed, SEED the seed of a "
                             "single run; unset one")
        types = {part.name: part.default_factory for part in dataclasses.fields(cls)}
        kinds = {name: typing.get_type_hints(types[part])[name] for name, part in cls.part_of_field().items()}
        values = {name: _parse_env_value(name.upper(), environ[name.upper()], kind)
                  for name, kind in kinds.items() if name != "stages" and name.upper() in environ}
        columns = {}
        for column in ("fraction", *STAGE_COLUMNS):
            name = f"STAGE_{column.upper()}"
            if name in environ:
                kind = float if column == "fraction" else typing.get_type_hints(Stage)[column]
                columns[column] = _parse_env_value(name, environ[name], tuple[kind, ...])
        taper = values.get("taper_fraction")
        stages = STAGES if taper is None else set_taper(STAGES, taper)  # first, so that the columns count its row
        return cls.of(**values, stages=replace_stage_columns(stages, **columns))


def hyperparameter_variables() -> list[str]:
    """The environment variables Hyperparameters.from_env reads."""
    names = [name.upper() for name in Hyperparameters.part_of_field() if name != "stages"]
    return names + [f"STAGE_{column.upper()}" for column in ("fraction", *STAGE_COLUMNS)]


def nearest_hint(name: str, known: list[str]) -> str:
    """', did you mean X?' for the closest known name, or ''."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def check_unknown_settings(environ):
    """Stop on an environment variable that looks like one of ours but is none: it shares a prefix
    that two or more settings share (MUON_, STAGE_, FP8_, ...) or is spelled close to one. Run.sh
    calls --check first, so a typo never trains silently with the default."""
    known = hyperparameter_variables()
    prefixes = {name.split("_")[0] + "_" for name in known}
    prefixes = {p for p in prefixes if sum(name.startswith(p) for name in known) >= 2}
    for name in sorted(environ):
        if name in REMOVED_SETTINGS:
            raise SetupError(f"{name} was removed: {REMOVED_SETTINGS[name]} (docs/TECHNIQUES.md, Removed); unset it")
        if name in known or name in NOT_SETTINGS:
            continue
        if any(name.startswith(p) for p in prefixes) or difflib.get_close_matches(name, known, n=1, cutoff=0.85):
            hint = nearest_hint(name, known) or f" (settings: {', '.join(sorted(known))})"
            raise SetupError(f"unknown setting {name}={environ[name]!r}{hint}")


# Environment variables that look like settings but belong to others (torchrun, run.sh)
NOT_SETTINGS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SMOKE", "NGPU"}
# Settings taken out of the code, and why (docs/TECHNIQUES.md, Removed, keeps their numbers)
REMOVED_SETTINGS = {
    **dict.fromkeys(("VALUE_EMBEDS", "SKIP_CONNECTION", "RESIDUAL_LAMBDAS", "ATTN_LAMBDAS", "SMEAR_GATE",
                     "ATTN_OUTPUT_GATES", "YARN", "KEY_OFFSET", "PAIRED_HEADS", "BIGRAM_EMBED", "BACKOUT",
                     "LATE_ATTN_FROM_LAYER7", "XSA", "DC_MHA", "SLIDING_WINDOWS", "MULTI_TOKEN_PREDICTION",
                     "PREFIX_LOSS", "ADAM_EVERY_OTHER_STEP", "MANTISSA_TRACKING", "MUON_RAILS"),
                    "the technique is always on; its switch's other value was not a measured alternative with a use"),
    **dict.fromkeys(("FA4_MIN_TOKENS", "FUSED_MLP_MIN_TOKENS", "FP8_QKV_MIN_TOKENS"),
                    "size thresholds that mattered only to eager steps launched from the host"),
    **dict.fromkeys(("BIGRAM_ROWS", "NGRAM_OPTIMIZER", "NGRAM_ORDERS"),
                    "the n-gram table (row-wise RMSprop, orders 2 and 3) beat the bigram table and Adam rows"),
    "OPTIMIZER_GRAPHS": "a speed-up of world size 1 alone (rank-slice), which the 8-GPU run it stands for lacks",
    "ORTHOGONALIZER": "Polar Express's five maps are the one set; bench/quintic_maps.py keeps the others",
    "VAL_MASK": "validation masking; record V9's own train_gpt.py keeps it",
    "NARROW_VO_LAYERS": "narrow V/O heads, unmeasured in training since 2026-11-28",
    "TAIL_EMA_RATE": "the tail EMA's rate is 2/(its steps + 1)", "SKIP_GUARD_CHECKS": "always on after the warm-up",
    "NONFINITE_CHECK_EVERY": "every 25 steps", "SAVE_CHECKPOINT": "no tool read its checkpoints; off, unused",
    "EMBED_GRAD_FP32": "fp32-summed embedding gradients measured no gain",
    "PAIRED_ROPE_BY_HEAD": "the reference's paired-head rotary positions measured no gain",
    "VALUE_EMBED_SPARSE": "the value embeddings as a row table measured slower than the dense path (T3.20)",
    "E4M3_LOGITS": "e4m3 logits into the cross-entropy cost more loss than time (T4.4)",
    "FP8_QKV_BACKWARD": "its kernel's transposed store was wrong on Triton 3.6, for ~0.35 s a run at best (T6.3)",
    **dict.fromkeys(("TABLE_ADAM_PERIOD", "TABLE_ADAM_PERIOD_FROM"),
                    "the embedding tables' Adam every 4th step cost more loss than time (T2.10)")}


def _parse_env_value(name: str, raw: str, kind):
    try:
        if kind is bool:
            word = raw.strip().lower()
            if word in ("1", "true", "yes", "on"):
                return True
            if word in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected 1/0/true/false")
        if kind is int:
            return int(raw.replace("_", ""))
        if kind is float:
            return float(raw)
        if kind is str:
            return raw
        item = typing.get_args(kind)[0]  # tuple[int, ...] / tuple[float, ...]: comma separated, empty: ()
        return tuple(item(x.replace("_", "")) for x in raw.split(",")) if raw.strip() else ()
    except ValueError as error:
        raise SetupError(f"environment variable {name}={raw!r} is not a valid {kind}: {error}") from None


def grad_accum_steps(hp: Hyperparameters, world_size: int) -> int:
    """Micro-batches per step on each GPU: fewer GPUs accumulate the 8 ranks' slices (T1.3)."""
    return 1 if hp.run.rank_slice else RANKS_PER_STEP // world_size


def longest_forward(hp: Hyperparameters) -> int:
    """Tokens of the longest forward on one rank (sizes the rotary tables)."""
    return max(hp.data.val_seq_len, longest_training_forward(hp))


def longest_training_forward(hp: Hyperparameters) -> int:
    """Tokens of the longest training forward (one micro-batch) on one rank (sizes the n-gram row cache, T3.19)."""
    return max(stage.batch_tokens for stage in hp.schedule.stages) // RANKS_PER_STEP

# =============================================================================================
# Model
# =============================================================================================

# Layer layout of the 11-layer model (T3.1). Which layers attend (layer 6 not, #17; the index in
# ModelConfig.attention_layers is the bank slot) and which take a value embedding (the index in
# ModelConfig.value_embed_layers is the table's block) are settings; the roles below are fixed.
NUM_LAYERS = 11
LONG_WINDOW_LAYERS = (3, 10)
PAIRED_HEAD_LAYERS = (0, 2, 5, 9)
KEY_OFFSET_LAYERS = (3, 10)
SKIP_SOURCE_LAYER, SKIP_TARGET_LAYER = 3, 6
CACHED_LAYER = 7  # its output feeds attention in layers 8-10 (#77) and the final mix (#40)
XSA_LAYERS = (1, 3, 4, 7)  # exclusive self-attention (#82, #85)
OUTPUT_GATE_LAYERS = (3, 10)  # attention output gates from the MUDD gates (#85)
MUDD_LAYER = 10  # residual mix, extra value input and value-embedding gate from the MUDD block (#81)
POST_GATE_LAYER = 4  # the post MUDD gate reads the residual entering this layer (#85)
DC_LAYER, DC_WINDOW = 10, 112  # lightweight DC-MHA: its layer and local window in keys (#85)
MUDD_HIDDEN, MUDD_SCALE, MUDD_GATE_SCALE_INIT = 64, 0.1, 0.1
GATE_INPUTS = 12  # residual channels a learned sigmoid gate reads (smear, value-embedding gates)
# Per-token coefficients of the MUDD block at layer 10 (from the residual entering it) and of the final mix (from the
# last residual), in output order (T3.14). "input" is the residual entering layer 0, "layerN" that after layer N.
MUDD_LAYER_OUTPUTS = ("v_input", "v_layer7", "v_residual", "mix_input", "mix_layer7", "mix_residual",
                      "ve_gate_first_heads", "ve_gate_last_heads", "attn_residual", "attn_out", "attn_input",
                      "attn_bigram", "mlp_residual", "mlp_out")
MUDD_FINAL_OUTPUTS = ("input", "layer7", "layer9", "value_embed", "layer3")
RESIDUAL_LAMBDA_INIT, BIGRAM_LAMBDA_INIT, BACKOUT_LAMBDA_INIT, SKIP_LAMBDA_INIT = math.sqrt(1.1), 0.05, 0.5, -1.5
ATTN_SCALE_INIT = 0.1  # softmax scale, raised by YaRN (#31)
# Narrow Q/K heads (T3.18) take the wide heads' softmax scale times √(128/64): a q·k of unit-RMS heads
# half as wide spreads √2 less, so its logits start as spread out as the wide heads' do (unmeasured)
NARROW_QK_SCALE_MUL = math.sqrt(2)
NO_WINDOW = -1


@dataclass(frozen=True)
class ForwardShape:
    """What a forward needs besides the tokens; each value is a compile-time constant."""
    short_window: int  # tokens, or NO_WINDOW
    long_window: int
    max_seq_len: int  # longest document (attention kernels' max_seqlen)
    n_predict: int = 1  # multi-token prediction targets t+1 .. t+n_predict
    prefix_target: bool = False  # one more target column: the prefix token of the next token (#88)
    copy_window: int = 0  # the copy pointer's look-back in tokens (T4.8); 0: COPY_WINDOW, training's


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does, fixed when the model is built from the layout above and ModelConfig's layer lists."""
    index: int
    attn_slot: int | None  # its slot in the attention banks; None: MLP only (layer 6)
    mlp_slot: int | None  # its slot in the MLP bank; None: no MLP (MLP_LAYERS, T3.1)
    long_window: bool
    paired_heads: bool  # heads h and h + H/2 attend as one head over a doubled sequence (T3.10)
    narrow_qk: bool  # Q/K heads half as wide, all their dimensions rotated; V/O stay full width (T3.18)
    qk_slot: int | None  # its slot in the Q/K bank of its width: qk_narrow_bank if narrow_qk, else qk_bank
    key_offset: bool  # keys' stationary half from the previous token (T3.11)
    value_embed: int | None  # block of the value-embedding table added to its values (T3.3)
    value_gate: int | None  # row of ve_gate_bank gating it; None at the MUDD layer (MUDD gates it)
    reads_layer7: bool  # attention reads the cached layer-7 output, not the residual (T3.12)
    mudd: bool  # the MUDD layer: dense value input and residual weights from MUDD connections (T3.14)
    skip_target: bool  # adds the gated output of SKIP_SOURCE_LAYER (T3.7)
    bigram: bool  # the bigram embedding re-injected after its attention (T3.4); layer 0's enters with x0
    xsa: bool  # gated exclusive self-attention (T3.13)
    out_gate: bool  # attention output gate from the MUDD gates (T3.16)
    dc_mha: bool  # lightweight DC-MHA on a local window (T3.17)
    gates_post: bool  # the post MUDD gate reads the residual entering this layer (T3.16)

    @property
    def value_input(self) -> bool:
        """Its attention adds an extra value input: a value embedding or the MUDD value mix."""
        return self.value_embed is not None or self.mudd


def layer_plans(cfg: ModelConfig) -> tuple[LayerPlan, ...]:
    attending = cfg.attention_layers
    wide = [layer for layer in attending if layer not in cfg.narrow_qk_layers]
    ve_layers = cfg.value_embed_layers
    gated = [layer for layer in ve_layers if layer != MUDD_LAYER]  # rows of ve_gate_bank
    return tuple(LayerPlan(
        index=layer,
        attn_slot=attending.index(layer) if layer in attending else None,
        mlp_slot=cfg.mlp_layers.index(layer) if layer in cfg.mlp_layers else None,
        long_window=layer in LONG_WINDOW_LAYERS,
        paired_heads=layer in PAIRED_HEAD_LAYERS and layer in attending,
        narrow_qk=layer in cfg.narrow_qk_layers,
        qk_slot=(cfg.narrow_qk_layers.index(layer) if layer in cfg.narrow_qk_layers
                 else wide.index(layer) if layer in wide else None),
        key_offset=layer in KEY_OFFSET_LAYERS,
        value_embed=ve_layers.index(layer) if layer in ve_layers else None,
        value_gate=gated.index(layer) if layer in gated else None,
        reads_layer7=layer > CACHED_LAYER,
        mudd=layer == MUDD_LAYER,
        skip_target=layer == SKIP_TARGET_LAYER,
        bigram=layer in attending and layer > 0,
        xsa=layer in XSA_LAYERS and layer in attending,
        out_gate=layer in OUTPUT_GATE_LAYERS,
        dc_mha=layer == DC_LAYER,
        gates_post=layer == POST_GATE_LAYER,
    ) for layer in range(NUM_LAYERS))


@dataclass(frozen=True)
class ExecutionPlan:
    """How a forward of one size runs on this device: every fast-path choice, resolved once per
    stage (resolve_execution) and passed to the model with the step, never re-tested inside it.
    With the ForwardShape it keys the compiled graph of a step."""
    attention: str  # the attention backend: fa4 | flex | sdpa
    mlp_fused: bool  # the ReLU² MLP's custom backward (T6.1); False: the plain expression
    mlp_kernel: bool  # ... with the Triton TMA GEMM (Hopper or newer); False: torch matmuls
    mlp_e4m3: bool  # the fused MLP's forward in e4m3 (T6.2) and its backward in FP8 (T6.5)
    qkv_e4m3: bool  # the Q/K/V projection in e4m3 (T6.3)
    lm_head_fp8: bool  # the lm_head and its gradients in FP8 (T4.4)
    ce_candidates: int  # the training cross-entropy's columns (T4.6): a sampled softmax; 0: the full one
    dc_mha_kernel: bool  # DC-MHA's Triton kernels (T3.17); False: plain torch
    qk_rope_kernel: bool  # QK-norm, rotary, key offset and q's scale as Triton kernels (T6.4); False: torch
    copy_kernel: bool  # the copy pointer's Triton kernels (T4.8); False: its blocked torch form
    evaluation_chunk: int  # evaluation: tokens per lm_head product and soft-capped cross-entropy; 0 in training


def resolve_execution(cfg: ExecutionConfig, model: ModelConfig, device: torch.device, tokens: int,
                      training: bool, ce_candidates: int = 0) -> ExecutionPlan:
    """The plan of a forward of `tokens` tokens on one rank: the settings and what the device has. ce_candidates: the
    stage's candidate budget (T4.6). Evaluation (training=False) stays bf16 and takes the full softmax."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    kernels = cuda and triton is not None
    hopper = kernels and torch.cuda.get_device_capability(device)[0] >= 9  # TMA, e4m3 GEMMs
    # the narrow width is a power of two where the wide one is
    qk_width = model.head_dim // 2 if model.narrow_qk_layers else model.head_dim
    return ExecutionPlan(
        attention=resolve_attention_backend(cfg.attention_backend, device.type), mlp_fused=cfg.fused_mlp,
        mlp_kernel=cfg.fused_mlp and hopper,
        mlp_e4m3=training and cfg.fp8_mlp and cfg.fused_mlp and hopper
        and tokens % 16 == 0,  # the transposed e4m3/e5m2 copies' TMA row strides
        qkv_e4m3=training and cfg.fp8_qkv and hopper, lm_head_fp8=training and cfg.fp8_lm_head and cuda,
        ce_candidates=ce_candidates if training else 0,
        dc_mha_kernel=kernels and dc_mha_kernel_supports(tokens, model.num_heads, model.head_dim, DC_WINDOW),
        qk_rope_kernel=kernels and cfg.qk_rope_kernel and qk_rope_kernel_supports(qk_width),
        copy_kernel=kernels and model.copy_pointer,
        # the logits of 64 tokens (13 MB in fp32) stay in a CPU's cache; a GPU takes 32768 at a time
        evaluation_chunk=0 if training else min(32768 if cuda else 64, tokens))


def document_ids(cu_seqlens: Tensor, T: int) -> Tensor:
    """The document of each of T packed positions, from the documents' start offsets cu_seqlens."""
    return torch.searchsorted(cu_seqlens, torch.arange(T, device=cu_seqlens.device, dtype=cu_seqlens.dtype), right=True)


def norm(x: Tensor) -> Tensor:
    """RMSNorm without weights (eps: F.rms_norm's default, fp32's machine epsilon for bf16 and fp32) (T3.2)."""
    return F.rms_norm(x, (x.size(-1),))


def rope_frequencies(head_dim: int) -> Tensor:
    """Half-truncated RoPE (#17): head_dim/4 frequencies 1 ... 1/1024 rad/token rotate the first
    head_dim/2 dimensions as interleaved pairs (#58); the other half is stationary (T3.9). Narrow Q/K
    heads (head_dim/2 wide, T3.18) are turned whole by the same frequencies."""
    return (1 / 1024) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float64)


def yarn(frequencies: Tensor, long_windows: list[int]) -> tuple[Tensor, float]:
    """YaRN (#31, T3.9): on each long-window change W_old -> W_new, interpolate the frequencies that
    rotate less than 32 times over W_old and raise the softmax scale by 1 + 0.2·ln(W_new/W_old).
    Returns (frequencies, attention scale) after the given sequence of long windows."""
    freqs, scale = frequencies.clone(), ATTN_SCALE_INIT
    for old, new in zip(long_windows, long_windows[1:]):
        if new == old:
            continue
        rotations = old * freqs / (2 * math.pi)
        keep = ((rotations - 1) / (32 - 1)).clamp(0, 1)
        freqs = freqs * (old / new + keep * (1 - old / new))
        scale *= 1 + 0.2 * math.log(new / old)
    return freqs, scale


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., D) with its first 2·P dimensions rotated as P interleaved pairs by the angles whose
    cos/sin (..., P), broadcasting against x's leading dimensions, are given; the rest stationary
    (T3.9). The model's tables have P = head_dim/4: half of a wide head turns, all of a narrow one (T3.18)."""
    turning = 2 * cos.size(-1)
    pairs = x[..., :turning].unflatten(-1, (turning // 2, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., turning:]), dim=-1)


def shift_key_half(k: Tensor) -> Tensor:
    """Partial key offset (#49, T3.11): the stationary half of each key takes the previous token's."""
    half = k.size(-1) // 2
    return torch.cat([k[:, :, :half], torch.cat([k[:1, :, half:], k[:-1, :, half:]])], dim=-1)


def exclusive_self_attention(y: Tensor, v: Tensor, alpha: Tensor) -> Tensor:
    """Gated XSA (arXiv 2603.09078; #82, #85; T3.13): removes tanh(α) of each head output's component
    along the token's own value vector. y, v (T, H, D); alpha (T, H) or (H,)."""
    yf, vf = y.float(), v.float()
    along = (yf * vf).sum(-1, keepdim=True) / vf.square().sum(-1, keepdim=True).clamp_min(1e-8)
    return (yf - torch.tanh(alpha.float())[..., None] * along * vf).to(y.dtype)


ATTENTION_BACKENDS = ("auto", "fa4", "flex", "sdpa")
FA4_GPU_MAJORS = (9, 10)  # Hopper (sm90) and datacenter Blackwell (sm100): the GPUs FA4's kernels target


def fa4_runs_here(device_type: str) -> bool:
    """FlashAttention-4 is importable and this process's GPU is one its kernels target."""
    return (fa4_interface is not None and device_type == "cuda"
            and torch.cuda.get_device_capability()[0] in FA4_GPU_MAJORS)


def resolve_attention_backend(requested: str, device_type: str) -> str:
    """auto: FA4 where it runs (T3.8), else compiled flex attention on CUDA; SDPA with a dense mask on the CPU."""
    if requested not in ATTENTION_BACKENDS:
        raise SetupError(f"ATTENTION_BACKEND={requested}: use one of {', '.join(ATTENTION_BACKENDS)}")
    if requested == "fa4" and fa4_interface is None:
        raise SetupError("ATTENTION_BACKEND=fa4 needs FlashAttention-4 (flash_attn.cute): "
                         "pip install -r requirements-gpu.txt, or use auto")
    if requested == "fa4" and not fa4_runs_here(device_type):
        raise SetupError("ATTENTION_BACKEND=fa4 runs on Hopper or Blackwell GPUs (sm90, sm100): use auto")
    if requested != "auto":
        return requested
    if device_type != "cuda":
        return "sdpa"
    return "fa4" if fa4_runs_here(device_type) else "flex"


@dataclass
class AttnArgs:
    """The document layout of one forward as the attention kernels take it, built once per forward."""
    cu_seqlens: Tensor  # document boundaries [0, ..., T] (varlen kernels)
    doc_ids: Tensor  # document of every position (DC-MHA, flex and SDPA masks)
    max_seqlen: int
    backend: str
    block_masks: dict  # flex: one block mask per window, made on first use

    def doubled(self) -> "AttnArgs":
        """The same documents over the doubled sequence of paired-head layers (2t, 2t + 1)."""
        return AttnArgs(2 * self.cu_seqlens, self.doc_ids.repeat_interleave(2), 2 * self.max_seqlen, self.backend, {})


def attend(q: Tensor, k: Tensor, v: Tensor, args: AttnArgs, window: int) -> Tensor:
    """Causal in-document attention, keys at most `window` back (NO_WINDOW: all); q, k, v (S, H, D), q pre-scaled."""
    if args.backend == "fa4":
        return fa4_varlen_attention(q, k, v, args.cu_seqlens, args.max_seqlen, window)[0]
    S, doc_ids = q.size(0), args.doc_ids
    if args.backend == "flex":
        if window not in args.block_masks:
            def doc_causal_window(b, h, qi, ki):
                inside = (qi >= ki) & (doc_ids[qi] == doc_ids[ki])
                return inside if window == NO_WINDOW else inside & (qi - ki <= window)
            args.block_masks[window] = create_block_mask(doc_causal_window, None, None, S, S, device=q.device)
        out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             block_mask=args.block_masks[window], scale=1.0)
        return out[0].transpose(0, 1)
    if args.backend == "sdpa":
        pos = torch.arange(S, device=q.device)
        mask = (pos[:, None] >= pos[None, :]) & (doc_ids[:, None] == doc_ids[None, :])
        if window != NO_WINDOW:
            mask &= pos[:, None] - pos[None, :] <= window
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=1.0)
        return out.transpose(0, 1)
    raise ValueError(f"unknown attention backend {args.backend!r} (one of {', '.join(ATTENTION_BACKENDS[1:])})")


def scalar_layout() -> dict[str, Tensor]:
    """The named parts of the `scalars` parameter, in this order, with their initial values (T3.5, T3.6, T3.7)."""
    return {"attn_lambdas": torch.tensor([0.5, 1.0]).repeat(NUM_LAYERS, 1), "smear_lambda": torch.tensor(0.0),
            "skip_lambda": torch.tensor(SKIP_LAMBDA_INIT)}


def mudd_gate_outputs(cfg: ModelConfig) -> tuple[list, list]:
    """The MUDD gates' outputs (T3.16), ((kind, layer), width, initial value) each: those of the pre
    gate (from x0, for layers before POST_GATE_LAYER), then those of the post gate."""
    H = cfg.num_heads
    outputs = [(("xsa", layer), H, 0.0) for layer in XSA_LAYERS if layer in cfg.attention_layers]
    outputs += [(("out_gate", layer), H, 0.25) for layer in OUTPUT_GATE_LAYERS]
    for layer in cfg.attention_layers:
        if layer != MUDD_LAYER:  # x0 and bigram injections; the MUDD layer mixes its own
            outputs += [(("x0", layer), 1, 0.0), (("bigram", layer), 1, BIGRAM_LAMBDA_INIT)]
    outputs += [(("skip", SKIP_TARGET_LAYER), 1, 0.5), (("dc_w1", DC_LAYER), H, 1.0), (("dc_w2", DC_LAYER), H, 0.0)]
    pre = [o for o in outputs if o[0][1] < POST_GATE_LAYER]
    return pre, [o for o in outputs if o[0][1] >= POST_GATE_LAYER]


def mudd_connection_outputs() -> tuple[list, list]:
    """The MUDD connections' coefficients (T3.14), (name, 1, initial value) each, for the layer-10 block
    and the final mix. At init they equal the static architecture they replaced: the residual
    lambdas, value-embedding gate 2 (= 2σ(0)), bigram 0.05, no x0, and the backout −0.5·layer7."""
    layer = dict.fromkeys(MUDD_LAYER_OUTPUTS, 0.0)
    layer.update(ve_gate_first_heads=2.0, ve_gate_last_heads=2.0, attn_residual=RESIDUAL_LAMBDA_INIT, attn_out=1.0,
                 attn_bigram=BIGRAM_LAMBDA_INIT, mlp_residual=RESIDUAL_LAMBDA_INIT, mlp_out=1.0)
    final = dict.fromkeys(MUDD_FINAL_OUTPUTS, 0.0)
    final["layer7"] = -BACKOUT_LAMBDA_INIT
    return [(name, 1, value) for name, value in layer.items()], [(name, 1, value) for name, value in final.items()]


class MuddBlock(nn.Module):
    """Two small per-token MLPs, x -> scale·(W2·GELU(W1[i]·x) + b2) for i = 0, 1, each with named
    outputs of given widths: MUDD connections (#81, fixed scale 0.1) and MUDD gates (#85, learned scale)."""

    def __init__(self, dim: int, outputs: tuple[list, list], scale: float, learned_scale: bool):
        super().__init__()
        self.outputs = outputs
        initial = torch.tensor([value for part in outputs for _, width, value in part for _ in range(width)])
        bound = dim ** -0.5  # Kaiming-uniform
        self.w1 = nn.Parameter(torch.empty(2, MUDD_HIDDEN, dim, dtype=torch.bfloat16).uniform_(-bound, bound))
        self.w2 = nn.Parameter(torch.zeros(len(initial), MUDD_HIDDEN, dtype=torch.bfloat16))
        self.b2 = nn.Parameter((initial / scale).to(torch.bfloat16))
        self.scale = nn.Parameter(torch.tensor(scale)) if learned_scale else scale

    def forward(self, which: int, x: Tensor) -> dict:
        """{name: (T, width)} of MLP `which` on x (T, dim)."""
        names, widths = zip(*[(name, width) for name, width, _ in self.outputs[which]])
        first = sum(width for _, width, _ in self.outputs[0]) if which else 0
        rows = slice(first, first + sum(widths))
        out = F.gelu(x @ self.w1[which].t()) @ self.w2[rows].t() + self.b2[rows]
        return dict(zip(names, (self.scale * out).split(widths, -1)))


@dataclass
class ForwardContext:
    """What the layers of one forward share besides the residual stream x."""
    x_input: Tensor  # the residual entering layer 0
    x0: Tensor  # the normalized embedding, re-injected after every attention (T3.4)
    bigram: Tensor  # the bigram embedding (the n-gram table's rows), re-injected likewise (LayerPlan.bigram)
    value_embeds: tuple[Tensor, ...]  # one (T, d) block per value-embedding layer
    gates: dict  # MUDD gate outputs {(kind, layer): (T, width)}; the post gate's added at its layer
    scalars: dict[str, Tensor]
    shape: ForwardShape
    execution: ExecutionPlan
    attn: AttnArgs
    attn_paired: AttnArgs | None  # the doubled sequence of paired-head layers
    rope: tuple[Tensor, Tensor]  # cos, sin (T, 1, hd/4) at positions 0..T-1
    rope_paired: tuple[Tensor, Tensor] | None  # cos, sin (T, 2, 1, hd/4): the paired-head positions
    # The banks unbound once per forward into per-layer views: their backward is one stack per bank,
    # where indexing the bank in each layer would zero-fill a bank-sized gradient per layer (#56, #74).
    qk: tuple[Tensor, ...]  # per attention slot: (2·H·w, d), Q then K rows, w its Q/K head width (T3.18)
    vo: tuple[Tensor, ...]  # per attention slot: (2, d, d), V then O (out, in)
    mlp_fc: tuple[Tensor, ...]  # per MLP slot: (hidden, d)
    mlp_proj: tuple[Tensor, ...]  # per MLP slot: (hidden, d), stored (in, out)
    qkv8: "QKVBankFP8 | None"  # with execution.qkv_e4m3: the e4m3 Q/K/V weights (T6.3)
    mlp8: "MLPBankFP8 | None"  # with execution.mlp_e4m3: the e4m3 MLP weights (T6.2)
    outputs: dict[int, Tensor]  # residual after each layer so far


class GPT(nn.Module):
    """GPT with banked weights: Q/K, V/O and MLP matrices of all layers live in 3-D parameters
    (#61, T3.1) that the optimizer orthogonalizes batch-wise. Activations are bf16. `max_tokens`:
    the longest forward on one rank (sizes the rotary tables); `max_train_tokens`: the longest training
    forward (sizes the n-gram row cache whose gradient the backward fills; None: max_tokens)."""

    def __init__(self, cfg: ModelConfig, max_tokens: int, max_train_tokens: int | None = None):
        super().__init__()
        if cfg.num_heads * cfg.head_dim != cfg.model_dim or cfg.num_heads % 2:
            raise SetupError(f"need NUM_HEADS * HEAD_DIM == MODEL_DIM and an even NUM_HEADS, got "
                             f"{cfg.num_heads}x{cfg.head_dim} vs {cfg.model_dim}")
        self.config = cfg
        self.layers = layer_plans(cfg)
        self._init_matrices(cfg)  # parameters in the order they draw from the random generator
        self._init_embeddings(cfg, max_tokens, max_train_tokens or max_tokens)
        self._init_scalars(cfg)
        self.mudd = MuddBlock(cfg.model_dim, mudd_connection_outputs(), MUDD_SCALE, learned_scale=False)
        self.gates = MuddBlock(cfg.model_dim, mudd_gate_outputs(cfg), MUDD_GATE_SCALE_INIT, learned_scale=True)
        if cfg.copy_pointer:  # the copy pointer's query and key, its query gain and sink key (T4.8); drawn last
            bound = math.sqrt(3) * cfg.model_dim ** -0.5
            self.copy_qk = nn.Parameter(torch.empty(2, COPY_HEAD_DIM, cfg.model_dim,
                                                    dtype=torch.bfloat16).uniform_(-bound, bound))
            self.copy_gain = nn.Parameter(torch.ones(()))
            self.copy_sink = nn.Parameter(torch.randn(COPY_HEAD_DIM) * COPY_HEAD_DIM ** -0.5)
        # prefix token of every token, filled by the trainer when the prefix-token loss runs (#88); -1: none
        self.register_buffer("prefix_ids", torch.full((cfg.vocab_size,), -1, dtype=torch.long), persistent=False)
        # the sampled cross-entropy's (T4.6): the step its negatives are swept for (set by the trainer,
        # read on the device), and the most distinct targets a forward had beyond its budget
        self.register_buffer("candidate_step", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("candidate_shortfall", torch.zeros((), dtype=torch.long), persistent=False)
        hd, positions = cfg.head_dim, 2 * max_tokens  # paired layers double the sequence
        self.register_buffer("rope_base", rope_frequencies(hd), persistent=False)
        self.register_buffer("rope_cos", torch.empty(positions, hd // 4, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("rope_sin", torch.empty(positions, hd // 4, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("attn_scale", torch.tensor(ATTN_SCALE_INIT), persistent=False)
        self.register_buffer("narrow_attn_scale", torch.tensor(ATTN_SCALE_INIT * NARROW_QK_SCALE_MUL),
                             persistent=False)  # narrow Q/K heads' (T3.18)
        self.set_long_windows([1])

    def _init_matrices(self, cfg: ModelConfig):
        d, H, hd, V = cfg.model_dim, cfg.num_heads, cfg.head_dim, cfg.vocab_size
        n_attn, bf16 = len(cfg.attention_layers), dict(dtype=torch.bfloat16)
        bound = math.sqrt(3) * 0.5 * d ** -0.5  # uniform with std 0.5/sqrt(d)
        self.lm_head = nn.Parameter(torch.empty(V, d, **bf16).normal_(0, 0.005))
        self.embed = nn.Parameter(self.lm_head.detach().clone())  # tied at init (#51, T3.15)
        # Q/K per head pair (#80): slot a holds H/2 Q groups then H/2 K groups of (2·hd, d); the narrow
        # layers' (T3.18) in a bank of their own, (hd, d) per head pair (NorMuon takes one shape per bank)
        n_narrow = len(cfg.narrow_qk_layers)
        if n_attn > n_narrow:
            self.qk_bank = nn.Parameter(torch.empty((n_attn - n_narrow) * H, 2 * hd, d, **bf16).uniform_(-bound, bound))
        if n_narrow:
            self.qk_narrow_bank = nn.Parameter(torch.empty(n_narrow * H, hd, d, **bf16).uniform_(-bound, bound))
        # V and O per attention slot: (d, d) each as (out, in)
        self.vo_bank = nn.Parameter(torch.empty(2 * n_attn, d, d, **bf16).uniform_(-bound, bound))
        mlp = torch.empty(len(cfg.mlp_layers), 2, cfg.mlp_hidden, d, **bf16)  # per MLP slot
        mlp[:, 0].uniform_(-bound, bound)  # fc (hidden, d); proj stored (hidden, d) = (in, out), zero (#5)
        mlp[:, 1].zero_()
        self.mlp_bank = nn.Parameter(mlp)

    def _init_embeddings(self, cfg: ModelConfig, max_tokens: int, max_train_tokens: int):
        d, H, V, bf16 = cfg.model_dim, cfg.num_heads, cfg.vocab_size, dict(dtype=torch.bfloat16)
        # (#14, #63, #70; T3.3) token-major (V, layers·d): one gather for every layer, one scatter for the gradient
        self.value_embeds = nn.Parameter(torch.empty(V, len(cfg.value_embed_layers) * d, **bf16).normal_(0, 0.01))
        gated = sum(plan.value_gate is not None for plan in self.layers)
        self.ve_gate_bank = nn.Parameter(torch.zeros(gated, H, GATE_INPUTS, **bf16))
        self.ngram = NgramTable(cfg, max_tokens, max_train_tokens)  # the bigram injection's rows (#92; T3.4, T3.19)
        self.smear_gate = nn.Parameter(torch.zeros(1, GATE_INPUTS, **bf16))  # one-token look-back (#34, T3.6)

    def _init_scalars(self, cfg: ModelConfig):
        # per-sublayer residual and output weights (#9, #73; T3.5)
        self.resid_lambdas = nn.Parameter(torch.full((NUM_LAYERS, 2), RESIDUAL_LAMBDA_INIT))
        self.post_lambdas = nn.Parameter(torch.ones(NUM_LAYERS, 2))
        for i in cfg.mlp_layers:  # each MLP's delayed scale of post for its e4m3 forward, one allocation each (T6.2)
            self.register_buffer(f"fp8_post_scale{i}", torch.ones((), dtype=torch.float32))
        layout = scalar_layout()  # attention lambdas, smear, skip
        self.scalars = nn.Parameter(torch.cat([value.flatten() for value in layout.values()]))
        self.scalar_parts, offset = {}, 0
        for name, value in layout.items():
            self.scalar_parts[name] = (offset, value.shape)
            offset += value.numel()

    # --- schedule-dependent state -----------------------------------------------------------------
    @torch.no_grad()
    def set_long_windows(self, long_windows: list[int]):
        """Rotary tables and softmax scale for the long windows used so far (YaRN, T3.9)."""
        freqs, scale = yarn(self.rope_base, long_windows)
        angles = torch.arange(self.rope_cos.size(0), dtype=torch.float64, device=freqs.device)[:, None] * freqs
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())
        self.attn_scale.fill_(scale)
        self.narrow_attn_scale.fill_(scale * NARROW_QK_SCALE_MUL)

    # --- losses -------------------------------------------------------------------------------------
    def training_loss(self, input_ids: Tensor, target_ids: Tensor, cu_seqlens: Tensor, shape: ForwardShape,
                      execution: ExecutionPlan, target_weights: Tensor,
                      grad_scale: float = 1.0) -> tuple[Tensor, Tensor]:
        """(loss to backpropagate, mean next-token CE). target_weights weighs the target columns (t+1 ... t+n_predict,
        then the prefix target); the fused lm_head + soft-capped cross-entropy (FP8 where the plan says, T4.4) scores
        every column at once, against the whole vocabulary or, where the plan gives a candidate budget, against the
        step's candidates (T4.6; the mean CE is then the candidates' too)."""
        x = self.hidden_states(input_ids, cu_seqlens, shape, execution)
        targets = self.target_columns(target_ids.long(), shape)
        pointer = (self.pointer_masses(x, input_ids, target_ids, cu_seqlens, shape, execution)
                   if self.config.copy_pointer else None)
        if execution.ce_candidates:
            loss, ce, shortfall = sampled_lm_head_softcap_ce(x, self.lm_head, targets, target_weights,
                                                             execution.ce_candidates, self.candidate_step,
                                                             grad_scale, execution.lm_head_fp8, pointer)
            self.candidate_shortfall.copy_(torch.maximum(self.candidate_shortfall, shortfall))
            return loss, ce
        copy = None if pointer is None else (torch.full_like(targets[0, :1], COPY_TOKEN), *pointer)
        return lm_head_softcap_ce(x, self.lm_head, targets, target_weights, grad_scale, execution.lm_head_fp8, copy)

    def evaluation_loss(self, input_ids: Tensor, target_ids: Tensor, cu_seqlens: Tensor, shape: ForwardShape,
                        execution: ExecutionPlan, chunk: int) -> Tensor:
        """The summed next-token cross-entropy, the lm_head applied `chunk` tokens at a time (with the copy pointer: the
        mixture's, T4.8; each chunk's pointer reads the window before it)."""
        x = self.hidden_states(input_ids, cu_seqlens, shape, execution)
        targets = target_ids.long()
        total = x.new_zeros((), dtype=torch.float32)
        for i in range(0, x.size(0), chunk):
            z = softcap(x[i: i + chunk] @ self.lm_head.t())
            lse = torch.logsumexp(z, -1)
            ce = lse - z.gather(1, targets[i: i + chunk, None])[:, 0]
            if self.config.copy_pointer:
                start = max(0, i - self.copy_window(shape))
                p_copy, a_sink = self.pointer_masses(x[start: i + chunk], input_ids[start: i + chunk],
                                                     targets[start: i + chunk], cu_seqlens - start, shape, execution)
                ce = copy_mixture(ce, lse - z[:, COPY_TOKEN], p_copy[i - start:], a_sink[i - start:])[0]
            total = total + ce.sum()
        return total

    def pointer_masses(self, x: Tensor, input_ids: Tensor, next_ids: Tensor, cu_seqlens: Tensor, shape: ForwardShape,
                       execution: ExecutionPlan) -> tuple[Tensor, Tensor]:
        """(p_copy, a_sink) of the copy pointer (T4.8) on the final hidden states x of the packed documents."""
        return copy_pointer(x, self.copy_qk, self.copy_gain, self.copy_sink, input_ids.long(), next_ids.long(),
                            document_ids(cu_seqlens, x.size(0)), self.copy_window(shape), execution.copy_kernel)

    def copy_window(self, shape: ForwardShape) -> int:
        """How far back the copy pointer looks in this forward: the shape's window (the final validation's), else
        COPY_WINDOW."""
        return shape.copy_window or self.config.copy_window

    def target_columns(self, targets: Tensor, shape: ForwardShape) -> Tensor:
        """Target matrix (T, N), -1 = none: multi-token prediction (#53, T4.2) scores the same logits
        against the targets t+1 .. t+n_predict (none past the end); the prefix-token loss (#88, T4.3)
        against the token spelling the longest proper prefix of the next token."""
        T, n = targets.size(0), shape.n_predict
        # Columns as shifted slices of the padded targets, stacked: torch 2.11's inductor fails on CUDA (loop merging)
        # for the same matrix built as a gather over (T, n) indices joined with the prefix column by cat.
        padded = torch.cat([targets, targets.new_full((n - 1,), -1)]) if n > 1 else targets
        columns = [padded[k: k + T] for k in range(n)]
        if shape.prefix_target:
            columns.append(self.prefix_ids[targets])
        return torch.stack(columns, 1)

    # --- forward ------------------------------------------------------------------------------------
    def hidden_states(self, input_ids: Tensor, cu_seqlens: Tensor, shape: ForwardShape,
                      execution: ExecutionPlan) -> Tensor:
        """The final normalized hidden states (T, d) of a batch of packed documents."""
        ctx = self.context(input_ids.long(), cu_seqlens, shape, execution)
        x = ctx.x_input
        for layer in self.layers:
            x = ctx.outputs[layer.index] = self.layer(layer, x, ctx)
        return norm(self.final_mix(x, ctx))

    def layer(self, layer: LayerPlan, x: Tensor, ctx: ForwardContext) -> Tensor:
        """One layer: attention input -> attention -> residual update -> MLP -> residual update. The updates re-inject
        x0 and the bigram embedding, gated (T3.4), or at the MUDD layer mix earlier residuals densely (T3.14)."""
        i = layer.index
        if layer.gates_post:
            ctx.gates.update(self.gates(1, x))
        mix = self.mudd(0, x) if layer.mudd else {}  # the MUDD layer's coefficients
        if layer.attn_slot is not None:
            a_in = norm(ctx.outputs[CACHED_LAYER] if layer.reads_layer7 else x)
            v_extra = self.value_input(layer, a_in, x, ctx, mix) if layer.value_input else None
            y = self.attention(layer, a_in, v_extra, ctx)
            if layer.mudd:
                layer7 = ctx.outputs[CACHED_LAYER]
                x = (1 + mix["mix_residual"]) * x + mix["mix_input"] * ctx.x_input + mix["mix_layer7"] * layer7
                x = mix["attn_residual"] * x + mix["attn_out"] * y + mix["attn_input"] * ctx.x_input
                if layer.bigram:
                    x = x + mix["attn_bigram"] * ctx.bigram
            else:
                x = self.resid_lambdas[i, 0] * x + self.post_lambdas[i, 0] * y + ctx.gates["x0", i] * ctx.x0
                if layer.bigram:
                    x = x + ctx.gates["bigram", i] * ctx.bigram
        if layer.skip_target:  # U-net remnant 3 -> 6 with a per-token gate (#45, #55; T3.7)
            gate = ctx.gates["skip", i]
            x = x + torch.sigmoid(ctx.scalars["skip_lambda"]) * gate * ctx.outputs[SKIP_SOURCE_LAYER]
        if layer.mlp_slot is None:  # no MLP (MLP_LAYERS, T3.1)
            return x
        out = self.mlp(layer, norm(x), ctx)
        if layer.mudd:
            return mix["mlp_residual"] * x + mix["mlp_out"] * out
        return self.resid_lambdas[i, 1] * x + self.post_lambdas[i, 1] * out

    def context(self, ids: Tensor, cu_seqlens: Tensor, shape: ForwardShape, execution: ExecutionPlan) -> ForwardContext:
        """What layers share: embeddings, pre MUDD gate, attention layout, per-layer weights (e4m3 too if planned)."""
        cfg, scalars = self.config, self.named_scalars()
        x = self.embed[ids]
        gate = torch.sigmoid(x[1:, :GATE_INPUTS] @ self.smear_gate.t())  # (#34, T3.6)
        x = torch.cat([x[:1], x[1:] + scalars["smear_lambda"] * gate * x[:-1]])
        x0 = norm(x)
        gates = self.gates(0, x0)
        bigram = self.ngram(ids.size(0))  # the rows NgramTable.load put in its cache for these ids (#62; T3.4, T3.19)
        x_input = x0 + gates["bigram", 0] * bigram
        value_embeds = self.value_embeds[ids].split(cfg.model_dim, -1)
        attn, rope, attn_paired, rope_paired = self.attention_layout(ids.size(0), cu_seqlens, shape, execution)
        n_attn, d = len(cfg.attention_layers), cfg.model_dim
        mlp_fc, mlp_proj = (w.unbind(0) for w in self.mlp_bank.unbind(1))
        qk_banks, qk = self.qk_banks(), [None] * n_attn
        for bank, slots in qk_banks:
            for slot, matrices in zip(slots, bank.view(len(slots), -1, d).unbind(0)):
                qk[slot] = matrices
        return ForwardContext(
            x_input=x_input, x0=x0, bigram=bigram, value_embeds=value_embeds, gates=gates, scalars=scalars,
            shape=shape, execution=execution, attn=attn, attn_paired=attn_paired, rope=rope, rope_paired=rope_paired,
            qk=tuple(qk), vo=self.vo_bank.view(n_attn, 2, d, d).unbind(0), mlp_fc=mlp_fc, mlp_proj=mlp_proj,
            qkv8=QKVBankFP8.quantize(qk_banks, self.vo_bank) if execution.qkv_e4m3 else None,
            mlp8=MLPBankFP8.quantize(self.mlp_bank) if execution.mlp_e4m3 else None, outputs={})

    def qk_banks(self) -> list[tuple[Tensor, list[int]]]:
        """Each Q/K bank with the attention slots whose Q/K matrices it holds, in its order: qk_bank
        (wide heads), then qk_narrow_bank (T3.18); a bank no layer uses is absent."""
        banks = []
        for name, narrow in (("qk_bank", False), ("qk_narrow_bank", True)):
            slots = [p.attn_slot for p in self.layers if p.attn_slot is not None and p.narrow_qk == narrow]
            if slots:  # increasing attention slots are increasing places in the bank (layer_plans' qk_slot)
                banks.append((getattr(self, name), slots))
        return banks

    def attention_layout(self, T: int, cu_seqlens: Tensor, shape: ForwardShape, execution: ExecutionPlan) -> tuple:
        """(AttnArgs, rotary tables) of the plain sequence, then of the doubled one (paired heads, T3.10)."""
        doc_ids = document_ids(cu_seqlens, T)
        attn = AttnArgs(cu_seqlens, doc_ids, shape.max_seq_len, execution.attention, {})
        rope = (self.rope_cos[:T, None], self.rope_sin[:T, None])
        quarter = self.config.head_dim // 4  # the doubled sequence's tables, as (token, half of the heads)
        rope_paired = tuple(t[: 2 * T].view(T, 2, 1, quarter) for t in (self.rope_cos, self.rope_sin))
        return attn, rope, attn.doubled(), rope_paired

    def value_input(self, layer: LayerPlan, a_in: Tensor, x: Tensor, ctx: ForwardContext, mix: dict) -> Tensor:
        """The extra value input (T, H, hd) of an attention: the value embedding with its gate (#55, #70; T3.3), at
        the MUDD layer one MUDD gate per half of the heads, plus the dense value mix of earlier residuals (T3.14)."""
        T, H, hd = x.size(0), self.config.num_heads, self.config.head_dim
        v_extra = 0
        if layer.value_embed is not None:
            ve = ctx.value_embeds[layer.value_embed]
            if layer.mudd:
                gate = torch.cat([mix["ve_gate_first_heads"].expand(T, H // 2),
                                  mix["ve_gate_last_heads"].expand(T, H - H // 2)], -1)
            else:
                half = GATE_INPUTS // 2
                gate = 2 * torch.sigmoid(torch.cat([a_in[:, :half], ve[:, :half]], -1)
                                         @ self.ve_gate_bank[layer.value_gate].t())
            v_extra = gate[..., None] * ve.view(T, H, hd)
        if layer.mudd:
            layer7 = ctx.outputs[CACHED_LAYER]
            v_extra = v_extra + (mix["v_input"] * ctx.x_input + mix["v_layer7"] * layer7
                                 + mix["v_residual"] * x).view(T, H, hd)
        return v_extra

    def attention(self, layer: LayerPlan, x: Tensor, v_extra: Tensor | None, ctx: ForwardContext) -> Tensor:
        """One attention sublayer on the normalized input x (T3.8-T3.13, T3.16-T3.18)."""
        cfg, i, slot = self.config, layer.index, layer.attn_slot
        T, H, hd = x.size(0), cfg.num_heads, cfg.head_dim
        qk_hd, scale = (hd // 2, self.narrow_attn_scale) if layer.narrow_qk else (hd, self.attn_scale)
        w_v, w_o = ctx.vo[slot][0], ctx.vo[slot][1]
        lambdas = ctx.scalars["attn_lambdas"][i]  # pre-multiplied into the weights (#47, #48)
        w_qkv, w_o = lambdas[0] * torch.cat([ctx.qk[slot], w_v]), lambdas[1] * w_o
        if ctx.execution.qkv_e4m3:  # e4m3 forward (T6.3): the bank's scale times the lambda
            qkv = fp8_normed_linear(x, w_qkv, ctx.qkv8.weights[slot], ctx.qkv8.scales[slot] * lambdas[0])
        else:
            qkv = x @ w_qkv.t()
        # QK-norm, rotary, key offset, q's scale, v's extra input, the paired heads' layout (T6.4)
        q, k, v = qk_norm_rope(qkv, v_extra, *(ctx.rope_paired if layer.paired_heads else ctx.rope), scale,
                               H, qk_hd, layer.paired_heads, layer.key_offset, ctx.execution.qk_rope_kernel)
        window = ctx.shape.long_window if layer.long_window else ctx.shape.short_window
        y = attend(q, k, v, ctx.attn_paired if layer.paired_heads else ctx.attn, window).reshape(T, H, hd)
        if layer.dc_mha:  # cross-head composition on a local window (#85, T3.17); w1 RMS-normalized
            w1 = F.rms_norm(ctx.gates["dc_w1", i].float(), (H,), eps=1e-6)
            y = y + dc_mha(q, k, v, ctx.attn.doc_ids, w1, ctx.gates["dc_w2", i], DC_WINDOW, ctx.execution.dc_mha_kernel)
        if layer.xsa:  # (T3.13)
            y = exclusive_self_attention(y, v, ctx.gates["xsa", i])
        if layer.out_gate:  # (#28, #85; T3.16)
            y = y * ctx.gates["out_gate", i][..., None]
        return y.reshape(T, H * hd) @ w_o.t()

    def mlp(self, layer: LayerPlan, x: Tensor, ctx: ForwardContext) -> Tensor:
        """The ReLU² MLP (#5) on the normalized input x: plain, fused (T6.1) or its e4m3 forward,
        which refreshes the layer's delayed scale of post (T6.2), as the plan says."""
        fc, proj, execution = ctx.mlp_fc[layer.mlp_slot], ctx.mlp_proj[layer.mlp_slot], ctx.execution
        if execution.mlp_e4m3:
            post_scale = getattr(self, f"fp8_post_scale{layer.index}")
            out, post_amax = fp8_relu_square_mlp(x, fc, proj, ctx.mlp8, layer.mlp_slot, post_scale)
            post_scale.copy_(post_amax.clamp_min(1e-12).view(()) * (FP8_POST_MARGIN / E4M3_MAX))
            return out
        if execution.mlp_fused:
            return relu_square_mlp(x, fc, proj, execution.mlp_kernel)
        return relu_square_mlp_reference(x, fc, proj)

    def final_mix(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        """MUDD's dense mix of earlier residuals before the head (#81, T3.14); at init its layer-7
        term is the backout (#40, T3.12)."""
        f, out = self.mudd(1, x), ctx.outputs
        x = (x + f["input"] * ctx.x_input + f["layer7"] * out[CACHED_LAYER] + f["layer9"] * out[MUDD_LAYER - 1]
             + f["layer3"] * out[SKIP_SOURCE_LAYER])
        return x + f["value_embed"] * ctx.value_embeds[0]

    def named_scalars(self) -> dict[str, Tensor]:
        return {name: self.scalars[offset: offset + math.prod(shape)].view(shape)
                for name, (offset, shape) in self.scalar_parts.items()}


# =============================================================================================
# Optimizer
# =============================================================================================


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is optimized and communicated (T2.1)."""
    optimizer: str  # "normuon" | "adam"
    comm: str  # "sharded": reduce-scatter + all-gather along dim 0 | "replicated": all-reduce (flat, per dtype)
    # | "sparse": (row id, row sum) pairs to the rows' owners (the NgramTable, not a parameter of NorMuonAdam)
    lr_mul: float = 1.0
    wd_mul: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    matrix_shape: tuple[int, int] | None = None  # NorMuon: each bank entry is one such matrix
    matrix_lr_muls: tuple[float, ...] = (1.0,)  # NorMuon: cycled over the bank's matrix index

    def matrix_lr_mul(self, index: Tensor) -> Tensor:
        """NorMuon's lr multiplier of bank matrices `index`: matrix_lr_muls × √(rows/cols) if tall (#42, T2.4)."""
        rows, cols = self.matrix_shape
        return torch.tensor(self.matrix_lr_muls)[index % len(self.matrix_lr_muls)] * max(1.0, rows / cols) ** 0.5


def param_table(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The optimizer's table (T2.1): how each parameter of GPT(cfg) is optimized. Within its group (replicated, bank,
    sharded table) a parameter's place here is its place in the optimizer's communication and work order: the big MLP
    bank sits between the two small banks, so the first wait and the last gather are short. Parameters a layout leaves
    out (qk_narrow_bank with no narrow layer) are simply absent from the model."""
    return {
        "qk_bank": ParamSpec("normuon", "sharded", matrix_shape=(2 * cfg.head_dim, cfg.model_dim), wd_mul=1.0),
        "qk_narrow_bank": ParamSpec("normuon", "sharded", matrix_shape=(cfg.head_dim, cfg.model_dim), wd_mul=1.0),
        "mlp_bank": ParamSpec("normuon", "sharded", matrix_shape=(cfg.mlp_hidden, cfg.model_dim), wd_mul=1.0,
                              matrix_lr_muls=(1.0, 2.0)),  # projections (odd index) x2
        "vo_bank": ParamSpec("normuon", "sharded", matrix_shape=(cfg.model_dim, cfg.model_dim), wd_mul=1.0),
        "scalars": ParamSpec("adam", "replicated", lr_mul=5.0, betas=(0.9, 0.99)),
        "smear_gate": ParamSpec("adam", "replicated", lr_mul=0.01, betas=(0.9, 0.99)),
        "ve_gate_bank": ParamSpec("adam", "replicated", wd_mul=1.0, betas=(0.9, 0.99)),
        "lm_head": ParamSpec("adam", "sharded", wd_mul=150.0, betas=(0.5, 0.95)),
        # row-wise RMSprop on the rows a step touches (NgramTable): the beta2, the lr and no weight decay are its
        "ngram_table": ParamSpec("adam", "sparse", lr_mul=75.0, betas=(0.75, 0.95)),
        "post_lambdas": ParamSpec("adam", "replicated", betas=(0.9, 0.95)),
        "resid_lambdas": ParamSpec("adam", "replicated", lr_mul=5.0, betas=(0.9, 0.95)),
        "value_embeds": ParamSpec("adam", "sharded", lr_mul=75.0, wd_mul=5.0, betas=(0.75, 0.95)),
        "embed": ParamSpec("adam", "sharded", wd_mul=150.0, betas=(0.5, 0.95)),
        "mudd.w1": ParamSpec("adam", "replicated", lr_mul=0.25, wd_mul=1.0, betas=(0.9, 0.99)),
        "mudd.w2": ParamSpec("adam", "replicated", lr_mul=0.25, wd_mul=1.0, betas=(0.9, 0.99)),
        "mudd.b2": ParamSpec("adam", "replicated", lr_mul=0.25, betas=(0.9, 0.99)),
        "gates.w1": ParamSpec("adam", "replicated", lr_mul=0.1, wd_mul=1.0, betas=(0.9, 0.99)),
        "gates.w2": ParamSpec("adam", "replicated", lr_mul=0.1, wd_mul=1.0, betas=(0.9, 0.99)),
        "gates.b2": ParamSpec("adam", "replicated", lr_mul=0.1, betas=(0.9, 0.99)),
        "gates.scale": ParamSpec("adam", "replicated", lr_mul=0.1, betas=(0.9, 0.99)),
        "copy_qk": ParamSpec("adam", "replicated", betas=(0.9, 0.99)),
        "copy_gain": ParamSpec("adam", "replicated", betas=(0.9, 0.99)),
        "copy_sink": ParamSpec("adam", "replicated", betas=(0.9, 0.99)),
    }


def param_specs(model: nn.Module) -> dict[str, ParamSpec]:
    """The table's rows of the model's parameters, in table order; every parameter must have one."""
    table, names = param_table(model.config), dict(model.named_parameters())
    missing = set(names) - set(table)
    if missing:
        raise ValueError(f"parameters without an optimizer spec: {sorted(missing)}")
    return {label: spec for label, spec in table.items() if label in names}


def _fp32_from_bf16_and_mantissa(hi: Tensor, mantissa: Tensor) -> Tensor:
    """The exact fp32 master weight whose top 16 bits are the bf16 weight (T2.6)."""
    bits = (hi.view(torch.int16).to(torch.int32) << 16) | (mantissa.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def _split_fp32_to_bf16_and_mantissa(x: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of the above: truncated bf16 top half and the low 16 bits as int16."""
    bits = x.view(torch.int32)
    hi = (bits >> 16).to(torch.int16).view(torch.bfloat16)
    mantissa = (((bits & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16)
    return hi, mantissa


def master_weight(weight: Tensor, mantissa: Tensor | None) -> Tensor:
    """The fp32 master of a weight: exact from bf16 + mantissa where kept (T2.6), else the weight in fp32."""
    return weight.float() if mantissa is None else _fp32_from_bf16_and_mantissa(weight, mantissa)


def store_master(weight: Tensor, mantissa: Tensor | None, w32: Tensor):
    """Write an fp32 master back into the weight (and its mantissa where kept, T2.6)."""
    if mantissa is None:
        weight.copy_(w32)
    else:
        hi, low = _split_fp32_to_bf16_and_mantissa(w32)
        weight.copy_(hi)
        mantissa.copy_(low)


def twin_rail_momentum(grad: Tensor, fast: Tensor, slow: Tensor, mu: Tensor, fast_beta: Tensor,
                       fast_weight: Tensor, slow_beta: float, grad_scale: float) -> Tensor:
    """Two EMA rails of the gradient (record #92, PR #360; T2.9): fast ← β_f·fast + (1−β_f)g on a
    scheduled β_f, slow ← β_s·slow + (1−β_s)g on a constant β_s; their blend b = w·fast + (1−w)·slow
    takes the Nesterov look-ahead: returns (1−μ)g + μb. With β_f = μ and w = 1 it is Muon's single EMA
    (#3, T2.2): m ← μm + (1−μ)g, returning (1−μ)g + μm, which the schedule runs until the rails engage."""
    g = grad.float() * grad_scale
    fast.lerp_(g, 1 - fast_beta)
    slow.lerp_(g, 1 - slow_beta)
    blend = fast_weight * fast + (1 - fast_weight) * slow
    return g.lerp(blend, mu)


def normuon_update(update: Tensor, second_moment: Tensor, weight: Tensor, mantissa: Tensor | None,
                   lr: Tensor, lr_muls: Tensor, wd_lr: Tensor, beta2: float, axis: int):
    """NorMuon (arXiv 2510.05491, #41; T2.4): per-row (axis -1) or per-column (axis -2) RMS equalization
    of the orthogonalized update by an EMA second moment, keeping each matrix's Frobenius norm;
    then the step with cautious, lr-coupled weight decay (#43, T2.5) on the fp32 master weight."""
    O = update.float()
    n = O.size(axis)
    v_mean = O.square().mean(axis, keepdim=True)
    norm = (v_mean.sum((-2, -1), keepdim=True) * n).sqrt()
    second_moment.lerp_(v_mean, 1 - beta2)
    scale = second_moment.clamp_min(1e-10).rsqrt()
    scaled_norm = (v_mean * scale.square()).sum((-2, -1), keepdim=True).mul(n).sqrt()
    O = O * scale * (norm / scaled_norm.clamp_min(1e-10))
    lr_eff = lr * lr_muls
    w32 = master_weight(weight, mantissa)
    decay = (O * w32 >= 0) * w32 * (wd_lr * lr_eff)
    store_master(weight, mantissa, w32 - lr_eff * O - decay)


def normuon_bank_step(grad: Tensor, rails: tuple, second_moment: Tensor, weight: Tensor,
                      mantissa: Tensor | None, mu: Tensor, lr: Tensor, lr_muls: Tensor, wd_lr: Tensor,
                      grad_scale: float, beta2: float, axis: int, use_triton: bool):
    """A whole NorMuon step of one bank shard: the momentum rails (twin_rail_momentum's `rails`), orthogonalization,
    variance normalization and the cautious update; compiled as one graph per bank (#74, T2.3)."""
    fast, slow, fast_beta, fast_weight, slow_beta = rails
    update = twin_rail_momentum(grad, fast, slow, mu, fast_beta, fast_weight, slow_beta, grad_scale)
    normuon_update(orthogonalize(update, use_triton), second_moment, weight, mantissa, lr, lr_muls, wd_lr, beta2, axis)


def tail_ema_update(ema: Tensor, weight: Tensor, mantissa: Tensor | None, rate: Tensor):
    """The weights' fp32 EMA (T5.4) one step on: ema ← ema + rate·(w − ema), w a bank's exact fp32
    master (bf16 + mantissa, T2.6) or the weight in fp32; rate 1 sets it to w exactly."""
    ema.lerp_(master_weight(weight, mantissa), rate)


def adam_update(grad: Tensor, kept_grad: Tensor | None, weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                step_size: Tensor, wd_lr2: Tensor, beta1: float, beta2: float, eps: float, grad_scale: float):
    """Adam with cautious weight decay (#50, T2.5): decay only where the update shrinks |w|; strength
    lr²·wd so it follows the schedule. step_size carries the bias correction. kept_grad: the
    previous step's gradient (T2.7), added here in fp32 rather than by autograd in a pass of its own."""
    g = grad.float() if kept_grad is None else grad.float() + kept_grad.float()
    g = g * grad_scale
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.lerp_(g.square(), 1 - beta2)
    w = weight.float()
    u = step_size * exp_avg / (exp_avg_sq.sqrt() + eps)
    u = u + (u * w > 0) * w * wd_lr2
    weight.copy_(w - u)


class RankRows:
    """This rank's rows of a parameter viewed as (n, ...): [start, start + rows) of a padded (n_pad = rows·world, ...)
    layout. Padding rows exist only in communication buffers. A 0-d parameter is one row (always replicated)."""

    def __init__(self, view_shape: tuple[int, ...], rank: int, world: int):
        self.view_shape = view_shape
        n = view_shape[0] if view_shape else 1
        self.rows = -(-n // world)
        self.padded = self.rows * world != n
        self.start = rank * self.rows
        self.real_rows = max(0, min(n - self.start, self.rows))

    def full(self, t: Tensor) -> Tensor:
        return t.view(self.view_shape)


class WaitOnce:
    """The work of one collective that several gradients share (a flat all-reduce), waited for once."""

    def __init__(self, work):
        self.work = work

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None


class FlatReplicatedGrads:
    """The gradients of a set of replicated parameters sent as one flat all-reduce per dtype (T2.1, as record #92
    does): one launch and one latency per dtype instead of one per parameter. The layout is fixed at construction:
    per dtype, the parameters in launch order, each on a 16-byte boundary (the alignment inductor's kernels assume),
    padding zero. Two buffer sets alternate between launches: a gradient kept on a step without Adam (T2.7) sits in
    the previous launch's set while the next launch fills the other; every launch covers all its labels and each
    earlier kept gradient is consumed or summed by it, so only the latest launch holds a kept view, and each launch
    is waited for before its set is filled again. Gradients are copied in (one multi-tensor copy per dtype, ~0.4 MB)
    rather than being views from the backward on: the CUDA graphs hand out their own static gradients (T5.3)."""

    ALIGN_BYTES = 16

    def __init__(self, params: dict[str, Tensor]):
        by_dtype: dict[torch.dtype, list[str]] = {}
        for label, p in params.items():
            by_dtype.setdefault(p.dtype, []).append(label)
        self.buffer_sets: tuple[list, list] = ([], [])  # per set: (flat buffer, labels, views) per dtype
        for dtype, labels in by_dtype.items():
            align = max(1, self.ALIGN_BYTES // params[labels[0]].element_size())
            offsets, end = [], 0
            for label in labels:
                offsets.append(end)
                end += -(-params[label].numel() // align) * align
            for buffer_set in self.buffer_sets:
                flat = torch.zeros(end, dtype=dtype, device=params[labels[0]].device)
                views = [flat[o: o + params[label].numel()].view(params[label].shape)
                         for label, o in zip(labels, offsets)]
                buffer_set.append((flat, labels, views))
        self.next_set = 0

    def launch(self, grads: dict[str, Tensor]) -> dict[str, tuple[WaitOnce, Tensor]]:
        """Copy `grads` (label -> gradient, the layout's labels) into the next buffer set and launch
        one async SUM all-reduce per dtype; label -> (its dtype's work, its view of the sum)."""
        buffer_set = self.buffer_sets[self.next_set]
        self.next_set ^= 1
        reductions = {}
        for flat, labels, views in buffer_set:
            torch._foreach_copy_(views, [grads[label] for label in labels])
            work = WaitOnce(dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True))
            reductions.update((label, (work, view)) for label, view in zip(labels, views))
        return reductions


# The schedule's scalars an update reads from the device, per optimizer of a label (NorMuonAdam.scalars); the
# fast momentum rail's beta and blend weight (T2.9) among NorMuon's
STEP_SCALARS = {"normuon": ("momentum", "lr", "wd_lr", "fast_beta", "fast_weight"), "adam": ("step_size", "wd_lr2")}


class NorMuonAdam:
    """One optimizer for every parameter, without DDP (#61, T2.1). step(): (1) launch each gradient's reduction
    asynchronously in its dtype, in `comm_order`: the small replicated gradients as one flat all-reduce per dtype
    (FlatReplicatedGrads), then one reduce-scatter per sharded parameter; (2) in the same order, wait for a reduction,
    update this rank's rows (scaled by 1/world) and launch their all-gather; (3) wait for the gathers. NCCL runs
    collectives in launch order, so a wait never waits for an unrelated reduction, and bank i is orthogonalized while
    bank i+1 and the tables still reduce. At world size 1 nothing is sent: updates read .grad. Step sizes: muon_lr
    (adam_lr) x the schedule's lr multiplier x spec.lr_mul (x spec.matrix_lr_mul(i)). Adam every other step (T2.7): a
    non-Adam step moves each Adam gradient into `kept` (its reduction launched at once, overlapping the next step), and
    the next update adds it inside the Adam kernel, not in an autograd pass over every table. Tied embedding (#51, #53;
    T3.15): while tied, embed's gradient is added to lm_head's, only lm_head is reduced and updated, and embed copies
    it; untie() hands lm_head's Adam state to embed (both stored (vocab, dim): no transpose)."""

    def __init__(self, params: dict[str, nn.Parameter], specs: dict[str, ParamSpec], config: OptimConfig,
                 rank: int = 0, world_size: int = 1, tied: tuple[str, str] | None = None, compile: bool = False,
                 tail_ema_blends: dict[str, float] | None = None):
        self.params, self.specs, self.config = params, specs, config
        # TAIL_EMA_FRAC (T5.4): label -> the EMA's share of its weights after tail_ema_blend
        self.tail_ema_blends = {label: blend for label, blend in (tail_ema_blends or {}).items() if label in params}
        self.rank, self.world = rank, world_size
        self.tied = self.initial_tie = tied  # (follower, leader) = ("embed", "lm_head") while tied
        group = lambda label: (specs[label].comm != "replicated", specs[label].optimizer != "normuon")  # noqa: E731
        self.comm_order = sorted((label for label in specs if label in params), key=group)
        self.grad_scale = 1.0 / world_size
        self.state: dict[str, dict[str, Tensor | int]] = {}
        self.kept: dict[str, tuple] = {}  # Adam label -> (reduction work or None, this rank's gradient rows)
        self.flat_layouts: dict[tuple[str, ...], FlatReplicatedGrads] = {}  # replicated labels sent together
        self.rows: dict[str, RankRows] = {}
        self.lr_muls: dict[str, Tensor] = {}  # NorMuon: per-matrix lr multipliers of the local rows
        on_cuda = next(iter(params.values())).is_cuda
        self.use_triton = triton_applies(next(iter(params.values())))  # symmetric kernels on every bank
        fns = (normuon_bank_step, adam_update, tail_ema_update)
        if on_cuda and compile:  # one graph per bank and table shape
            allow_graph_per_shape()
            fns = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in fns)
        self._normuon_fn, self._adam_fn, self._tail_ema_fn = fns
        for label, p in params.items():
            self._init_state(label, p, specs[label])
        self.tail_ema_rate = torch.zeros((), device=next(iter(params.values())).device)  # this tick's, on the device
        # This step's schedule scalars on the device (T5.3): one copy per step into a fixed tensor, so a CUDA graph of
        # the step reads each step's values; each value 16-byte aligned, as inductor's kernels assume of their inputs.
        self.scalar_slots: dict[str, list[int]] = {}  # label -> its values' places in `scalars`
        count = 0
        for label in self.comm_order:
            names = STEP_SCALARS[specs[label].optimizer]
            self.scalar_slots[label] = [4 * (count + i) for i in range(len(names))]
            count += len(names)
        self.scalars = torch.zeros(4 * count, device=next(iter(params.values())).device)
        self.scalar_views = {label: dict(zip(STEP_SCALARS[specs[label].optimizer], (self.scalars[i] for i in slots)))
                             for label, slots in self.scalar_slots.items()}
        # what a bank's step takes as its momentum: the two rails with their scalars (T2.9)
        self.bank_momentum = {label: (st["momentum"], st["slow_momentum"], self.scalar_views[label]["fast_beta"],
                                      self.scalar_views[label]["fast_weight"], config.muon_rails_slow_beta)
                              for label, st in self.state.items() if specs[label].optimizer == "normuon"}

    def _init_state(self, label: str, p: Tensor, spec: ParamSpec):
        view = (-1, *spec.matrix_shape) if spec.optimizer == "normuon" else tuple(p.shape)
        view = tuple(p.view(view).shape)
        rows = self.rows[label] = RankRows(view, self.rank, self.world)
        local = (rows.rows, *view[1:]) if spec.comm == "sharded" else view
        st = self.state[label] = {}
        zeros = lambda shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, device=p.device)  # noqa: E731
        if label in self.tail_ema_blends:
            st["tail_ema"] = zeros(local)  # this rank's rows' EMA (T5.4)
        if spec.optimizer == "adam":
            st.update(exp_avg=zeros(local), exp_avg_sq=zeros(local), step=0)
            return
        matrix_rows, cols = spec.matrix_shape
        st["momentum"], st["slow_momentum"] = zeros(local), zeros(local)  # the fast and the slow rail (T2.9)
        st["second_moment"] = zeros((local[0], matrix_rows, 1) if matrix_rows >= cols else (local[0], 1, cols))
        if p.dtype == torch.bfloat16:  # the low halves of the fp32 master (T2.6)
            st["mantissa"] = zeros(local, torch.int16)
        index = torch.arange(local[0]) + (rows.start if spec.comm == "sharded" else 0)
        self.lr_muls[label] = spec.matrix_lr_mul(index).view(-1, 1, 1).to(p.device)

    # --- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr_multiplier: float = 1.0, momentum: float = 0.95, adam: bool = True,
             fast_rail: tuple[float, float] | None = None):
        """One update: NorMuon on the banks with this momentum, Adam on the rest when `adam` (the
        schedule runs it on every other step with two steps' gradients, T2.7). `fast_rail`: the fast
        momentum rail's beta and blend weight (T2.9; None: momentum and 1, Muon's single EMA)."""
        params = self.params
        follower = self.tied[0] if self.tied else None
        tie = follower is not None and params[follower].grad is not None
        with_grad, active, kept = self.step_labels(lambda label: params[label].grad is not None, adam, follower)
        self._load_scalars(active, lr_multiplier, momentum, fast_rail or (momentum, 1.0))
        if self.world > 1:
            self._step_with_collectives(active, kept, tie, adam)
        else:
            self._local_step(active, kept, tie, adam)
        if tie:
            params[follower].grad = None
        for label in with_grad:
            params[label].grad = None

    def step_labels(self, has_grad, adam: bool, follower: str | None) -> tuple[list, list, list]:
        """(labels the step updates or keeps, those it updates, those it keeps for the next Adam step), in comm_order;
        the tie's follower (None when untied) is neither updated nor kept."""
        with_grad = [label for label in self.comm_order if has_grad(label) and label != follower]
        active = [label for label in with_grad if adam or self.specs[label].optimizer == "normuon"]
        return with_grad, active, [label for label in with_grad if label not in active]

    def _load_scalars(self, active: list[str], lr_multiplier: float, momentum: float, fast_rail: tuple[float, float]):
        """Advance the Adam step counts of the labels updated now and copy this step's scalars (float64
        on the host, then float32) into `scalars` with one non-blocking copy from a fresh pinned tensor:
        the caching host allocator keeps it until the copy has run."""
        cfg, values = self.config, [0.0] * self.scalars.numel()
        for label in active:
            spec = self.specs[label]
            if spec.optimizer == "normuon":
                label_values = (momentum, cfg.muon_lr * lr_multiplier * spec.lr_mul,
                                cfg.muon_weight_decay * spec.wd_mul * cfg.muon_lr * lr_multiplier, *fast_rail)
            else:
                beta1, beta2 = spec.betas
                self.state[label]["step"] += 1
                t = self.state[label]["step"]
                lr = cfg.adam_lr * spec.lr_mul * lr_multiplier
                label_values = (lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t),
                                lr * lr * cfg.adam_weight_decay * spec.wd_mul)
            for slot, value in zip(self.scalar_slots[label], label_values):
                values[slot] = value
        host = torch.tensor(values, dtype=torch.float32, pin_memory=self.scalars.is_cuda)
        self.scalars.copy_(host, non_blocking=True)

    def _local_step(self, active: list[str], kept: list[str], tie: bool, adam: bool):
        """A step at world size 1, nothing sent: the tie's gradient sum, the updates from .grad (Adam's with the
        gradient kept before), a non-Adam step's gradients kept (summed with any kept before), the follower's copy."""
        params, (follower, leader) = self.params, self.tied or (None, None)
        if tie:
            params[leader].grad.add_(params[follower].grad)
        for label in active:
            _, earlier = self.kept.pop(label, (None, None))
            self._update(label, self.rows[label].full(params[label].grad), earlier)
        for label in kept:
            grad = self.rows[label].full(params[label].grad)
            if label in self.kept:  # two steps without Adam in a row (the warm-up's stage edges): sum them
                grad.add_(self.kept[label][1])
            self.kept[label] = (None, grad)
        if self.tied and adam:
            params[follower].copy_(params[leader])

    def _step_with_collectives(self, active: list[str], kept: list[str], tie: bool, adam: bool):
        """A step at world size > 1: reductions, updates and gathers in comm_order, each collective
        launched asynchronously; the kept gradients' reductions after the gathers."""
        params = self.params
        if tie:
            follower, leader = self.tied
            params[leader].grad.add_(params[follower].grad)
        reductions = self._launch_reductions(active)
        gathers = []
        for label, (work, grad) in zip(active, reductions):
            if work is not None:
                work.wait()
            kept_grad = self._kept_grad(label) if self.specs[label].optimizer == "adam" else None
            gathers.append(self._update(label, grad, kept_grad))
        for gather in gathers:
            if gather is not None:
                gather()
        for label, (work, grad) in zip(kept, self._launch_reductions(kept)):
            self._keep(label, work, grad)  # after the gathers: these reductions overlap the next step
        if self.tied and adam:
            follower, leader = self.tied
            params[follower].copy_(params[leader])

    def _keep(self, label: str, work, grad: Tensor):
        """Hold a step's gradient (its reduction under way) for the next Adam update of the label."""
        earlier = self._kept_grad(label)
        if earlier is not None:  # two steps without Adam in a row (the warm-up's stage edges): sum them
            if work is not None:
                work.wait()
            work, grad = None, grad.add_(earlier)
        self.kept[label] = (work, grad)

    def _kept_grad(self, label: str) -> Tensor | None:
        """The kept gradient rows of `label`, reduced (the reduction waited for), or None."""
        if label not in self.kept:
            return None
        work, grad = self.kept.pop(label)
        if work is not None:
            work.wait()
        return grad

    def _launch_reductions(self, labels: list[str]) -> list[tuple]:
        """Launch the reductions of `labels`, in comm_order: the replicated ones as one flat all-reduce per dtype, laid
        out at this label set's first launch; one reduce-scatter per sharded label. (work, gradient rows) per label."""
        replicated = tuple(label for label in labels if self.specs[label].comm == "replicated")
        flat = {}
        if replicated:
            if replicated not in self.flat_layouts:
                self.flat_layouts[replicated] = FlatReplicatedGrads({label: self.params[label] for label in replicated})
            flat = self.flat_layouts[replicated].launch({label: self.params[label].grad for label in replicated})
        return [flat[label] if label in flat else self._launch_reduce_scatter(label) for label in labels]

    def _launch_reduce_scatter(self, label: str):
        grad, rows = self.params[label].grad, self.rows[label]
        full = rows.full(grad)
        if rows.padded:
            padded = full.new_zeros((rows.rows * self.world, *full.shape[1:]))
            padded[: full.size(0)] = full
            full = padded
        local = full.new_empty((rows.rows, *full.shape[1:]))
        return dist.reduce_scatter_tensor(local, full, op=dist.ReduceOp.SUM, async_op=True), local

    def _local_weight(self, label: str) -> tuple[Tensor, Tensor, bool]:
        """(the full weight as viewed, this rank's rows of it, whether they are sharded)."""
        p, spec, rows = self.params[label], self.specs[label], self.rows[label]
        full_weight = rows.full(p.data)
        if not (spec.comm == "sharded" and self.world > 1):
            return full_weight, full_weight, False
        if rows.padded:
            weight = full_weight.new_zeros((rows.rows, *full_weight.shape[1:]))
            weight[: rows.real_rows] = full_weight[rows.start: rows.start + rows.real_rows]
            return full_weight, weight, True
        return full_weight, full_weight[rows.start: rows.start + rows.rows], True

    def _update(self, label: str, grad: Tensor, kept_grad: Tensor | None):
        """Update this rank's rows of one parameter with this step's scalars (`scalar_views`) and, for
        Adam, the gradient kept by the step before (T2.7); returns a wait function for their all-gather."""
        spec, st, cfg, scalars = self.specs[label], self.state[label], self.config, self.scalar_views[label]
        full_weight, weight, sharded = self._local_weight(label)
        if spec.optimizer == "normuon":
            rows, cols = spec.matrix_shape
            self._normuon_fn(grad, self.bank_momentum[label], st["second_moment"], weight, st.get("mantissa"),
                             scalars["momentum"], scalars["lr"], self.lr_muls[label], scalars["wd_lr"],
                             self.grad_scale, cfg.muon_beta2, -1 if rows >= cols else -2, self.use_triton)
        else:
            beta1, beta2 = spec.betas
            self._adam_fn(grad, kept_grad, weight, st["exp_avg"], st["exp_avg_sq"], scalars["step_size"],
                          scalars["wd_lr2"], beta1, beta2, cfg.adam_eps, self.grad_scale)
        return self._launch_gather(label, full_weight, weight) if sharded else None

    def _launch_gather(self, label: str, full_weight: Tensor, weight: Tensor):
        """All-gather this rank's rows `weight` of a sharded parameter into each rank's full weight; a wait function."""
        if self.rows[label].padded:
            gathered = weight.new_empty((self.rows[label].rows * self.world, *weight.shape[1:]))
            work = dist.all_gather_into_tensor(gathered, weight, async_op=True)
            n = full_weight.size(0)
            return lambda: (work.wait(), full_weight.copy_(gathered[:n]))
        work = dist.all_gather_into_tensor(full_weight, weight, async_op=True)  # in place
        return work.wait

    # --- the weights' EMA over the last steps (TAIL_EMA_FRAC; record #92, PR #360; T5.4) ------------
    def _own_rows(self, label: str) -> tuple[Tensor, Tensor | None, Tensor]:
        """Views of this rank's real rows of a tail-averaged label: (weight, mantissa or None, EMA)."""
        p, spec, rows, st = self.params[label], self.specs[label], self.rows[label], self.state[label]
        sharded = spec.comm == "sharded" and self.world > 1
        start, n = (rows.start, rows.real_rows) if sharded else (0, rows.full(p.data).size(0))
        mantissa = st.get("mantissa")
        return (rows.full(p.data)[start: start + n], None if mantissa is None else mantissa[:n], st["tail_ema"][:n])

    @torch.no_grad()
    def tail_ema_update(self, rate: float):
        """After a step of the window: each tail-averaged label's EMA of this rank's rows, one fused
        lerp per label on the weights the step left (rate 1: the EMA starts as them)."""
        self.tail_ema_rate.fill_(rate)
        for label in self.tail_ema_blends:
            weight, mantissa, ema = self._own_rows(label)
            self._tail_ema_fn(ema, weight, mantissa, self.tail_ema_rate)

    @torch.no_grad()
    def tail_ema_blend(self):
        """At the end of training: w ← w + blend·(EMA − w) on this rank's rows (the fp32 master of a bank,
        its mantissa kept exact), then every rank gathers the full, identical weights."""
        gathers = []
        for label, blend in self.tail_ema_blends.items():
            full_weight, weight, sharded = self._local_weight(label)
            st = self.state[label]
            mantissa = st.get("mantissa")
            store_master(weight, mantissa, master_weight(weight, mantissa).lerp(st["tail_ema"], blend))
            if sharded:
                gathers.append(self._launch_gather(label, full_weight, weight))
        for gather in gathers:
            gather()

    # --- state ----------------------------------------------------------------------------------
    def untie(self):
        """Give the follower (embed) the leader's (lm_head's) Adam state and update both from now on (#53)."""
        follower, leader = self.tied
        for key in ("exp_avg", "exp_avg_sq"):
            self.state[follower][key].copy_(self.state[leader][key])
        self.state[follower]["step"] = self.state[leader]["step"]
        self.tied = None

    def _settle_kept(self) -> dict[str, Tensor]:
        """Wait for the kept gradients' reductions (a flat buffer set must not be filled again while
        one is in flight); label -> kept gradient rows, left in `kept` with nothing to wait for."""
        kept = {label: self._kept_grad(label) for label in list(self.kept)}
        self.kept = {label: (None, grad) for label, grad in kept.items()}
        return kept

    def state_dict(self) -> dict:
        """Moments, step counts, the tie, and the gradients kept for the next Adam step (T2.7)."""
        kept = self._settle_kept()
        return {"tied": self.tied,
                "state": {label: {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in st.items()}
                          for label, st in self.state.items()},
                "kept": {label: grad.clone() for label, grad in kept.items()}}

    def reset(self):
        """A new optimizer's state: zero moments, buffers and step counts, the tables tied again."""
        self.tied = self.initial_tie
        self._settle_kept()
        self.kept = {}
        for st in self.state.values():
            for key, value in st.items():
                if isinstance(value, Tensor):
                    value.zero_()  # in place: compiled functions keep their inputs
                else:
                    st[key] = 0

    def load_state_dict(self, state: dict):
        self._settle_kept()
        self.tied = state["tied"]
        self.kept = {label: (None, grad.clone()) for label, grad in state["kept"].items()}
        for label, st in state["state"].items():
            for key, value in st.items():
                if isinstance(value, Tensor):
                    self.state[label][key].copy_(value)  # in place: compiled functions keep their inputs
                else:
                    self.state[label][key] = value


# =============================================================================================
# The n-gram table
# =============================================================================================

# Token classes for the n-gram hashes (NGRAM_TOKEN_CLASSES=1; modded-nanogpt PR #375; T3.22): tokens whose text
# normalizes alike share the smallest id of their class, so " The", "THE" and " the" hash to the same rows. The
# normalization is #375's: NFKC, then NFD without the nonspacing marks (accents), lowercase, runs of space, tab, CR
# and LF as one space, then the outer Unicode whitespace stripped unless the text is that one space. Tokens that are
# not whole UTF-8, or that normalize to nothing, keep their own id; so do the special token and the padding ids.
TOKEN_CLASS_WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B)))
                          + "\u2028\u2029\u202f\u205f\u3000")  # Unicode's White_Space, as Rust's char::is_whitespace


def token_class_text(token: bytes) -> str:
    """A token's normalized text for its class (see above); "" where the token keeps its own id."""
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return ""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Mn").lower()
    text = re.sub(r"[ \t\r\n]+", " ", text)
    return text if text == " " else text.strip(TOKEN_CLASS_WHITESPACE)


def token_classes(token_bytes: dict[int, bytes], vocab_size: int) -> Tensor:
    """Each id's class (vocab_size,) long: the smallest id whose token normalizes to the same text (PR #375)."""
    first: dict[str, int] = {}
    classes = list(range(vocab_size))
    for i in sorted(token_bytes):
        if i >= vocab_size:
            raise SetupError(f"token id {i} does not fit the vocabulary of {vocab_size} (VOCAB_SIZE)")
        text = token_class_text(token_bytes[i])
        if text:
            classes[i] = first.setdefault(text, i)
    return torch.tensor(classes, dtype=torch.long)


# Hashed n-gram table (record #92 "ANVIL2", PR #360; T3.19): per order n, a polynomial hash of the tokens
# x[t-n+1..t] (each + 1) modulo the Mersenne prime 2^31 - 1, started at n so the orders hash apart, scattered
# by a multiplication modulo the prime, then taken modulo the table's hashed rows. Integer arithmetic on the
# device, every product below 2^62: the same rows on every rank, process and device.
NGRAM_PRIME, NGRAM_BASE, NGRAM_SCATTER = 2**31 - 1, 1_000_003, 1_460_320_421
NGRAM_ORDERS = (2, 3)  # the n-gram lengths hashed into the table: bigrams and trigrams
# What one process may hold of the table and its state: an 80 GB GPU less the model's peak (about 45 GB in
# rank-slice mode) and room for the row cache and the kept gradients
NGRAM_STATE_GIB = 28


def ngram_ids(ids: Tensor, rows: int, orders: tuple[int, ...] = NGRAM_ORDERS) -> Tensor:
    """(T, len(orders)) rows of each position's n-gram of each order in a table of `rows` rows: the first
    rows - len(orders) are hashed; order k's n-grams that would reach before the first position of the
    flattened batch take reserved row rows - len(orders) + k."""
    hashed_rows, x = rows - len(orders), ids.long() + 1
    columns = []
    for k, n in enumerate(orders):
        h = torch.full_like(x, n)
        for back in range(n - 1, -1, -1):  # x[t - back], zeros before the first position
            h = (h * NGRAM_BASE + torch.cat([x.new_zeros(back), x[: x.size(0) - back]])) % NGRAM_PRIME
        row = (h * NGRAM_SCATTER) % NGRAM_PRIME % hashed_rows
        row[: n - 1].fill_(hashed_rows + k)  # fill_: a host scalar copied in would sync in eager mode
        columns.append(row)
    return torch.stack(columns, 1)


def padded_unique(values: Tensor, fill: int) -> tuple[Tensor, Tensor]:
    """(the distinct values in increasing order, then `fill` up to values' length; each value's place in
    it): torch.unique's answer with a static shape and no host sync (T3.19). `fill` exceeds every value."""
    ordered, order = values.sort()
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    place = first.cumsum(0) - 1
    inverse = torch.empty_like(values).scatter_(0, order, place)
    return torch.full_like(values, fill).scatter_(0, place, ordered), inverse  # equal values write one place


def summed_row_gradients(rows: tuple[Tensor, ...], grads: tuple[Tensor, ...], fill: int) -> tuple[Tensor, Tensor]:
    """(the distinct row ids of the parts `rows`, increasing, then `fill` up to their total length; each one's
    gradient, summed in fp32 over the parts' pairs) (T3.19). Compiled, the fp32 sums are the one buffer it
    writes: each part's gradients are read in their own dtype and added in place, with no fp32 copy or concat."""
    distinct, places = padded_unique(torch.cat(rows), fill)
    sums = grads[0].new_zeros(distinct.numel(), grads[0].size(1), dtype=torch.float32)
    start = 0
    for part in grads:
        sums.index_add_(0, places[start: start + part.size(0)], part.float())
        start += part.size(0)
    return distinct, sums


def rowwise_rmsprop_rows(weight: Tensor, row_sq: Tensor, last_step: Tensor, local: Tensor, sums: Tensor,
                         scalars: Tensor, beta2: float, eps: float, grad_scale: float):
    """One row-wise RMSprop step of the table's rows `local` (T3.19), in place: each row's second moment (the
    mean square of its gradient's values) decayed over the steps it missed, then the row moved by its gradient
    over that moment's root, with adam_update's cautious decay (T2.5). scalars: float64 on the device, (t, the
    step size with its bias correction, lr²·wd), so one compiled graph serves every step."""
    t, step_size, wd_lr2 = scalars[0], scalars[1], scalars[2]
    missed = (t - 1 - last_step[local]).float()
    g = sums * grad_scale
    v = (row_sq[local] * beta2 ** missed).lerp(g.square().mean(dim=1), 1 - beta2)
    w = weight[local].float()
    u = step_size.float() * g / (v.sqrt() + eps)[:, None]
    u = u + (u * w > 0) * w * wd_lr2.float()
    weight[local] = (w - u).to(weight.dtype)
    row_sq[local] = v
    last_step[local] = t.to(last_step.dtype)


def ngram_bytes_per_row(dim: int) -> int:
    """A table row's bytes with optimizer state: bf16 values, last update's step (int32), fp32 second moment."""
    return 2 * dim + 4 + 4


NGRAM_EXCHANGE_SIGMAS = 8  # an owner's slots in an exchange: its mean share plus this many standard deviations


def exchange_capacity(ids: int, world: int, shard_rows: int) -> int:
    """The slots for each owner in an exchange of `ids` distinct row ids (T3.19): hashed rows fall on the owners as
    independent draws, so an owner's share is binomial; its mean plus NGRAM_EXCHANGE_SIGMAS deviations (an overflow
    below one in 10^15 per owner), never more than the ids or an owner's rows."""
    mean = ids / world
    return max(1, min(ids, shard_rows, math.ceil(mean + NGRAM_EXCHANGE_SIGMAS * math.sqrt(mean)) + 8))


class ExchangeOverflow(RuntimeError):
    pass


class NgramTable(nn.Module):
    """The hashed n-gram table (record #92, PR #360; T3.19): NGRAM_ROWS rows, each position reading one row per order
    (ngram_ids), summed into the bigram injection (T3.4). One object holds it all: the row cache the forward reads
    (buffers: `cache`, a leaf whose gradient is the per-row sums; `eval_cache` for longer validation forwards;
    `inverse`, each position's places), this rank's rows and optimizer state, the gradients kept for the next Adam step,
    and the exchange with the rows' owners. No parameter: NorMuonAdam never sees it; no dense gradient exists. The model
    calls `self.ngram(tokens)`; the trainer calls `shard` once, `load` before each forward on new tokens (`serve` in a
    validation round where this rank has no chunk), `keep_gradient` after each backward, `step` after each optimizer
    step, `reset` after the warm-up and between seeds (nn.Module's state_dict leaves the rows out: they are no buffers).

    Rank r owns rows [r·S, (r+1)·S), S = ⌈rows / world⌉, and a scratch row (local S) that padding reads and
    writes. load: the distinct rows (padded_unique: static shapes) and their current weights into the cache; at world
    size 1 one gather, above it the row ids go to their owners and the weights come back. step (on an Adam step, T2.7):
    the kept (row, gradient) pairs of every micro-batch and of the step before are summed per row, sent to their owners,
    summed there and applied. Above world size 1 an exchange (to_owners) is all_to_all_single of fixed-size slots:
    static shapes and no host sync, so the loads run inside the step graphs at every world size. The rows' optimizer is
    row-wise RMSprop (rowwise_rmsprop_rows; FBGEMM's row-wise AdaGrad with an EMA): no momentum, one fp32 second moment
    per row. A row a step leaves out gets a zero gradient, so it does not move and only its moment decays: the lazy
    update equals the dense one. 2 bytes a value beside 8 a row, so one process holds record #92's per-rank rows."""

    def __init__(self, cfg: ModelConfig, max_tokens: int, max_train_tokens: int):
        super().__init__()
        self.rows, self.spec, orders = cfg.ngram_rows, param_table(cfg)["ngram_table"], len(NGRAM_ORDERS)
        d = cfg.model_dim
        cache = torch.zeros(max_train_tokens * orders, d, dtype=torch.bfloat16).requires_grad_()
        self.register_buffer("cache", cache, persistent=False)
        if max_tokens > max_train_tokens:
            self.register_buffer("eval_cache", torch.zeros(max_tokens * orders, d, dtype=torch.bfloat16),
                                 persistent=False)
        self.register_buffer("inverse", torch.zeros(max_tokens, orders, dtype=torch.long), persistent=False)
        if cfg.ngram_token_classes:  # each id's normalization class (token_classes; identity until the trainer sets it)
            self.register_buffer("token_class", torch.arange(cfg.vocab_size), persistent=False)
        else:
            self.token_class = None
        self.weight = None  # this rank's rows: shard()

    def _apply(self, fn, recurse=True):
        """Module.to and the like, the cache kept a leaf whose .grad the backward fills: Module moves buffers
        with autograd on, which would leave a moved cache the output of a copy."""
        super()._apply(fn, recurse)
        self.cache.detach_().requires_grad_()
        return self

    def cache_for(self, tokens: int) -> Tensor:
        """The row cache of a forward of `tokens` tokens: the training one (its gradient is the per-row sums) up
        to the longest training forward, beyond it (validation's) one without a gradient, so that each backward
        fills a gradient of the training forward's size, not validation's."""
        return self.cache if tokens * self.inverse.size(1) <= self.cache.size(0) else self.eval_cache

    def forward(self, tokens: int) -> Tensor:
        """The sum over the orders of each position's rows, read from the cache `load` filled (T, d)."""
        return self.cache_for(tokens)[self.inverse[:tokens]].sum(1)

    def shard(self, optim: OptimConfig, rank: int = 0, world_size: int = 1, compile: bool = False,
              dtype: torch.dtype = torch.bfloat16):
        """Allocate this rank's rows and their optimizer state on the cache's device, all zero (the injection
        starts at nothing, T3.4), no step taken; returns the table."""
        self.optim, self.world = optim, world_size
        self.shard_rows = -(-self.rows // world_size)
        self.start = rank * self.shard_rows
        device, local = self.cache.device, self.shard_rows + 1  # the owned rows and the scratch row
        self.weight = torch.zeros(local, self.cache.size(1), dtype=dtype, device=device)
        self.row_sq = torch.zeros(local, device=device)
        self.last_step = torch.zeros(local, dtype=torch.int32, device=device)  # 0: never updated
        self.step_count = 0  # Adam steps taken
        self.kept: list[tuple[Tensor, Tensor]] = []  # (row ids, their gradient sums) since the last Adam step
        self.scalars = torch.zeros(3, dtype=torch.float64, device=device)  # the update's (t, step size, lr²·wd)
        self.overflow = torch.zeros((), dtype=torch.long, device=device)  # the most ids an exchange's slots left out
        fns = (rowwise_rmsprop_rows, summed_row_gradients)
        if compile and device.type == "cuda":  # the gathers and arithmetic fused; one graph per stage's row count
            allow_graph_per_shape()
            fns = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in fns)
        self._rows_fn, self._summed = fns
        return self

    # --- forward and backward -----------------------------------------------------------------------
    @torch.no_grad()
    def load(self, ids: Tensor) -> Tensor:
        """Fill the row cache for a forward on `ids`: each position's places in `inverse`, the distinct rows'
        current weights in the cache. Returns the distinct row ids (then `rows` as padding), as many as the cache
        holds (the forward's distinct rows always fit), which keep_gradient takes with the cache's gradient."""
        cache = self.cache_for(ids.size(0))
        row_ids = ngram_ids(ids if self.token_class is None else self.token_class[ids.long()], self.rows)
        distinct, places = padded_unique(row_ids.flatten(), self.rows)
        distinct = distinct[: self.load_ids(ids.size(0))]
        self.inverse[: ids.size(0)].copy_(places.view_as(row_ids))
        # at world size 1 the padding reads the scratch row
        cache[: distinct.numel()].copy_(self.weight[distinct] if self.world == 1 else self.fetch(distinct))
        return distinct

    def load_ids(self, tokens: int) -> int:
        """The row ids a load of `tokens` tokens exchanges (distinct, then padding): one per order and token, at most
        as many as its cache holds. Every rank's load in a round has this length, also serve's."""
        return min(tokens * len(NGRAM_ORDERS), self.cache_for(tokens).size(0))

    def keep_gradient(self, distinct: Tensor, grad: Tensor | None = None):
        """Keep a backward's per-row gradient sums for the next Adam step: `grad` (a CUDA graph's output), or
        the cache's .grad that an eager backward left, which is then cleared."""
        if grad is None:
            grad, self.cache.grad = self.cache.grad, None
        self.kept.append((distinct, grad[: distinct.numel()].clone()))

    # --- optimizer ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr_multiplier: float, adam: bool = True):
        """On Adam steps the owners sum the kept gradients per row and update those rows; else they stay kept (T2.7)."""
        if not adam:
            return
        kept, self.kept = self.kept, []
        self.update(*self.owner_sums(kept), lr_multiplier)

    def owner_sums(self, pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """From this rank's (row ids, gradients) pairs, repeats and padding allowed: (local rows, each one's
        gradient summed over every pair of every rank) of the rows this rank owns, scratch-padded."""
        # one padding pair (the scratch row's): an Adam step with no pairs still sums, exchanges and steps
        padding = (self.last_step.new_full((1,), self.rows, dtype=torch.long),
                   self.weight.new_zeros(1, self.weight.size(1)))
        distinct, sums = self._summed(*zip(padding, *pairs), fill=self.rows)
        if self.world == 1:
            return distinct, sums
        local, (received,), _ = self.to_owners(distinct, sums)
        return self._summed((local,), (received,), fill=self.shard_rows)

    def update(self, local: Tensor, sums: Tensor, lr_multiplier: float):
        """One step of the rows `local` (duplicates only of the scratch row) with their gradients summed over
        the ranks, their moments decayed over the steps they missed."""
        _, beta2 = self.spec.betas
        self.step_count += 1
        t = self.step_count
        lr = self.optim.adam_lr * self.spec.lr_mul * lr_multiplier
        wd_lr2 = lr * lr * self.optim.adam_weight_decay * self.spec.wd_mul  # adam_update's decay (T2.5)
        host = torch.tensor([t, lr * math.sqrt(1 - beta2 ** t), wd_lr2], dtype=torch.float64,
                            pin_memory=self.scalars.is_cuda)
        self.scalars.copy_(host, non_blocking=True)
        self._rows_fn(self.weight, self.row_sq, self.last_step, local, sums, self.scalars, beta2, self.optim.adam_eps,
                      1.0 / self.world)

    # --- exchange (world size > 1) --------------------------------------------------------------------
    def to_owners(self, rows: Tensor, *payloads: Tensor) -> tuple[Tensor, list[Tensor], Tensor]:
        """Send the increasing row ids `rows` (padding: self.rows, last) and the payloads' rows with them to their
        owners, in exchange_capacity slots per owner (every rank sends as many ids): (the local rows received, the
        scratch row in empty slots; the payloads received; each id's slot, where the owners' answers come back). An
        owner's ids beyond its slots are counted in `overflow`, which the trainer's periodic check reads."""
        world, n, device = self.world, rows.numel(), rows.device
        capacity = exchange_capacity(n, world, self.shard_rows)
        starts = torch.searchsorted(
            rows, (torch.arange(world + 1, device=device) * self.shard_rows).clamp(max=self.rows))
        torch.maximum(self.overflow, (starts.diff() - capacity).max(), out=self.overflow)
        owner = (rows // self.shard_rows).clamp(max=world - 1)
        slot = torch.arange(n, device=device) - starts[owner]
        place = torch.where((rows < self.rows) & (slot < capacity), owner * capacity + slot, 0)
        take = starts[:-1, None] + torch.arange(capacity, device=device)  # (owner, slot) -> an index into rows
        filled = (take < starts[1:, None]).flatten()
        take = torch.where(filled, take.flatten(), 0)

        def exchange(t: Tensor) -> Tensor:
            out = torch.empty_like(t)
            dist.all_to_all_single(out, t)  # equal splits: static shapes, no sizes to send first
            return out

        received = exchange(torch.where(filled, rows[take], self.rows))
        local = torch.where(received < self.rows, received - self.start, self.shard_rows)
        return local, [exchange(p[take]) for p in payloads], place

    def serve(self, tokens: int):
        """Take part in the other ranks' loads of `tokens` tokens with none of its own: answer their requests."""
        if self.world > 1:
            self.fetch(torch.full((self.load_ids(tokens),), self.rows, device=self.weight.device))

    def fetch(self, rows: Tensor) -> Tensor:
        """The current weights of the increasing row ids `rows` (padding: self.rows, last) from their owners."""
        local, _, place = self.to_owners(rows)
        served = self.weight[local]
        answers = torch.empty_like(served)
        dist.all_to_all_single(answers, served)
        return answers[place]

    # --- state ----------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, Tensor]:
        """This rank's rows, their state and the exchanges' overflow count (what CUDA graphs use besides the cache)."""
        return {"weight": self.weight, "last_step": self.last_step, "row_sq": self.row_sq, "overflow": self.overflow}

    def reset(self):
        """Zero rows and moments, no step taken, no gradient kept."""
        for t in self.tensors().values():
            t.zero_()
        self.step_count, self.kept = 0, []
        self.cache.grad = None


# =============================================================================================
# Data
# =============================================================================================

BOS_ID = 50256  # <|endoftext|> precedes every document
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
SHARD_HEADER_BYTES = 4 * SHARD_HEADER_INTS
DOWNLOAD_HINT = ("download FineWeb shards with `python data/cached_fineweb10B.py 9`, or point TRAIN_FILES / VAL_FILES "
                 "at your shards")
MAX_DOCS_PER_BATCH = {16384: 64, 32768: 96, 49152: 128}  # cu_seqlens lengths (#78)


class ShardError(SetupError):
    """A token shard that cannot be used: the message names the file and the defect (also .path, .defect)."""

    def __init__(self, path, defect: str):
        self.path, self.defect = os.fspath(path), defect
        super().__init__(f"{self.path}: {defect}")


def read_shard_header(path: str) -> int:
    """A shard's token count, its magic, version and size checked. data/shards.py has a copy for the data scripts (held
    equal by tests/data/test_shards.py). A folder fails here, not at first read: its size passes the size check."""
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise ShardError(path, f"{kind}, not a token shard: give a pattern of .bin files, e.g. "
                               f"{os.path.join(path, '*_train_*.bin')!r}")
    size = os.path.getsize(path)
    if size < SHARD_HEADER_BYTES:
        raise ShardError(path, f"{size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte header (truncated download?)")
    magic, version, tokens = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    if magic != SHARD_MAGIC:
        raise ShardError(path, f"bad magic number: expected {SHARD_MAGIC}, got {magic} (not a token shard?)")
    if version != SHARD_VERSION:
        raise ShardError(path, f"unsupported version {version} (expected {SHARD_VERSION})")
    expected = SHARD_HEADER_BYTES + 2 * tokens
    if size != expected:
        raise ShardError(path, f"size mismatch: header says {tokens} tokens = {expected} bytes, file has {size} bytes"
                               + (" (truncated? download it again)" if size < expected else ""))
    return tokens


def find_shards(pattern: str) -> list[str]:
    """The shard files a pattern names, in order, each header checked."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no token shards match {pattern!r}: {DOWNLOAD_HINT}")
    for path in files:
        read_shard_header(path)
    return files


class Shard:
    """One shard's tokens in (pinned) host memory and the positions of its documents' BOS tokens; with a
    vocab_size, a token id outside the vocabulary is a ShardError (an embedding lookup would fail on it)."""

    def __init__(self, path: str, pin_memory: bool, vocab_size: int | None = None):
        n = read_shard_header(path)
        storage = torch.empty(n, dtype=torch.int16, pin_memory=pin_memory)
        self.tokens = storage.numpy().view(np.uint16)
        with open(path, "rb") as f:
            f.seek(SHARD_HEADER_BYTES)
            if f.readinto(self.tokens) != 2 * n:
                raise ShardError(path, f"could not read {n} tokens")
        if vocab_size is not None and n and (largest := int(self.tokens.max())) >= vocab_size:
            raise ShardError(path, f"token id {largest} at position {int(self.tokens.argmax())} is outside the "
                                   f"vocabulary of {vocab_size} (VOCAB_SIZE): not GPT-2 tokens? re-tokenize it")
        self.path = path
        self.bos = np.flatnonzero(self.tokens == BOS_ID)


def max_docs_per_batch(tokens: int) -> int:
    return MAX_DOCS_PER_BATCH.get(tokens) or max(16, -(-(tokens // 300) // 128) * 128)


def plan_batch(bos: np.ndarray, first_doc: int, shard_len: int, tokens: int, num_ranks: int,
               max_seq_len: int, max_docs: int):
    """BOS-aligned packing (#26, T1.2): every rank gets consecutive documents starting at a BOS, each truncated to
    max_seq_len and the last cut to fit, totalling exactly tokens+1. A rank's (max_docs)-th segment takes all it still
    needs, across document boundaries, so that cu_seqlens keeps a fixed length. Returns (per-rank [(start, end)], next
    document index), or None when the shard runs out (the caller re-plans from the next shard)."""
    plan, i = [], first_doc
    for _ in range(num_ranks):
        segments, length = [], 0
        while length < tokens + 1:
            if i >= len(bos):
                return None
            start = int(bos[i])
            need = tokens + 1 - length
            if len(segments) == max_docs - 1:
                end = start + need
                if end > shard_len:
                    return None
                i = int(np.searchsorted(bos, end))
            else:
                next_start = int(bos[i + 1]) if i + 1 < len(bos) else shard_len
                end = min(next_start, start + max_seq_len, start + need)
                i += 1
            segments.append((start, end))
            length += end - start
        plan.append(segments)
    return plan, i


def cu_seqlens_for(lengths: list[int], tokens: int, max_docs: int) -> np.ndarray:
    """[0, c1, ..., tokens] for segments of the given lengths (the last one loses its final token,
    which is only a target), padded to max_docs+1 entries by repeating tokens."""
    cu = np.full(max_docs + 1, tokens, dtype=np.int32)
    cu[0] = 0
    cu[1: len(lengths) + 1] = np.minimum(np.cumsum(lengths), tokens)
    return cu


def capped_lengths(lengths: list[int], attention_cap: int) -> list[int]:
    """The attention cap (record #92, PR #360; T5.5): each segment longer than attention_cap split into consecutive
    virtual segments of attention_cap tokens and the rest, so attention never spans more; the tokens and their targets
    stay where they are. n segments of T + 1 tokens become at most n + T // attention_cap (max_segments_per_batch)."""
    pieces = []
    for length in lengths:
        whole, rest = divmod(length, attention_cap)
        pieces += [attention_cap] * whole + ([rest] if rest else [])
    return pieces


def max_segments_per_batch(tokens: int, attention_cap: int) -> int:
    """cu_seqlens' fixed length less one: the packed documents (max_docs_per_batch) and, with an
    attention cap, the at most tokens // attention_cap cuts it adds (capped_lengths)."""
    return max_docs_per_batch(tokens) + (tokens // attention_cap if attention_cap else 0)


class TrainLoader:
    """Training batches for one rank: the planner's slice of consecutive documents, the next shard loaded by a
    background thread, cycling over the files when they run out (logged once per pass). next_batch() accepts a new batch
    size and max_seq_len at any step. With a vocab_size each shard's token ids are checked as it loads (Shard)."""

    def __init__(self, pattern: str, rank: int, world_size: int, device: torch.device, log=print,
                 grad_accum: int = 1, vocab_size: int | None = None):
        self.files = find_shards(pattern)
        self.rank, self.world_size, self.device, self.log = rank, world_size, device, log
        self.grad_accum = grad_accum
        self._step_slices, self._step_shape = [], None  # this rank's remaining micro-batches of the step
        self.pin_memory = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1)
        self.file_index, self.passes, self.doc_cursor = 0, 1, 0
        self._load = functools.partial(Shard, pin_memory=self.pin_memory, vocab_size=vocab_size)
        self.shard = self._load(self.files[0])
        self._next_shard = self._pool.submit(self._load, self.files[1 % len(self.files)])

    def _advance_shard(self):
        self.file_index += 1
        if self.file_index % len(self.files) == 0:
            self.passes += 1
            self.log(f"data: starting pass {self.passes} over {len(self.files)} train files")
        self.shard = self._next_shard.result()
        following = self.files[(self.file_index + 1) % len(self.files)]
        self._next_shard = self._pool.submit(self._load, following)
        self.doc_cursor = 0

    def plan_step(self, tokens: int, max_seq_len: int) -> list:
        """The whole step's plan (world_size x grad_accum slices of `tokens`, every rank's), made at once so
        that a shard boundary falls at the same place on 1, 2, 4 or 8 GPUs; the next shard where this one runs
        out (check_train_data replays the run's steps through it)."""
        slices = self.world_size * self.grad_accum
        for _ in range(2 * len(self.files) + 1):
            planned = plan_batch(self.shard.bos, self.doc_cursor, len(self.shard.tokens), tokens, slices,
                                 max_seq_len, max_docs_per_batch(tokens))
            if planned is not None:
                plan, self.doc_cursor = planned
                return plan
            self._advance_shard()
        raise SetupError(f"no train shard holds a batch of {tokens} tokens x {slices} slices: the "
                         f"{len(self.files)} train files are too small")

    def close(self):
        """Drop the shard loading in the background (a loader that only planned: check_train_data)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def next_batch(self, tokens: int, max_seq_len: int, into: tuple[Tensor, Tensor] | None = None,
                   attention_cap: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """(inputs int32 (tokens,), targets int32 (tokens,), cu_seqlens int32) on the device; with
        `into` (a (tokens + 1,) token buffer and a cu_seqlens buffer on the device), written there:
        the static inputs of a CUDA graph (T5.3). attention_cap > 0: cu_seqlens splits the documents
        into attention segments of at most that many tokens (T5.5); the tokens are the same."""
        if self._step_slices and self._step_shape != (tokens, max_seq_len):
            raise ValueError(f"batch shape changed to {(tokens, max_seq_len)} in the middle of a step "
                             f"planned for {self._step_shape}")
        if not self._step_slices:
            plan = self.plan_step(tokens, max_seq_len)
            self._step_slices = [plan[k * self.world_size + self.rank] for k in range(self.grad_accum)]
            self._step_shape = (tokens, max_seq_len)
        segments = self._step_slices.pop(0)
        buf = torch.empty(tokens + 1, dtype=torch.int32, pin_memory=self.pin_memory)
        np.concatenate([self.shard.tokens[s:e] for s, e in segments], out=buf.numpy(), casting="safe")
        lengths = [e - s for s, e in segments]
        if attention_cap:
            lengths = capped_lengths(lengths, attention_cap)
        cu = torch.from_numpy(cu_seqlens_for(lengths, tokens, max_segments_per_batch(tokens, attention_cap)))
        if self.pin_memory:
            cu = cu.pin_memory()
        if into is None:
            buf, cu = buf.to(self.device, non_blocking=True), cu.to(self.device, non_blocking=True)
        else:
            buf, cu = into[0].copy_(buf, non_blocking=True), into[1].copy_(cu, non_blocking=True)
        return buf[:-1], buf[1:], cu


class ValidationSet:
    """The first val_tokens (+1) validation tokens in seq_len chunks (chunk i: rank i % world_size), documents whole."""

    def __init__(self, pattern: str, val_tokens: int, seq_len: int, rank: int, world_size: int, device: torch.device,
                 vocab_size: int | None = None):
        if val_tokens % seq_len:
            raise SetupError(f"VAL_TOKENS={val_tokens} must be a multiple of VAL_SEQ_LEN={seq_len}")
        parts, have = [], 0
        for path in find_shards(pattern):
            parts.append(Shard(path, pin_memory=False, vocab_size=vocab_size).tokens)
            have += len(parts[-1])
            if have > val_tokens:
                break
        if have < val_tokens + 1:
            raise SetupError(f"validation files {pattern!r} hold {have} tokens; VAL_TOKENS={val_tokens} needs "
                             f"{val_tokens + 1} (its last input's target): lower VAL_TOKENS")
        self.tokens = np.concatenate(parts)[: val_tokens + 1].astype(np.int32)
        self.seq_len, self.device = seq_len, device
        self.chunks = list(range(rank, val_tokens // seq_len, world_size))
        self.rounds = -(-(val_tokens // seq_len) // world_size)  # the chunks of the ranks with the most
        self.max_docs = max_docs_per_batch(seq_len)

    def batch(self, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
        seq = self.tokens[chunk * self.seq_len: (chunk + 1) * self.seq_len + 1]
        starts = np.flatnonzero(seq[:-1] == BOS_ID)
        bounds = np.unique(np.concatenate([[0], starts, [self.seq_len]]))
        lengths = list(np.diff(bounds))
        if len(lengths) > self.max_docs:  # fold the excess documents into the last segment
            lengths = lengths[: self.max_docs - 1] + [int(sum(lengths[self.max_docs - 1:]))]
        cu = cu_seqlens_for(lengths, self.seq_len, self.max_docs)
        seq = torch.from_numpy(seq).to(self.device)
        return seq[:-1], seq[1:], torch.from_numpy(cu).to(self.device)

    def __iter__(self):
        return (self.batch(chunk) for chunk in self.chunks)


GPT2_SPECIAL_TOKEN = "<|endoftext|>"


def gpt2_byte_of() -> dict[str, int]:
    """GPT-2's byte alphabet, char -> byte: printable Latin-1 is its own byte, the rest chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_of = {chr(b): b for b in printable}
    byte_of.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in printable)})
    return byte_of


def gpt2_token_bytes(tokenizer_dir: str) -> dict[int, bytes]:
    """The byte string of every GPT-2 token id (the special token excluded), read from
    tokenizer_dir/encoder.json, whose keys spell bytes in GPT-2's byte-level alphabet (gpt2_byte_of)."""
    path = os.path.join(tokenizer_dir, "encoder.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the prefix-token loss needs GPT-2's tokenizer file {path}: the repository keeps it "
                                f"in data/gpt2/ (restore it with `git checkout -- data/gpt2`); or set TOKENIZER_DIR "
                                f"to a folder holding encoder.json")
    byte_of = gpt2_byte_of()
    try:
        with open(path, encoding="utf-8") as f:
            encoder = json.load(f)
        return {int(i): bytes(byte_of[c] for c in token) for token, i in encoder.items() if token != GPT2_SPECIAL_TOKEN}
    except (ValueError, KeyError) as error:
        raise SetupError(f"{path} is not a GPT-2 encoder.json ({type(error).__name__}: {error})") from None


def prefix_token_ids(token_bytes: dict[int, bytes], vocab_size: int) -> Tensor:
    """For every id: the token whose bytes are the longest proper prefix of its bytes, -1 where none
    is a token (single bytes, the special token, padding ids) (#88, T4.3)."""
    id_of = {b: i for i, b in token_bytes.items()}
    table = [-1] * vocab_size
    for i, b in token_bytes.items():
        if i >= vocab_size:
            raise SetupError(f"token id {i} does not fit the vocabulary of {vocab_size} (VOCAB_SIZE)")
        table[i] = next((id_of[b[:n]] for n in range(len(b) - 1, 0, -1) if b[:n] in id_of), -1)
    return torch.tensor(table, dtype=torch.long)


# =============================================================================================
# Schedule, logs and checks
# =============================================================================================


@dataclass(frozen=True)
class StepPlan:
    """What one step takes from the schedule: the loader its batch shape, the model its windows, target columns and
    loss weights, the optimizer its learning-rate multiplier, momentum and whether Adam runs."""
    step: int
    stage: int
    tokens_per_rank: int
    shape: ForwardShape
    target_weights: tuple[float, ...]  # multi-token prediction targets, then the prefix target
    long_windows: tuple[int, ...]  # the long windows so far, in tokens, each change once (YaRN)
    attention_cap: int  # the loader splits documents into attention segments of at most this many tokens (T5.5)
    graph_stage: int  # the first stage whose training forward is this stage's: its CUDA graphs serve both
    lr_multiplier: float
    momentum: float
    fast_rail: tuple[float, float]  # the fast momentum rail's beta and its weight in the blend (T2.9)
    adam_step: bool
    untie: bool  # untie embed and lm_head after this step
    tail_ema_rate: float  # TAIL_EMA_FRAC: the weights' EMA's rate after this step; 1 starts it, 0 none (T5.4)


class Schedule:
    """The stage table (T5.1) as per-step plans: stage boundaries at cumulative fractions of the scheduled steps, then
    the extension; the lr multiplier's linear cooldown to the floor; Muon's momentum warm-up and cool-down (T2.8)."""

    def __init__(self, config: ScheduleConfig):
        self.config = cfg = config
        n = cfg.num_scheduled_iterations
        self.num_scheduled = n
        fractions = [stage.fraction for stage in cfg.stages[:-1]]
        self.stage_starts = [round(n * sum(fractions[:k])) for k in range(len(fractions))] + [n]
        self.total_steps = n + cfg.num_extension_iterations
        self.stage_ends = self.stage_starts[1:] + [self.total_steps]
        forwards = [forward_columns(stage) for stage in cfg.stages]
        self.graph_stages = [forwards.index(forward) for forward in forwards]  # StepPlan.graph_stage
        self.cooldown_start = int(n * (1 - cfg.cooldown_frac))
        self.untie_step = (round(n * cfg.untie_embed_at) | 1) if cfg.untie_embed_at > 0 else None  # an Adam step
        self.rails_engage_step = round(n * cfg.muon_rails_engage_at)
        self.tail_ema_steps = round(cfg.tail_ema_frac * self.total_steps)
        self.tail_ema_start = self.total_steps - self.tail_ema_steps if self.tail_ema_steps else None

    def plan(self, step: int, final: bool = False) -> StepPlan:
        """The plan of `step`; `final`: the last validation's, with FINAL_LONG_WINDOW."""
        cfg, stage = self.config, self.stage(step)
        row, block = cfg.stages[stage], cfg.window_block_size
        tau = self.stage_progress(step)
        mtp = [interpolate(w, tau) for w in row.mtp_weights]
        prefix = interpolate(row.prefix_weight, tau) if row.prefix_weight else None
        windows = (row.short_window * block, (cfg.final_long_window if final else row.long_window) * block)
        so_far = [s.long_window for s in cfg.stages[: stage + 1]]  # each change once: a taper's equal window
        # is no second YaRN rescale, and its plan equals stage 3's (T5.5)
        return StepPlan(
            step=step, stage=stage, tokens_per_rank=row.batch_tokens // RANKS_PER_STEP,
            shape=ForwardShape(*windows, row.max_seq_len, len(mtp), prefix is not None),
            target_weights=tuple(mtp + ([] if prefix is None else [prefix])),
            long_windows=tuple(w * block for i, w in enumerate(so_far) if i == 0 or w != so_far[i - 1]),
            attention_cap=row.attention_cap, graph_stage=self.graph_stages[stage],
            lr_multiplier=self.lr_multiplier(step), momentum=self.momentum(step), fast_rail=self.fast_rail(step),
            adam_step=step % 2 == 1, untie=step == self.untie_step, tail_ema_rate=self.tail_ema_rate(step))

    def stage(self, step: int) -> int:
        return max(i for i, start in enumerate(self.stage_starts) if step >= start)

    def stage_progress(self, step: int) -> float:
        """Fraction of the current stage elapsed before this step; a stage and its taper row count as
        one span, so the taper continues the stage's weights where the cut left them (T5.5)."""
        stage, stages = self.stage(step), self.config.stages
        first = stage - 1 if stages[stage].taper else stage
        last = stage + 1 if stage + 1 < len(stages) and stages[stage + 1].taper else stage
        start, end = self.stage_starts[first], self.stage_ends[last]
        return (step - start) / (end - start)

    def lr_multiplier(self, step: int) -> float:
        stage_mul = self.config.stages[self.stage(step)].lr_mul
        if step < self.cooldown_start:
            return stage_mul
        tau = min(1.0, (step - self.cooldown_start) / (self.num_scheduled - self.cooldown_start))
        return stage_mul * (1 - tau) + self.config.lr_floor * tau

    def momentum(self, step: int) -> float:
        cfg = self.config
        low, high = cfg.muon_momentum_min, cfg.muon_momentum_max
        warm = min(1.0, step / cfg.muon_momentum_warmup_steps) if cfg.muon_momentum_warmup_steps else 1.0
        cooldown_start = self.total_steps - cfg.muon_momentum_cooldown_steps
        if step > cooldown_start:
            return high - (high - low) * (step - cooldown_start) / cfg.muon_momentum_cooldown_steps
        return low + (high - low) * warm

    def fast_rail(self, step: int) -> tuple[float, float]:
        """The fast momentum rail (T2.9): (its beta, its weight in the blend with the slow rail). Until
        the engage step it is Muon's single EMA: the scheduled momentum, weight 1."""
        cfg = self.config
        if step < self.rails_engage_step:
            return self.momentum(step), 1.0
        return cfg.muon_rails_fast_beta, cfg.muon_rails_fast_weight

    def tail_ema_rate(self, step: int) -> float:
        """The tail EMA's rate after `step` (T5.4): 0 before its window (the last TAIL_EMA_FRAC of the steps), 1 at
        the window's first step (the EMA starts as that step's weights), then 2/(window + 1), record #92's."""
        start = self.tail_ema_start
        if start is None or step < start:
            return 0.0
        return 1.0 if step == start else 2 / (self.tail_ema_steps + 1)

    def warmup_steps(self) -> list[int]:
        """Steps whose graphs the warm-up compiles: the first two and both sides of every stage start, in
        (non-Adam, Adam) pairs as the run takes them, so that each Adam step sees the gradients of the two steps
        it sees in the run: the old stage's two, the start's pair, the new stage's two (an odd start splits a pair)."""
        steps = {0, 1}
        for start in self.stage_starts[1:]:
            first, last = (start - 2) & ~1, (start + 1) | 1  # the pair before the start's, to the one after it
            steps.update(s for s in range(first, last + 1) if 0 <= s < self.total_steps)
        return sorted(steps)


def forward_columns(stage: Stage) -> tuple:
    """What a stage's training forward is made of: its shapes, its execution plan's inputs (tokens per
    rank, candidate budget) and the attention cap (the cu_seqlens' length). Two stages alike here, a
    taper row and the stage it is cut from unless a column changed, share their CUDA graphs (T5.5)."""
    return (stage.batch_tokens, stage.max_seq_len, stage.short_window, stage.long_window, len(stage.mtp_weights),
            stage.prefix_weight is not None, stage.ce_candidates, stage.attention_cap)


def tail_ema_blends(cfg: ScheduleConfig, specs: dict[str, ParamSpec]) -> dict[str, float]:
    """TAIL_EMA_FRAC's labels, each with the EMA's share of its weights after the blend (T5.4): the NorMuon banks at
    TAIL_EMA_BANK_BLEND, embed and lm_head at TAIL_EMA_EMBED_BLEND; a share of 0 leaves its labels out."""
    if not cfg.tail_ema_frac:
        return {}
    blends = {label: cfg.tail_ema_bank_blend for label, spec in specs.items() if spec.optimizer == "normuon"}
    blends.update((label, cfg.tail_ema_embed_blend) for label in ("embed", "lm_head") if label in specs)
    return {label: blend for label, blend in blends.items() if blend}


def interpolate(weights: tuple[float, float], tau: float) -> float:
    """A stage's weight at fraction tau of it: (start, end) linearly."""
    start, end = weights
    return start if start == end else start * (1 - tau) + end * tau


# steps between checks of the training losses and the candidate shortfall (T4.6), each read a period later
NONFINITE_CHECK_EVERY = 25
CONSOLE_EVERY = 5.0  # seconds between the console's step lines (the log has every step's)


class NonFiniteLoss(RuntimeError):
    pass


class CandidateShortfall(RuntimeError):
    """A training forward had more distinct targets than its stage's candidate budget (T4.6)."""


# The log's lines, defined once: the trainer writes them with these functions and records/tool.py
# parses them with these patterns (the field's format: step:250/1270 val_loss:3.9812 train_time:...).
LOG_SEPARATOR = "=" * 100  # after the source, and after the environment report
LOG_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf"
STEP_LINE_RE = re.compile(rf"^step:(?P<step>\d+)/(?P<total>\d+)(?: val_loss:(?P<val_loss>{LOG_NUMBER}))?"
                          rf"(?: train_loss:(?P<train_loss>{LOG_NUMBER}))? train_time:(?P<train_time>\d+(?:\.\d+)?)ms"
                          rf" step_avg:(?P<step_avg>{LOG_NUMBER})ms$")
PEAK_MEMORY_RE = re.compile(r"^peak memory allocated: (?P<allocated>\d+) MiB reserved: (?P<reserved>\d+) MiB"
                            r"(?: \(cpu: [^)]*\))?$")
FINAL_WINDOWS_RE = re.compile(rf"^final_windows (?P<setting>.+) val_loss:(?P<val_loss>{LOG_NUMBER})$")
DESCRIPTION_RE = re.compile(r"^(?P<key>[a-z_]+): (?P<value>.*)$")  # run_id: ..., hyperparameters: {...}


def step_line(step: int, total: int, train_ms: float, val_loss: float | None = None,
              train_loss: float | None = None) -> str:
    """A step line: after a validation (val_loss) or a training step (train_loss when logged)."""
    parts = [f"step:{step}/{total}"]
    if val_loss is not None:
        parts.append(f"val_loss:{val_loss:.4f}")
    if train_loss is not None:
        parts.append(f"train_loss:{train_loss:.4f}")
    return " ".join(parts + [f"train_time:{train_ms:.0f}ms", f"step_avg:{train_ms / max(step, 1):.2f}ms"])


def duration(ms: float) -> str:
    """A console duration: 850ms, 42s, 3m07s, 1h02m."""
    s = int(ms // 1000)
    return (f"{ms:.0f}ms" if s < 1 else f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600
            else f"{s // 3600}h{s // 60 % 60:02d}m")


def peak_memory_line(allocated_mib: int, reserved_mib: int, cpu: bool = False) -> str:
    """The run's last line; on the CPU both numbers are the process's peak resident memory."""
    return (f"peak memory allocated: {allocated_mib} MiB reserved: {reserved_mib} MiB"
            + (" (cpu: peak resident set size)" if cpu else ""))


def final_windows_line(setting: str, val_loss: float) -> str:
    """bench/eval_windows.py's score of the final model under another final-validation setting."""
    return f"final_windows {setting} val_loss:{val_loss:.4f}"


class RunLog:
    """Rank 0 writes logs/<run_id>.txt through one buffered handle and echoes chosen lines to the console. The file is
    flushed with each console line and at exit, so the step lines between cost the timed loop no system call (T5.3)."""

    def __init__(self, path: str | None):
        self.path, self.file = path, None
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.file = open(path, "a", buffering=1 << 20)
            atexit.register(self.file.close)

    def __call__(self, text: str, console: bool = True, note: str = ""):
        """Write a line; with console, print it too (with `note` after it, on the console only)."""
        if self.file is None:
            return
        self.file.write(text + "\n")
        if console:
            print(text + note, flush=True)
            self.file.flush()


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU model and how many of its cores this process may use: the launch-bound stages run at
    the host's speed, so two machines with the same GPU can differ there."""
    model = "unknown model"
    try:
        with open(cpuinfo) as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({usable} cores usable)"


def environment_report() -> str:
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout.rstrip()
    except (OSError, subprocess.TimeoutExpired):
        smi = ""
    return "\n".join([f"Running Python {sys.version.replace(chr(10), ' ')}",
                      f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
                      f"Running Triton version {triton.__version__ if triton else 'not installed'}",
                      f"Running on host CPU {host_cpu()}", smi or "nvidia-smi: not available"])


def environment_overrides(environ=os.environ) -> str:
    """The hyperparameter variables set for this run, as shell assignments (RUN_ID excluded)."""
    names = [name for name in hyperparameter_variables() if name != "RUN_ID"]
    return " ".join(f"{name}={shlex.quote(environ[name])}" for name in names if name in environ)


def data_label(data: DataConfig) -> str:
    name = os.path.basename(data.train_files).lower()
    kind = "proxy" if "proxy" in name else "FineWeb" if name.startswith("fineweb_") else "custom"
    return f"{kind} (train {data.train_files}; val {data.val_files}, {data.val_tokens} tokens)"


def check_hyperparameters(hp: Hyperparameters):
    stages, run = hp.schedule.stages, hp.run
    for name, low in (("val_tokens", 1), ("val_seq_len", 1), ("num_scheduled_iterations", 1),
                      ("num_extension_iterations", 0), ("val_loss_every", 0), ("train_loss_every", 0),
                      ("window_block_size", 1), ("final_long_window", 1), ("ngram_rows", 1),
                      ("ngram_rows_per_rank", 0), ("copy_window", 1), ("final_copy_window", 1)):
        if (value := hp.flat()[name]) < low:
            raise SetupError(f"{name.upper()}={value}: give a whole number >= {low}")
    if len(stages) < 2 or stages[-1].fraction is not None or any(s.fraction is None for s in stages[:-1]):
        raise SetupError("the stage table needs stages with a fraction of the scheduled steps, then the extension")
    fractions = [s.fraction for s in stages[:-1]]
    if min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-6:
        raise SetupError(f"STAGE_FRACTION={','.join(f'{f:.6g}' for f in fractions)}: the stages' fractions of the "
                         f"scheduled steps must be positive and add up to 1 (within 1e-6)")
    check_taper(hp.schedule)
    if len(set(run.seeds)) < len(run.seeds):
        raise SetupError(f"SEEDS={','.join(map(str, run.seeds))} repeats a seed: each run's log is named by its seed")
    total_steps = Schedule(hp.schedule).total_steps
    if run.gpu_memory_gib < 0 or (run.gpu_memory_gib > 0 and run.device != "cuda"):
        raise SetupError(f"GPU_MEMORY_GIB={run.gpu_memory_gib:g}: give the GiB this process's CUDA allocator may hold "
                         f"(> 0, DEVICE=cuda), or 0 for the whole GPU")
    if not 0 <= run.stop_after <= total_steps:
        raise SetupError(f"STOP_AFTER={run.stop_after}: must lie in 0..{total_steps} (the schedule's steps; 0: all)")
    if not 0 <= hp.schedule.tail_ema_frac <= 1:
        raise SetupError(
            f"TAIL_EMA_FRAC={hp.schedule.tail_ema_frac}: the tail EMA's share of the steps must lie in 0..1 (0: off)")
    for stage in stages:
        if stage.batch_tokens % RANKS_PER_STEP:
            raise SetupError(f"STAGE_BATCH_TOKENS entry {stage.batch_tokens} is not divisible by {RANKS_PER_STEP}")
        if not 0 <= stage.ce_candidates <= hp.model.vocab_size or stage.ce_candidates % 16:
            raise SetupError(f"STAGE_CE_CANDIDATES entry {stage.ce_candidates}: use a multiple of 16 (the FP8 "
                             f"lm_head's GEMM) up to VOCAB_SIZE={hp.model.vocab_size}, or 0 for the full softmax")
        if stage.attention_cap < 0:
            raise SetupError(f"STAGE_ATTENTION_CAP entry {stage.attention_cap}: give the longest attention span in "
                             f"tokens, or 0 for no cap")
    check_layer_layout(hp.model)
    if hp.model.copy_pointer and hp.model.vocab_size <= COPY_TOKEN:
        raise SetupError(f"COPY_POINTER=1 needs VOCAB_SIZE > {COPY_TOKEN} (its <copy> column is row {COPY_TOKEN}, "
                         f"the first padding row of GPT-2's vocabulary), got {hp.model.vocab_size}")


def check_taper(cfg: ScheduleConfig):
    """TAPER_FRACTION (T5.5) and the table agree: with a fraction > 0, one taper row right before the
    extension (from_env sets it with set_taper; STAGE_FRACTION may then give it another share); with 0, none."""
    tapers = [i for i, stage in enumerate(cfg.stages) if stage.taper]
    if cfg.taper_fraction < 0:
        raise SetupError(
            f"TAPER_FRACTION={cfg.taper_fraction}: give a share of the scheduled steps >= 0 (0: no taper row)")
    if tapers != ([len(cfg.stages) - 2] if cfg.taper_fraction else []):
        raise SetupError(f"TAPER_FRACTION={cfg.taper_fraction} but the stage table has {len(tapers)} taper rows: "
                         f"build the table with set_taper(stages, TAPER_FRACTION), as from_env does")


def rows_for_world(hp: Hyperparameters, world_size: int) -> Hyperparameters:
    """hp with NGRAM_ROWS = NGRAM_ROWS_PER_RANK × world size where that is set (T3.19)."""
    per_rank = hp.model.ngram_rows_per_rank
    if not per_rank:
        return hp
    if hp.model.ngram_rows != ModelConfig.ngram_rows:
        raise SetupError(f"NGRAM_ROWS={hp.model.ngram_rows} and NGRAM_ROWS_PER_RANK={per_rank}: give one of them")
    return hp.replace(ngram_rows=per_rank * world_size)


def check_ngram_rows(hp: Hyperparameters, world_size: int):
    """NGRAM_ROWS (T3.19): more rows than orders (one reserved row each), hashable, and at this world size each
    process's ⌈NGRAM_ROWS / world size⌉ rows with their optimizer state (rank-slice mode, at world size 1: the
    whole table) within NGRAM_STATE_GIB beside the model."""
    rows, row_bytes = hp.model.ngram_rows, ngram_bytes_per_row(hp.model.model_dim)
    if not len(NGRAM_ORDERS) < rows <= NGRAM_PRIME:
        raise SetupError(f"NGRAM_ROWS={rows}: give more than {len(NGRAM_ORDERS)} rows (one reserved row per n-gram "
                         f"order) and at most {NGRAM_PRIME}")
    largest = NGRAM_STATE_GIB * 2**30 // row_bytes * world_size
    if rows > largest:
        holds = "rank-slice mode holds the whole table" if hp.run.rank_slice else f"world size {world_size}"
        raise SetupError(f"NGRAM_ROWS={rows} does not fit: {row_bytes} bytes per row with its optimizer state, at most "
                         f"{NGRAM_STATE_GIB} GiB per process beside the model ({holds}); the largest that fits: "
                         f"NGRAM_ROWS={largest}")


# Layers whose attention is needed: long windows, key offset and output gates (3, 10), MUDD value mix, DC-MHA (10).
ATTENTION_REQUIRED_LAYERS = tuple(sorted({*LONG_WINDOW_LAYERS, *KEY_OFFSET_LAYERS, *OUTPUT_GATE_LAYERS,
                                          MUDD_LAYER, DC_LAYER}))


def check_layer_layout(model: ModelConfig):
    """The layer lists (T3.1): increasing indices; attention kept where it has a role of its own; value embeddings
    (at least one) and narrow Q/K heads only on attention layers, the narrow ones (T3.18) not where the key offset
    (no stationary half to shift) or DC-MHA (one width for q, k, v) needs full width; the MUDD layer's MLP (T3.14)."""
    attention, listed = model.attention_layers, lambda values: ",".join(map(str, values))  # noqa: E731
    lists = {"ATTENTION_LAYERS": attention, "VALUE_EMBED_LAYERS": model.value_embed_layers,
             "MLP_LAYERS": model.mlp_layers, "NARROW_QK_LAYERS": model.narrow_qk_layers}
    for name, layers in lists.items():
        if any(not 0 <= layer < NUM_LAYERS for layer in layers) or list(layers) != sorted(set(layers)):
            raise SetupError(f"{name}={listed(layers)}: give increasing layer indices from 0 to {NUM_LAYERS - 1}")
    if missing := [layer for layer in ATTENTION_REQUIRED_LAYERS if layer not in attention]:
        raise SetupError(f"ATTENTION_LAYERS={listed(attention)} drops the attention of layer(s) {listed(missing)}, "
                         f"which the architecture needs (long windows, key offset, output gates, the MUDD value mix, "
                         f"DC-MHA): keep {listed(ATTENTION_REQUIRED_LAYERS)}")
    for name in ("VALUE_EMBED_LAYERS", "NARROW_QK_LAYERS"):
        if stray := [layer for layer in lists[name] if layer not in attention]:
            raise SetupError(f"{name}={listed(lists[name])} names layer(s) {listed(stray)} without attention "
                             f"(ATTENTION_LAYERS={listed(attention)}): set {name} to attention layers only")
    if not model.value_embed_layers:
        raise SetupError("VALUE_EMBED_LAYERS is empty: name at least one attention layer (the final mix reads the "
                         "first plane, T3.14)")
    if clash := [layer for layer in model.narrow_qk_layers if layer in (*KEY_OFFSET_LAYERS, DC_LAYER)]:
        raise SetupError(f"NARROW_QK_LAYERS names layer(s) {listed(clash)}, whose key offset (T3.11) or DC-MHA (T3.17) "
                         f"needs full-width Q/K heads: leave them wide")
    if model.narrow_qk_layers and model.head_dim % 4:
        raise SetupError(f"NARROW_QK_LAYERS needs HEAD_DIM divisible by 4 (narrow heads are HEAD_DIM/2 wide), got "
                         f"{model.head_dim}")
    if MUDD_LAYER not in model.mlp_layers:
        raise SetupError(f"MLP_LAYERS={listed(model.mlp_layers)} drops the MLP of layer {MUDD_LAYER}, whose MLP output "
                         f"the MUDD residual mix weighs (T3.14): keep {MUDD_LAYER}")


# =============================================================================================
# CUDA graphs of the training step (#92, T5.3)
# =============================================================================================


class CudaGraph:
    """One CUDA graph: capture(fn) runs fn once eagerly on the capture stream (lazy set-up and autotuning happen
    there), then records its kernels; replay() launches them again on the same addresses. The graphs of one StepGraphs
    share a memory pool; outputs that must outlive other graphs' replays are protected by StepGraphs.capture_order."""

    def __init__(self, pool, stream: "torch.cuda.Stream"):
        self.graph, self.pool, self.stream = torch.cuda.CUDAGraph(), pool, stream

    def capture(self, fn):
        """(fn's eager result, its result in the graph's memory, written by each replay)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            eager = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.empty_cache()  # the eager run's cached activations, free for the graph's pool
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            captured = fn()
        return eager, captured

    def replay(self):
        self.graph.replay()


@dataclass
class CapturedStep:
    """One key's graphs and static memory: the loader's micro-batch buffers, the graphs' mean CE and gradients."""
    tokens: Tensor  # (tokens + 1,): the inputs are tokens[:-1], the targets tokens[1:]
    cu_seqlens: Tensor
    target_weights: Tensor
    first: CudaGraph  # the first micro-batch: writes ce and grads
    accumulate: CudaGraph | None  # each further micro-batch (gradient accumulation): adds into them
    ce: Tensor
    grads: dict[str, Tensor]
    # the n-gram table's (distinct rows, row cache's gradient) of the first micro-batch's graph, then of the
    # accumulating one's: per micro-batch, handed to the table after each replay (T3.19)
    rows: tuple[Tensor, Tensor]
    accumulate_rows: tuple[Tensor, Tensor] | None


class GraphMismatch(RuntimeError):
    pass


class StepGraphs:
    """The training step's forward and backward as CUDA graphs (#92, T5.3), captured in the warm-up, replayed in the
    timed loop, one per key (graph stage, Adam step): stages alike in shapes and plan share the first one's graphs
    (StepPlan.graph_stage); Adam and non-Adam steps get their own outputs, so a gradient kept for the next Adam step
    (T2.7) survives its replay. Each capture is checked against eager execution on its batch (CE and every gradient's
    norm), every tensor the graphs read must stay put (check_addresses), and `max_over_ranks` stops every rank together.
    The optimizer runs outside the graphs. Each graph loads its micro-batch's n-gram rows (T3.19; above world size 1 an
    exchange of fixed-size slots) and leaves the row cache's gradient for `run` to hand to the table."""

    def __init__(self, loss_fn, model: nn.Module, grad_accum: int, grad_scale: float, new_graph=None,
                 rtol: float = 1e-2, grad_rtol: float = 5e-2, max_over_ranks=lambda t: t):
        self.loss_fn, self.model, self.grad_accum, self.grad_scale = loss_fn, model, grad_accum, grad_scale
        self.rtol, self.grad_rtol, self.max_over_ranks = rtol, grad_rtol, max_over_ranks
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.ngram = model.ngram
        if new_graph is None:
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            new_graph = lambda: CudaGraph(pool, stream)  # noqa: E731
        self.new_graph = new_graph
        self.steps: dict[tuple[int, bool], CapturedStep] = {}
        self.addresses: dict[str, int] = {}
        self.worst_share, self.worst_where = 0.0, ""  # of its tolerance, the largest graph-vs-eager difference: where

    @staticmethod
    def key(plan: StepPlan) -> tuple[int, bool]:
        return plan.graph_stage, plan.adam_step

    def capture(self, plan: StepPlan, execution: ExecutionPlan, batch: tuple[Tensor, Tensor, Tensor],
                target_weights: Tensor):
        """Capture the graphs of plan's key on `batch` (one micro-batch), replay them, and stop with
        GraphMismatch unless they give eager execution's results."""
        inputs, targets, cu_seqlens = batch
        tokens, cu_seqlens = torch.cat([inputs, targets[-1:]]), cu_seqlens.clone()
        inputs, targets = tokens[:-1], tokens[1:]
        weights, names = target_weights.clone(), list(self.params)

        def forward_backward() -> tuple[Tensor, dict[str, Tensor], tuple[Tensor, Tensor]]:
            distinct = self.ngram.load(inputs)
            loss, ce = self.loss_fn(inputs, targets, cu_seqlens, plan.shape, execution, weights, self.grad_scale)
            *grads, cache_grad = torch.autograd.grad(loss, [*(self.params[name] for name in names), self.ngram.cache],
                                                     allow_unused=True)
            return (ce.float() * self.grad_scale, {name: g for name, g in zip(names, grads) if g is not None},
                    (distinct, cache_grad))

        first = self.new_graph()
        (eager_ce, eager_grads, eager_rows), (ce, grads, rows) = first.capture(forward_backward)
        reference = self.summary(eager_ce, eager_grads, eager_rows)
        del eager_ce, eager_grads, eager_rows
        # eager execution's own spread on this batch (kernels that reduce with atomics differ run to run)
        noise = (self.summary(*forward_backward()) - reference).abs()
        step = CapturedStep(tokens, cu_seqlens, weights, first, None, ce, grads, rows, None)
        first.replay()
        self.compare(plan, "", self.summary(ce, grads, rows), reference, noise, self.labels(grads))
        if self.grad_accum > 1:
            def accumulate() -> tuple[Tensor, Tensor]:
                more_ce, more, more_rows = forward_backward()
                ce.add_(more_ce)
                torch._foreach_add_(list(grads.values()), [more[name] for name in grads])
                return more_rows  # a micro-batch's rows are its own: not added into the first's

            step.accumulate = self.new_graph()
            _, step.accumulate_rows = step.accumulate.capture(accumulate)
            first.replay()
            step.accumulate.replay()  # the same micro-batch twice: twice the reference, the same rows
            twice = torch.cat([2 * reference[:-1], reference[-1:]])
            self.compare(plan, " with an accumulated micro-batch", self.summary(ce, grads, step.accumulate_rows),
                         twice, 2 * noise, self.labels(grads))
        self.steps[self.key(plan)] = step

    @staticmethod
    def capture_order(keys) -> list[tuple[int, bool]]:
        """Non-Adam steps' graphs first, then Adam steps', each in stage order: a graph captured later may put its
        outputs where an earlier one keeps temporaries, so the non-Adam graphs, whose gradients are kept (T2.7)
        through the next replays, are captured while nothing else holds memory in the pool."""
        return sorted(keys, key=lambda key: (key[1], key[0]))

    def check_kept_gradients(self):
        """Stop unless every non-Adam graph's outputs survive the replays of the graphs that can run while they are
        kept (the non-Adam graphs in stage order, then the Adam graphs)."""
        def replay(step: CapturedStep):
            step.first.replay()
            if step.accumulate is not None:
                step.accumulate.replay()

        kept = {}
        for key in sorted(key for key in self.steps if not key[1]):
            step = self.steps[key]
            replay(step)
            kept[key] = self.summary(step.ce, step.grads)
        for key in sorted(key for key in self.steps if key[1]):
            replay(self.steps[key])
        lost = [key for key, before in kept.items()
                if not torch.equal(self.summary(self.steps[key].ce, self.steps[key].grads), before)]
        device = next(iter(self.params.values())).device
        if self.max_over_ranks(torch.tensor(float(bool(lost)), device=device)).item():
            where = f"stage {lost[0][0] + 1}'s non-Adam graph" if lost else "another rank's non-Adam graph"
            raise GraphMismatch(f"the CUDA graphs overwrite a gradient kept for the next Adam step ({where}): "
                                f"their shared memory overlaps; run with CUDA_GRAPHS=0 and report it")

    def read_tensors(self) -> list[tuple[str, Tensor]]:
        """What the graphs read besides their inputs: the model's parameters and buffers (the n-gram table's row
        cache among them), the table's rows and their state."""
        table = [(f"ngram.{name}", t) for name, t in self.ngram.tensors().items()]
        return [*self.model.named_parameters(), *self.model.named_buffers(), *table]

    def record_addresses(self):
        """Where every parameter, buffer and n-gram table tensor is now: where the graphs read them."""
        self.addresses = {name: t.data_ptr() for name, t in self.read_tensors()}

    @staticmethod
    def summary(ce: Tensor, grads: dict[str, Tensor], rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The CE, each gradient's norm, the row cache's gradient norm (when given)."""
        return torch.stack([ce.float(), *(g.float().norm() for g in grads.values()),
                            *([rows[1].float().norm()] if rows is not None else [])])

    def labels(self, grads: dict[str, Tensor]) -> list[str]:
        """What summary's entries are, for a mismatch's line."""
        return ["CE", *(f"{name}'s gradient norm" for name in grads), "the n-gram table's row gradient norm"]

    def compare(self, plan: StepPlan, what: str, got: Tensor, expected: Tensor, noise: Tensor, labels: list[str]):
        """The CE within rtol, each gradient norm within grad_rtol (another memory layout may order its sums
        differently), both widened by four times eager execution's own spread; the worst share is kept for the log."""
        rtol = torch.full_like(expected, self.grad_rtol)
        rtol[0] = self.rtol
        tolerance = rtol * expected.abs() + 4 * noise + 1e-6
        shares = torch.where(torch.isfinite(got), (got - expected).abs() / tolerance, torch.inf)
        worst, i = self.max_over_ranks(shares.max()), int(shares.argmax())
        if worst.item() > self.worst_share:  # named from this rank's entries
            self.worst_where = f"{labels[i]}, stage {plan.stage + 1}{' Adam' if plan.adam_step else ''}{what}"
        self.worst_share = max(self.worst_share, worst.item())
        if self.worst_share <= 1:
            return
        graph = f"the CUDA graph of stage {plan.stage + 1} ({'Adam' if plan.adam_step else 'non-Adam'} step{what})"
        if shares.max() <= 1:
            raise GraphMismatch(f"{graph} differs from eager execution on another rank (see its log); "
                                f"run with CUDA_GRAPHS=0 and report it")
        raise GraphMismatch(f"{graph} gives {labels[i]} {got[i].item():.6g} where eager execution gives "
                            f"{expected[i].item():.6g}; run with CUDA_GRAPHS=0 and report it")

    def check_addresses(self):
        """Stop unless every parameter, buffer and n-gram tensor is where the graphs read it (restored with copy_)."""
        for name, t in self.read_tensors():
            if self.addresses.get(name) != t.data_ptr():
                raise GraphMismatch(f"{name} is no longer at the address the CUDA graphs read: restore state "
                                    f"in place (copy_), or run with CUDA_GRAPHS=0")

    def run(self, plan: StepPlan, loader: "TrainLoader", target_weights: Tensor) -> Tensor:
        """The step's micro-batches from `loader` through its key's graphs, the n-gram table given each micro-batch's
        rows and their gradients; sets each parameter's .grad to its static gradient and returns the mean CE."""
        step = self.steps[self.key(plan)]
        step.target_weights.copy_(target_weights)
        for k in range(self.grad_accum):
            loader.next_batch(plan.tokens_per_rank, plan.shape.max_seq_len, into=(step.tokens, step.cu_seqlens),
                              attention_cap=plan.attention_cap)
            (step.first if k == 0 else step.accumulate).replay()
            distinct, cache_grad = step.rows if k == 0 else step.accumulate_rows
            # the next replay rewrites the graph's rows and gradient; keep_gradient copies the gradient
            self.ngram.keep_gradient(distinct.clone(), cache_grad)
        self.set_grads(self.key(plan))
        return step.ce

    def set_grads(self, key: tuple[int, bool]):
        """Set each parameter's .grad to its static gradient of key's graphs."""
        for name, grad in self.steps[key].grads.items():
            self.params[name].grad = grad


# =============================================================================================
# Training
# =============================================================================================


def step_runner(hp: Hyperparameters, device: torch.device) -> tuple[bool, str]:
    """Whether the timed steps replay CUDA graphs (T5.3), and the log's words for what runs them and why: the
    graphs need a CUDA device, CUDA_GRAPHS=1 and the warm-up that captures them (WARMUP=1)."""
    if not hp.execution.cuda_graphs:
        return False, "eager steps (CUDA_GRAPHS=0)"
    if device.type != "cuda":
        return False, f"eager steps (CUDA graphs need a CUDA device, not {device.type})"
    if not hp.run.warmup:
        return False, "eager steps (the warm-up captures the CUDA graphs, and WARMUP=0 skips it)"
    return True, "CUDA graphs of each step's forward and backward, captured in the warm-up (T5.3)"


class Trainer:
    """Owns the model, optimizer, schedule and data of one run, and performs its steps."""

    def __init__(self, hp: Hyperparameters, rank: int, world_size: int, device: torch.device, log: RunLog):
        self.hp, self.rank, self.world_size, self.device, self.log = hp, rank, world_size, device, log
        self.grad_accum = grad_accum_steps(hp, world_size)
        self.grad_scale = 1.0 / self.grad_accum
        self.schedule = Schedule(hp.schedule)
        self.last_step = hp.run.stop_after or self.schedule.total_steps  # the run's final validation
        # inputs first: a missing or damaged file stops the run before the model takes the GPU
        data = hp.data
        find_shards(data.train_files)
        self.val_set = ValidationSet(data.val_files, data.val_tokens, data.val_seq_len, rank, world_size, device,
                                     hp.model.vocab_size)
        self.token_bytes = gpt2_token_bytes(data.tokenizer_dir)
        self.stage_execution, self.validation_execution = self.resolve_executions()
        torch.manual_seed(hp.run.seed)
        self.model = GPT(hp.model, longest_forward(hp), longest_training_forward(hp)).to(device)
        self._share_initialization()
        self.ngram = self.model.ngram.shard(hp.optim, rank, world_size, compile=hp.execution.compile)
        classes = ""
        if self.ngram.token_class is not None:  # from the tokenizer alone, off the clock (PR #375 builds it on import)
            class_of = token_classes(self.token_bytes, hp.model.vocab_size)
            self.ngram.token_class.copy_(class_of)
            merged = int((class_of != torch.arange(class_of.numel())).sum())
            classes = f", {merged} ids hashed as their class's first (T3.22)"
        gib = self.ngram.shard_rows * ngram_bytes_per_row(hp.model.model_dim) / 2**30
        per_rank = f" (NGRAM_ROWS_PER_RANK={hp.model.ngram_rows_per_rank})" if hp.model.ngram_rows_per_rank else ""
        log(f"n-gram table (T3.19): {hp.model.ngram_rows} rows{per_rank}, orders {','.join(map(str, NGRAM_ORDERS))}; "
            f"{self.ngram.shard_rows} rows per process, {gib:.2f} GiB with their row-wise RMSprop state{classes}")
        specs = param_specs(self.model)
        self.optimizer = NorMuonAdam(dict(self.model.named_parameters()), specs, hp.optim, rank, world_size,
                                     tied=("embed", "lm_head"), compile=hp.execution.compile,
                                     tail_ema_blends=tail_ema_blends(hp.schedule, specs))
        # TAIL_EMA_FRAC (T5.4): the run blends the EMA in at its end when its last step is past the window's start
        start = self.schedule.tail_ema_start
        self.blend_tail_ema = bool(self.optimizer.tail_ema_blends) and start is not None and start < self.last_step
        if hp.execution.compile:  # one graph per stage shape
            allow_graph_per_shape()
        compiled = ((lambda f: torch.compile(f, dynamic=False, fullgraph=True)) if hp.execution.compile
                    else (lambda f: f))
        self.training_loss = compiled(self.model.training_loss)
        self.evaluation_loss = compiled(self.model.evaluation_loss)
        # the timed steps' runner, decided here once: the CUDA graphs the warm-up captures, or eager steps (T5.3)
        graphs, runner = step_runner(hp, device)
        log(f"step runner: {runner}")
        self.step_graphs = (StepGraphs(self.training_loss, self.model, self.grad_accum, self.grad_scale,
                                       max_over_ranks=self.max_over_ranks) if graphs else None)
        self.forward_backward = self.step_graphs.run if graphs else self.eager_forward_backward
        self.long_windows = None  # those the model's rotary tables are set for
        self.losses = torch.zeros(self.schedule.total_steps, device=device)
        self.checked_steps, self.pending_check = 0, None  # pending: (first step, CUDA event of its flags' copy)
        self.position = "before the warm-up"  # where the run is, for an interruption's line
        # what a check reads a period later: non-finite loss (0/1), candidate shortfall (T4.6), n-gram overflow (T3.19)
        self.check_flags = torch.zeros(3, dtype=torch.long, pin_memory=device.type == "cuda")
        # Every step's target-column weights on the device, made once: a per-step copy from host
        # memory would block the CPU until the GPU drained its queue, exposing launch gaps.
        self.target_weights = [torch.tensor(self.schedule.plan(step).target_weights, device=device)
                               for step in range(self.schedule.total_steps)]
        # Every step's number on the device, for the model's candidate_step (the sampled CE's sweep, T4.6)
        sampled = any(plan.ce_candidates for plan in self.stage_execution)
        self.candidate_steps = torch.arange(self.schedule.total_steps, device=device) if sampled else None

    def resolve_executions(self) -> tuple[tuple[ExecutionPlan, ...], ExecutionPlan]:
        """Each stage's training execution plan and validation's, decided once; a log line per distinct plan."""
        hp, tokens = self.hp, [stage.batch_tokens // RANKS_PER_STEP for stage in self.hp.schedule.stages]
        stages = tuple(resolve_execution(hp.execution, hp.model, self.device, n, training=True,
                                         ce_candidates=stage.ce_candidates)
                       for n, stage in zip(tokens, hp.schedule.stages))
        validation = resolve_execution(hp.execution, hp.model, self.device, hp.data.val_seq_len, training=False)
        users = {}
        for plan, name in zip(stages, stage_names(hp.schedule.stages)):
            users.setdefault(plan, []).append(name)
        users.setdefault(validation, []).append("validation")
        for plan, names in users.items():
            fields = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                              for k, v in dataclasses.asdict(plan).items())
            self.log(f"execution plan ({', '.join(names)}): {fields}")
        return stages, validation

    def _share_initialization(self):
        if self.world_size > 1:  # the same initialization on every rank
            for tensor in self.model.parameters():
                dist.broadcast(tensor.data, 0)

    def start_over(self, hp: Hyperparameters, log: "RunLog"):
        """The initial state of another run with hp's seed (SEEDS), as a new process would draw it:
        the parameters and buffers of a fresh model, a fresh optimizer's state; the compiled graphs stay."""
        self.hp, self.log = hp, log
        torch.manual_seed(hp.run.seed)
        fresh = GPT(self.model.config, longest_forward(hp), longest_training_forward(hp))
        own = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        with torch.no_grad():  # every tensor, the non-persistent buffers too
            for name, tensor in [*fresh.named_parameters(), *fresh.named_buffers()]:
                own[name].copy_(tensor)
        self._share_initialization()
        self.optimizer.reset()
        self.ngram.reset()
        self._clear_run_state()
        if self.step_graphs is not None:
            self.step_graphs.check_addresses()

    def _clear_run_state(self):
        """What a run leaves beside the weights and optimizer state (Adam's kept gradients, T2.7, are the optimizer's):
        gradients, losses, YaRN's windows, the periodic checks and the candidate shortfall they read (T4.6)."""
        for p in self.model.parameters():  # the n-gram table's cache gradient goes with its reset, before this
            p.grad = None
        self.losses.zero_()
        self.model.candidate_shortfall.zero_()
        self.long_windows = None
        self.checked_steps, self.pending_check = 0, None

    def set_long_windows(self, long_windows: tuple[int, ...]):
        """The YaRN state that lives in the model, refreshed when a stage changes the long window."""
        if long_windows != self.long_windows:
            self.model.set_long_windows(list(long_windows))
            self.long_windows = long_windows

    def train_step(self, plan: StepPlan, loader: "TrainLoader", forward_backward=None) -> Tensor:
        """One step: forward and backward by the runner (the warm-up passes the eager one), the optimizer's and
        the n-gram table's updates (T3.19), the schedule's untie and tail EMA; the mean CE, also kept in losses."""
        self.set_long_windows(plan.long_windows)
        if self.candidate_steps is not None:
            self.model.candidate_step.copy_(self.candidate_steps[plan.step])
        mean_ce = (forward_backward or self.forward_backward)(plan, loader, self.target_weights[plan.step])
        self.optimizer.step(plan.lr_multiplier, plan.momentum, plan.adam_step, fast_rail=plan.fast_rail)
        self.ngram.step(plan.lr_multiplier, plan.adam_step)
        if plan.untie and self.optimizer.tied:
            self.optimizer.untie()
        if plan.tail_ema_rate:  # the last TAIL_EMA_FRAC of the steps (T5.4)
            self.optimizer.tail_ema_update(plan.tail_ema_rate)
        self.losses[plan.step] = mean_ce
        return mean_ce

    def eager_forward_backward(self, plan: StepPlan, loader: "TrainLoader", target_weights: Tensor) -> Tensor:
        """The step's micro-batches forward and backward, their gradients summed in .grad (the n-gram table's
        kept per micro-batch, T3.19); the mean CE."""
        mean_ce = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum):
            inputs, targets, cu_seqlens = loader.next_batch(plan.tokens_per_rank, plan.shape.max_seq_len,
                                                            attention_cap=plan.attention_cap)
            distinct = self.ngram.load(inputs)
            loss, ce = self.training_loss(inputs, targets, cu_seqlens, plan.shape, self.stage_execution[plan.stage],
                                          target_weights, self.grad_scale)
            loss.backward()
            self.ngram.keep_gradient(distinct)
            mean_ce += ce / self.grad_accum
        return mean_ce

    def capture_graphs(self, loader: "TrainLoader"):
        """One CUDA graph per (graph stage, Adam step) key the run uses, captured on a batch of its first
        step and checked against eager execution there (T5.3). The optimizer step stays eager: at world size
        above 1 it launches its collectives from Python, and the rank-slice run must stand for that run."""
        plans = {}
        for step in range(self.last_step):
            plan = self.schedule.plan(step)
            plans.setdefault(StepGraphs.key(plan), plan)
        start = time.perf_counter()
        for key in StepGraphs.capture_order(plans):
            plan = plans[key]
            self.set_long_windows(plan.long_windows)
            batches = [loader.next_batch(plan.tokens_per_rank, plan.shape.max_seq_len, attention_cap=plan.attention_cap)
                       for _ in range(self.grad_accum)]
            self.step_graphs.capture(plan, self.stage_execution[plan.stage], batches[0], self.target_weights[plan.step])
        self.step_graphs.check_kept_gradients()
        self.step_graphs.record_addresses()
        self._sync()
        self.log(f"CUDA graphs: {len(plans)} captured (one per distinct stage forward and Adam/non-Adam step) in "
                 f"{time.perf_counter() - start:.1f}s, each equal to eager execution on its batch "
                 f"(the largest difference: {self.step_graphs.worst_share:.2f} of its tolerance, "
                 f"{self.step_graphs.worst_where}); the optimizer "
                 f"step runs eagerly; the gradients kept by non-Adam steps survive every other graph's replay")

    def validation_shape(self, step: int, final: bool = False) -> tuple[ForwardShape, tuple[int, ...]]:
        """(forward shape, long windows) of the validation before `step`; the final one's pointer looks back
        FINAL_COPY_WINDOW tokens."""
        plan, model = self.schedule.plan(step, final), self.hp.model
        shape = dataclasses.replace(plan.shape, max_seq_len=self.hp.data.val_seq_len, n_predict=1, prefix_target=False,
                                    copy_window=model.final_copy_window if final and model.copy_pointer else 0)
        return shape, plan.long_windows

    def evaluate(self, step: int, final: bool = False, max_batches: int | None = None) -> float:
        return self.validation_loss(*self.validation_shape(step, final), max_batches)

    @torch.no_grad()
    def validation_loss(self, shape: ForwardShape, long_windows: tuple[int, ...],
                        max_batches: int | None = None) -> float:
        """Mean next-token cross-entropy over the validation set, all ranks, with the rotary tables of
        `long_windows` (bench/eval_windows.py tries other shapes than the schedule's)."""
        self.set_long_windows(long_windows)
        totals = torch.zeros(1, device=self.device)
        count = 0
        chunks = self.val_set.chunks
        for i in range(self.val_set.rounds if max_batches is None else min(max_batches, self.val_set.rounds)):
            if i >= len(chunks):  # a rank with a chunk fewer than others still answers their loads (T3.19)
                self.ngram.serve(self.val_set.seq_len)
                continue
            inputs, targets, cu_seqlens = self.val_set.batch(chunks[i])
            self.ngram.load(inputs)
            totals += self.evaluation_loss(inputs, targets, cu_seqlens, shape, self.validation_execution,
                                           self.validation_execution.evaluation_chunk)
            count += inputs.numel()
        stats = torch.cat([totals, torch.tensor([float(count)], device=self.device)])
        if self.world_size > 1:
            dist.all_reduce(stats)
        return (stats[0] / stats[1]).item()

    def max_over_ranks(self, value: Tensor) -> Tensor:
        """A per-rank tensor's maximum over all ranks (a collective: every rank must call it)."""
        value = value.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value

    def global_mean(self, value: Tensor) -> float:
        """Mean of a per-rank scalar over all ranks (a collective: every rank must call it)."""
        value = value.detach().clone()
        if self.world_size > 1:
            dist.all_reduce(value)
        return value.item() / self.world_size

    def check_finite(self, upto: int, wait: bool = True):
        """Stop at the first non-finite training loss among the steps not checked yet, or at a candidate shortfall
        (T4.6). wait=False (the periodic check) queues the test with no host sync: its flags land in pinned memory and
        are read at the next check, long finished by then, so a bad step stops the run one period late."""
        if self.pending_check is not None:
            (start, copied), self.pending_check = self.pending_check, None
            self.read_check_flags(copied, start, self.checked_steps, upto)
        recent = self.recent_losses(self.checked_steps, upto)
        counts = torch.stack([self.model.candidate_shortfall, self.ngram.overflow])
        if self.world_size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # every rank stops together
        self.check_flags.copy_(torch.cat([(~torch.isfinite(recent)).any().long()[None], counts]), non_blocking=True)
        copied = torch.cuda.Event() if self.device.type == "cuda" else None  # the CPU's copy is done on return
        if copied is not None:
            copied.record()
        if wait:
            self.read_check_flags(copied, self.checked_steps, upto, upto)
        else:
            self.pending_check = (self.checked_steps, copied)
        self.checked_steps = upto

    def read_check_flags(self, copied: "torch.cuda.Event | None", start: int, end: int, detected_at: int):
        if copied is not None:
            copied.synchronize()
        nonfinite, shortfall, overflow = self.check_flags.tolist()
        if nonfinite:
            self.raise_nonfinite(start, end, detected_at)
        if overflow:
            raise ExchangeOverflow(
                f"an n-gram table exchange sent an owner {overflow} more rows than its slots (detected "
                f"at step {detected_at}): raise NGRAM_EXCHANGE_SIGMAS in train_gpt.py and report it")
        if shortfall:
            budgets = ",".join(str(stage.ce_candidates) for stage in self.hp.schedule.stages)
            raise CandidateShortfall(f"a training forward had {shortfall} more distinct targets than its stage's "
                                     f"cross-entropy candidates (STAGE_CE_CANDIDATES={budgets}; detected at step "
                                     f"{detected_at}); raise that stage's entry, or 0 for the full softmax")

    def recent_losses(self, start: int, end: int) -> Tensor:
        recent = self.losses[start:end].clone()
        if self.world_size > 1:
            dist.all_reduce(recent)  # a NaN on any rank shows on every rank
        return recent

    def raise_nonfinite(self, start: int, end: int, detected_at: int):
        recent = self.recent_losses(start, end)  # every rank is here: the flag was reduced over ranks
        first = int((~torch.isfinite(recent)).nonzero()[0])  # losses[s] is the loss of the step line step:s+1
        raise NonFiniteLoss(f"non-finite training loss {recent[first].item()} at step {start + first + 1} "
                            f"(detected at step {detected_at}); lower the learning rates or check the data")

    def warmup(self):
        """Compile every graph the run uses (each stage's shapes, Adam and non-Adam steps, the untie step, every
        validation shape) on real eager steps, capture the step runner's CUDA graphs, then restore the initial state
        (#47, T5.2; the n-gram table by its reset). Each Adam step compiled follows a non-Adam one, as in the run:
        dynamo's guards are skipped after the warm-up, so a step it never saw would need a graph it lacks."""
        steps = [step for step in self.schedule.warmup_steps() if step < self.last_step]
        validations = {}  # one validation per distinct shape the run validates with
        for step in self.validation_steps():
            validations.setdefault(self.validation_shape(step, final=step == self.schedule.total_steps), step)
        self.log(f"Compiling model and warming up kernels on steps {steps}")
        self.position = "during the warm-up"
        initial_model = copy.deepcopy(self.model.state_dict())
        initial_optimizer = self.optimizer.state_dict()
        loader = TrainLoader(self.hp.data.train_files, self.rank, self.world_size, self.device, log=lambda _: None,
                             grad_accum=self.grad_accum)
        start = time.perf_counter()
        for step in steps:
            self.train_step(self.schedule.plan(step), loader, self.eager_forward_backward)
            self._sync()
            self.log(f"warm-up step {step} done at {time.perf_counter() - start:.0f}s")
        for step in validations.values():
            self.evaluate(step, final=step == self.schedule.total_steps, max_batches=1)
        self.log(f"warm-up validations ({len(validations)} shapes) done at {time.perf_counter() - start:.0f}s")
        if self.step_graphs is not None:
            self.capture_graphs(loader)
        if self.blend_tail_ema:  # T5.4's kernels, off the clock; the reset below undoes what they wrote
            self.optimizer.tail_ema_update(1.0)
            self.optimizer.tail_ema_blend()
        self.log(f"Compile and warm-up took {time.perf_counter() - start:.0f}s. Resetting model")
        if self.hp.execution.compile:  # dynamo checks only the guards that tell its graphs apart: host time (T5.2)
            torch.compiler.set_stance(skip_guard_eval_unsafe=True)
        self.model.load_state_dict(initial_model)
        self.optimizer.load_state_dict(initial_optimizer)
        self.ngram.reset()
        self._clear_run_state()
        if self.step_graphs is not None:
            self.step_graphs.check_addresses()

    def validation_steps(self) -> list[int]:
        """The steps before which the run validates: the first, every VAL_LOSS_EVERY-th, the last."""
        every = self.hp.run.val_loss_every
        return sorted({0, self.last_step, *(range(every, self.last_step, every) if every > 0 else ())})

    def run_each(self, runs: list[Hyperparameters]):
        """Warm up once (WARMUP), then train each of `runs` (SEEDS: the compiled graphs serve every run,
        each after the first starts over under its own log); yields (run, final val loss) after each."""
        if self.hp.run.warmup:
            self.warmup()
        for i, run in enumerate(runs):
            if i > 0:
                self.start_over(run, open_run_log(run, self.rank, self.world_size, self.device))
            yield run, self.run()

    def run(self) -> float:
        loader = TrainLoader(self.hp.data.train_files, self.rank, self.world_size, self.device, log=self.log,
                             grad_accum=self.grad_accum, vocab_size=self.hp.model.vocab_size)
        gc.collect()
        gc.freeze()  # on the clock the collector neither pauses the host nor scans the model's objects (T5.3)
        gc.disable()
        try:
            val_loss = self.timed_steps(loader)
        finally:
            gc.enable()
            gc.unfreeze()
            gc.collect()
        self.log_memory()
        return val_loss

    def timed_steps(self, loader: "TrainLoader") -> float:
        """The timed loop: train steps, with the validations (off the clock) where they fall."""
        total = self.schedule.total_steps
        self._sync()
        training_ms, t0 = 0.0, time.perf_counter()
        if self.token_bytes is not None:  # built on the clock, like the reference's
            self.model.prefix_ids.copy_(prefix_token_ids(self.token_bytes, self.hp.model.vocab_size))
        val_loss = float("nan")
        validation_steps = set(self.validation_steps())
        # each stage's first step line waits for the GPU, so its train_time is the GPU's and the ms/step
        # per stage (records/tool.py stages) hold with the step graphs too, where the host runs ahead (T5.3)
        stage_edges = set(self.schedule.stage_starts[1:])
        self.position, self.last_console = "at step 0", time.perf_counter()
        for step in range(self.last_step + 1):
            last = step == self.last_step
            if last and self.blend_tail_ema:  # on the clock, before the final validation (T5.4)
                self.optimizer.tail_ema_blend()
            if step in validation_steps:
                self._sync()
                training_ms += 1000 * (time.perf_counter() - t0)
                self.check_finite(step)
                val_loss = self.evaluate(step, final=step == total)
                self.log(step_line(step, total, training_ms, val_loss=val_loss))
                self._sync()
                t0 = time.perf_counter()
            if last:
                break
            ce = self.train_step(self.schedule.plan(step), loader)
            if (step + 1) % NONFINITE_CHECK_EVERY == 0:
                self.check_finite(step + 1, wait=False)
            if step + 1 in stage_edges:
                self._sync()
            self.log_step(step + 1, training_ms + 1000 * (time.perf_counter() - t0), ce)
            self.position = f"at step {step + 1}"
        return val_loss

    def log_step(self, steps_done: int, elapsed_ms: float, ce: Tensor):
        """A step line in the log; on the console the first one, then one at least every CONSOLE_EVERY seconds,
        each with the training time so far and an estimate of what is left (the run's mean step so far)."""
        train_loss = None
        every = self.hp.run.train_loss_every
        if every and steps_done % every == 0:
            train_loss = self.global_mean(ce)
        line = step_line(steps_done, self.schedule.total_steps, elapsed_ms, train_loss=train_loss)
        now = time.perf_counter()
        if steps_done > 1 and now - self.last_console < CONSOLE_EVERY:
            return self.log(line, console=False)
        self.last_console = now
        left = elapsed_ms / steps_done * (self.last_step - steps_done)
        self.log(line, note=f"  ({duration(elapsed_ms)} trained, about {duration(left)} left)")

    def log_memory(self):
        if self.device.type == "cuda":
            self.log(peak_memory_line(torch.cuda.max_memory_allocated() // 2**20,
                                      torch.cuda.max_memory_reserved() // 2**20))
        else:  # the same line with the process's peak resident memory
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
            self.log(peak_memory_line(rss, rss, cpu=True))

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# =============================================================================================
# Processes and the entry point
# =============================================================================================


def check_world_size(hp: Hyperparameters, world_size: int):
    """1, 2, 4 or 8 processes (fewer GPUs accumulate the 8 ranks' slices, T1.3); rank-slice mode on one."""
    if world_size not in (1, 2, 4, 8):
        raise SetupError(f"world size {world_size} is not supported: run on 1, 2, 4 or 8 GPUs "
                         f"(gradient accumulation 8 // world_size keeps the 8-GPU math)")
    if hp.run.rank_slice and world_size != 1:
        raise SetupError("RANK_SLICE=1 runs one rank's share on a single GPU: use --nproc_per_node=1 (NGPU=1)")


def check_inputs(hp: Hyperparameters):
    """A run's inputs, checked on the CPU: the shards (check_train_data), validation tokens and tokenizer file."""
    data = hp.data
    check_train_data(hp)
    ValidationSet(data.val_files, data.val_tokens, data.val_seq_len, 0, 1, torch.device("cpu"), hp.model.vocab_size)
    prefix_token_ids(gpt2_token_bytes(data.tokenizer_dir), hp.model.vocab_size)


def check_train_data(hp: Hyperparameters):
    """The train files against what the run reads of them, by the loader's own plan over their documents (a
    document longer than its stage's max_seq_len leaves its tail unread, so a run reads more than its batches
    hold): their token ids inside the vocabulary and, unless ALLOW_REPEAT=1, no second pass over them (a run
    that repeats stops, naming the shards it needs). Every GPU count reads what the 8-GPU run reads (T1.3)."""
    data, schedule = hp.data, Schedule(hp.schedule)
    loader = TrainLoader(data.train_files, 0, 1, torch.device("cpu"), log=lambda _: None,
                         grad_accum=1 if hp.run.rank_slice else RANKS_PER_STEP, vocab_size=hp.model.vocab_size)
    steps, repeats_at = hp.run.stop_after or schedule.total_steps, None
    try:
        for step in range(steps):
            stage = hp.schedule.stages[schedule.stage(step)]
            loader.plan_step(stage.batch_tokens // RANKS_PER_STEP, stage.max_seq_len)
            if loader.passes > 1 and repeats_at is None:
                if data.allow_repeat:  # every file read once: their token ids checked
                    return
                repeats_at = step + 1
    finally:
        loader.close()
    if repeats_at is not None:
        raise SetupError(f"the run's {steps} steps would read past the end of its {len(loader.files)} train files at "
                         f"step {repeats_at} and train on them again: they need {loader.file_index + 1} shards like "
                         f"{os.path.basename(loader.files[0])}; add train shards (TRAIN_FILES), or ALLOW_REPEAT=1")


def check_log_dir(hp: Hyperparameters):
    """LOG_DIR: a folder this process can write (made if missing), where the run's log goes."""
    try:
        os.makedirs(hp.run.log_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=hp.run.log_dir):
            pass
    except OSError as error:
        raise SetupError(f"LOG_DIR={hp.run.log_dir!r} is not a folder this process can write "
                         f"({error.strerror or error}): give another LOG_DIR") from None


def check_setup(hp: Hyperparameters, world_size: int, rank: int = 0):
    """Everything checked before any GPU work, for --check and for a run: the world size, the n-gram table's share,
    the device and its GPUs, and on rank 0 the input files, then the log folder (made only once all else is ok)."""
    check_world_size(hp, world_size)
    check_ngram_rows(hp, world_size)
    check_device(hp, world_size)
    if rank == 0:
        check_inputs(hp)
        check_log_dir(hp)


def allow_graph_per_shape():
    """Dynamo's recompile limit (8) raised to 64: one graph per stage shape and per optimizer table shape."""
    for name in ("recompile_limit", "cache_size_limit"):  # the name before and since PyTorch 2.6
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)


def check_device(hp: Hyperparameters, world_size: int):
    """DEVICE, a visible CUDA GPU per process (run.sh's --check: WORLD_SIZE=NGPU) and the attention backend there."""
    if hp.run.device not in ("cuda", "cpu"):
        raise SetupError(f"DEVICE={hp.run.device!r}: use cuda (one GPU per process) or cpu")
    visible = torch.cuda.device_count() if hp.run.device == "cuda" and torch.cuda.is_available() else 0
    if hp.run.device == "cuda" and visible == 0:
        raise SetupError("no CUDA GPU visible. train_gpt.py trains on NVIDIA GPUs (H100-class); `SMOKE=1 "
                         "./run.sh` trains a tiny model on the CPU, DEVICE=cpu runs this one there (slowly)")
    if hp.run.device == "cuda" and visible < world_size:
        fits = max(n for n in (1, 2, 4, 8) if n <= visible)
        raise SetupError(f"{world_size} processes (NGPU) but {visible} CUDA GPU(s) visible: use NGPU={fits} "
                         f"(fewer GPUs accumulate gradients: the same training)")
    resolve_attention_backend(hp.execution.attention_backend, hp.run.device)


def limit_gpu_memory(gib: float, device: torch.device):
    """GPU_MEMORY_GIB: the caching allocator on device holds at most gib GiB from now on (its share of the GPU's
    memory, torch.cuda.set_per_process_memory_fraction); past it an allocation first frees cached blocks, then
    raises torch.OutOfMemoryError. Memory outside the allocator (the CUDA context, kernels' code) is not counted."""
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * 2**30 > total:
        raise SetupError(f"GPU_MEMORY_GIB={gib:g} is more than this GPU's {total / 2**30:.1f} GiB: give less, or 0 "
                         f"for the whole GPU")
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, index)


# CPU runs (tests, SMOKE=1): torch's bf16 and fp16 matrix products on a CPU without bf16 GEMM instructions
# (AVX512-BF16, AMX: the CI runners') are scalar loops, far slower than MKL's fp32 GEMM (README, Tests).
_CPU_GEMMS = None


def cpu_16bit_gemms_in_fp32() -> None:
    """From now on in this process, aten::mm and aten::bmm on the CPU multiply bf16/fp16 operands as fp32
    and round the result once to their dtype: a bf16 GEMM's fp32-accumulated products (summation order
    aside), the same on every CPU, autograd's backward products included (they dispatch to the same ops).
    Other dtypes and devices are untouched. Called by init_process on the CPU and by tests/helpers.py."""
    global _CPU_GEMMS
    if _CPU_GEMMS is not None:
        return

    def kernel(op):
        def product(a: Tensor, b: Tensor) -> Tensor:
            shape = (*a.shape[:-1], b.size(-1))
            if a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
                out = torch.empty(shape, dtype=torch.float32)
                return op(a.float(), b.float(), out=out).to(a.dtype)
            return op(a, b, out=torch.empty(shape, dtype=torch.promote_types(a.dtype, b.dtype)))  # the .out kernels
        return product

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point
        warnings.simplefilter("ignore")
        library.impl("mm", kernel(torch.mm), "CPU")
        library.impl("bmm", kernel(torch.bmm), "CPU")
    _CPU_GEMMS = library  # the registration lives as long as the Library object


def launch_ranks(environ=os.environ) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables (run.sh's --check: WORLD_SIZE=NGPU), or (0, 1, 0)."""
    values = []
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        raw = environ.get(name, default)
        if not raw.isdigit():
            raise SetupError(f"{name}={raw!r} is not a whole number (torchrun sets it; run.sh passes NGPU as "
                             f"WORLD_SIZE)")
        values.append(int(raw))
    return tuple(values)


def init_process(hp: Hyperparameters) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process; the process group when several run."""
    rank, world_size, local_rank = launch_ranks()
    if hp.run.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if hp.run.gpu_memory_gib > 0:
            limit_gpu_memory(hp.run.gpu_memory_gib, device)
    else:
        device = torch.device(hp.run.device)
        if device.type == "cpu":
            cpu_16bit_gemms_in_fp32()
    if world_size > 1:
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return rank, world_size, device


def planned_runs(hp: Hyperparameters, world_size: int) -> list[Hyperparameters]:
    """This process's runs: hp, or one per SEEDS entry as RUN_ID_s<seed>; no RUN_ID: rank 0's uuid4 on every rank."""
    run_id = hp.run.run_id or str(uuid.uuid4())
    if world_size > 1:  # every rank logs under rank 0's id
        shared = [run_id]
        dist.broadcast_object_list(shared, 0)
        run_id = shared[0]
    if not hp.run.seeds:
        return [hp.replace(run_id=run_id)]
    return [hp.replace(seed=seed, run_id=f"{run_id}_s{seed}") for seed in hp.run.seeds]


def open_run_log(hp: Hyperparameters, rank: int, world_size: int, device: torch.device) -> RunLog:
    """The run's log (rank 0 writes it): this source, the environment, the run's description."""
    log = RunLog(os.path.join(hp.run.log_dir, f"{hp.run.run_id}.txt") if rank == 0 else None)
    with open(__file__) as f:
        log(f.read().rstrip("\n") + "\n" + LOG_SEPARATOR, console=False)
    log(environment_report() + "\n" + LOG_SEPARATOR, console=False)
    hardware = f"{world_size}x {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "cpu"
    capped = []
    if hp.run.gpu_memory_gib > 0:
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        capped.append(f"gpu_memory: the allocator capped at {hp.run.gpu_memory_gib:g} GiB of {total:.1f} "
                      f"(GPU_MEMORY_GIB)")
    log("\n".join([f"run_id: {hp.run.run_id}", f"hardware: {hardware}", *capped,
                   f"mode: {'rank-slice' if hp.run.rank_slice else 'full-batch'}", f"world_size: {world_size}",
                   f"grad_accum_steps: {grad_accum_steps(hp, world_size)}", f"data: {data_label(hp.data)}",
                   f"overrides: {environment_overrides()}"]))
    log(f"hyperparameters: {json.dumps(hp.flat())}", console=False)
    log(f"log: {log.path}")
    return log


def report_setup_error(error: Exception, rank: int, log: RunLog | None):
    """One line naming the fix, from rank 0 only (not once per process), and into the open run log; exit 1."""
    message = f"error: {error}"
    if log is not None:
        log(message, console=False)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(1)


def out_of_memory_hint(hp: Hyperparameters, world_size: int) -> str:
    """What to change after torch.OutOfMemoryError: the allocator's cap, the n-gram table's share, the batch."""
    capped = (f"GPU_MEMORY_GIB={hp.run.gpu_memory_gib:g} caps this process's allocator; "
              if hp.run.gpu_memory_gib else "")
    gib = -(-hp.model.ngram_rows // world_size) * ngram_bytes_per_row(hp.model.model_dim) / 2**30  # T3.19
    table = (f"The n-gram table holds {gib:.1f} GiB of it per process (NGRAM_ROWS={hp.model.ngram_rows}): "
             f"fewer rows take less (a row: {ngram_bytes_per_row(hp.model.model_dim)} bytes). ")
    return (f"out of GPU memory. {capped}{table}Free the GPU (other processes?), keep PYTORCH_ALLOC_CONF="
            "expandable_segments:True, or lower STAGE_BATCH_TOKENS / VAL_SEQ_LEN for smaller GPUs.")


def report_interrupt(where: str, rank: int, log: RunLog | None):
    """Ctrl-C: one `interrupted ...` line (console and log, which keeps everything before it), exit 130."""
    if log is not None:
        log(f"interrupted {where}", console=False)
    if rank == 0:
        print(f"interrupted {where}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(130)


def main():
    """Train; `python train_gpt.py --check` only checks the settings and inputs (run.sh does so
    before it starts torchrun, so a bad setting is one line, not one traceback per process)."""
    rank, log = 0, None
    if sys.argv[1:] in (["--help"], ["-h"]):
        return print(__doc__.strip())
    try:
        if sys.argv[1:] not in ([], ["--check"]):
            raise SetupError(f"unknown arguments {sys.argv[1:]}: settings are environment variables (README)")
        rank, world_size, _ = launch_ranks()
        hp = Hyperparameters.from_env()
        check_hyperparameters(hp)
        hp = rows_for_world(hp, world_size)
        check_setup(hp, world_size, rank)
        if sys.argv[1:] == ["--check"]:
            return print(f"settings and inputs ok ({data_label(hp.data)})")
        rank, world_size, device = init_process(hp)
        runs = planned_runs(hp, world_size)
        log = open_run_log(runs[0], rank, world_size, device)
        trainer = Trainer(runs[0], rank, world_size, device, log)
    except (SetupError, FileNotFoundError) as error:
        report_setup_error(error, rank, log)
    except KeyboardInterrupt:
        report_interrupt("during set-up", rank, log)
    except torch.OutOfMemoryError:  # the model, or the n-gram table's rows (T3.19)
        report_setup_error(out_of_memory_hint(hp, world_size), rank, log)
    try:
        for _ in trainer.run_each(runs):  # each run logs its own results
            pass
    except (NonFiniteLoss, CandidateShortfall, GraphMismatch, ExchangeOverflow) as error:
        trainer.log(f"error: {error}")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        report_interrupt(trainer.position, rank, trainer.log)
    except torch.OutOfMemoryError:
        trainer.log(f"error: {out_of_memory_hint(hp, world_size)}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

# =============================================================================================
# Fast paths
# =============================================================================================
# Each fused op is one block, in this order: its torch reference (the definition and the fallback), the Triton
# kernels, their launcher (traced by torch.compile, or in a custom op where the op cannot be traced), the autograd
# function, and the dispatcher the model or optimizer calls. One rule picks the path: a dispatcher's `use_triton=None`
# means triton_applies(input) (a CUDA tensor with Triton installed, and the shapes the kernels take); True forces the
# kernels (tests run them in Triton's CPU interpreter), False the reference. What the model runs (FP8, the fused MLP,
# DC-MHA's kernels) the execution plan decides once per stage (resolve_execution) and passes as explicit flags.
TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)


def triton_applies(t: Tensor) -> bool:
    """Whether the Triton kernels run for this tensor by default: on CUDA, with Triton installed."""
    return t.is_cuda and triton is not None


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# --- Orthogonalization: Polar Express (T2.3) --------------------------------------------------------
# Polar Express (Amsel, Persson, Musco, Gower 2025; #38): five per-iteration odd quintics,
# computed for num_iters=5, safety_factor=2e-2, cushion=2, applied after X / (1.02·‖X‖ + 1e-6).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_SAFETY, POLAR_EPS = 1.02, 1e-6  # the normalization X = G / (safety·‖G‖_F + eps)


def polar_normalize(G: Tensor, safety: float = POLAR_SAFETY, eps: float = POLAR_EPS) -> Tensor:
    """G / (safety·‖G‖_F + eps) per matrix, in bf16: the start of the iteration."""
    norm = torch.linalg.vector_norm(G.float(), dim=(-2, -1), keepdim=True)
    return (G / (norm * safety + eps)).bfloat16()


def orthogonalize_float64(G: Tensor, coeffs: tuple = POLAR_EXPRESS_COEFFS, safety: float = POLAR_SAFETY,
                          eps: float = POLAR_EPS) -> Tensor:
    """The same iteration (normalization, then the odd polynomials `coeffs`) in float64: the function
    every bf16 path approximates, for tests and benchmarks (bench/quintic_maps.py tries other sets)."""
    X = G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * safety + eps)
    tall = X.size(-2) > X.size(-1)
    for a, b, c in coeffs:
        A = X.mT @ X if tall else X @ X.mT
        B = b * A + c * A @ A
        X = a * X + (X @ B if tall else B @ X)
    return X


def _gemm_dtype(X: Tensor) -> torch.dtype:
    # On the CPU the products run in fp32, rounded to bf16 where a bf16 GEMM rounds: the same function, faster.
    return torch.float32 if X.device.type == "cpu" else torch.bfloat16


def polar_iterations_reference(X: Tensor, coeffs: tuple = POLAR_EXPRESS_COEFFS) -> Tensor:
    """The odd-polynomial iteration on a normalized bf16 bank X (B, rows, cols) in torch. Wide and square matrices use
    X·Xᵀ, tall ones use Xᵀ·X (#74), so the symmetric products are min(rows, cols)² and nothing is transposed in memory.
    (a·X + X·B, not X·(B + a·I): torch would round B to bf16 before adding a·I, 1.1-1.5e-2 from float64.)"""
    tall, work = X.size(-2) > X.size(-1), _gemm_dtype(X)
    for a, b, c in coeffs:
        Y = X.to(work)
        A = (Y.mT @ Y if tall else Y @ Y.mT).bfloat16().to(work)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c).bfloat16().to(work)
        X = (torch.baddbmm(Y, Y, B, beta=a) if tall else torch.baddbmm(Y, B, Y, beta=a)).bfloat16()
    return X

# Symmetric batched products for Newton-Schulz / Polar Express (#27, #69, #74): only output tiles on or below the
# diagonal are computed (a 1-D enumeration of the triangle), each stored at [m, n] and mirrored to [n, m]; fp32
# accumulation; operands loaded along their contiguous dim. Odd sizes wrap the output offsets (loads stay in bounds)
# and mask the stores and reduction. UPCAST only serves Triton's CPU interpreter (TRITON_INTERPRET=1), whose dot
# cannot do bf16 and whose fp32-to-bf16 cast truncates: there the kernels round to nearest themselves (_to_dtype).
if triton is not None:
    @triton.jit
    def _lower_triangle_tile(t):
        # linear index t = row*(row+1)/2 + col (col <= row): fp32 sqrt guess, integer corrections
        r = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
        r = tl.where((r + 1) * (r + 2) // 2 <= t, r + 1, r)
        r = tl.where(r * (r + 1) // 2 > t, r - 1, r)
        return r, t - r * (r + 1) // 2

    @triton.jit
    def _to_dtype(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
        # x.to(dtype) as a GPU casts: fp32 to the nearest bf16 (ties to even); Triton's CPU
        # interpreter (UPCAST) truncates, so there the bits are rounded first
        if UPCAST:
            if dtype == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def _store_symmetric(out_ptr, c, pid_m, pid_n, offs_m, offs_n, N, stride_om, UPCAST: tl.constexpr):
        # tile (m, n) and, off the diagonal, its transpose at (n, m)
        c = _to_dtype(c, out_ptr.dtype.element_ty, UPCAST)
        mask = (offs_m[:, None] < N) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], c, mask=mask)
        if pid_m != pid_n:
            mask_t = (offs_n[:, None] < N) & (offs_m[None, :] < N)
            tl.store(out_ptr + offs_n[:, None] * stride_om + offs_m[None, :], tl.trans(c), mask=mask_t)

    @triton.jit
    def _aat_kernel(a_ptr, out_ptr, M, K, alpha, beta, gamma, stride_ab, stride_am, stride_ob, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ADD_A: tl.constexpr,
                    ADD_I: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        # out[b] = alpha·A[b]·A[b]ᵀ (+ beta·A[b] when ADD_A, for square symmetric A) (+ gamma·I when ADD_I);
        # A (M, K) row-major
        pid_m, pid_n = _lower_triangle_tile(tl.program_id(0))
        pid_b = tl.program_id(1).to(tl.int64)
        a_ptr += pid_b * stride_ab
        out_ptr += pid_b * stride_ob
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        rm, rn = offs_m % M, offs_n % M
        a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]
        b_ptrs = a_ptr + rn[:, None] * stride_am + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a, b = tl.load(a_ptrs), tl.load(b_ptrs)
            else:
                k_mask = offs_k[None, :] < K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_mask, other=0.0)
                b = tl.load(b_ptrs, mask=k_mask, other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        acc = alpha * acc
        if ADD_A:
            acc += beta * tl.load(a_ptr + rm[:, None] * stride_am + rn[None, :]).to(tl.float32)
        if ADD_I:
            acc = tl.where(offs_m[:, None] == offs_n[None, :], acc + gamma, acc)
        _store_symmetric(out_ptr, acc, pid_m, pid_n, offs_m, offs_n, M, stride_om, UPCAST)

    @triton.jit
    def _ata_kernel(a_ptr, out_ptr, M, K, stride_ab, stride_am, stride_ob, stride_om,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        # out[b] = A[b]ᵀ·A[b], A (M, K) row-major, reduction over M; tiles [BLOCK_R, BLOCK_N] along K
        pid_i, pid_j = _lower_triangle_tile(tl.program_id(0))
        pid_b = tl.program_id(1).to(tl.int64)
        a_ptr += pid_b * stride_ab
        out_ptr += pid_b * stride_ob
        offs_i = pid_i * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = pid_j * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        ci, cj = (offs_i, offs_j) if EVEN_N else (offs_i % K, offs_j % K)
        a_ptrs = a_ptr + offs_r[:, None] * stride_am + ci[None, :]
        b_ptrs = a_ptr + offs_r[:, None] * stride_am + cj[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
        for r in range(0, tl.cdiv(M, BLOCK_R)):
            if EVEN_M:
                a, b = tl.load(a_ptrs), tl.load(b_ptrs)
            else:
                r_mask = offs_r[:, None] < M - r * BLOCK_R
                a = tl.load(a_ptrs, mask=r_mask, other=0.0)
                b = tl.load(b_ptrs, mask=r_mask, other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_R * stride_am
            b_ptrs += BLOCK_R * stride_am
        _store_symmetric(out_ptr, acc, pid_i, pid_j, offs_i, offs_j, K, stride_om, UPCAST)


# Launch configurations (block, block_k, num_warps, num_stages) per (kernel, output size, reduction size),
# tuned on an H100 with `python bench/bench_orthogonalize.py --sweep`; other sizes use the defaults.
SYMMETRIC_KERNEL_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int]] = {
    ("xxt", 256, 768): (128, 64, 4, 3),
    ("ba_plus_caa", 256, 256): (64, 32, 4, 4),
    ("xxt", 768, 768): (128, 64, 4, 3),
    ("ba_plus_caa", 768, 768): (128, 64, 8, 3),
    ("xtx", 768, 3072): (128, 64, 8, 3),
}


def _symmetric_launch(A: Tensor, kernel: str, n_out: int, reduction: int, config: tuple | None):
    """Output buffer, grid, tile sizes and launch options for an (n_out x n_out) symmetric product of A."""
    if A.dim() != 3 or not A.is_contiguous():
        raise ValueError(f"expected a contiguous (batch, rows, cols) tensor, got {tuple(A.shape)}")
    fp32 = A.dtype == torch.float32
    big = n_out >= 512  # 768-wide Gram matrices: 128-tiles; small ones (256): more, smaller programs
    default = (128 if big else 64, 32 if fp32 else 64, 8 if big else 4, 3 if fp32 else 4)
    block, block_k, num_warps, num_stages = config or SYMMETRIC_KERNEL_CONFIGS.get((kernel, n_out, reduction), default)
    tiles = triton.cdiv(n_out, block)
    options = dict(num_warps=num_warps, num_stages=num_stages, INPUT_PRECISION="ieee" if fp32 else "tf32",
                   UPCAST=TRITON_INTERPRETER and not fp32)
    out = A.new_empty((A.size(0), n_out, n_out))
    return out, (tiles * (tiles + 1) // 2, A.size(0)), block, block_k, options


def xxt(A: Tensor, config: tuple | None = None) -> Tensor:
    """A·Aᵀ for a batch A (B, M, K) -> (B, M, M). config: (block, block_k, num_warps, num_stages)."""
    B, M, K = A.shape
    out, grid, block, block_k, options = _symmetric_launch(A, "xxt", M, K, config)
    _aat_kernel[grid](A, out, M, K, 1.0, 0.0, 0.0, A.stride(0), A.stride(1), out.stride(0), out.stride(1),
                      BLOCK_M=block, BLOCK_K=block_k, EVEN_K=K % block_k == 0, ADD_A=False, ADD_I=False, **options)
    return out


def ba_plus_caa(A: Tensor, alpha: float, beta: float, config: tuple | None = None, identity: float = 0.0) -> Tensor:
    """beta·A + alpha·A·A (+ identity·I) for a batch of symmetric A (B, N, N) (A·A = A·Aᵀ)."""
    B, N, _ = A.shape
    out, grid, block, block_k, options = _symmetric_launch(A, "ba_plus_caa", N, N, config)
    _aat_kernel[grid](A, out, N, N, float(alpha), float(beta), float(identity), A.stride(0), A.stride(1),
                      out.stride(0), out.stride(1), BLOCK_M=block, BLOCK_K=block_k, EVEN_K=N % block_k == 0,
                      ADD_A=True, ADD_I=identity != 0.0, **options)
    return out


def xtx(A: Tensor, config: tuple | None = None) -> Tensor:
    """Aᵀ·A for a batch A (B, M, K) -> (B, K, K)."""
    B, M, K = A.shape
    out, grid, block, block_k, options = _symmetric_launch(A, "xtx", K, M, config)
    _ata_kernel[grid](A, out, M, K, A.stride(0), A.stride(1), out.stride(0), out.stride(1),
                      BLOCK_N=block, BLOCK_R=block_k, EVEN_M=M % block_k == 0, EVEN_N=K % block == 0, **options)
    return out


def polar_iterations(X: Tensor, use_triton: bool | None = None, coeffs: tuple = POLAR_EXPRESS_COEFFS) -> Tensor:
    """polar_iterations_reference's function; with the symmetric Triton kernels, a·X + X·B is one
    product X·(B + a·I), a·I added in the kernel's fp32 epilogue: baddbmm with beta != 0 first copies
    X into its output, a device-to-device copy of the whole bank per iteration."""
    if not (triton_applies(X) if use_triton is None else use_triton):
        return polar_iterations_reference(X, coeffs)
    tall, work = X.size(-2) > X.size(-1), _gemm_dtype(X)
    for a, b, c in coeffs:
        Y = X.to(work)
        B = ba_plus_caa(xtx(X) if tall else xxt(X), alpha=c, beta=b, identity=a).to(work)
        X = (Y @ B if tall else B @ Y).bfloat16()
    return X


def orthogonalize(G: Tensor, use_triton: bool | None = None, coeffs: tuple = POLAR_EXPRESS_COEFFS,
                  safety: float = POLAR_SAFETY, eps: float = POLAR_EPS) -> Tensor:
    """Approximate U·Vᵀ (the orthogonal polar factor) of every matrix of a bank G (B, rows, cols), in bf16."""
    return polar_iterations(polar_normalize(G, safety, eps), use_triton, coeffs)


# --- lm_head and soft-capped multi-target cross-entropy (T4.1, T4.4) ---------------------------------
# Logit soft-cap z = 23·σ((u+5)/7.5) (#54) and the FP8 lm_head scales: x/x_s and W/w_s in e4m3, the
# logit gradient in e5m2 as du/grad_s with grad_s = FP8_GRAD_SCALE·grad_scale (#51, #55, #65).
SOFTCAP_SCALE, SOFTCAP_SHIFT, SOFTCAP_TEMPERATURE = 23.0, 5.0, 7.5
FP8_X_SCALE, FP8_W_SCALE, FP8_GRAD_SCALE = 100 / 448, 1.6 / 448, 0.75 / 448
E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # largest finite float8_e4m3fn / float8_e5m2
MAX_TARGETS = 4  # target columns per row of the fused cross-entropy


def softcap(logits: Tensor) -> Tensor:
    """Asymmetric logit soft-cap into (0, 23) (#54), computed in fp32 (or the logits' wider dtype)."""
    u = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return SOFTCAP_SCALE * torch.sigmoid((u + SOFTCAP_SHIFT) / SOFTCAP_TEMPERATURE)


def copy_mixture(ce0: Tensor, ce_copy: Tensor, p_copy: Tensor, a_sink: Tensor) -> tuple[Tensor, ...]:
    """The copy pointer's mixture (T4.8) for one row (elementwise over rows): from ce0 = lse − z[y], ce_copy = lse −
    z[<copy>], the pointer's mass p_copy on earlier copies of y and its sink's mass a_sink, (nll, g_t, g_c, g_lse,
    d_p, d_s): nll = −log p(y), p(y) = P·(1 + A·a_sink/(1 − A)) + A·p_copy with P = e^−ce0 and A = e^−ce_copy, and
    its derivatives: ∂nll/∂z_v = g_lse·softmax_v + g_t·[v = y] + g_c·[v = <copy>], d_p = ∂nll/∂p_copy,
    d_s = ∂nll/∂a_sink."""
    P, A = torch.exp(-ce0), torch.exp(-ce_copy)
    rest = (1 - A).clamp_min(1e-6)
    r_t = 1 + A * a_sink / rest  # ∂p/∂P
    r_c = P * a_sink / (rest * rest) + p_copy  # ∂p/∂A
    p = (P * r_t + A * p_copy).clamp_min(1e-30)
    return -torch.log(p), -r_t * P / p, -r_c * A / p, (r_t * P + r_c * A) / p, -A / p, -P * A / (rest * p)


def softcap_ce_reference(logits: Tensor, targets: Tensor, weights: Tensor, grad_mul: float,
                         grad_dtype: torch.dtype, copy: tuple[Tensor, Tensor, Tensor] | None = None,
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Plain-torch form of the fused kernel. logits u (T, V); targets (T, N) int, −1 = none;
    weights (N,). Returns per row loss_t = Σ_k w_k·[y_tk ≥ 0]·(lse − z[y_tk]), ce0_t = lse − z[y_t0]
    (0 where y_t0 = −1) and grad_mul·∂(Σ_t loss_t)/∂u in grad_dtype (e5m2: saturated). copy (T4.8): (the
    <copy> column (1,), p_copy (T,), a_sink (T,)): the first target's term is copy_mixture's nll instead, and a
    fourth result holds ∂(Σ_t loss_t)/∂(p_copy, a_sink) (T, 2) (without grad_mul)."""
    z = softcap(logits)
    lse = torch.logsumexp(z, -1, keepdim=True)
    valid = targets >= 0
    safe_targets = targets.clamp_min(0)
    ce = lse - z.gather(1, safe_targets)
    w_valid = weights.to(z.dtype) * valid
    column_coefs, softmax_coef, copy_grad = w_valid, w_valid.sum(-1, keepdim=True), None
    if copy is not None:
        column, p_copy, a_sink = copy
        column = column.view(1, 1).expand(z.size(0), 1)
        nll, g_t, g_c, g_lse, d_p, d_s = copy_mixture(ce[:, :1], lse - z.gather(1, column), p_copy[:, None].to(z.dtype),
                                                      a_sink[:, None].to(z.dtype))
        w0 = w_valid[:, :1]
        ce = torch.cat([nll, ce[:, 1:]], 1)
        column_coefs = torch.cat([-w0 * g_t, w_valid[:, 1:]], 1)
        softmax_coef = softmax_coef + w0 * (g_lse - 1)
        copy_grad = torch.cat([w0 * d_p, w0 * d_s], 1)
    loss_rows = (ce * w_valid).sum(-1)
    ce0_rows = torch.where(valid[:, 0], ce[:, 0], 0.0)
    dz = torch.exp(z - lse) * softmax_coef
    dz = dz.scatter_add(1, safe_targets, -column_coefs)  # duplicate targets add up
    if copy is not None:
        dz = dz.scatter_add(1, column, w0 * g_c)
    sigma = z / SOFTCAP_SCALE
    grad = (grad_mul * SOFTCAP_SCALE / SOFTCAP_TEMPERATURE) * sigma * (1 - sigma) * dz
    if grad_dtype == torch.float8_e5m2:
        grad = grad.clamp(-E5M2_MAX, E5M2_MAX)
    return loss_rows, ce0_rows, grad.to(grad_dtype), copy_grad


# Fused soft-capped multi-target cross-entropy, forward and backward in one kernel (#60, #67, #79; T4.1). Persistent
# programs take rows t = pid, pid + programs, ...; each row is read once and held in registers as up to three
# power-of-two parts (`vocab_parts`: 32768 + 16384 + 2048 for GPT-2's 50,304, the last masked): sweep 1 sums exp(z − 23)
# (z < 23: no running max), sweep 2 writes the logit gradient from them, then the ≤ MAX_TARGETS target columns are
# rewritten after a barrier. With tanh: z = h + h·t, t = tanh((u+5)/15), h = 23/2; dz/du = 23/(4·7.5)·(1 − t²).
if triton is not None:
    @triton.jit
    def _tanh(x, FAST: tl.constexpr):
        if FAST:  # one MUFU op, ~2^-11 relative error (the reference's fast-math kernel does the same)
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return 2 * tl.sigmoid(2 * x) - 1

    @triton.jit
    def _softcap_tanh(u, SHIFT: tl.constexpr, TEMPERATURE: tl.constexpr, FAST_TANH: tl.constexpr):
        """t = tanh((u + 5)/15) of logits u (z = h + h·t)."""
        return _tanh((u.to(tl.float32) + SHIFT) * (0.5 / TEMPERATURE), FAST_TANH)

    @triton.jit
    def _load_part(u_row, offs, V, MASKED: tl.constexpr):
        if MASKED:
            return tl.load(u_row + offs, mask=offs < V, other=0.0)
        else:
            return tl.load(u_row + offs)

    @triton.jit
    def _softcap_exp_sum(u, offs, V, SHIFT: tl.constexpr, TEMPERATURE: tl.constexpr, HALF: tl.constexpr,
                         MASKED: tl.constexpr, FAST_TANH: tl.constexpr):
        """Σ exp(z − 23) over a part of one row's logits u (masked-off columns excluded)."""
        LOG2E: tl.constexpr = 1.4426950408889634
        t = _softcap_tanh(u, SHIFT, TEMPERATURE, FAST_TANH)
        e = tl.exp2((t - 1) * (HALF * LOG2E))
        if MASKED:
            e = tl.where(offs < V, e, 0.0)
        return tl.sum(e, axis=0)

    @triton.jit
    def _softcap_grad_store(u, g_row, offs, V, scale, bias, SHIFT: tl.constexpr, TEMPERATURE: tl.constexpr,
                            HALF: tl.constexpr, SATURATE_AT: tl.constexpr, MASKED: tl.constexpr,
                            FAST_TANH: tl.constexpr):
        """Writes scale·(1 − t²)·exp(z − lse) for a part of one row (bias: (h − lse)·log2 e)."""
        LOG2E: tl.constexpr = 1.4426950408889634
        t = _softcap_tanh(u, SHIFT, TEMPERATURE, FAST_TANH)
        g = scale * (1 - t * t) * tl.exp2(t * (HALF * LOG2E) + bias)
        if SATURATE_AT > 0:  # e5m2: saturate, never overflow to inf
            g = tl.minimum(tl.maximum(g, -SATURATE_AT), SATURATE_AT)
        if MASKED:
            tl.store(g_row + offs, g.to(g_row.dtype.element_ty), mask=offs < V)
        else:
            tl.store(g_row + offs, g.to(g_row.dtype.element_ty))

    @triton.jit
    def _copy_mixture(ce0, ce_copy, p_copy, a_sink):
        """copy_mixture (T4.8) for one row's scalars."""
        P, A = tl.exp(-ce0), tl.exp(-ce_copy)
        rest = tl.maximum(1 - A, 1e-6)
        r_t = 1 + A * a_sink / rest
        r_c = P * a_sink / (rest * rest) + p_copy
        p = tl.maximum(P * r_t + A * p_copy, 1e-30)
        return -tl.log(p), -r_t * P / p, -r_c * A / p, (r_t * P + r_c * A) / p, -A / p, -P * A / (rest * p)

    @triton.jit
    def _softcap_ce_kernel(logits_ptr, targets_ptr, weights_ptr, loss_ptr, ce0_ptr, grad_ptr, copy_column_ptr,
                           p_copy_ptr, a_sink_ptr, copy_grad_ptr,
                           n_rows, V, stride_logits, stride_targets, stride_grad, grad_mul,
                           CAP: tl.constexpr, SHIFT: tl.constexpr, TEMPERATURE: tl.constexpr,
                           N_TARGETS: tl.constexpr, N_PAD: tl.constexpr, PART_A: tl.constexpr, PART_B: tl.constexpr,
                           PART_C: tl.constexpr, SATURATE_AT: tl.constexpr, FAST_TANH: tl.constexpr,
                           COPY: tl.constexpr, PREFETCH: tl.constexpr):
        LOG2E: tl.constexpr = 1.4426950408889634
        HALF: tl.constexpr = CAP * 0.5
        k = tl.arange(0, N_PAD)
        weights = tl.load(weights_ptr + k, mask=k < N_TARGETS, other=0.0).to(tl.float32)
        coef = grad_mul * (CAP / (4 * TEMPERATURE))
        # parts A and B are whole; C is the masked rest (B and C may be absent: size 0)
        offs_a = tl.arange(0, PART_A)
        if PART_B > 0:
            offs_b = PART_A + tl.arange(0, PART_B)
        if PART_C > 0:
            offs_c = PART_A + PART_B + tl.arange(0, PART_C)
        first_row, programs = tl.program_id(0).to(tl.int64), tl.num_programs(0)
        if COPY:
            column = tl.load(copy_column_ptr)
        if PREFETCH:  # the first row's loads before the loop; each iteration then loads the next row's
            u_first = logits_ptr + first_row * stride_logits
            u_a = _load_part(u_first, offs_a, V, False)
            if PART_B > 0:
                u_b = _load_part(u_first, offs_b, V, False)
            if PART_C > 0:
                u_c = _load_part(u_first, offs_c, V, True)
        for i in range(0, tl.cdiv(n_rows - first_row, programs)):
            row = first_row + i * programs
            u_row = logits_ptr + row * stride_logits
            g_row = grad_ptr + row * stride_grad
            if PREFETCH:  # the next row's loads in flight over this row's sums and stores (the last reloads a row)
                next_row = logits_ptr + tl.minimum(row + programs, n_rows - 1) * stride_logits
                next_a = _load_part(next_row, offs_a, V, False)
                if PART_B > 0:
                    next_b = _load_part(next_row, offs_b, V, False)
                if PART_C > 0:
                    next_c = _load_part(next_row, offs_c, V, True)
            else:
                u_a = _load_part(u_row, offs_a, V, False)  # every load of the row in flight at once
                if PART_B > 0:
                    u_b = _load_part(u_row, offs_b, V, False)
                if PART_C > 0:
                    u_c = _load_part(u_row, offs_c, V, True)
            total = _softcap_exp_sum(u_a, offs_a, V, SHIFT, TEMPERATURE, HALF, False, FAST_TANH)
            if PART_B > 0:
                total += _softcap_exp_sum(u_b, offs_b, V, SHIFT, TEMPERATURE, HALF, False, FAST_TANH)
            if PART_C > 0:
                total += _softcap_exp_sum(u_c, offs_c, V, SHIFT, TEMPERATURE, HALF, True, FAST_TANH)
            lse = CAP + tl.log(total)
            ys = tl.load(targets_ptr + row * stride_targets + k, mask=k < N_TARGETS, other=-1).to(tl.int32)
            valid = ys >= 0
            u_y = tl.load(u_row + tl.maximum(ys, 0)).to(tl.float32)
            ce = lse - CAP * tl.sigmoid((u_y + SHIFT) / TEMPERATURE)
            w_valid = tl.where(valid, weights, 0.0)
            # the logit gradient: softmax_coef·softmax − Σ_k column_coef_k·[column y_k]
            column_coef, softmax_coef = w_valid, tl.sum(w_valid, axis=0)
            if COPY:  # the first target's term is the copy pointer's mixture (T4.8); <copy> joins as column N
                u_copy = tl.load(u_row + column).to(tl.float32)
                w0 = tl.sum(tl.where(k == 0, w_valid, 0.0), axis=0)
                nll, g_t, g_c, g_lse, d_p, d_s = _copy_mixture(
                    tl.sum(tl.where(k == 0, ce, 0.0), axis=0), lse - CAP * tl.sigmoid((u_copy + SHIFT) / TEMPERATURE),
                    tl.load(p_copy_ptr + row).to(tl.float32), tl.load(a_sink_ptr + row).to(tl.float32))
                ce = tl.where(k == 0, nll, ce)
                column_coef = tl.where(k == 0, -w0 * g_t, tl.where(k == N_TARGETS, -w0 * g_c, column_coef))
                softmax_coef += w0 * (g_lse - 1)
                ys = tl.where(k == N_TARGETS, column, ys)
                u_y = tl.where(k == N_TARGETS, u_copy, u_y)
                valid = valid | (k == N_TARGETS)
                tl.store(copy_grad_ptr + 2 * row, w0 * d_p)
                tl.store(copy_grad_ptr + 2 * row + 1, w0 * d_s)
            tl.store(loss_ptr + row, tl.sum(w_valid * ce, axis=0))
            tl.store(ce0_ptr + row, tl.sum(tl.where((k == 0) & valid, ce, 0.0), axis=0))
            bias = (HALF - lse) * LOG2E  # z − lse = h·t + h − lse
            _softcap_grad_store(u_a, g_row, offs_a, V, coef * softmax_coef, bias, SHIFT, TEMPERATURE, HALF,
                                SATURATE_AT, False, FAST_TANH)
            if PART_B > 0:
                _softcap_grad_store(u_b, g_row, offs_b, V, coef * softmax_coef, bias, SHIFT, TEMPERATURE, HALF,
                                    SATURATE_AT, False, FAST_TANH)
            if PART_C > 0:
                _softcap_grad_store(u_c, g_row, offs_c, V, coef * softmax_coef, bias, SHIFT, TEMPERATURE, HALF,
                                    SATURATE_AT, True, FAST_TANH)
            tl.debug_barrier()  # the sweep's stores to the target columns land before their rewrite
            t_y = _softcap_tanh(u_y, SHIFT, TEMPERATURE, FAST_TANH)
            same_target = tl.sum(tl.where(ys[:, None] == ys[None, :], column_coef[None, :], 0.0), axis=1)
            g_y = coef * (1 - t_y * t_y) * (softmax_coef * tl.exp2(t_y * (HALF * LOG2E) + bias) - same_target)
            if SATURATE_AT > 0:
                g_y = tl.minimum(tl.maximum(g_y, -SATURATE_AT), SATURATE_AT)
            tl.store(g_row + ys, g_y.to(grad_ptr.dtype.element_ty), mask=valid)
            if PREFETCH:
                u_a = next_a
                if PART_B > 0:
                    u_b = next_b
                if PART_C > 0:
                    u_c = next_c

    @triton.jit
    def _transpose_kernel(src_ptr, dst_ptr, M, N, stride_src, stride_dst, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # dst (N, M) = srcᵀ: a tile read along src's rows, written along dst's rows
        offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tile = tl.load(src_ptr + offs_m[:, None] * stride_src + offs_n[None, :], mask=mask)
        tl.store(dst_ptr + offs_n[:, None] * stride_dst + offs_m[None, :], tl.trans(tile), mask=tl.trans(mask))


def vocab_parts(V: int) -> tuple[int, int, int]:
    """A row of V logits as the kernel holds it: the largest power of two A <= V, the largest B <=
    V − A (0 if none), and C, the next power of two >= the rest (masked; 0 if none)."""
    part_a = 1 << (V.bit_length() - 1)
    rest = V - part_a
    part_b = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= part_b
    return part_a, part_b, (1 << (rest - 1).bit_length()) if rest else 0


# The kernel's launch by row width (T4.1): (widest row, num_warps, persistent programs per SM, prefetch), the first
# entry at least as wide as the row. A 50,304-logit row fills an SM's registers at 16 warps, 128 a thread (one row in
# flight; larger vocabularies spill, T4.4); the sampled budgets' narrower rows (T4.6) leave room for more.
CE_LAUNCH = ((10240, 4, 3, True), (14336, 4, 2, True), (1 << 62, 16, 1, False))


def ce_launch(width: int) -> tuple[int, int, bool]:
    """(num_warps, programs per SM, prefetch) of the fused cross-entropy at rows `width` logits wide (CE_LAUNCH)."""
    return next((warps, per_sm, prefetch) for widest, warps, per_sm, prefetch in CE_LAUNCH if width <= widest)


def softcap_ce(logits: Tensor, targets: Tensor, weights: Tensor, grad_mul: float, grad_dtype: torch.dtype,
               use_triton: bool | None = None, num_warps: int | None = None, programs: int | None = None,
               fast_tanh: bool | None = None, copy: tuple[Tensor, Tensor, Tensor] | None = None,
               prefetch: bool | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """softcap_ce_reference's function; the fused Triton kernel where use_triton (default: CUDA), launched as
    ce_launch(row width) says unless num_warps, programs (persistent programs in all) or prefetch are given.
    fast_tanh: tanh.approx.f32 (default on, except in Triton's CPU interpreter). prefetch: each program loads its next
    row while it sums and stores the current one (two rows in registers)."""
    if not (triton_applies(logits) if use_triton is None else use_triton):
        return softcap_ce_reference(logits, targets, weights, grad_mul, grad_dtype, copy)
    T, V = logits.shape
    N = targets.size(1)
    if not 1 <= N <= MAX_TARGETS or weights.numel() != N or logits.stride(1) != 1 or targets.stride(1) != 1:
        raise ValueError(f"need unit-stride (T, V) logits, (T, N <= {MAX_TARGETS}) targets and N weights, got "
                         f"{tuple(logits.shape)} {tuple(targets.shape)} {tuple(weights.shape)}")
    interpreting = TRITON_INTERPRETER
    loss_rows = torch.empty(T, dtype=torch.float32, device=logits.device)
    ce0_rows = torch.empty(T, dtype=torch.float32, device=logits.device)
    grad = torch.empty((T, V), dtype=grad_dtype, device=logits.device)
    copy_column, p_copy, a_sink = copy if copy is not None else (None, None, None)
    copy_grad = torch.empty((T, 2), dtype=torch.float32, device=logits.device) if copy is not None else None
    warps_by_width, per_sm, prefetch_by_width = ce_launch(V)
    num_warps = warps_by_width if num_warps is None else num_warps
    prefetch = prefetch_by_width if prefetch is None else prefetch
    if programs is None:
        programs = T if interpreting else per_sm * _sm_count(logits.device)
    if fast_tanh is None:
        fast_tanh = not interpreting
    part_a, part_b, part_c = vocab_parts(V)
    _softcap_ce_kernel[(max(1, min(T, programs)),)](
        logits, targets, weights.contiguous(), loss_rows, ce0_rows, grad, copy_column, p_copy, a_sink, copy_grad, T, V,
        logits.stride(0), targets.stride(0), grad.stride(0), float(grad_mul), CAP=SOFTCAP_SCALE, SHIFT=SOFTCAP_SHIFT,
        TEMPERATURE=SOFTCAP_TEMPERATURE, N_TARGETS=N, N_PAD=max(2, triton.next_power_of_2(N + (copy is not None))),
        PART_A=part_a, PART_B=part_b, PART_C=part_c,
        SATURATE_AT=E5M2_MAX if grad_dtype == torch.float8_e5m2 else 0.0, FAST_TANH=fast_tanh,
        COPY=copy is not None, PREFETCH=prefetch, num_warps=num_warps)
    return loss_rows, ce0_rows, grad, copy_grad


def transpose_copy(src: Tensor, use_triton: bool | None = None, block_m: int = 64, block_n: int = 128,
                   num_warps: int = 4) -> Tensor:
    """A contiguous copy of srcᵀ for a 2-D tensor with unit column stride (1- or 2-byte elements:
    the FP8 operands _scaled_mm wants K-major); tiled Triton kernel where use_triton (default: CUDA)."""
    if not (triton_applies(src) if use_triton is None else use_triton):
        return src.t().contiguous()
    M, N = src.shape
    if src.stride(1) != 1:
        raise ValueError("transpose_copy needs unit column stride")
    dst = torch.empty((N, M), dtype=src.dtype, device=src.device)
    _transpose_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        src, dst, M, N, src.stride(0), dst.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return dst


def _scale_tensor(value: float, device: torch.device) -> Tensor:
    """A 0-d float32 scale in its own allocation: cuBLASLt (CUDA 13) rejects scale pointers that
    are not 16-byte aligned, e.g. views into a shared buffer."""
    return torch.full((), value, dtype=torch.float32, device=device)


# The lm_head + loss as two custom ops (opaque to torch.compile): the forward computes the logits, runs the fused
# cross-entropy, which writes the logit gradient at once (the logits are freed), and the backward only multiplies the
# upstream scalar in and does the two products. FP8 (#19, #67; T4.4): e4m3 x and W inputs select it; logits = x8·W8ᵀ
# (fast accumulation), gradient e5m2, dx = g8·W8 and dW = g8ᵀ·x8 in FP8 with transposed copies for the K-major operands.
# With the copy pointer (T4.8) the forward also returns the loss's derivatives in p_copy and a_sink ((0, 2) without).
@torch.library.custom_op("speedrun::lm_head_softcap_ce", mutates_args=())
def _lm_head_softcap_ce_forward(x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, grad_scale: float,
                                copy_column: Tensor | None = None, p_copy: Tensor | None = None,
                                a_sink: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if x.dtype == torch.float8_e4m3fn:
        logits = torch._scaled_mm(x, w.t(), scale_a=_scale_tensor(FP8_X_SCALE, x.device),
                                  scale_b=_scale_tensor(FP8_W_SCALE, x.device), out_dtype=torch.bfloat16,
                                  use_fast_accum=True)
        grad_dtype, grad_mul = torch.float8_e5m2, 1 / FP8_GRAD_SCALE  # stores du/grad_s
    else:
        logits = x @ w.t()
        grad_dtype, grad_mul = logits.dtype, grad_scale
    copy = None if copy_column is None else (copy_column, p_copy, a_sink)
    loss_rows, ce0_rows, grad, copy_grad = softcap_ce(logits, targets, weights, grad_mul, grad_dtype, copy=copy)
    if copy_grad is None:
        copy_grad = loss_rows.new_zeros((0, 2))
    return loss_rows.sum() * grad_scale, ce0_rows.mean(), grad, copy_grad


@_lm_head_softcap_ce_forward.register_fake
def _(x, w, targets, weights, grad_scale, copy_column=None, p_copy=None, a_sink=None):
    fp8 = x.dtype == torch.float8_e4m3fn
    logits_dtype = torch.bfloat16 if fp8 else x.dtype
    loss_dtype = torch.promote_types(logits_dtype, torch.float32)
    grad = x.new_empty((x.size(0), w.size(0)), dtype=torch.float8_e5m2 if fp8 else logits_dtype)
    copy_grad = x.new_empty((0 if copy_column is None else x.size(0), 2), dtype=loss_dtype)
    return x.new_empty((), dtype=loss_dtype), x.new_empty((), dtype=loss_dtype), grad, copy_grad


@torch.library.custom_op("speedrun::lm_head_softcap_ce_backward", mutates_args=())
def _lm_head_softcap_ce_backward(g: Tensor, grad_logits: Tensor, x: Tensor, w: Tensor,
                                 grad_scale: float) -> tuple[Tensor, Tensor]:
    if grad_logits.dtype == torch.float8_e5m2:
        grad_s = (g.float() * (FP8_GRAD_SCALE * grad_scale)).reshape(())  # the upstream scalar, folded in
        grad_x = torch._scaled_mm(grad_logits, transpose_copy(w).t(), scale_a=grad_s,
                                  scale_b=_scale_tensor(FP8_W_SCALE, w.device), out_dtype=torch.bfloat16)
        grad_w = torch._scaled_mm(transpose_copy(grad_logits), transpose_copy(x).t(), scale_a=grad_s,
                                  scale_b=_scale_tensor(FP8_X_SCALE, x.device), out_dtype=torch.bfloat16)
        return grad_x, grad_w
    g = g.to(grad_logits.dtype)
    return (grad_logits @ w).mul_(g), (grad_logits.t() @ x).mul_(g)


@_lm_head_softcap_ce_backward.register_fake
def _(g, grad_logits, x, w, grad_scale):
    dtype = torch.bfloat16 if grad_logits.dtype == torch.float8_e5m2 else x.dtype
    return x.new_empty(x.shape, dtype=dtype), w.new_empty(w.shape, dtype=dtype)


def to_e4m3(t: Tensor, scale: Tensor | float) -> Tensor:
    """t / scale in e4m3, saturated at ±448 (scale broadcasts against t)."""
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


class _LMHeadSoftcapCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, grad_scale: float, fp8: bool,
                copy_column: Tensor | None, p_copy: Tensor | None, a_sink: Tensor | None):
        if fp8:  # quantized in the compiled graph, where inductor fuses the scale and cast
            x, w = to_e4m3(x, FP8_X_SCALE), to_e4m3(w, FP8_W_SCALE)
        loss, ce0_mean, grad_logits, copy_grad = _lm_head_softcap_ce_forward(x, w, targets, weights, grad_scale,
                                                                             copy_column, p_copy, a_sink)
        ctx.save_for_backward(x, w, grad_logits, copy_grad)
        ctx.grad_scale = grad_scale
        ctx.mark_non_differentiable(ce0_mean)
        return loss, ce0_mean

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce0: Tensor):
        x, w, grad_logits, copy_grad = ctx.saved_tensors
        grad_x, grad_w = _lm_head_softcap_ce_backward(grad_loss, grad_logits, x, w, ctx.grad_scale)
        grad_copy = [None, None]
        if copy_grad.numel():
            grad_copy = (copy_grad * (grad_loss * ctx.grad_scale)).unbind(1)
        return grad_x, grad_w, None, None, None, None, None, *grad_copy


def lm_head_softcap_ce(x: Tensor, lm_head: Tensor, targets: Tensor, weights: Tensor, grad_scale: float = 1.0,
                       fp8: bool = False, copy: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Training loss of the lm_head (V, d) on hidden states x (T, d): (Σ_t loss_t · grad_scale as a
    0-d fp32 tensor, mean ce0_t), with loss_t, ce0_t of softcap_ce_reference for targets (T, N ≤ 4)
    (−1: none) and weights (N,). fp8 applies on CUDA (needs T % 16 == 0); elsewhere the plain path. copy: the copy
    pointer's (<copy> column (1,), p_copy (T,), a_sink (T,)) (T4.8); the gradient reaches p_copy and a_sink."""
    fp8 = fp8 and x.is_cuda
    if fp8 and x.size(0) % 16:
        raise ValueError(f"the FP8 lm_head needs a multiple of 16 tokens, got {x.size(0)}")
    return _LMHeadSoftcapCE.apply(x.contiguous(), lm_head, targets, weights, grad_scale, fp8, *(copy or (None,) * 3))


# --- Sampled (shared-negative) soft-capped cross-entropy for training (#92, T4.6) ----------------------
# Over the stages whose budget is not 0, the training loss scores one forward's tokens against a shared set of
# candidate columns: every target of the forward and a sweep of negatives. The set is built on the device with static
# shapes (CUDA graphs, no host sync); the loss is lm_head_softcap_ce on the candidates' lm_head rows, so the fused
# kernel and the FP8 path run unchanged on a (tokens, budget) logit matrix. Validation always takes the full softmax.
GOLDEN_RATIO = (1 + 5 ** 0.5) / 2


def sweep_stride(vocab_size: int) -> tuple[int, int]:
    """(G, G⁻¹ mod V): the step through the vocabulary from one position of the negatives' sweep to the next, the
    integer nearest V/φ that is coprime with V (so j -> j·G mod V visits every token once, and a stretch of the sweep
    spreads over the whole id range: frequent low ids and rare high ones alike), and its inverse."""
    stride = round(vocab_size / GOLDEN_RATIO)
    while math.gcd(stride, vocab_size) != 1:
        stride += 1
    return stride, pow(stride, -1, vocab_size)


def candidate_set(targets: Tensor, vocab_size: int, budget: int, step: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate columns of one forward (T4.6): (candidates (budget,) token ids, each once; the targets (T, N) as
    indices into candidates, −1 where none; shortfall, 0-d: the distinct targets that did not fit). `step` is a 0-d
    tensor, so the set changes per step with no host sync, new shape or recompile. The n distinct targets take the
    first slots in token order, the other slots the non-targets in this step's sweep order, position j holding token
    ((s + j)·G) mod V (G: sweep_stride), s = step·⌊budget/4⌋ mod V: every token's slot is computed directly and one
    scatter writes each slot below the budget exactly once (no duplicates, no sort). While the targets take at most
    three quarters of the budget, any ⌈V / ⌊budget/4⌋⌉ consecutive steps cover the vocabulary. Targets beyond the
    budget are left out of the loss (−1) and counted in shortfall: the trainer stops at its next check."""
    V, device = vocab_size, targets.device
    stride, inverse = sweep_stride(V)
    tokens = torch.arange(V, device=device)
    is_target = torch.zeros(V + 1, dtype=torch.bool, device=device)  # row V: where the −1s land
    is_target = is_target.index_fill_(0, torch.where(targets >= 0, targets, V).flatten(), True)[:V]
    n_targets = is_target.sum()
    start = (step * (budget // 4)) % V
    swept = ((start + tokens) * stride) % V  # the token at each position of this step's sweep
    negative_rank = torch.cumsum(~is_target[swept], 0) - 1  # among the non-targets, in sweep order
    position = (tokens * inverse - start) % V  # each token's position in the sweep
    slot = torch.where(is_target, torch.cumsum(is_target, 0) - 1, n_targets + negative_rank[position])
    slot = slot.clamp_max(budget)
    candidates = torch.empty(budget + 1, dtype=torch.long, device=device).scatter_(0, slot, tokens)[:budget]
    target_slot = slot[targets.clamp_min(0)]
    candidate_targets = torch.where((targets >= 0) & (target_slot < budget), target_slot, -1)
    return candidates, candidate_targets, (n_targets - budget).clamp_min(0)


def sampled_softcap_ce_reference(x: Tensor, lm_head: Tensor, targets: Tensor, weights: Tensor, candidates: Tensor,
                                 grad_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """The sampled cross-entropy by its definition, for autograd: logits z = softcap(x·W[c]ᵀ) of the candidate rows c
    only, each target looked up among the candidates (none if absent), then (Σ_t Σ_k w_k·(lse_t − z_t[y_tk])·grad_scale,
    mean ce0_t) as lm_head_softcap_ce's. The gradient reaches x and, through the gather, W's candidate rows only."""
    z = softcap(x @ lm_head[candidates].t())
    slot_of = torch.full((lm_head.size(0),), -1, dtype=torch.long, device=x.device)
    slot_of[candidates] = torch.arange(candidates.numel(), device=x.device)
    slots = torch.where(targets >= 0, slot_of[targets.clamp_min(0)], -1)
    valid = slots >= 0
    ce = torch.logsumexp(z, -1, keepdim=True) - z.gather(1, slots.clamp_min(0))
    loss = (ce * weights.to(z.dtype) * valid).sum() * grad_scale
    return loss, torch.where(valid[:, 0], ce[:, 0], 0.0).mean().detach()


def sampled_lm_head_softcap_ce(x: Tensor, lm_head: Tensor, targets: Tensor, weights: Tensor, budget: int,
                               step: Tensor, grad_scale: float = 1.0, fp8: bool = False,
                               pointer: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """lm_head_softcap_ce against `budget` candidate columns (candidate_set's for `step`): the candidates' rows of the
    lm_head gathered (with fp8, the e4m3 weight's rows: the fixed-scale quantization commutes with the gather, so only
    the gathered rows are quantized), the fused kernel on the (T, budget) logits (its exponent sums already take the
    soft-cap's bound, 23, in place of a running maximum) with the targets remapped; the gradient reaches W's candidate
    rows only (autograd's scatter of the gather). (loss, mean ce0 over the candidates, shortfall). pointer: the copy
    pointer's (p_copy, a_sink) (T4.8); <copy> then joins the candidates as a target of its own (an extra column, row 0),
    the first one left out should the targets overflow the budget (the trainer stops at its shortfall)."""
    copy = None
    if pointer is not None:
        forced = torch.cat([targets.new_full((1,), COPY_TOKEN), targets.new_full((targets.size(0) - 1,), -1)])
        targets = torch.cat([targets, forced[:, None]], 1)
    candidates, candidate_targets, shortfall = candidate_set(targets, lm_head.size(0), budget, step)
    if pointer is not None:
        copy = (candidate_targets[0, -1:].clamp_min(0), *pointer)
        candidate_targets = candidate_targets[:, :-1]
    loss, ce0 = lm_head_softcap_ce(x, lm_head[candidates], candidate_targets, weights, grad_scale, fp8, copy)
    return loss, ce0, shortfall


# --- Copy pointer (PR #379 "CPLM", on record #92; T4.8) ----------------------------------------------------
# COPY_POINTER=1 mixes the next-token distribution with a pointer over the same document's last COPY_WINDOW tokens:
# p(y) = p_lm(y)·(1 − α·(1 − a_sink))/(1 − α) + α·p_copy(y), with α the softmax mass of the <copy> column (the
# vocabulary's first padding row: no new output parameters), p_copy(y) the pointer's attention mass on earlier positions
# holding token y, and a_sink its learned sink's mass (returned to the vocabulary). One head, COPY_HEAD_DIM wide, reads
# the final normed hidden state, as the lm_head does; its query (times a learned gain) and key are RMS-normed. Only the
# next-token term is the mixture; the multi-token and prefix terms stay plain cross-entropies over the same softmax.
COPY_TOKEN = 50257
COPY_HEAD_DIM = 128


def copy_pointer_reference(q: Tensor, k: Tensor, sink: Tensor, input_ids: Tensor, next_ids: Tensor, doc_ids: Tensor,
                           window: int) -> tuple[Tensor, Tensor]:
    """(p_copy, a_sink) (T,) by the definition, over the full (T, T) scores of the pointer's query and key (T,
    COPY_HEAD_DIM): position i attends to the j with i − window ≤ j < i in its document and to the sink; p_copy is the
    mass on the j with input_ids[j] = next_ids[i]."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.t()).to(wide) * COPY_HEAD_DIM ** -0.5
    i, j = torch.arange(q.size(0), device=q.device)[:, None], torch.arange(q.size(0), device=q.device)[None, :]
    valid = (j < i) & (i - j <= window) & (doc_ids[:, None] == doc_ids[None, :])
    sink_scores = (q.to(wide) @ sink.to(wide)) * COPY_HEAD_DIM ** -0.5
    lse = torch.logsumexp(torch.cat([scores.masked_fill(~valid, float("-inf")), sink_scores[:, None]], 1), 1)
    match = valid & (input_ids[None, :] == next_ids[:, None])
    return (torch.exp(scores - lse[:, None]) * match).sum(1), torch.exp(sink_scores - lse)


def copy_pointer_qk(x: Tensor, copy_qk: Tensor, gain: Tensor) -> tuple[Tensor, Tensor]:
    """The pointer's query and key (T, COPY_HEAD_DIM) in x's dtype: copy_qk (2, COPY_HEAD_DIM, d) holds W_q, W_k."""
    return norm(x @ copy_qk[0].t()) * gain.to(x.dtype), norm(x @ copy_qk[1].t())


def copy_pointer(x: Tensor, copy_qk: Tensor, gain: Tensor, sink: Tensor, input_ids: Tensor, next_ids: Tensor,
                 doc_ids: Tensor, window: int, use_triton: bool = False) -> tuple[Tensor, Tensor]:
    """The pointer's (p_copy, a_sink) (T,) fp32 on the final hidden states x: the Triton kernels where use_triton
    (CopyPointerKernel), else copy_pointer_blocked."""
    q, k = copy_pointer_qk(x, copy_qk, gain)
    if use_triton:
        return CopyPointerKernel.apply(q, k, sink, input_ids, next_ids, doc_ids, window)
    return copy_pointer_blocked(q, k, sink, input_ids, next_ids, doc_ids, window)


def copy_pointer_blocked(q: Tensor, k: Tensor, sink: Tensor, input_ids: Tensor, next_ids: Tensor, doc_ids: Tensor,
                         window: int) -> tuple[Tensor, Tensor]:
    """copy_pointer_reference in torch, in blocks of `window` queries (T where the window reaches further back), each
    against its own and the previous block's keys ((T/window)·window·2·window scores instead of T²): static shapes,
    one batched product."""
    T, B, device = q.size(0), min(window, q.size(0)), q.device
    blocks, pad = -(-T // B), -T % B

    def keys(t: Tensor, fill) -> Tensor:  # (blocks, 2B, ...): block b's keys, positions (b − 1)·B ... (b + 1)·B − 1
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (B, pad), value=fill).view(blocks + 1, B, *t.shape[1:])
        return torch.cat([t[:-1], t[1:]], 1)

    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (F.pad(q, (0, 0, 0, pad)).view(blocks, B, -1) @ keys(k, 0.0).transpose(1, 2)).to(wide)
    scores = scores * COPY_HEAD_DIM ** -0.5
    q_pos = torch.arange(blocks * B, device=device).view(blocks, B, 1)
    k_pos = ((torch.arange(blocks, device=device)[:, None] - 1) * B + torch.arange(2 * B, device=device))[:, None, :]
    q_doc, k_doc = F.pad(doc_ids, (0, pad), value=-2).view(blocks, B, 1), keys(doc_ids, -1)[:, None, :]
    valid = (k_pos < q_pos) & (q_pos - k_pos <= window) & (q_doc == k_doc)
    sink_scores = (q.to(wide) @ sink.to(wide)) * COPY_HEAD_DIM ** -0.5
    sink_scores = F.pad(sink_scores, (0, pad)).view(blocks, B, 1)
    # a finite fill (no NaN gradient where only the sink is valid), far below any score of normed q and k
    lse = torch.logaddexp(torch.logsumexp(scores.masked_fill(~valid, -1e9), 2, keepdim=True), sink_scores)
    match = valid & (F.pad(next_ids, (0, pad), value=-2).view(blocks, B, 1) == keys(input_ids, -1)[:, None, :])
    p_copy = (torch.exp(scores - lse) * match).sum(2)
    return p_copy.view(-1)[:T], torch.exp(sink_scores - lse).view(-1)[:T]


# The pointer as flash-style Triton kernels (T4.8; PR #379 fuses it the same way): a block of queries streams the key
# tiles of its window from its first row's document start on (tiles wholly in earlier documents are skipped; a key is in
# its query's document when it is at or after the query's document start) with an online softmax (the sink its first
# term), so no score matrix reaches memory. Backward:
# ∂loss/∂s_ij = P_ij·(dp_i·[input_j = next_i] − dmix_i), dmix_i = dp_i·p_copy_i + da_i·a_sink_i, recomputed per tile:
# dq by query blocks, dk by key blocks (no atomics); the sink's share (T × COPY_HEAD_DIM) in torch.
if triton is not None:
    @triton.jit
    def _copy_load_rows(ptr, rows, T, D: tl.constexpr, UPCAST: tl.constexpr):
        # rows of a contiguous (T, D) tensor, zeros past T (fp32 in the interpreter)
        t = tl.load(ptr + rows[:, None] * D + tl.arange(0, D)[None, :], mask=(rows < T)[:, None], other=0.0)
        return t.to(tl.float32) if UPCAST else t

    @triton.jit
    def _copy_scores(q, k, rows, keys, same_doc, window, scale):
        # a (query, key) tile's fp32 scores, −inf where the key is not among the query's last `window` positions of its
        # document (same_doc: whether the key is in the query's document, where it precedes the query)
        distance = rows[:, None] - keys[None, :]
        valid = (distance > 0) & (distance <= window) & same_doc
        return tl.where(valid, tl.dot(q, tl.trans(k)) * scale, float("-inf"))

    @triton.jit
    def _copy_query_block(q_ptr, next_ptr, doc_start_ptr, T, window, D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
        # this program's query rows: the rows, their queries, next tokens and document starts, and the first key tile
        # they read (the first row's window or document start, the later; tiles wholly in earlier documents skipped)
        first = tl.program_id(0) * BLOCK_M
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        start_q = tl.load(doc_start_ptr + rows, mask=row_ok, other=T)
        first_key = tl.maximum(first - window, tl.min(start_q, 0)) // BLOCK_N * BLOCK_N
        next_q = tl.load(next_ptr + rows, mask=row_ok, other=-3)
        return (rows, row_ok, _copy_load_rows(q_ptr, rows, T, D, UPCAST), next_q, start_q, first_key,
                tl.minimum(first + BLOCK_M - 1, T))

    @triton.jit
    def _copy_key_tile(q, k_ptr, ids_ptr, rows, start_q, next_q, start, T, window, scale, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
        # a query block's scores against the key tile at `start`, whether each key's token is the query's next, the keys
        keys = start + tl.arange(0, BLOCK_N)
        k = _copy_load_rows(k_ptr, keys, T, D, UPCAST)
        s = _copy_scores(q, k, rows, keys, keys[None, :] >= start_q[:, None], window, scale)
        return s, tl.load(ids_ptr + keys, mask=keys < T, other=-4)[None, :] == next_q[:, None], k

    @triton.jit
    def _copy_score_grad(s, match, lse, dp, dmix, dtype: tl.constexpr, UPCAST: tl.constexpr):
        # ∂loss/∂s of a tile, rounded to the operands' dtype for the next product (fp32 again in the interpreter)
        ds = tl.exp(s - lse[:, None]) * (tl.where(match, dp[:, None], 0.0) - dmix[:, None])
        ds = _to_dtype(ds, dtype, UPCAST)
        return ds.to(tl.float32) if UPCAST else ds

    @triton.jit
    def _copy_forward_kernel(q_ptr, k_ptr, sink_ptr, ids_ptr, next_ptr, doc_start_ptr, p_ptr, a_ptr, lse_ptr, T, window,
                             scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             UPCAST: tl.constexpr):
        rows, row_ok, q, next_q, start_q, first_key, last_key = _copy_query_block(
            q_ptr, next_ptr, doc_start_ptr, T, window, D, BLOCK_M, BLOCK_N, UPCAST)
        sink_score = tl.sum(q.to(tl.float32) * tl.load(sink_ptr + tl.arange(0, D))[None, :], 1) * scale
        m, total = sink_score, tl.full((BLOCK_M,), 1.0, tl.float32)  # the sink, the softmax's first term
        copied = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(first_key, last_key, BLOCK_N):
            s, match, _ = _copy_key_tile(q, k_ptr, ids_ptr, rows, start_q, next_q, start, T, window, scale, D, BLOCK_N,
                                         UPCAST)
            m_new = tl.maximum(m, tl.max(s, 1))
            rescale = tl.exp(m - m_new)
            e = tl.exp(s - m_new[:, None])
            total = total * rescale + tl.sum(e, 1)
            copied = copied * rescale + tl.sum(tl.where(match, e, 0.0), 1)
            m = m_new
        lse = m + tl.log(total)
        tl.store(p_ptr + rows, copied / total, mask=row_ok)
        tl.store(a_ptr + rows, tl.exp(sink_score - lse), mask=row_ok)
        tl.store(lse_ptr + rows, lse, mask=row_ok)

    @triton.jit
    def _copy_backward_query_kernel(q_ptr, k_ptr, ids_ptr, next_ptr, doc_start_ptr, lse_ptr, dp_ptr, dmix_ptr, dq_ptr,
                                    T, window, scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    UPCAST: tl.constexpr):
        rows, row_ok, q, next_q, start_q, first_key, last_key = _copy_query_block(
            q_ptr, next_ptr, doc_start_ptr, T, window, D, BLOCK_M, BLOCK_N, UPCAST)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        dp = tl.load(dp_ptr + rows, mask=row_ok, other=0.0)
        dmix = tl.load(dmix_ptr + rows, mask=row_ok, other=0.0)
        dq = tl.zeros((BLOCK_M, D), tl.float32)
        for start in range(first_key, last_key, BLOCK_N):
            s, match, k = _copy_key_tile(q, k_ptr, ids_ptr, rows, start_q, next_q, start, T, window, scale, D, BLOCK_N,
                                         UPCAST)
            dq = tl.dot(_copy_score_grad(s, match, lse, dp, dmix, k_ptr.dtype.element_ty, UPCAST), k, dq)
        tl.store(dq_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], dq * scale, mask=row_ok[:, None])

    @triton.jit
    def _copy_backward_key_kernel(q_ptr, k_ptr, ids_ptr, next_ptr, doc_end_ptr, lse_ptr, dp_ptr, dmix_ptr, dk_ptr, T,
                                  window, scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  UPCAST: tl.constexpr):
        first = tl.program_id(0) * BLOCK_N
        keys = first + tl.arange(0, BLOCK_N)
        key_ok = keys < T
        end_k = tl.load(doc_end_ptr + keys, mask=key_ok, other=0)
        token_k = tl.load(ids_ptr + keys, mask=key_ok, other=-4)
        k = _copy_load_rows(k_ptr, keys, T, D, UPCAST)
        dk = tl.zeros((BLOCK_N, D), tl.float32)
        # the queries that see these keys: first < i ≤ first + BLOCK_N − 1 + window, before the last key's document ends
        for start in range(first // BLOCK_M * BLOCK_M, tl.minimum(first + BLOCK_N + window, tl.max(end_k, 0)), BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < T
            q = _copy_load_rows(q_ptr, rows, T, D, UPCAST)
            s = _copy_scores(q, k, rows, keys, rows[:, None] < end_k[None, :], window, scale)
            match = token_k[None, :] == tl.load(next_ptr + rows, mask=row_ok, other=-3)[:, None]
            ds = _copy_score_grad(s, match, tl.load(lse_ptr + rows, mask=row_ok, other=0.0),
                                  tl.load(dp_ptr + rows, mask=row_ok, other=0.0),
                                  tl.load(dmix_ptr + rows, mask=row_ok, other=0.0), q_ptr.dtype.element_ty, UPCAST)
            dk = tl.dot(tl.trans(ds), q, dk)
        tl.store(dk_ptr + keys[:, None] * D + tl.arange(0, D)[None, :], dk * scale, mask=key_ok[:, None])


COPY_LAUNCH = {"forward": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
               "backward_query": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
               "backward_key": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)}


def _copy_launch(q: Tensor, kernel: str) -> tuple[int, dict]:
    if q.numel() >= 2**31:
        raise ValueError(f"the copy pointer's kernels index with int32: {q.size(0)} tokens are too many")
    config = dict(COPY_LAUNCH[kernel])
    block = config["BLOCK_N"] if kernel == "backward_key" else config["BLOCK_M"]
    return triton.cdiv(q.size(0), block), config


def document_bounds(doc_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(start, end) (T,) int32 of each position's document: its first position and the one after its last (document
    ids never decrease along a packed batch). int32, not searchsorted's int64: the kernels' key indices, loop bounds
    and masks derive from them and would all run in 64-bit arithmetic (T4.8)."""
    return (torch.searchsorted(doc_ids, doc_ids, out_int32=True),
            torch.searchsorted(doc_ids, doc_ids, right=True, out_int32=True))


@torch.library.custom_op("speedrun::copy_pointer_forward", mutates_args=())
def copy_pointer_forward(q: Tensor, k: Tensor, sink: Tensor, input_ids: Tensor, next_ids: Tensor, doc_start: Tensor,
                         window: int) -> tuple[Tensor, Tensor, Tensor]:
    """p_copy, a_sink and the normalizer lse (T,) fp32 of the pointer; q, k contiguous (T, COPY_HEAD_DIM), sink fp32,
    doc_start document_bounds'."""
    programs, config = _copy_launch(q, "forward")
    p_copy, a_sink, lse = (q.new_empty(q.size(0), dtype=torch.float32) for _ in range(3))
    _copy_forward_kernel[(programs,)](q, k, sink, input_ids, next_ids, doc_start, p_copy, a_sink, lse, q.size(0),
                                      window, COPY_HEAD_DIM ** -0.5, D=q.size(1), UPCAST=TRITON_INTERPRETER, **config)
    return p_copy, a_sink, lse


@copy_pointer_forward.register_fake
def _copy_pointer_forward_fake(q, k, sink, input_ids, next_ids, doc_start, window):
    return tuple(q.new_empty(q.size(0), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("speedrun::copy_pointer_backward", mutates_args=())
def copy_pointer_backward(q: Tensor, k: Tensor, input_ids: Tensor, next_ids: Tensor, doc_start: Tensor, doc_end: Tensor,
                          lse: Tensor, grad_p: Tensor, dmix: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """dq, dk (T, COPY_HEAD_DIM) fp32 through the pointer's scores, without the sink's share."""
    dq, dk = torch.empty_like(q, dtype=torch.float32), torch.empty_like(k, dtype=torch.float32)
    for kernel, fn, bound, out in (("backward_query", _copy_backward_query_kernel, doc_start, dq),
                                   ("backward_key", _copy_backward_key_kernel, doc_end, dk)):
        programs, config = _copy_launch(q, kernel)
        fn[(programs,)](q, k, input_ids, next_ids, bound, lse, grad_p, dmix, out, q.size(0), window,
                        COPY_HEAD_DIM ** -0.5, D=q.size(1), UPCAST=TRITON_INTERPRETER, **config)
    return dq, dk


@copy_pointer_backward.register_fake
def _copy_pointer_backward_fake(q, k, input_ids, next_ids, doc_start, doc_end, lse, grad_p, dmix, window):
    return torch.empty_like(q, dtype=torch.float32), torch.empty_like(k, dtype=torch.float32)


class CopyPointerKernel(torch.autograd.Function):
    """copy_pointer_reference's (p_copy, a_sink) with the Triton kernels."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, sink: Tensor, input_ids: Tensor, next_ids: Tensor, doc_ids: Tensor,
                window: int):
        q, k, sink32 = q.contiguous(), k.contiguous(), sink.float().contiguous()
        doc_start, doc_end = document_bounds(doc_ids)
        p_copy, a_sink, lse = copy_pointer_forward(q, k, sink32, input_ids, next_ids, doc_start, window)
        ctx.save_for_backward(q, k, sink32, input_ids, next_ids, doc_start, doc_end, p_copy, a_sink, lse)
        ctx.window, ctx.sink_dtype = window, sink.dtype
        return p_copy, a_sink

    @staticmethod
    def backward(ctx, grad_p: Tensor, grad_a: Tensor):
        q, k, sink32, input_ids, next_ids, doc_start, doc_end, p_copy, a_sink, lse = ctx.saved_tensors
        grad_p, grad_a = grad_p.float().contiguous(), grad_a.float()
        dmix = grad_p * p_copy + grad_a * a_sink
        dq, dk = copy_pointer_backward(q, k, input_ids, next_ids, doc_start, doc_end, lse, grad_p, dmix, ctx.window)
        grad_sink_score = a_sink * (grad_a - dmix) * COPY_HEAD_DIM ** -0.5  # the sink's score: a_sink·(da − dmix)
        dq = dq + grad_sink_score[:, None] * sink32
        dsink = grad_sink_score @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dsink.to(ctx.sink_dtype), None, None, None, None


# --- MLP: ReLU² with the activation in the GEMM (T6.1) ------------------------------------------------


def relu_square_mlp_reference(x: Tensor, fc: Tensor, proj: Tensor) -> Tensor:
    """The MLP, relu(x·fcᵀ)²·proj (#5), with fc (hidden, d) and proj (hidden, d) stored (in, out);
    also the model's choice where the step is launch-bound (stage 1), compiled by inductor."""
    return torch.relu(x @ fc.t()).square() @ proj

# Fused MLP up-projection + ReLU² (#59, #87; T6.1): one persistent TMA GEMM C = A·Bᵀ (A (M, K), B (N, K), both
# row-major bf16) with fp32 accumulation and the activation in the epilogue. Forward: post = relu(x·fcᵀ)², so the
# pre-activation never reaches memory. Backward: dpre = (grad·projᵀ)·2·√post, as √post = relu(pre). TMA zero-fills
# out-of-bounds loads and clips out-of-bounds stores, so ragged M, N, K need no masks.
if triton is not None:
    @triton.jit
    def _grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        # GROUP_M row blocks share each sweep over the column blocks (L2 reuse of both operands)
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        rows = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % rows, (tile % per_group) // rows

    @triton.jit
    def _relu_square_epilogue(c_desc, aux_desc, c8_desc, c8t_desc, amax_ptr, acc, m, n, aux_scale, inv_out_scale,
                              GRAD: tl.constexpr, OUT8_MAX: tl.constexpr):
        if GRAD:  # aux holds post (bf16, or e4m3 at aux_scale)
            acc = acc * (2.0 * tl.sqrt(aux_desc.load([m, n]).to(tl.float32) * aux_scale))
        else:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        if OUT8_MAX > 0:  # FP8 at the given scale, saturated, row-major and transposed; the running amax if asked
            q = tl.minimum(tl.maximum(acc * inv_out_scale, -OUT8_MAX), OUT8_MAX).to(c8_desc.dtype)
            c8_desc.store([m, n], q)
            c8t_desc.store([n, m], tl.trans(q))
            if amax_ptr is not None:
                tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(acc), 1), 0), sem="relaxed")
        else:
            c_desc.store([m, n], acc.to(tl.bfloat16))

    @triton.jit
    def _relu_square_gemm_kernel(a_desc, b_desc, c_desc, aux_desc, c8_desc, c8t_desc, scale_ptr, aux_scale_ptr,
                                 out_scale_ptr, amax_ptr, M, N, K, num_programs,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, GRAD: tl.constexpr,
                                 OUT8_MAX: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr, FLATTEN: tl.constexpr,
                                 UPCAST: tl.constexpr):
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        product_scale, aux_scale, inv_out_scale = 1.0, 1.0, 1.0
        if OUT8_MAX > 0:  # FP8 operands: the product's scale, aux's scale (GRAD), the FP8 output's inverse scale
            product_scale = tl.load(scale_ptr)
            inv_out_scale = 1.0 / tl.load(out_scale_ptr)
            if GRAD:
                aux_scale = tl.load(aux_scale_ptr)
        # the epilogue keeps its own tile counter, so the pipelined loads do not depend on the stores
        epilogue_tile = tl.program_id(0) - num_programs
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=FLATTEN):
            pid_m, pid_n = _grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
                b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, tl.trans(b), acc)
            if OUT8_MAX > 0:
                acc = acc * product_scale
            epilogue_tile += num_programs
            pid_m, pid_n = _grouped_tile(epilogue_tile, tiles_m, tiles_n, GROUP_M)
            m, n = pid_m * BLOCK_M, pid_n * BLOCK_N
            if SPLIT_EPILOGUE:  # two (BLOCK_M, BLOCK_N/2) halves: half the shared memory for C and aux
                left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                _relu_square_epilogue(c_desc, aux_desc, c8_desc, c8t_desc, amax_ptr, left, m, n, aux_scale,
                                      inv_out_scale, GRAD, OUT8_MAX)
                _relu_square_epilogue(c_desc, aux_desc, c8_desc, c8t_desc, amax_ptr, right, m, n + BLOCK_N // 2,
                                      aux_scale, inv_out_scale, GRAD, OUT8_MAX)
            else:
                _relu_square_epilogue(c_desc, aux_desc, c8_desc, c8t_desc, amax_ptr, acc, m, n, aux_scale,
                                      inv_out_scale, GRAD, OUT8_MAX)


@dataclass(frozen=True)
class GemmConfig:
    """Launch of _relu_square_gemm_kernel (bench/bench_mlp.py --sweep times the alternatives)."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    warps: int = 8
    group_m: int = 8
    persistent: bool = True  # one program per SM looping over the tiles, else one program per tile
    flatten: bool = True  # pipeline across tiles: the next tile's loads overlap this tile's epilogue
    split_epilogue: bool = True


RELU_SQUARE_GEMM_CONFIGS = {"relu_square": GemmConfig(), "relu_square_grad": GemmConfig(),
                            "relu_square_fp8": GemmConfig(block_k=128), "relu_square_grad_fp8": GemmConfig(block_k=128)}
# Each epilogue's constants: (GRAD: times 2·√aux, else ReLU²; OUT8_MAX: C in FP8 saturated there, in both layouts,
# else 0: C in bf16)
RELU_SQUARE_EPILOGUES = {"relu_square": (False, 0.0), "relu_square_grad": (True, 0.0),
                         "relu_square_fp8": (False, E4M3_MAX), "relu_square_grad_fp8": (True, E5M2_MAX)}


def _tma_ready(t: Tensor) -> bool:
    """Row-major from a 16-byte aligned address (TMA's requirement). torch.compile can trace neither
    data_ptr() nor storage_offset(): in a traced launch only the layout is judged here, and the
    descriptor built at run time asserts the address (TensorDescriptor: "base must be 16-byte aligned")."""
    if torch.compiler.is_compiling():
        return t.is_contiguous()
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _tma_operand(t: Tensor) -> Tensor:
    """t, or a copy of it that _tma_ready."""
    return t if _tma_ready(t) else t.clone(memory_format=torch.contiguous_format)


def relu_square_gemm(a: Tensor, b: Tensor, aux: Tensor | None = None, config: GemmConfig | None = None,
                     out: Tensor | None = None) -> Tensor:
    """Triton: relu(a·bᵀ)² when aux is None, else (a·bᵀ)·2·√aux; a (M, K), b (N, K), aux (M, N),
    all bf16, bf16 out (M, N). N and K must be multiples of 8 (16-byte TMA row strides)."""
    epilogue = "relu_square" if aux is None else "relu_square_grad"
    config = config or RELU_SQUARE_GEMM_CONFIGS[epilogue]
    (M, K), N = a.shape, b.size(0)
    tensors = [t for t in (a, b, aux, out) if t is not None]
    if b.size(1) != K or any(t.shape != (M, N) for t in (aux, out) if t is not None):
        raise ValueError(f"expected a (M, K), b (N, K), aux and out (M, N), got {[tuple(t.shape) for t in tensors]}")
    if N % 8 or K % 8:
        raise ValueError(f"N={N} and K={K} must be multiples of 8 (16-byte TMA row strides)")
    if any(t.dtype != torch.bfloat16 for t in tensors):
        raise ValueError(f"expected bf16 tensors, got {[t.dtype for t in tensors]}")
    if out is None:
        out = a.new_empty((M, N))
    elif not _tma_ready(out):
        raise ValueError("out must be contiguous from a 16-byte aligned address")
    _launch_relu_square_gemm(a, b, out, aux, None, None, None, None, None, None, epilogue, config)
    return out


def _check_fp8_gemm(a: Tensor, b: Tensor, a_dtype: torch.dtype, scales: tuple[Tensor, ...]):
    (M, K), N = a.shape, b.size(0)
    if b.size(1) != K or a.dtype != a_dtype or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected {a_dtype} a (M, K) and e4m3 b (N, K), got {a.dtype} {tuple(a.shape)}, "
                         f"{b.dtype} {tuple(b.shape)}")
    if M % 16 or N % 16 or K % 16:
        raise ValueError(f"M={M}, N={N} and K={K} must be multiples of 16 (16-byte TMA row strides of the output "
                         "in both layouts)")
    if any(s.numel() != 1 for s in scales):
        raise ValueError("the scales must be one-element tensors")


def relu_square_fp8_gemm(a: Tensor, b: Tensor, product_scale: Tensor, act_scale: Tensor,
                         config: GemmConfig | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Triton, e4m3 operands a (M, K) and b (N, K): post = relu(product_scale·a·bᵀ)² in e4m3 as
    min(post / act_scale, 448), (M, N) and transposed (N, M), and post's amax (fp32, shape (1,)):
    (post8, post8_t, amax). product_scale and act_scale are fp32 one-element tensors. M, N and K must be
    multiples of 16 (TMA row strides)."""
    _check_fp8_gemm(a, b, torch.float8_e4m3fn, (product_scale, act_scale))
    (M, _), N = a.shape, b.size(0)
    post8, post8_t = a.new_empty((M, N)), a.new_empty((N, M))
    amax = torch.zeros(1, dtype=torch.float32, device=a.device)
    _launch_relu_square_gemm(a, b, None, None, post8, post8_t, product_scale.float(), None, act_scale.float(), amax,
                             "relu_square_fp8", config or RELU_SQUARE_GEMM_CONFIGS["relu_square_fp8"])
    return post8, post8_t, amax


def relu_square_grad_fp8_gemm(grad8: Tensor, w8: Tensor, post8: Tensor, product_scale: Tensor, post_scale: Tensor,
                              out_scale: Tensor, config: GemmConfig | None = None,
                              amax: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Triton (T6.5): dpre = (product_scale·grad8·w8ᵀ)·2·√(post8·post_scale) in e5m2 as dpre / out_scale,
    saturated at ±57344, (M, N) and transposed (N, M), and with amax dpre's amax (the tests' exact check; the
    backward's scale is a bound); grad8 (M, K) e5m2, w8 (N, K) and post8 (M, N) e4m3, the scales fp32
    one-element tensors. M, N and K must be multiples of 16."""
    _check_fp8_gemm(grad8, w8, torch.float8_e5m2, (product_scale, post_scale, out_scale))
    (M, _), N = grad8.shape, w8.size(0)
    if post8.shape != (M, N) or post8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected e4m3 post8 {(M, N)}, got {post8.dtype} {tuple(post8.shape)}")
    dpre8, dpre8_t = grad8.new_empty((M, N)), grad8.new_empty((N, M))
    dpre_amax = torch.zeros(1, dtype=torch.float32, device=grad8.device) if amax else None
    _launch_relu_square_gemm(grad8, w8, None, post8, dpre8, dpre8_t, product_scale.float(), post_scale.float(),
                             out_scale.float(), dpre_amax, "relu_square_grad_fp8",
                             config or RELU_SQUARE_GEMM_CONFIGS["relu_square_grad_fp8"])
    return dpre8, dpre8_t, dpre_amax


def _launch_relu_square_gemm(a, b, out, aux, out8, out8_t, scale, aux_scale, out_scale, amax, epilogue, config):
    """out: the bf16 output (M, N), or None where the epilogue writes FP8 (out8 (M, N) and out8_t (N, M))."""
    c_block = [config.block_m, config.block_n // 2 if config.split_epilogue else config.block_n]
    a_desc = TensorDescriptor.from_tensor(_tma_operand(a), [config.block_m, config.block_k])
    b_desc = TensorDescriptor.from_tensor(_tma_operand(b), [config.block_n, config.block_k])
    aux_desc = None if aux is None else TensorDescriptor.from_tensor(_tma_operand(aux), c_block)
    out_desc, out8_desc, out8_t_desc = (None if t is None else TensorDescriptor.from_tensor(t, block)
                                        for t, block in ((out, c_block), (out8, c_block), (out8_t, c_block[::-1])))
    M, N = (out if out is not None else out8).shape
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    # persistent: one program per SM (a few on the CPU interpreter, so each still loops over tiles)
    slots = _sm_count(a.device) if a.is_cuda else 4
    programs = min(tiles, slots) if config.persistent else tiles
    grad, out8_max = RELU_SQUARE_EPILOGUES[epilogue]
    _relu_square_gemm_kernel[(programs,)](
        a_desc, b_desc, out_desc, aux_desc, out8_desc, out8_t_desc, scale, aux_scale, out_scale, amax,
        M, N, a.size(1), programs,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        GRAD=grad, OUT8_MAX=out8_max, SPLIT_EPILOGUE=config.split_epilogue,
        FLATTEN=config.flatten, UPCAST=TRITON_INTERPRETER, num_warps=config.warps, num_stages=config.stages)


def tma_gemm_applies(t: Tensor) -> bool:
    """Where relu_square_gemm can run: triton_applies and a GPU with TMA (Hopper or newer)."""
    return triton_applies(t) and torch.cuda.get_device_capability(t.device)[0] >= 9


# The two GEMMs. torch.compile traces the Triton launches (TMA descriptors too) into its graph and inductor launches the
# kernels itself, sparing a custom op's per-call Python host time (T6.1). use_triton=False: the products in torch.
def relu_square_matmul(x: Tensor, w: Tensor, use_triton: bool) -> Tensor:
    """post = relu(x·wᵀ)², x (M, K), w (N, K)."""
    if use_triton:
        return relu_square_gemm(x, w)
    return torch.relu(x @ w.t()).square()


def relu_square_grad_matmul(grad: Tensor, w: Tensor, post: Tensor, use_triton: bool) -> Tensor:
    """dpre = (grad·wᵀ)·2·√post, grad (M, K), w (N, K), post (M, N)."""
    if use_triton:
        return relu_square_gemm(grad, w, post)
    return (grad @ w.t()) * (2 * post.sqrt())


class ReluSquareMLP(torch.autograd.Function):
    """relu_square_mlp_reference's function saving x and post only: the backward's first GEMM
    produces dpre directly (dpre = (grad·projᵀ)·2·√post, as √post = relu(pre)), the other three are cuBLAS."""

    @staticmethod
    def forward(ctx, x: Tensor, fc: Tensor, proj: Tensor, use_triton: bool):
        post = relu_square_matmul(x, fc, use_triton)
        ctx.save_for_backward(x, fc, proj, post)
        ctx.use_triton = use_triton
        return post @ proj

    @staticmethod
    def backward(ctx, grad: Tensor):
        return *relu_square_mlp_backward(grad, *ctx.saved_tensors, ctx.use_triton), None


def relu_square_mlp_backward(grad: Tensor, x: Tensor, fc: Tensor, proj: Tensor, post: Tensor,
                             use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dfc, dproj) of the ReLU² MLP from x and post alone (ReluSquareMLP's backward)."""
    dpre = relu_square_grad_matmul(grad, proj, post, use_triton)
    return dpre @ fc, dpre.t() @ x, post.t() @ grad


def relu_square_mlp(x: Tensor, fc: Tensor, proj: Tensor, use_triton: bool) -> Tensor:
    """The fused MLP: relu_square_mlp_reference's function with the ReLU² in the GEMM epilogues
    where use_triton (tma_gemm_applies says where they run), else the same products in torch."""
    return ReluSquareMLP.apply(x, fc, proj, use_triton)


# --- FP8 MLP forward (the reference's #84, #89; T6.2) -------------------------------------------------
# The training forward's two MLP products in e4m3 with fp32 accumulation (the backward's: T6.5 below). Tensorwise
# scales: x, RMS-normalized without weights so that no element exceeds √d, at the
# static scale √d/448 (no amax pass); each layer's fc and proj by their amax per forward (one pass over the bank: the
# weights change only at optimizer steps); post by a delayed scale, the layer's previous amax of post times
# FP8_POST_MARGIN (post's amax is known only once the GEMM that writes it is done); values above it clamp to 448.
FP8_POST_MARGIN = 1.8


def quantize_e4m3(t: Tensor, amax: Tensor | float) -> tuple[Tensor, Tensor | float]:
    """(t / scale in e4m3, scale), scale = amax / 448 in fp32 (amax broadcasts against t)."""
    scale = amax.float().clamp_min(1e-12) / E4M3_MAX if isinstance(amax, Tensor) else amax / E4M3_MAX
    return to_e4m3(t, scale), scale


def quantize_normed_e4m3(x: Tensor) -> tuple[Tensor, float]:
    """quantize_e4m3 of an RMS-normalized x (no weights): its elements are bounded by √d."""
    return quantize_e4m3(x, x.size(-1) ** 0.5)


@dataclass
class MLPBankFP8:
    """The MLP bank (L, 2, hidden, d), one entry per MLP slot, in e4m3, each slot's fc and proj with its own scale,
    once per forward in both layouts the products read."""
    fc: Tensor  # (L, hidden, d)
    proj_t: Tensor  # (L, d, hidden): proj transposed, so proj_t[i].t() is the column-major operand cuBLAS takes
    scales: Tensor  # (L, 2, 4) fp32: [i, 0, 0] fc's, [i, 1, 0] proj's; 16 bytes apart, as cuBLASLt wants
    proj: Tensor  # (L, hidden, d): the backward's dpre GEMM reads it row-major (a view, T6.5)
    fc_t: Tensor  # (L, d, hidden): fc transposed, dx's column-major operand in the backward (T6.5)

    @classmethod
    def quantize(cls, bank: Tensor) -> "MLPBankFP8":
        bank = bank.detach()
        q, scale = quantize_e4m3(bank, bank.abs().amax(dim=(2, 3), keepdim=True))
        return cls(q[:, 0], q[:, 1].transpose(1, 2).contiguous(), F.pad(scale.view(-1, 2, 1), (0, 3)), q[:, 1],
                   q[:, 0].transpose(1, 2).contiguous())


def fp8_relu_square_mlp_reference(x: Tensor, fc: Tensor, proj: Tensor, post_scale: Tensor) -> tuple[Tensor, Tensor]:
    """(out, amax of post): the FP8 MLP forward's arithmetic in fp32 on the e4m3 values; x RMS-normalized."""
    x8, x_scale = quantize_normed_e4m3(x)
    fc8, fc_scale = quantize_e4m3(fc, fc.abs().amax())
    proj8, proj_scale = quantize_e4m3(proj, proj.abs().amax())
    post = torch.relu((x8.float() @ fc8.float().t()) * (x_scale * fc_scale)).square()
    post8 = (post / post_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    out = (post8.float() @ proj8.float()) * (post_scale * proj_scale)
    return out.bfloat16(), post.amax().view(1)


# The down-projection as a custom op: inductor's own lowering of _scaled_mm rejects the per-layer
# scale views. The up-projection's Triton launch is traced, as relu_square_matmul's.
@torch.library.custom_op("speedrun::fp8_down_projection", mutates_args=())
def fp8_down_projection(post8: Tensor, post_scale: Tensor, proj8_t: Tensor, proj_scale: Tensor) -> Tensor:
    """post8·proj in bf16: post8 (M, hidden) e4m3 at post_scale, proj transposed (d, hidden) in e4m3 at proj_scale."""
    return torch._scaled_mm(post8, proj8_t.t(), scale_a=post_scale, scale_b=proj_scale,
                            out_dtype=torch.bfloat16, use_fast_accum=True)


@fp8_down_projection.register_fake
def _fp8_down_projection_fake(post8, post_scale, proj8_t, proj_scale):
    return post8.new_empty((post8.size(0), proj8_t.size(0)), dtype=torch.bfloat16)


# --- FP8 MLP backward (record #92, modded-nanogpt PR #360; T6.5) ----------------------------------------
# The MLP's four backward products from FP8 operands (fp32 accumulation, bf16 results): gradients in
# e5m2, activations and weights in e4m3, each written in the layouts its products read by the kernel that makes it,
# one tensorwise scale each:
#   x: the forward's e4m3 x (static √d/448, T6.2), saved transposed (dW_fc's operand) instead of the bf16 x.
#   post: the forward's own e4m3 post (its delayed scale, T6.2), written row-major and transposed by the up-projection's
#     epilogue (no bf16 post): dW_proj then multiplies exactly the post the forward multiplied, and dpre's √post is
#     √(post8·scale) (e4m3's rounding: ≤ 3.1 % per element).
#   grad (T, d): its amax, one reduction before the first GEMM (grad has no a-priori bound): it cannot clip.
#   dpre = (grad·projᵀ)·2√post: written in e5m2 by the dpre GEMM's epilogue, row-major (dx's) and transposed
#     (dW_fc's), so its scale must exist before that GEMM: a bound, which cannot clip. |grad8·proj8ᵀ| ≤ K·amax(grad)
#     ·amax(proj) (each dequantized value is at most its tensor's amax) and √(post8·scale) ≤ √(448·scale); times
#     FP8_BACKWARD_MARGIN for the accumulator's rounding. Loose by K and more: a few of e5m2's ~31 binades.
# The weights come in both layouts from MLPBankFP8. cuBLASLt takes the first operand row-major and the second
# column-major (both K-contiguous).
FP8_BACKWARD_MARGIN = 2.0


def to_e5m2(t: Tensor, scale: Tensor | float) -> Tensor:
    """t / scale in e5m2, saturated at ±57344 (scale broadcasts against t)."""
    return (t.float() / scale).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def fp8_mlp_backward_scales(grad_amax: Tensor, post_scale: Tensor, proj_scale: Tensor,
                            K: int) -> tuple[Tensor, Tensor]:
    """(grad's, dpre's) fp32 scales of the FP8 backward (see above): grad's amax and dpre's bound map to 57344."""
    grad_scale = grad_amax.float().clamp_min(1e-30) / E5M2_MAX
    dpre_bound = (FP8_BACKWARD_MARGIN * 2 * (E4M3_MAX * post_scale.float()).sqrt()
                  * (K * grad_amax.float() * (E4M3_MAX * proj_scale.float())))
    return grad_scale, dpre_bound.clamp_min(1e-30) / E5M2_MAX


def fp8_relu_square_mlp_backward_reference(grad: Tensor, x: Tensor, fc: Tensor, proj: Tensor,
                                           post_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dfc, dproj) in bf16: the FP8 backward's arithmetic in fp32 on the dequantized FP8 values (CPU or GPU),
    the forward's e4m3 post recomputed; x RMS-normalized, post_scale the forward's."""
    bank8 = MLPBankFP8.quantize(torch.stack([fc, proj])[None])
    fc_scale, proj_scale = bank8.scales[0, 0, 0], bank8.scales[0, 1, 0]
    x8, x_scale = quantize_normed_e4m3(x)
    x_q, fc_q, proj_q = x8.float() * x_scale, bank8.fc[0].float() * fc_scale, bank8.proj[0].float() * proj_scale
    post = torch.relu(x_q @ fc_q.t()).square()
    post_q = (post / post_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float() * post_scale
    grad_scale, dpre_scale = fp8_mlp_backward_scales(grad.abs().amax(), post_scale, proj_scale, grad.size(1))
    grad_q = to_e5m2(grad, grad_scale).float() * grad_scale
    dpre = (grad_q @ proj_q.t()) * (2 * post_q.sqrt())
    dpre_q = to_e5m2(dpre, dpre_scale).float() * dpre_scale
    return (dpre_q @ fc_q).bfloat16(), (dpre_q.t() @ x_q).bfloat16(), (post_q.t() @ grad_q).bfloat16()


# dx, dW_fc and dW_proj as one custom op, for the reason fp8_down_projection is one; no fast accumulation
# (K = T for the weight gradients).
@torch.library.custom_op("speedrun::fp8_mlp_backward_products", mutates_args=())
def fp8_mlp_backward_products(dpre8: Tensor, dpre8_t: Tensor, fc8_t: Tensor, x8_t: Tensor, post8_t: Tensor,
                              grad8_t: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dfc, dproj) in bf16 = (dpre8·fc8, dpre8ᵀ·x8, post8ᵀ·grad8) × their scales: dpre8 (T, hidden) and dpre8_t
    (hidden, T) e5m2, fc8_t (d, hidden), x8_t (d, T), post8_t (hidden, T) e4m3, grad8_t (d, T) e5m2; scales (4, 4)
    fp32, [i, 0] the three products' scales and 1, 16 bytes apart."""
    def product(a: Tensor, b_t: Tensor, i: int) -> Tensor:
        return torch._scaled_mm(a, b_t.t(), scale_a=scales[3, 0], scale_b=scales[i, 0], out_dtype=torch.bfloat16)
    return product(dpre8, fc8_t, 0), product(dpre8_t, x8_t, 1), product(post8_t, grad8_t, 2)


@fp8_mlp_backward_products.register_fake
def _fp8_mlp_backward_products_fake(dpre8, dpre8_t, fc8_t, x8_t, post8_t, grad8_t, scales):
    (T, hidden), d = dpre8.shape, fc8_t.size(0)
    return (dpre8.new_empty((T, d), dtype=torch.bfloat16), dpre8.new_empty((hidden, d), dtype=torch.bfloat16),
            dpre8.new_empty((hidden, d), dtype=torch.bfloat16))


def fp8_relu_square_mlp_backward(grad: Tensor, x8_t: Tensor, x_scale: float, post8: Tensor, post8_t: Tensor,
                                 post_scale: Tensor, proj8: Tensor, fc8_t: Tensor, fc_scale: Tensor,
                                 proj_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dfc, dproj): fp8_relu_square_mlp_backward_reference's arithmetic on the GPU, from the forward's e4m3 x
    (transposed, and its scale) and post (both layouts) and the layer's e4m3 weights."""
    grad_amax = grad.abs().amax()
    grad_scale, dpre_scale = fp8_mlp_backward_scales(grad_amax, post_scale, proj_scale, grad.size(1))
    grad8 = to_e5m2(grad, grad_scale)
    dpre8, dpre8_t, _ = relu_square_grad_fp8_gemm(grad8, proj8, post8, grad_scale * proj_scale, post_scale,
                                                  dpre_scale)
    scales = torch.stack([dpre_scale * fc_scale, dpre_scale * x_scale, post_scale * grad_scale,
                          torch.ones_like(dpre_scale)]).view(4, 1)
    return fp8_mlp_backward_products(dpre8, dpre8_t, fc8_t, x8_t, post8_t, grad8.t().contiguous(),
                                     F.pad(scales, (0, 3)))


class FP8ReluSquareMLP(torch.autograd.Function):
    """relu_square_mlp's function with the e4m3 forward (T6.2) and the FP8 backward (T6.5): saves x8 transposed,
    post8 in both layouts and the e4m3 weights it reads (no bf16 x, post, fc or proj)."""

    @staticmethod
    def forward(ctx, x: Tensor, fc: Tensor, proj: Tensor, fc8: Tensor, proj8_t: Tensor, fc_scale: Tensor,
                proj_scale: Tensor, post_scale: Tensor, proj8: Tensor, fc8_t: Tensor):
        x8, x_scale = quantize_normed_e4m3(x)
        post8, post8_t, amax = relu_square_fp8_gemm(x8, fc8, x_scale * fc_scale, post_scale)
        out = fp8_down_projection(post8, post_scale, proj8_t, proj_scale)
        # post_scale is the layer's buffer, refreshed after this forward: the backward keeps this forward's
        ctx.save_for_backward(x8.t().contiguous(), post8, post8_t, post_scale.clone(), proj8, fc8_t, fc_scale,
                              proj_scale)
        ctx.x_scale = x_scale
        ctx.mark_non_differentiable(amax)
        return out, amax

    @staticmethod
    def backward(ctx, grad: Tensor, _amax_grad):
        x8_t, *rest = ctx.saved_tensors
        return *fp8_relu_square_mlp_backward(grad, x8_t, ctx.x_scale, *rest), *[None] * 7


def fp8_relu_square_mlp(x: Tensor, fc: Tensor, proj: Tensor, bank8: MLPBankFP8, slot: int,
                        post_scale: Tensor) -> tuple[Tensor, Tensor]:
    """(out, amax of post) of the MLP in bank slot `slot` in FP8 forward and backward; x RMS-normalized (norm), its
    token count a multiple of 16; fc and proj the bf16 weights the gradients reach; post_scale a one-element fp32
    tensor of its own (16-byte aligned)."""
    return FP8ReluSquareMLP.apply(x, fc, proj, bank8.fc[slot], bank8.proj_t[slot], bank8.scales[slot, 0, 0],
                                  bank8.scales[slot, 1, 0], post_scale, bank8.proj[slot], bank8.fc_t[slot])


# --- FP8 Q/K/V projections (T6.3) ----------------------------------------------------------------------
# The attention input is RMS-normalized, so it takes the MLP's static e4m3 scale; each layer's Q, K and V rows are
# quantized once per forward with one scale per layer. cuBLAS multiplies (fast accumulation, as the lm_head's
# forward); the backward is the bf16 product's, from the bf16 input and weight it saves.
@dataclass
class QKVBankFP8:
    """Each attention slot's Q, K, V weights in e4m3, (2·H·w + d, d) for Q/K heads w wide ((3d, d) unless
    narrow, T3.18), and their scales (0-d fp32), indexed by attention slot."""
    weights: tuple[Tensor, ...]
    scales: tuple[Tensor, ...]

    @classmethod
    def quantize(cls, qk_banks: list[tuple[Tensor, list[int]]], vo_bank: Tensor) -> "QKVBankFP8":
        """From GPT.qk_banks() and vo_bank: a quantization per Q/K bank with its slots' V matrices, a scale per slot."""
        d = vo_bank.size(-1)
        values = vo_bank.detach().view(-1, 2, d, d)[:, 0]  # each attention slot's V
        weights, scales = [None] * values.size(0), [None] * values.size(0)
        for matrices, slots in qk_banks:
            w = torch.cat([matrices.detach().view(len(slots), -1, d), bank_slots(values, slots)], 1)
            w8, scale = quantize_e4m3(w, w.abs().amax(dim=(1, 2), keepdim=True))
            for slot, slot_w8, slot_scale in zip(slots, w8.unbind(0), scale.view(len(slots)).unbind(0)):
                weights[slot], scales[slot] = slot_w8, slot_scale
        return cls(tuple(weights), tuple(scales))


def bank_slots(matrices: Tensor, indices: list[int]) -> Tensor:
    """matrices[indices] for a Python list of indices: the tensor itself where it is all of them in order, else a
    stack of views (a list index would copy the indices from the host, which a CUDA graph capture refuses)."""
    if indices == list(range(matrices.size(0))):
        return matrices
    return torch.stack([matrices[i] for i in indices])


def fp8_normed_linear_reference(x: Tensor, w8: Tensor, w_scale: Tensor) -> Tensor:
    """fp8_normed_linear's forward in fp32 on the e4m3 values: x RMS-normalized, w ≈ w8·w_scale."""
    x8, x_scale = quantize_normed_e4m3(x)
    return ((x8.float() @ w8.float().t()) * (x_scale * w_scale)).bfloat16()


class FP8NormedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, w8: Tensor, w_scale: Tensor):
        x8, x_scale = quantize_normed_e4m3(x)
        ctx.save_for_backward(x, w)
        one = torch.ones((), dtype=torch.float32, device=x.device)
        return torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=(w_scale * x_scale).float().reshape(()),
                                out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x, None, None


def fp8_normed_linear(x: Tensor, w: Tensor, w8: Tensor, w_scale: Tensor) -> Tensor:
    """x @ wᵀ (bf16) for an RMS-normalized x (T, d): forward in e4m3 (w8 ≈ w / w_scale, 0-d fp32), bf16 gradients."""
    return FP8NormedLinear.apply(x, w, w8, w_scale)


# --- QK-norm + rotary (T6.4) --------------------------------------------------------------------------
# What each attention layer does between its Q/K/V projection and attend: QK-norm (T3.2), half-truncated rotary
# (T3.9), the key offset (T3.11), the softmax scale into q, the extra value input (T3.3, T3.14) and the paired heads'
# doubled sequence (T3.10), as Triton kernels that read the projection once and write q, k, v once (inductor spreads
# it over several); the backward writes the projection's whole gradient, dv included (so v passes through them too).
def qk_norm_rope_reference(qkv: Tensor, v_extra: Tensor | None, cos: Tensor, sin: Tensor, scale: Tensor,
                           heads: int, qk_head_dim: int, paired: bool,
                           key_offset: bool) -> tuple[Tensor, Tensor, Tensor]:
    """attend's q, k, v from the projection qkv (T, heads·(2·qk_head_dim + hd)): q and k (qk_head_dim wide: hd, or hd/2
    on narrow layers, T3.18) RMS-normalized per head, rotated by cos, sin (attention_layout's tables: (T, 1, hd/4), or
    (T, 2, 1, hd/4) for paired heads; apply_rope says which dimensions turn), the keys' stationary half from the
    previous position where key_offset, q times the softmax scale (0-d), v plus v_extra (T, heads, hd) where given.
    Shaped (T, heads, ·), or (2T, heads/2, ·) if paired: heads h and h + heads/2 of token t at 2t and 2t + 1 (#58)."""
    T, H, qk_hd = qkv.size(0), heads, qk_head_dim
    hd = qkv.size(1) // H - 2 * qk_hd
    q, k, v = (t.view(T, H, -1) for t in qkv.split([H * qk_hd, H * qk_hd, H * hd], dim=1))
    q, k = norm(q), norm(k)  # QK-norm
    if v_extra is not None:
        v = v + v_extra
    if paired:  # rotated as (T, 2, H/2, ·) views of the projection (plain strides), then interleaved
        q, k = (apply_rope(t.view(T, 2, H // 2, qk_hd), cos, sin) for t in (q, k))
        q, k, v = (t.reshape(2 * T, H // 2, -1) for t in (q, k, v))
    else:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if key_offset:
        k = shift_key_half(k)
    return (q * scale).to(v.dtype), k, v


# The kernels work on head rows: row n = t·H + h is head h of token t. Its q and k (HD wide) are at qkv[t, h·HD:] and
# H·HD further, its v (VD wide: HD, or 2·HD on narrow layers, T3.18) at qkv[t, 2·H·HD + h·VD:], and it is row n of the
# outputs, (T·H, HD) and (T·H, VD) row-major, which is attend's (T, H, ·) and, for paired heads, (2T, H/2, ·): head n
# % (H/2) at position n // (H/2) of the doubled sequence. So row n rotates its first 2·PAIRS dimensions at position n
# // SEQ_HEADS (H/2 with paired heads, else H) and its key offset takes the stationary half of row n − SEQ_HEADS (its
# own at the first position). The backward recomputes the norms from the projection, which it saves.
if triton is not None:
    @triton.jit
    def _projection_rows(rows, H: tl.constexpr, HD: tl.constexpr, VD: tl.constexpr):
        # offsets of the head rows' q in the projection (T, H·(2·HD + VD)), and of their v
        token = (rows // H).to(tl.int64) * (H * (2 * HD + VD))
        return token + (rows % H) * HD, token + 2 * H * HD + (rows % H) * VD

    @triton.jit
    def _rope_tables(cos_ptr, sin_ptr, rows, live, SEQ_HEADS: tl.constexpr, HD: tl.constexpr, PAIRS: tl.constexpr):
        # cos and sin per pair (2i, 2i + 1) at each row's position; the stationary pairs turn by 0. Loaded 4
        # pairs a thread, the layout that _rotate's split gives the pairs (8 values a thread), so the
        # tables need no move through shared memory (and no barrier) to meet them.
        pairs = tl.max_contiguous(tl.arange(0, HD // 2), 4)
        at = (rows // SEQ_HEADS)[:, None] * PAIRS + pairs[None, :]
        turning = live[:, None] & (pairs < PAIRS)[None, :]
        cos = tl.load(cos_ptr + at, mask=turning, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + at, mask=turning, other=0.0).to(tl.float32)
        return cos, sin

    @triton.jit
    def _rotate(x, cos, sin, BLOCK: tl.constexpr, HD: tl.constexpr):
        # pairs (a, b) = (x[2i], x[2i + 1]) -> (a·cos + b·sin, b·cos − a·sin), as apply_rope
        a, b = tl.split(tl.reshape(x, (BLOCK, HD // 2, 2)))
        return tl.reshape(tl.join(a * cos + b * sin, b * cos - a * sin), (BLOCK, HD))

    @triton.jit
    def _reciprocal_rms(x, EPS: tl.constexpr, HD: tl.constexpr):
        # F.rms_norm's 1 / sqrt(mean(x²) + eps) per row, (BLOCK, 1); its default eps for bf16 and fp32
        # inputs is that of its fp32 arithmetic
        return tl.rsqrt(tl.sum(x * x, 1) / HD + EPS)[:, None]

    @triton.jit
    def _normed(ptrs, live, EPS: tl.constexpr, HD: tl.constexpr):
        x = tl.load(ptrs, mask=live[:, None], other=0.0).to(tl.float32)
        return x * _reciprocal_rms(x, EPS, HD)

    @triton.jit
    def _normed_rotated_grad(x, grad, cos, sin, EPS: tl.constexpr, BLOCK: tl.constexpr, HD: tl.constexpr):
        # the gradient of the projection's rows x from that of rotate(norm(x)): the rotation by −angle,
        # then RMSNorm's backward r·(g − n·mean(g·n)), n = r·x, r = 1/rms(x), as r·g − x·r³·mean(g·x): its
        # two sums independent, so their reductions overlap
        grad = _rotate(grad, cos, -sin, BLOCK, HD)
        reciprocal_rms = _reciprocal_rms(x, EPS, HD)
        grad_dot_x = (tl.sum(grad * x, 1) / HD)[:, None]
        return reciprocal_rms * grad - x * (reciprocal_rms * reciprocal_rms * reciprocal_rms * grad_dot_x)

    @triton.jit
    def _program_rows(cos_ptr, sin_ptr, n_rows, H: tl.constexpr, HD: tl.constexpr, VD: tl.constexpr,
                      PAIRS: tl.constexpr, SEQ_HEADS: tl.constexpr, BLOCK: tl.constexpr):
        # this program's head rows, which are live, the q/k columns, the rows' q in the projection and in
        # the q/k outputs, their v in the projection and in the v output, and their rotation tables
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = rows < n_rows
        cols, v_cols = tl.arange(0, HD)[None, :], tl.arange(0, VD)[None, :]
        source, v_source = _projection_rows(rows, H, HD, VD)
        out, v_out = rows.to(tl.int64)[:, None] * HD + cols, rows.to(tl.int64)[:, None] * VD + v_cols
        cos, sin = _rope_tables(cos_ptr, sin_ptr, rows, live, SEQ_HEADS, HD, PAIRS)
        return rows, live, cols, source[:, None] + cols, out, v_source[:, None] + v_cols, v_out, cos, sin

    @triton.jit
    def _qk_norm_rope_forward_kernel(qkv_ptr, v_extra_ptr, cos_ptr, sin_ptr, scale_ptr, q_ptr, k_ptr, v_ptr, n_rows,
                                     H: tl.constexpr, HD: tl.constexpr, VD: tl.constexpr, PAIRS: tl.constexpr,
                                     SEQ_HEADS: tl.constexpr, KEY_OFFSET: tl.constexpr, EPS: tl.constexpr,
                                     BLOCK: tl.constexpr):
        rows, live, cols, source, out, v_source, v_out, cos, sin = _program_rows(cos_ptr, sin_ptr, n_rows, H, HD, VD,
                                                                                 PAIRS, SEQ_HEADS, BLOCK)
        q = _rotate(_normed(qkv_ptr + source, live, EPS, HD), cos, sin, BLOCK, HD) * tl.load(scale_ptr)
        tl.store(q_ptr + out, q.to(q_ptr.dtype.element_ty), mask=live[:, None])
        k = _rotate(_normed(qkv_ptr + H * HD + source, live, EPS, HD), cos, sin, BLOCK, HD)
        if KEY_OFFSET:  # the stationary half of row n − SEQ_HEADS, normalized by that row's RMS
            previous = tl.where(rows >= SEQ_HEADS, rows - SEQ_HEADS, rows)
            previous_source, _ = _projection_rows(previous, H, HD, VD)
            k_previous = _normed(qkv_ptr + H * HD + previous_source[:, None] + cols, live, EPS, HD)
            k = tl.where(cols < HD // 2, k, k_previous)
        tl.store(k_ptr + out, k.to(k_ptr.dtype.element_ty), mask=live[:, None])
        v = tl.load(qkv_ptr + v_source, mask=live[:, None], other=0.0)
        if v_extra_ptr is not None:
            v = v.to(tl.float32) + tl.load(v_extra_ptr + v_out, mask=live[:, None], other=0.0).to(tl.float32)
        tl.store(v_ptr + v_out, v.to(v_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _projection_grad(x_ptr, grad_x_ptr, at, grad, cos_ptr, sin_ptr, rows, n_rows, SEQ_HEADS: tl.constexpr,
                         HD: tl.constexpr, PAIRS: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
        # writes the gradient of the projection's q or k rows x (at `at`) from that of their output
        live = rows[:, None] < n_rows
        x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        cos, sin = _rope_tables(cos_ptr, sin_ptr, rows, rows < n_rows, SEQ_HEADS, HD, PAIRS)
        grad = _normed_rotated_grad(x, grad, cos, sin, EPS, BLOCK, HD)
        tl.store(grad_x_ptr + at, grad.to(grad_x_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _qk_norm_rope_backward_kernel(qkv_ptr, grad_q_ptr, grad_k_ptr, grad_v_ptr, cos_ptr, sin_ptr, scale_ptr,
                                      grad_qkv_ptr, n_rows, H: tl.constexpr, HD: tl.constexpr, VD: tl.constexpr,
                                      PAIRS: tl.constexpr, SEQ_HEADS: tl.constexpr, KEY_OFFSET: tl.constexpr,
                                      EPS: tl.constexpr, BLOCK: tl.constexpr):
        # Program p takes part p % 3 (q, k or v) of the rows of block p // 3: one tile in registers, not
        # three one after another, so more programs fit an SM and keep more loads in flight, and the three
        # parts of a block run side by side. v's part copies its gradient.
        part, block = tl.program_id(0) % 3, tl.program_id(0) // 3
        rows = block * BLOCK + tl.arange(0, BLOCK)
        live = rows[:, None] < n_rows
        source, v_source = _projection_rows(rows, H, HD, VD)
        cols = tl.arange(0, HD)[None, :]
        out = rows.to(tl.int64)[:, None] * HD + cols
        if part == 0:
            grad = tl.load(grad_q_ptr + out, mask=live, other=0.0).to(tl.float32) * tl.load(scale_ptr)
            _projection_grad(qkv_ptr, grad_qkv_ptr, source[:, None] + cols, grad, cos_ptr, sin_ptr, rows, n_rows,
                             SEQ_HEADS, HD, PAIRS, EPS, BLOCK)
        elif part == 1:
            if KEY_OFFSET:  # row n's stationary half went to row n + SEQ_HEADS (one load with the turning
                # half), and at the first position to row n too (the first programs only)
                following = tl.where(cols >= HD // 2, SEQ_HEADS, 0)
                grad = tl.load(grad_k_ptr + out + following * HD, mask=rows[:, None] + following < n_rows,
                               other=0.0).to(tl.float32)
                if block * BLOCK < SEQ_HEADS:
                    first = (rows[:, None] < SEQ_HEADS) & (following > 0)
                    grad += tl.load(grad_k_ptr + out, mask=first, other=0.0).to(tl.float32)
            else:
                grad = tl.load(grad_k_ptr + out, mask=live, other=0.0).to(tl.float32)
            _projection_grad(qkv_ptr + H * HD, grad_qkv_ptr + H * HD, source[:, None] + cols, grad, cos_ptr, sin_ptr,
                             rows, n_rows, SEQ_HEADS, HD, PAIRS, EPS, BLOCK)
        else:
            v_cols = tl.arange(0, VD)[None, :]
            grad_v = tl.load(grad_v_ptr + rows.to(tl.int64)[:, None] * VD + v_cols, mask=live)
            tl.store(grad_qkv_ptr + v_source[:, None] + v_cols, grad_v.to(grad_qkv_ptr.dtype.element_ty), mask=live)


# Head rows per program and warps (bench/bench_qk_rope.py times others: --launch, --backward-launch)
QK_ROPE_FORWARD_LAUNCH = {"BLOCK": 32, "num_warps": 4}
QK_ROPE_BACKWARD_LAUNCH = {"BLOCK": 32, "num_warps": 4}


def _qk_rope_launch(qkv: Tensor, tensors: tuple, cos: Tensor, heads: int, qk_head_dim: int, paired: bool,
                    launch: dict) -> tuple[int, dict]:
    """(head rows, the kernel's constants) of one launch on the projection qkv (T, heads·(2·qk_head_dim + hd))
    with rotary tables as wide as cos, at launch's BLOCK and num_warps."""
    if any(not t.is_contiguous() for t in tensors if t is not None):
        raise ValueError("the QK-norm + rotary kernels take contiguous tensors")
    constants = {"H": heads, "HD": qk_head_dim, "VD": qkv.size(1) // heads - 2 * qk_head_dim, "PAIRS": cos.size(-1),
                 "SEQ_HEADS": heads // 2 if paired else heads, "EPS": torch.finfo(torch.float32).eps, **launch}
    return qkv.size(0) * heads, constants


def qk_norm_rope_forward(qkv: Tensor, v_extra: Tensor | None, cos: Tensor, sin: Tensor, scale: Tensor, heads: int,
                         qk_head_dim: int, paired: bool, key_offset: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Triton: qk_norm_rope_reference's q, k, v, from contiguous tensors (scale fp32)."""
    rows, constants = _qk_rope_launch(qkv, (qkv, v_extra, cos, sin), cos, heads, qk_head_dim, paired,
                                      QK_ROPE_FORWARD_LAUNCH)
    q, k, v = (qkv.new_empty(rows, constants[width]) for width in ("HD", "HD", "VD"))
    grid = (triton.cdiv(rows, constants["BLOCK"]),)
    _qk_norm_rope_forward_kernel[grid](qkv, v_extra, cos, sin, scale, q, k, v, rows, KEY_OFFSET=key_offset, **constants)
    seq_heads = heads // 2 if paired else heads
    return (q.view(-1, seq_heads, qk_head_dim), k.view(-1, seq_heads, qk_head_dim),
            v.view(-1, seq_heads, constants["VD"]))


def qk_norm_rope_backward(qkv: Tensor, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, cos: Tensor, sin: Tensor,
                          scale: Tensor, heads: int, qk_head_dim: int, paired: bool, key_offset: bool) -> Tensor:
    """Triton: qkv's gradient from those of qk_norm_rope_forward's q, k, v (contiguous); v_extra's is grad_v's."""
    rows, constants = _qk_rope_launch(qkv, (qkv, grad_q, grad_k, grad_v, cos, sin), cos, heads, qk_head_dim, paired,
                                      QK_ROPE_BACKWARD_LAUNCH)
    grad_qkv = torch.empty_like(qkv)
    grid = (3 * triton.cdiv(rows, constants["BLOCK"]),)  # q, k and v of each block of rows
    _qk_norm_rope_backward_kernel[grid](qkv, grad_q, grad_k, grad_v, cos, sin, scale, grad_qkv, rows,
                                        KEY_OFFSET=key_offset, **constants)
    return grad_qkv


class QKNormRope(torch.autograd.Function):
    """qk_norm_rope_reference's function as Triton kernels, saving the projection only."""

    @staticmethod
    def forward(ctx, qkv: Tensor, v_extra: Tensor | None, cos: Tensor, sin: Tensor, scale: Tensor, heads: int,
                qk_head_dim: int, paired: bool, key_offset: bool):
        qkv = qkv.contiguous()
        ctx.save_for_backward(qkv, cos, sin, scale)
        ctx.heads, ctx.qk_head_dim, ctx.paired, ctx.key_offset = heads, qk_head_dim, paired, key_offset
        v_extra = None if v_extra is None else v_extra.contiguous()
        return qk_norm_rope_forward(qkv, v_extra, cos, sin, scale, heads, qk_head_dim, paired, key_offset)

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor):
        qkv, cos, sin, scale = ctx.saved_tensors
        grad_q, grad_k, grad_v = grad_q.contiguous(), grad_k.contiguous(), grad_v.contiguous()
        grad_qkv = qk_norm_rope_backward(qkv, grad_q, grad_k, grad_v, cos, sin, scale, ctx.heads, ctx.qk_head_dim,
                                         ctx.paired, ctx.key_offset)
        grad_v_extra = grad_v.reshape(qkv.size(0), ctx.heads, -1) if ctx.needs_input_grad[1] else None
        return grad_qkv, grad_v_extra, None, None, None, None, None, None, None


def qk_rope_kernel_supports(head_dim: int) -> bool:
    """Whether the Triton kernels take this head size: Triton, head_dim a power of two ≥ 4."""
    return triton is not None and head_dim >= 4 and head_dim & (head_dim - 1) == 0


def qk_norm_rope(qkv: Tensor, v_extra: Tensor | None, cos: Tensor, sin: Tensor, scale: Tensor, heads: int,
                 qk_head_dim: int, paired: bool, key_offset: bool, kernels: bool) -> tuple[Tensor, Tensor, Tensor]:
    """attend's q, k, v from the projection (qk_norm_rope_reference says what): the Triton kernels where
    kernels (qk_rope_kernel_supports says where they apply), else the reference."""
    if kernels:
        return QKNormRope.apply(qkv, v_extra, cos, sin, scale, heads, qk_head_dim, paired, key_offset)
    return qk_norm_rope_reference(qkv, v_extra, cos, sin, scale, heads, qk_head_dim, paired, key_offset)


# --- Lightweight DC-MHA (T3.17) -----------------------------------------------------------------------

def dc_mha_torch(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, w1: Tensor, w2: Tensor,
                 window: int = DC_WINDOW) -> Tensor:
    """dc_mha in plain torch (the kernels' reference). Blocked: each block of `window` queries sees
    its own and the previous block of keys, so memory and work are O(T·window), not O(T²)."""
    T, H, D = q.shape
    n = -(-T // window)
    pad = n * window - T

    def blocks(t: Tensor) -> Tensor:  # (T, H, C) -> (n, H, window, C)
        return F.pad(t, (0, 0, 0, 0, 0, pad)).view(n, window, H, t.size(-1)).transpose(1, 2)

    def with_previous(t: Tensor) -> Tensor:  # (n, ..., window, D) -> (n, ..., 2·window, D)
        return torch.cat([torch.cat([torch.zeros_like(t[:1]), t[:-1]]), t], dim=-2)

    positions = torch.arange(n * window, device=q.device).view(n, window)
    docs = F.pad(doc_ids, (0, pad), value=-1).view(n, window)  # padding: a document of its own
    key_positions = torch.cat([positions - window, positions], 1)
    key_docs = torch.cat([torch.cat([torch.full_like(docs[:1], -2), docs[:-1]]), docs], 1)
    distance = positions[:, :, None] - key_positions[:, None, :]
    visible = (distance >= 0) & (distance < window) & (docs[:, :, None] == key_docs[:, None, :])
    scores = (blocks(q) @ with_previous(blocks(k)).mT).float().masked_fill(~visible[:, None], float("-inf"))
    mix = (scores.softmax(-1) * blocks(w1[..., None])).sum(1, keepdim=True)  # (n, 1, window, 2·window)
    out = (mix.to(v.dtype) @ with_previous(blocks(v))) * blocks(w2[..., None])
    return out.transpose(1, 2).reshape(n * window, H, D)[:T]


# Lightweight DC-MHA (#85, T3.17) as Triton kernels. A program takes BLOCK queries; they see three key tiles of BLOCK
# keys (the two previous blocks and their own), enough for windows up to 2·BLOCK + 1 keys. Forward: per head the softmax
# normalizer over the three tiles (online), then the probabilities mixed over the heads by w1 into a (kept in bf16 for
# the backward), then o_h = a·V_h. Backward: per query block da = Σ_h dO_h·V_hᵀ (through an fp32 scratch buffer), dw1_h
# = Σ_s p_h·da, dS_h = w1_h·p_h·(da − dw1_h) (kept in bf16) and dq_h; then per key tile dk_h = Σ dS_hᵀ·q_h and dv_h = Σ
# aᵀ·dO_h over the three query blocks that see it, so every gradient has one writer (deterministic, no atomics). Scores
# are recomputed rather than held, and da is reloaded per tile (fewer spills than holding it). Tile j of query block i
# holds the keys of block i + j − 2; a, da and dS are kept as (rows, 3·BLOCK), column j·BLOCK + c for key c of tile j.
if triton is not None:
    @triton.jit
    def _dc_load_head(ptr, rows, h, H: tl.constexpr, D: tl.constexpr, T, UPCAST: tl.constexpr):
        # rows of head h from a contiguous (T, H, D) tensor, zeros outside [0, T)
        ok = (rows >= 0) & (rows < T)
        t = tl.load(ptr + (rows[:, None] * H + h) * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
        return t.to(tl.float32) if UPCAST else t

    @triton.jit
    def _dc_store_head(ptr, value, rows, h, H: tl.constexpr, D: tl.constexpr, T, UPCAST: tl.constexpr):
        offs = (rows[:, None] * H + h) * D + tl.arange(0, D)[None, :]
        tl.store(ptr + offs, _to_dtype(value, ptr.dtype.element_ty, UPCAST), mask=(rows < T)[:, None])

    @triton.jit
    def _dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys, h, T, H: tl.constexpr, D: tl.constexpr,
                   WINDOW: tl.constexpr, UPCAST: tl.constexpr):
        # (BLOCK, BLOCK) scores of one key tile; −inf where the key is not in the query's document
        # among its last WINDOW positions (rows past T carry document −1 and see nothing)
        key_ok = (keys >= 0) & (keys < T)
        doc_k = tl.load(docs_ptr + keys, mask=key_ok, other=-2)
        distance = rows[:, None] - keys[None, :]
        visible = (doc_q[:, None] == doc_k[None, :]) & (distance >= 0) & (distance < WINDOW)
        s = tl.dot(q, tl.trans(_dc_load_head(k_ptr, keys, h, H, D, T, UPCAST)))
        return tl.where(visible, s, float("-inf"))

    @triton.jit
    def _dc_operand(t, dtype: tl.constexpr, UPCAST: tl.constexpr):
        # a tile rounded to the storage dtype as the GPU's dot sees it (fp32 again in the interpreter)
        t = _to_dtype(t, dtype, UPCAST)
        return t.to(tl.float32) if UPCAST else t

    @triton.jit
    def _dc_forward_kernel(q_ptr, k_ptr, v_ptr, docs_ptr, w1_ptr, o_ptr, lse_ptr, a_ptr, T,
                           H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                           UPCAST: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK)
        row_ok = rows < T
        doc_q = tl.load(docs_ptr + rows, mask=row_ok, other=-1)
        keys0, keys1, keys2 = rows - 2 * BLOCK, rows - BLOCK, rows
        a0 = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        a1 = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        a2 = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for h in range(H):
            q = _dc_load_head(q_ptr, rows, h, H, D, T, UPCAST)
            s = _dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys0, h, T, H, D, WINDOW, UPCAST)
            m = tl.maximum(tl.max(s, 1), -1e30)  # finite: rows that see nothing get total 0
            total = tl.sum(tl.exp(s - m[:, None]), 1)
            s = _dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys1, h, T, H, D, WINDOW, UPCAST)
            m_new = tl.maximum(m, tl.max(s, 1))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
            s = _dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys2, h, T, H, D, WINDOW, UPCAST)
            m = tl.maximum(m_new, tl.max(s, 1))
            total = total * tl.exp(m_new - m) + tl.sum(tl.exp(s - m[:, None]), 1)
            total = tl.where(total > 0, total, 1.0)
            lse = m + tl.log(total)
            tl.store(lse_ptr + rows * H + h, lse, mask=row_ok)
            weight = tl.load(w1_ptr + rows * H + h, mask=row_ok, other=0.0)[:, None]
            lse = lse[:, None]
            a0 += weight * tl.exp(_dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys0, h, T, H, D, WINDOW, UPCAST) - lse)
            a1 += weight * tl.exp(_dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys1, h, T, H, D, WINDOW, UPCAST) - lse)
            a2 += weight * tl.exp(_dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys2, h, T, H, D, WINDOW, UPCAST) - lse)
        a_rows = a_ptr + rows[:, None] * (3 * BLOCK) + cols[None, :]
        a0 = _dc_operand(a0, a_ptr.dtype.element_ty, UPCAST)
        a1 = _dc_operand(a1, a_ptr.dtype.element_ty, UPCAST)
        a2 = _dc_operand(a2, a_ptr.dtype.element_ty, UPCAST)
        tl.store(a_rows, a0.to(a_ptr.dtype.element_ty))
        tl.store(a_rows + BLOCK, a1.to(a_ptr.dtype.element_ty))
        tl.store(a_rows + 2 * BLOCK, a2.to(a_ptr.dtype.element_ty))
        for h in range(H):
            o = tl.dot(a0, _dc_load_head(v_ptr, keys0, h, H, D, T, UPCAST))
            o = tl.dot(a1, _dc_load_head(v_ptr, keys1, h, H, D, T, UPCAST), o)
            o = tl.dot(a2, _dc_load_head(v_ptr, keys2, h, H, D, T, UPCAST), o)
            _dc_store_head(o_ptr, o, rows, h, H, D, T, UPCAST)

    @triton.jit
    def _dc_probs(q, k_ptr, docs_ptr, rows, doc_q, keys, h, lse, T, H: tl.constexpr, D: tl.constexpr,
                  WINDOW: tl.constexpr, UPCAST: tl.constexpr):
        return tl.exp(_dc_scores(q, k_ptr, docs_ptr, rows, doc_q, keys, h, T, H, D, WINDOW, UPCAST) - lse)

    @triton.jit
    def _dc_backward_query_kernel(q_ptr, k_ptr, v_ptr, docs_ptr, w1_ptr, lse_ptr, do_ptr, dq_ptr, dw1_ptr,
                                  da_ptr, ds_ptr, T, T_pad, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                                  WINDOW: tl.constexpr, UPCAST: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK)
        row_ok = rows < T
        doc_q = tl.load(docs_ptr + rows, mask=row_ok, other=-1)
        # dL/da per key tile, through a scratch buffer (L2-resident) rather than held in registers
        da_rows = da_ptr + rows[:, None] * (3 * BLOCK) + cols[None, :]
        for tile in tl.static_range(3):
            da = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
            for h in range(H):
                v = _dc_load_head(v_ptr, rows + (tile - 2) * BLOCK, h, H, D, T, UPCAST)
                da = tl.dot(_dc_load_head(do_ptr, rows, h, H, D, T, UPCAST), tl.trans(v), da)
            tl.store(da_rows + tile * BLOCK, da)
        tl.debug_barrier()
        ds_type: tl.constexpr = ds_ptr.dtype.element_ty
        for h in range(H):
            q = _dc_load_head(q_ptr, rows, h, H, D, T, UPCAST)
            lse = tl.load(lse_ptr + rows * H + h, mask=row_ok, other=0.0)[:, None]
            dw1 = tl.zeros((BLOCK,), dtype=tl.float32)
            for j in range(3):
                keys = rows + (j - 2) * BLOCK
                p = _dc_probs(q, k_ptr, docs_ptr, rows, doc_q, keys, h, lse, T, H, D, WINDOW, UPCAST)
                dw1 += tl.sum(p * tl.load(da_rows + j * BLOCK), 1)
            tl.store(dw1_ptr + rows * H + h, dw1, mask=row_ok)
            w1 = tl.load(w1_ptr + rows * H + h, mask=row_ok, other=0.0)[:, None]
            ds_rows = ds_ptr + (h * T_pad + rows)[:, None] * (3 * BLOCK) + cols[None, :]
            dq = tl.zeros((BLOCK, D), dtype=tl.float32)
            for j in range(3):
                keys = rows + (j - 2) * BLOCK
                p = _dc_probs(q, k_ptr, docs_ptr, rows, doc_q, keys, h, lse, T, H, D, WINDOW, UPCAST)
                ds = _dc_operand(w1 * p * (tl.load(da_rows + j * BLOCK) - dw1[:, None]), ds_type, UPCAST)
                tl.store(ds_rows + j * BLOCK, ds.to(ds_type))
                dq = tl.dot(ds, _dc_load_head(k_ptr, keys, h, H, D, T, UPCAST), dq)
            _dc_store_head(dq_ptr, dq, rows, h, H, D, T, UPCAST)

    @triton.jit
    def _dc_backward_key_kernel(q_ptr, do_ptr, a_ptr, ds_ptr, dk_ptr, dv_ptr, T, T_pad, H: tl.constexpr,
                                D: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
        keys = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK)
        for h in range(H):
            dk = tl.zeros((BLOCK, D), dtype=tl.float32)
            dv = tl.zeros((BLOCK, D), dtype=tl.float32)
            for j in tl.static_range(3):
                rows = keys + (2 - j) * BLOCK  # the query block that holds these keys as its tile j
                in_pad = (rows < T_pad)[:, None]
                tile = j * BLOCK + cols[None, :]
                ds = tl.load(ds_ptr + (h * T_pad + rows)[:, None] * (3 * BLOCK) + tile, mask=in_pad, other=0.0)
                a = tl.load(a_ptr + rows[:, None] * (3 * BLOCK) + tile, mask=in_pad, other=0.0)
                if UPCAST:
                    ds, a = ds.to(tl.float32), a.to(tl.float32)
                dk = tl.dot(tl.trans(ds), _dc_load_head(q_ptr, rows, h, H, D, T, UPCAST), dk)
                dv = tl.dot(tl.trans(a), _dc_load_head(do_ptr, rows, h, H, D, T, UPCAST), dv)
            _dc_store_head(dk_ptr, dk, keys, h, H, D, T, UPCAST)
            _dc_store_head(dv_ptr, dv, keys, h, H, D, T, UPCAST)


DC_BLOCK = 64  # queries per program and keys per tile: windows up to 129 keys
# Launch options per kernel: no software pipelining of the head loops (Triton would multi-buffer every tile load,
# beyond Hopper's shared memory; tests compile them for sm_90); warps per bench/bench_arch.py --dc-warps (T3.17).
DC_LAUNCH = {"forward": dict(num_warps=8, num_stages=1), "backward_query": dict(num_warps=4, num_stages=1),
             "backward_key": dict(num_warps=4, num_stages=1)}


def _dc_padded_tokens(T: int, block: int) -> int:
    """Rows of the kernels' (T_pad, 3·block) buffers: T rounded up to whole query blocks."""
    return -(-T // block) * block


def _dc_fits_int32(T: int, H: int, D: int, block: int) -> bool:
    """q/k/v (T, H, D) and dS (H, T_pad, 3·block) below 2^31 elements."""
    return max(T * H * D, H * _dc_padded_tokens(T, block) * 3 * block) < 2**31


def _dc_launch(q: Tensor, block: int) -> tuple[int, int, int, int, int]:
    T, H, D = q.shape
    if not _dc_fits_int32(T, H, D, block):
        raise ValueError(f"DC-MHA kernels index with int32: {T} tokens x {H} heads x {D} is too many")
    T_pad = _dc_padded_tokens(T, block)
    return T, H, D, T_pad // block, T_pad


@torch.library.custom_op("speedrun::dc_mha_forward", mutates_args=())
def dc_mha_forward(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, w1: Tensor, window: int,
                   block: int) -> tuple[Tensor, Tensor, Tensor]:
    """o (T, H, D) = a·V_h per head, the softmax normalizers lse (T, H) fp32 and the head mix a
    (T_pad, 3·block); q, k, v contiguous (T, H, D), w1 (T, H) fp32."""
    T, H, D, n, T_pad = _dc_launch(q, block)
    o, lse = torch.empty_like(q), q.new_empty((T, H), dtype=torch.float32)
    a = q.new_empty((T_pad, 3 * block))
    _dc_forward_kernel[(n,)](q, k, v, doc_ids, w1, o, lse, a, T, H=H, D=D, BLOCK=block, WINDOW=window,
                             UPCAST=TRITON_INTERPRETER, **DC_LAUNCH["forward"])
    return o, lse, a


@dc_mha_forward.register_fake
def _dc_mha_forward_fake(q, k, v, doc_ids, w1, window, block):
    return (torch.empty_like(q), q.new_empty((q.size(0), q.size(1)), dtype=torch.float32),
            q.new_empty((_dc_padded_tokens(q.size(0), block), 3 * block)))


@torch.library.custom_op("speedrun::dc_mha_backward", mutates_args=())
def dc_mha_backward(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, w1: Tensor, lse: Tensor, a: Tensor,
                    grad_o: Tensor, window: int, block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (T, H, D) and dw1 (T, H) fp32 of dc_mha_forward's o, given grad_o (contiguous)."""
    T, H, D, n, T_pad = _dc_launch(q, block)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dw1 = torch.empty_like(w1)
    da, ds = q.new_empty((T_pad, 3 * block), dtype=torch.float32), q.new_empty((H, T_pad, 3 * block))
    _dc_backward_query_kernel[(n,)](q, k, v, doc_ids, w1, lse, grad_o, dq, dw1, da, ds, T, T_pad, H=H, D=D, BLOCK=block,
                                    WINDOW=window, UPCAST=TRITON_INTERPRETER, **DC_LAUNCH["backward_query"])
    _dc_backward_key_kernel[(n,)](q, grad_o, a, ds, dk, dv, T, T_pad, H=H, D=D, BLOCK=block,
                                  UPCAST=TRITON_INTERPRETER, **DC_LAUNCH["backward_key"])
    return dq, dk, dv, dw1


@dc_mha_backward.register_fake
def _dc_mha_backward_fake(q, k, v, doc_ids, w1, lse, a, grad_o, window, block):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(w1)


class DCMHAKernel(torch.autograd.Function):
    """o_h(t) = Σ_s (Σ_g w1[t,g]·p_g(t,s))·v_h(s) with the Triton kernels (dc_mha multiplies by w2)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, w1: Tensor, window: int, block: int):
        q, k, v, w1_32 = q.contiguous(), k.contiguous(), v.contiguous(), w1.float().contiguous()
        o, lse, a = dc_mha_forward(q, k, v, doc_ids, w1_32, window, block)
        ctx.save_for_backward(q, k, v, doc_ids, w1_32, lse, a)
        ctx.window, ctx.block, ctx.w1_dtype = window, block, w1.dtype
        return o

    @staticmethod
    def backward(ctx, grad_o: Tensor):
        q, k, v, doc_ids, w1_32, lse, a = ctx.saved_tensors
        dq, dk, dv, dw1 = dc_mha_backward(q, k, v, doc_ids, w1_32, lse, a, grad_o.contiguous(), ctx.window, ctx.block)
        return dq, dk, dv, None, dw1.to(ctx.w1_dtype), None, None


def dc_mha_kernel_supports(T: int, H: int, D: int, window: int, block: int = DC_BLOCK) -> bool:
    """Whether the Triton DC-MHA kernels take q (T, H, D) and this window: Triton, head_dim a power
    of two ≥ 16, windows up to 2·block + 1 keys, tensors they can index with int32."""
    return (triton is not None and D >= 16 and D & (D - 1) == 0 and 1 <= window <= 2 * block + 1
            and _dc_fits_int32(T, H, D, block))


def dc_mha(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor, w1: Tensor, w2: Tensor, window: int,
           use_triton: bool) -> Tensor:
    """Lightweight DC-MHA (#85, T3.17): the heads' softmax patterns over the last `window` keys of the query's
    document, mixed across heads by w1 (T, H) and applied to every head's values, scaled by w2 (T, H): out_h(t) =
    w2[t,h]·Σ_s (Σ_g w1[t,g]·p_g(t,s))·v_h(s). q (T, H, D) carries the softmax scale. The Triton kernels where
    use_triton (dc_mha_kernel_supports says where they apply), else dc_mha_torch."""
    if use_triton:
        return DCMHAKernel.apply(q, k, v, doc_ids, w1, window, DC_BLOCK) * w2[..., None]
    return dc_mha_torch(q, k, v, doc_ids, w1, w2, window)


# --- FlashAttention-4 (Dao-AILab/flash-attention, flash_attn/cute) as custom ops -----------------
# FA4's CuTe-DSL kernels are JIT-compiled on first use by an autograd.Function dynamo cannot trace; as two custom ops
# (forward; FA4's own backward from the saved output and lse) they stay opaque to torch.compile, keeping one graph.
def _fa4_window_size(window: int) -> tuple[int | None, int]:
    """FA4's window_size for keys at most `window` back. Unbounded is a left size of None: FA4
    reads a negative one with a right size of 0 as a local window, unlike FA3 and torch."""
    return (None if window == NO_WINDOW else window), 0


@torch.library.custom_op("speedrun::fa4_varlen_attention", mutates_args=())
def fa4_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                         window: int) -> tuple[Tensor, Tensor]:
    """(out (S, H, D), lse (H, S) fp32) of attend's attention with FA4; q already scaled. FA4's forward itself, as the
    backward below: its public function adds an autograd.Function (host time per call) whose graph this op replaces."""
    left, right = _fa4_window_size(window)
    out, lse, *_ = fa4_interface._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=1.0, causal=True, window_size_left=left,
        window_size_right=right, return_lse=True)
    return out, lse


@fa4_varlen_attention.register_fake
def _fa4_varlen_attention_fake(q, k, v, cu_seqlens, max_seqlen, window):
    S, H = q.shape[:2]
    return q.new_empty((S, H, v.size(-1))), q.new_empty((H, S), dtype=torch.float32)


@torch.library.custom_op("speedrun::fa4_varlen_attention_backward", mutates_args=())
def fa4_varlen_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  cu_seqlens: Tensor, max_seqlen: int, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of fa4_varlen_attention's out, given grad_out."""
    left, right = _fa4_window_size(window)
    dq, dk, dv = fa4_interface._flash_attn_bwd(
        q, k, v, out, grad_out, lse, softmax_scale=1.0, causal=True, window_size_left=left,
        window_size_right=right, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen)
    return dq, dk, dv


@fa4_varlen_attention_backward.register_fake
def _fa4_varlen_attention_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fa4_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.window = max_seqlen, window


def _fa4_backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = fa4_varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.window)
    return dq, dk, dv, None, None, None


fa4_varlen_attention.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)

# FA4 4.0.0b36 picks its SM90 backward tile from the Q/K width alone; for Q/K 64 wide with V 128 wide (narrow Q/K
# heads, T3.18) it needs more shared memory than an H100 has and fails to launch. This one is the library's tile for
# 128-wide heads with blocks of 64 query rows by 128 keys, two Q and two dO stages (bench/bench_head_dims.py; T3.18).
FA4_NARROW_BACKWARD_TILE = {"base_head_dim": 128, "m_block_size": 64, "n_block_size": 128, "num_stages_Q": 2,
                            "num_stages_dO": 2}


def fa4_backward_tile_for_narrow_qk(library_tile):
    """FA4's SM90 backward tile choice, with FA4_NARROW_BACKWARD_TILE for Q/K 64 wide and V 128 wide: the
    library's tile for heads base_head_dim wide, its block sizes and stages replaced."""
    @functools.wraps(library_tile)
    def tile(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
        if head_dim == 64 and head_dim_v == 128 and sparse_block_size_q is None:
            fields = dict(FA4_NARROW_BACKWARD_TILE)
            base = fields.pop("base_head_dim")
            return dataclasses.replace(library_tile(base, base, causal, local, sparse_block_size_q), **fields)
        return library_tile(head_dim, head_dim_v, causal, local, sparse_block_size_q)
    return tile


if fa4_interface is not None:
    fa4_interface._tile_size_bwd_sm90 = fa4_backward_tile_for_narrow_qk(fa4_interface._tile_size_bwd_sm90)


if __name__ == "__main__":
    main()
