#!/usr/bin/env python3
"""Records tool for the speedrun: statistics, new record folders, diffs and the README table.

Run from the repository root:

    python records/tool.py stats DIR [--target T] [--baseline DIR] [--no-plot]
    python records/tool.py new NAME LOGS... [--date YYYY-MM-DD] [--records-dir records] [--target 3.28]
    python records/tool.py diff [DIR] [--working]
    python records/tool.py table [--write | --check]
    python records/tool.py ablation LOGS...
    python records/tool.py compare BASE_LOG LOGS... [--noise LOG_A LOG_B] [--tolerance T] [--only train|val]
    python records/tool.py compare LOGS... --repeats LOG LOG [LOG...] [--tolerance T] [--only train|val]
    python records/tool.py stages LOGS...
    python records/tool.py slim PATHS...
    python records/tool.py full PATHS... [--stdout]

Logs are parsed exactly as specified by the log format that train_gpt.py writes: the source
text, a line of 100 '=', the environment header, a line of 100 '=', the run description
(`key: value` lines), then progress lines, step lines and the final peak memory line. The
patterns of those lines are train_gpt.py's own (LOG_SEPARATOR, STEP_LINE_RE, ...; the repository
root's train_gpt.py is imported, so torch must be installed), so the writer and this reader cannot
drift apart. scipy and matplotlib (the tool extras, requirements-tools.txt) are imported lazily.

A slim log (`slim`) has, in place of the source, one line naming the commit and the git blob of that
exact train_gpt.py text: `source: train_gpt.py at commit <40 hex> (blob <40 hex>); python records/tool.py
full <this log> restores it`. Every command reads slim logs as it reads full ones (the source comes
from `git cat-file blob`), and `full` writes the byte-exact original back. Record folders keep full logs.
A log compressed with xz (*.txt.xz) is read as the log it holds.

Records are ordered by date, then by the sequence in their record.json ({"sequence": N}, written
by `new`: one more than the largest of that date), then by name; a folder without record.json
counts as sequence 0 (made before the file existed, ordered by name).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import difflib
import hashlib
import io
import itertools
import json
import lzma
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
# The log format is defined once, in train_gpt.py: its writers make the lines, its patterns read them.
import train_gpt  # noqa: E402  (imports torch; tests/test_records.py writes its fake logs with its writers)
from train_gpt import (DESCRIPTION_RE, FINAL_WINDOWS_RE, LOG_NUMBER, LOG_SEPARATOR, PEAK_MEMORY_RE,  # noqa: E402
                       STEP_LINE_RE)

# Legacy: VAL_MASK=1 logs (T4.5, since removed from train_gpt.py) follow each validation's step line with
# the same forwards' loss without the mask; old logs keep these lines, so the tool still reads them.
UNMASKED_VAL_RE = re.compile(rf"^unmasked step:(?P<step>\d+)/(?P<total>\d+) val_loss:(?P<val_loss>{LOG_NUMBER})$")

# where the embedded source ends: the first separator line, found in the raw bytes so the source
# stays byte-exact (CRLF endings included)
SOURCE_END_RE = re.compile(rb"(?m)^" + re.escape(LOG_SEPARATOR.encode()) + rb"\r?$")
RECORD_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})_([A-Za-z0-9]+)$")
RECORD_JSON = "record.json"  # {"sequence": N}: the record's place among the records of its date
NAME_RE = re.compile(r"^[A-Z][A-Za-z0-9]*$")
TORCH_RE = re.compile(r"^Running PyTorch (\S+) compiled for CUDA (\S+)$")
REQUIRED_KEYS = ("run_id", "hardware", "mode", "world_size", "data", "hyperparameters")
TABLE_START, TABLE_END = "<!-- records-table:start -->", "<!-- records-table:end -->"
DEFAULT_TARGET = 3.28  # the speedrun's FineWeb target
PASS_RE = re.compile(r"^data: starting pass (?P<n>\d+) over (?P<files>\d+) train files$")
GENERATED_RE = re.compile(r"^Generated from \d+ log\(s\) by `python records/tool\.py stats (.+)`\.$", re.M)
# Overrides that name a run, where its files go or its initialization, not the configuration it computes.
NOT_ABLATIONS = {"RUN_ID", "LOG_DIR", "SEED", "SEEDS"}


class RecordsError(Exception):
    """A user error: printed as one line, no traceback, non-zero exit."""


@dataclass
class Run:
    path: Path
    source: bytes
    python: str = ""
    torch: str = ""
    cuda: str = ""
    triton: str = ""
    driver: str = ""
    host_cpu: str = ""  # absent in older logs
    run_id: str = ""
    hardware: str = ""
    mode: str = ""
    world_size: int = 1
    grad_accum_steps: str = ""
    overrides: str = ""
    data: str = ""
    hyperparameters: dict = field(default_factory=dict)
    total: int = 0
    val: list = field(default_factory=list)  # (step, train_time_s, val_loss)
    final_loss: float = math.nan
    train_time: float = math.nan  # seconds, train_time of the final validation line
    peak_allocated: int = 0  # MiB
    peak_reserved: int = 0  # MiB
    train_losses: dict = field(default_factory=dict)  # step -> rank-mean train loss (TRAIN_LOSS_EVERY logs)
    train_ms: dict = field(default_factory=dict)  # step -> train_time (ms) of its step lines
    last_step: int = 0
    step_avg_ms: float = math.nan  # step_avg of the last step line
    final_windows: dict = field(default_factory=dict)  # setting label -> val loss (bench/eval_windows.py lines)
    train_file_count: int = 0  # from "data: starting pass N over K train files" (0: the run never wrapped)
    data_passes: int = 1  # the largest N of those lines: passes over the train files the run started
    unmasked_final_loss: float = math.nan  # VAL_MASK=1 (final_loss is masked): the final validation's without the mask

    @property
    def software(self) -> str:
        s = f"Python {self.python.split()[0] if self.python else '?'}; PyTorch {self.torch} (CUDA {self.cuda}); Triton {self.triton}"
        return s + (f"; NVIDIA driver {self.driver}" if self.driver else "")


# ---------------------------------------------------------------- parsing

def parse_log(path, complete: bool = True, repo: Path | None = None) -> Run:
    """The run of a log, full or slim (its source read from git in repo, default this tool's repository);
    complete=False also accepts a run that stopped early (STOP_AFTER, interrupted): its step lines up to
    the last one, without final results."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if path.name.endswith(".xz"):  # a log xz-compressed as it was (`xz -dk` gives it back)
            raw = lzma.decompress(raw)
    except OSError as e:
        raise RecordsError(f"{path}: cannot read log: {e.strerror}") from None
    except lzma.LZMAError as e:
        raise RecordsError(f"{path}: cannot decompress log: {e}") from None
    m = SOURCE_END_RE.search(raw)
    if not m:
        raise RecordsError(f"{path}: no source separator (a line of 100 '='): not a train_gpt.py log")
    stub = read_stub(raw[:m.start()], str(path))
    run = Run(path=path, source=raw[:m.start()] if stub is None else stub_source(stub, str(path), repo))
    lines = raw.decode("utf-8", "replace").split("\n")
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in lines]
    i = raw.count(b"\n", 0, m.start())  # 0-based index of the first separator line

    def err(idx, msg):  # idx is 0-based; messages use 1-based line numbers
        return RecordsError(f"{path}:{idx + 1}: {msg}")

    try:
        j = lines.index(LOG_SEPARATOR, i + 1)
    except ValueError:
        raise err(i, "no second separator line after the environment header") from None
    for idx in range(i + 1, j):
        ln = lines[idx]
        if ln.startswith("Running Python "):
            run.python = ln[len("Running Python "):].strip()
        elif ln.startswith("Running PyTorch "):
            tm = TORCH_RE.match(ln)
            if not tm:
                raise err(idx, f"cannot parse PyTorch line: {ln!r}")
            run.torch, run.cuda = tm.groups()
        elif ln.startswith("Running Triton version "):
            run.triton = ln[len("Running Triton version "):].strip()
        elif ln.startswith("Running on host CPU "):
            run.host_cpu = ln[len("Running on host CPU "):].strip()
        elif not run.driver and (dm := re.search(r"Driver Version:\s*(\S+)", ln)):
            run.driver = dm.group(1)
    for what, val in (("Running Python", run.python), ("Running PyTorch", run.torch), ("Running Triton version", run.triton)):
        if not val:
            raise err(i, f"environment header has no '{what} ...' line")

    desc, k = {}, j + 1  # an `error:` line right after the description is a start-up failure, not a key
    while k < len(lines) and not lines[k].startswith("error:") and (dm := DESCRIPTION_RE.match(lines[k])):
        desc.setdefault(dm["key"], (dm["value"].strip(), k))
        k += 1
    for key in REQUIRED_KEYS:
        if key not in desc:
            raise err(j, f"run description has no '{key}:' line")
    run.run_id, run.hardware, run.mode, run.data = (desc[x][0] for x in ("run_id", "hardware", "mode", "data"))
    run.grad_accum_steps = desc.get("grad_accum_steps", ("", 0))[0]
    run.overrides = desc.get("overrides", ("", 0))[0]  # environment overrides (absent in older logs)
    try:
        run.world_size = int(desc["world_size"][0])
    except ValueError:
        raise err(desc["world_size"][1], f"cannot parse world_size: {desc['world_size'][0]!r}") from None
    try:
        run.hyperparameters = json.loads(desc["hyperparameters"][0])
    except json.JSONDecodeError as e:
        raise err(desc["hyperparameters"][1], f"cannot parse hyperparameters JSON: {e.msg}") from None

    final_idx = None
    for idx in range(k, len(lines)):
        ln = lines[idx].rstrip()
        if pm := PASS_RE.match(ln):
            run.train_file_count, run.data_passes = int(pm["files"]), max(run.data_passes, int(pm["n"]))
        elif ln.startswith("step:"):
            sm = STEP_LINE_RE.match(ln)  # a validation's line (val_loss) or a training step's
            if not sm:
                raise err(idx, f"cannot parse step line: {ln!r}")
            step, total, ms = int(sm["step"]), int(sm["total"]), float(sm["train_time"])
            if run.total and total != run.total:
                raise err(idx, f"step line has total {total}, earlier lines have {run.total}")
            run.total, run.last_step, run.step_avg_ms = total, step, float(sm["step_avg"])
            run.train_ms[step] = ms
            if sm["train_loss"] is not None:
                run.train_losses[step] = float(sm["train_loss"])
            if sm["val_loss"] is not None:
                loss = float(sm["val_loss"])
                run.val.append((step, ms / 1000.0, loss))
                if step == total and final_idx is None:
                    if not math.isfinite(loss):
                        raise err(idx, f"final validation loss is not finite: {ln!r}")
                    run.final_loss, run.train_time, final_idx = loss, ms / 1000.0, idx
        elif (um := UNMASKED_VAL_RE.match(ln)) and final_idx is not None and idx == final_idx + 1:
            run.unmasked_final_loss = float(um["val_loss"])  # the final step line's, without validation masking
        elif ln.startswith("peak memory allocated:") and final_idx is not None:
            pm = PEAK_MEMORY_RE.match(ln)
            if not pm:
                raise err(idx, f"cannot parse peak memory line: {ln!r}")
            run.peak_allocated, run.peak_reserved = int(pm["allocated"]), int(pm["reserved"])
            for later in lines[idx + 1:]:  # bench/eval_windows.py scores the final model after the run
                if fm := FINAL_WINDOWS_RE.match(later.rstrip()):
                    run.final_windows[fm["setting"]] = float(fm["val_loss"])
            return run
        elif ln.startswith("error:") and not run.total:  # before any step line: setup, data, warm-up
            raise RecordsError(f"{path}: the run failed at start-up: {ln.removeprefix('error:').strip()}")
        elif ln.startswith("error:"):
            raise err(idx, f"run stopped with an error: {ln.removeprefix('error:').strip()}")
    if not complete:
        return run
    n = len(lines) - (1 if lines and lines[-1] == "" else 0)
    planned = planned_last_step(run)
    if final_idx is None and planned < run.total and any(step == planned for step, _, _ in run.val):
        raise RecordsError(f"{path}: the run was stopped early by STOP_AFTER={planned} after {planned} of {run.total} "
                           "steps; a record needs the whole schedule (compare and stages read stopped runs)")
    if final_idx is None:
        where = f"last step {run.last_step}/{run.total}" if run.total else "no step lines"
        raise err(n - 1, f"truncated run: no final validation line ({where})")
    raise err(n - 1, "truncated run: no 'peak memory allocated' line after the final validation line")


def scored_by_final_windows(runs: list[Run], setting: str | None) -> list[Run]:
    """The runs with each final val loss replaced by its log's `final_windows SETTING` line
    (bench/eval_windows.py), to compare runs under one final-validation setting; None: unchanged."""
    if setting is None:
        return runs
    out = []
    for r in runs:
        if setting not in r.final_windows:
            have = ", ".join(repr(x) for x in r.final_windows) or "none"
            raise RecordsError(f"{r.path}: no 'final_windows {setting} val_loss:...' line (its settings: {have}); "
                               "bench/eval_windows.py writes them")
        out.append(replace(r, final_loss=r.final_windows[setting]))
    return out


def load_runs(folder, repo: Path | None = None) -> list[Run]:
    """Parse every *.txt log of a folder (slim logs' sources from git in repo), and every *.txt.xz log
    whose *.txt is not there; refuse mixed hardware/mode/data or duplicate run ids."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RecordsError(f"{folder}: not a directory")
    logs = sorted([*folder.glob("*.txt"), *(p for p in folder.glob("*.txt.xz") if not p.with_suffix("").exists())])
    if not logs:
        raise RecordsError(f"{folder}: no *.txt logs")
    runs = [parse_log(p, repo=repo) for p in logs]
    check_consistent(runs)
    return runs


def check_consistent(runs: list[Run]) -> None:
    first = runs[0]
    for r in runs[1:]:
        for attr in ("hardware", "mode", "data"):
            if getattr(r, attr) != getattr(first, attr):
                raise RecordsError(f"logs disagree on {attr}: {first.path} has {getattr(first, attr)!r}, "
                                   f"{r.path} has {getattr(r, attr)!r}")
    seen = {}
    for r in runs:
        if r.run_id in seen:
            raise RecordsError(f"{seen[r.run_id]} and {r.path} have the same run_id {r.run_id!r}")
        seen[r.run_id] = r.path


def configuration(run: Run) -> set[str]:
    """The run's environment overrides that change what it computes (NOT_ABLATIONS left out)."""
    return {t for t in shlex.split(run.overrides) if t.split("=", 1)[0] not in NOT_ABLATIONS}


def mixed_overrides(runs: list[Run]) -> str | None:
    """A warning when the runs' overrides differ (RUN_ID, LOG_DIR, SEED, SEEDS aside), else None."""
    configs = [configuration(r) for r in runs]
    if all(c == configs[0] for c in configs):
        return None
    shared = set.intersection(*configs)
    own = "; ".join(f"{r.path.name}: {' '.join(sorted(c - shared)) or 'none'}" for r, c in zip(runs, configs))
    return f"the runs have different overrides, so these statistics pool different configurations ({own})"


def joined(runs, attr) -> str:
    vals = list(dict.fromkeys(getattr(r, attr) for r in runs))
    return vals[0] if len(vals) == 1 else " / ".join(vals) + " (logs differ)"


# ---------------------------------------------------------------- slim logs

STUB_TEXT = "python records/tool.py full <this log> restores it"
STUB_RE = re.compile(rb"source: (?P<path>[^\s()]+) at commit (?P<commit>[0-9a-f]{40}) \(blob (?P<blob>[0-9a-f]{40})\); "
                     + re.escape(STUB_TEXT.encode()) + rb"\n")
LOG_SUFFIXES = (".txt", ".out", ".log")  # the files `slim` and `full` read in a folder, beside *.tar.xz archives
ARCHIVE_SUFFIX = ".tar.xz"
_SOURCES: dict[tuple[str, str, str, str], bytes] = {}  # (repo, commit, path, blob) -> text, read from git once


def stub_line(path: str, commit: str, blob: str) -> bytes:
    """A slim log's first line, in place of the train_gpt.py text that `path` has at `commit` (blob id `blob`)."""
    return f"source: {path} at commit {commit} (blob {blob}); {STUB_TEXT}\n".encode()


def read_stub(head: bytes, where: str) -> re.Match | None:
    """The stub of a slim log, from the text before its first separator line; None for a full log's
    source. A one-line head that starts like a stub but does not match it is a corrupted stub."""
    if not head.startswith(b"source: ") or head.count(b"\n") > 1:
        return None
    m = STUB_RE.fullmatch(head)
    if not m:
        shown = head.rstrip(b"\r\n").decode("utf-8", "replace")[:300]
        raise RecordsError(f"{where}:1: corrupted source stub {shown!r}: expected 'source: train_gpt.py at commit "
                           f"<40 hex> (blob <40 hex>); {STUB_TEXT}'")
    return m


def blob_id(data: bytes) -> str:
    """git's id of a blob holding data (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    """The stdout of `git -C repo ARGS...`; a failure is a RecordsError quoting git's last line."""
    try:
        res = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, check=False)
    except FileNotFoundError:
        raise RecordsError("git is not installed: slim logs name their train_gpt.py source by git commit and blob") from None
    if res.returncode:
        said = res.stderr.decode("utf-8", "replace").strip().splitlines()
        raise RecordsError(f"`git {args[0]}` in {repo} failed: {said[-1] if said else f'exit code {res.returncode}'}")
    return res.stdout


def git_objects(repo: Path, names: list[str]) -> list[tuple[str, str, bytes] | None]:
    """(id, type, content) of each object name (`<id>`, `<commit>:<path>`), None where the repository
    has none: one `git cat-file --batch`."""
    out = git(repo, "cat-file", "--batch", stdin="".join(f"{n}\n" for n in names).encode())
    found, pos = [], 0
    for _ in names:
        end = out.index(b"\n", pos)
        header = out[pos:end].decode("utf-8", "replace").split()
        if len(header) != 3:  # "<name> missing", "<name> ambiguous"
            found.append(None)
            pos = end + 1
            continue
        size = int(header[2])
        found.append((header[0], header[1], out[end + 1:end + 1 + size]))
        pos = end + 1 + size + 1  # the content, then a newline
    return found


def stub_source(stub: re.Match, where: str, repo: Path | None = None) -> bytes:
    """The train_gpt.py text a slim log's stub names, from git in repo (default: this tool's repository):
    the blob, checked against its id and against the file the stub's commit has at the stub's path."""
    repo = Path(repo or REPO_ROOT)
    path, commit, blob = (stub[k].decode() for k in ("path", "commit", "blob"))
    key = (str(repo), commit, path, blob)
    if key not in _SOURCES:
        try:
            content, at_commit = git_objects(repo, [blob, f"{commit}:{path}"])
        except RecordsError as e:
            raise RecordsError(f"{where}: a slim log, whose source comes from git: {e}") from None
        if content is None or content[1] != "blob" or blob_id(content[2]) != blob:
            raise RecordsError(f"{where}: its source stub names blob {blob}, which the git repository at {repo} does "
                               "not have (a corrupted stub, or a shallow clone: `git fetch --unshallow`)")
        if at_commit is None or at_commit[0] != blob:
            raise RecordsError(f"{where}: corrupted source stub: commit {commit} has no {path} with blob {blob} "
                               f"in the git repository at {repo}")
        _SOURCES[key] = content[2]
    return _SOURCES[key]


def log_source_end(raw: bytes) -> int | None:
    """Where the source (or a slim log's stub) of a train_gpt.py log ends: at its first separator line,
    which follows some text and precedes the environment header; None for any other file."""
    m = SOURCE_END_RE.search(raw)
    return m.start() if m and m.start() > 0 and re.match(rb"\r?\nRunning Python ", raw[m.end():]) else None


def full_bytes(raw: bytes, where: str, repo: Path | None = None) -> bytes:
    """The original bytes of a slim log, its source from git in repo; raw itself for a full log (or any
    other file)."""
    end = log_source_end(raw)
    stub = read_stub(raw[:end], where) if end is not None else None
    return raw if stub is None else stub_source(stub, where, repo) + raw[end:]


def train_gpt_blobs(repo: Path) -> dict[str, tuple[str, str]]:
    """Blob id -> (commit, path) of every train_gpt.py text in the history of the repository's HEAD: the
    root's and the copies under records/ (records/*/train_gpt.py, records/experiments/**/train_gpt.py),
    each at the oldest commit that has it, the root's path before a copy's. HEAD's history, not every
    branch's: a slim log must not name a commit that a deleted branch takes with it."""
    out = git(repo, "log", "HEAD", "--reverse", "-m", "--format=commit %H", "--raw", "--no-abbrev", "--no-renames",
              "--", "train_gpt.py", ":(glob)records/**/train_gpt.py").decode("utf-8", "replace")
    found, commit = {}, ""
    for ln in out.splitlines():
        if ln.startswith("commit "):
            commit = ln.split()[1]
        elif ln.startswith(":") and "\t" in ln:
            meta, path = ln.split("\t", 1)
            blob = meta.split()[3]
            if set(blob) == {"0"}:  # the file deleted
                continue
            if blob not in found or (path == "train_gpt.py" and found[blob][1] != "train_gpt.py"):
                found[blob] = (commit, path)
    return found


def slimmed(raw: bytes, where: str, blobs: dict[str, tuple[str, str]], repo: Path) -> tuple[bytes | None, str]:
    """(the slim log, a note) of a log's bytes, checked to rebuild them byte for byte; (None, why) when it
    stays as it is: slim already, or its source is in no commit (blobs: train_gpt_blobs)."""
    end = log_source_end(raw)
    if read_stub(raw[:end], where) is not None:
        return None, "already slim"
    blob = blob_id(raw[:end])
    if blob not in blobs:
        return None, (f"kept full {where}: its train_gpt.py source (blob {blob}) is in no commit of the history of "
                      f"{repo}, so git cannot rebuild it")
    commit, path = blobs[blob]
    slim = stub_line(path, commit, blob) + raw[end:]
    if hashlib.sha256(full_bytes(slim, where, repo)).digest() != hashlib.sha256(raw).digest():
        raise RecordsError(f"{where}: its slim form does not rebuild the original byte for byte; left as it is")
    return slim, f"slimmed {where}: source {path} at commit {commit[:12]} ({len(raw)} -> {len(slim)} bytes)"


def record_folder_of(path: Path, root: Path) -> Path | None:
    """The record folder (records/YYYY-MM-DD_Name/ of the repository at root) that holds path, if any."""
    records = (root / "records").resolve()
    try:
        parts = path.resolve().relative_to(records).parts
    except ValueError:
        return None
    return records / parts[0] if len(parts) >= 2 and RECORD_RE.match(parts[0]) else None


def log_paths(args: list[str], root: Path, slimming: bool) -> list[tuple[Path, bool]]:
    """(file, named on the command line) for each log or *.tar.xz archive of logs the arguments name:
    files as given, and in each folder (searched down) its *.txt, *.out, *.log and *.tar.xz files.
    Slimming leaves record folders alone: a named file in one is refused, a folder's are skipped."""
    out = []
    for arg in args:
        p = Path(arg)
        if p.is_file():
            if slimming and (rec := record_folder_of(p, root)) is not None:
                raise RecordsError(f"{p}: a log of the record {rec.name}; record folders keep full logs")
            out.append((p, True))
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith((*LOG_SUFFIXES, ARCHIVE_SUFFIX)))
            kept = sorted({rec for f in found if slimming and (rec := record_folder_of(f, root)) is not None})
            for rec in kept:
                print(f"kept full {rec}: record folders keep full logs")
            out += [(f, False) for f in found if not (slimming and record_folder_of(f, root) in kept)]
        else:
            raise RecordsError(f"{arg}: no such file or folder")
    return out


def rewrite_file(path: Path, data: bytes) -> None:
    """Replace path's bytes by data through a file beside it (no reader sees half), keeping its mode."""
    tmp = path.with_name(path.name + ".records-tool.tmp")
    tmp.write_bytes(data)
    shutil.copymode(path, tmp)
    os.replace(tmp, path)


def archive_members(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    """The members of a .tar.xz in their order, each with its content (None: not a regular file)."""
    try:
        with tarfile.open(path, "r:xz") as tar:
            return [(info, tar.extractfile(info).read() if info.isfile() else None) for info in tar.getmembers()]
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
        raise RecordsError(f"{path}: cannot read it as a .tar.xz archive: {e}") from None


def packed_archive(path: Path, before: list[tuple[tarfile.TarInfo, bytes | None]],
                   members: list[tuple[tarfile.TarInfo, bytes | None]], repo: Path) -> bytes:
    """A .tar.xz of the members (name, type, mode, owner, time as they were; new contents), checked to
    read back as the archive at path (its members: before) did: the same members, each file rebuilding
    (full_bytes) to its original."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", format=tarfile.GNU_FORMAT, preset=9 | lzma.PRESET_EXTREME) as tar:
        for info, data in members:
            info = copy.copy(info)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, None if data is None else io.BytesIO(data))
    packed = buf.getvalue()
    meta = ("name", "type", "mode", "mtime", "linkname", "uid", "gid", "uname", "gname")
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:xz") as tar:
        got = [(info, tar.extractfile(info).read() if info.isfile() else None) for info in tar.getmembers()]
    if len(got) != len(before) or any(
            [getattr(a, k) for k in meta] != [getattr(b, k) for k in meta] or (x is None) != (y is None)
            or (x is not None and hashlib.sha256(full_bytes(x, f"{path}:{a.name}", repo)).digest()
                != hashlib.sha256(full_bytes(y, f"{path}:{b.name}", repo)).digest())
            for (a, x), (b, y) in zip(got, before)):
        raise RecordsError(f"{path}: the repacked archive does not read back as the original; left as it is")
    return packed


def cmd_slim(args) -> int:
    """Replace the embedded source of each log by its stub, where git has that exact text and the slim
    log rebuilds the original byte for byte; in archives too (repacked with the same members)."""
    blobs = train_gpt_blobs(args.root)
    done = {"slimmed": 0, "kept": 0, "slim": 0, "before": 0, "after": 0}

    def one(raw: bytes, where: str, member: bool = False) -> bytes | None:
        """The slim log of raw, or None (with a line saying why, unless it is slim already); an archive's
        member is not reported when slimmed (its archive is)."""
        slim, note = slimmed(raw, where, blobs, args.root)
        if slim is None:
            done["slim" if note == "already slim" else "kept"] += 1
            if note != "already slim":
                print(note)
            return None
        done["slimmed"] += 1
        done["before"], done["after"] = done["before"] + len(raw), done["after"] + len(slim)
        if not member:
            print(note)
        return slim

    for path, named in log_paths(args.paths, args.root, slimming=True):
        if path.name.endswith(ARCHIVE_SUFFIX):
            members = archive_members(path)
            new = [(info, data if data is None or log_source_end(data) is None
                    else one(data, f"{path}:{info.name}", member=True) or data) for info, data in members]
            changed = sum(a is not b for (_, a), (_, b) in zip(members, new))
            if changed:
                packed = packed_archive(path, members, new, args.root)
                size = path.stat().st_size
                rewrite_file(path, packed)
                print(f"slimmed {path}: {changed} of its {len(members)} files ({size} -> {len(packed)} bytes)")
            continue
        raw = path.read_bytes()
        if log_source_end(raw) is None:
            if named:
                print(f"skipped {path}: not a train_gpt.py log (no source before a line of 100 '=' and the "
                      "environment header)")
            continue
        if (slim := one(raw, str(path))) is not None:
            rewrite_file(path, slim)
    print(f"slim: {done['slimmed']} log(s) slimmed ({done['before']} -> {done['after']} bytes), {done['kept']} kept "
          f"full (source in no commit), {done['slim']} slim already")
    return 0


def cmd_full(args) -> int:
    """Write the byte-exact original of each slim log back in its place (in archives too), or to stdout."""
    if args.stdout:
        p = Path(args.paths[0])
        if len(args.paths) != 1 or not p.is_file() or p.name.endswith(ARCHIVE_SUFFIX):
            raise RecordsError("--stdout writes one log: give the path of one log file (not an archive or folder)")
        data = full_bytes(p.read_bytes(), str(p), args.root)
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        return 0
    restored = full = 0
    for path, _ in log_paths(args.paths, args.root, slimming=False):
        if path.name.endswith(ARCHIVE_SUFFIX):
            members = archive_members(path)
            new = [(info, None if data is None else full_bytes(data, f"{path}:{info.name}", args.root))
                   for info, data in members]
            changed = sum(a != b for (_, a), (_, b) in zip(members, new))
            if changed:
                rewrite_file(path, packed_archive(path, members, new, args.root))
                print(f"restored {path}: {changed} of its {len(members)} files")
            restored += changed
            full += sum(data is not None and log_source_end(data) is not None for _, data in members) - changed
            continue
        raw = path.read_bytes()
        if log_source_end(raw) is None:
            continue
        original = full_bytes(raw, str(path), args.root)
        if original == raw:
            full += 1
            continue
        rewrite_file(path, original)
        restored += 1
        print(f"restored {path} ({len(raw)} -> {len(original)} bytes)")
    print(f"full: {restored} log(s) restored, {full} full already")
    return 0


# ---------------------------------------------------------------- statistics

def _std(xs):
    return statistics.stdev(xs) if len(xs) >= 2 else math.nan


def welch(new, base) -> dict:
    from scipy import stats as st
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        two = st.ttest_ind(new, base, equal_var=False)
        less = st.ttest_ind(new, base, equal_var=False, alternative="less")
    v1, v2 = statistics.variance(new) / len(new), statistics.variance(base) / len(base)
    df = (v1 + v2) ** 2 / (v1 ** 2 / (len(new) - 1) + v2 ** 2 / (len(base) - 1)) if v1 + v2 > 0 else math.nan
    mn, mb = statistics.fmean(new), statistics.fmean(base)
    return {"new_mean": mn, "base_mean": mb, "diff": mn - mb, "t": float(two.statistic), "df": df,
            "p_two_sided": float(two.pvalue), "p_less": float(less.pvalue)}


def stage_bounds(run: Run) -> list[tuple[str, int, int]]:
    """(label, first step, end step) of each stage of the run's schedule, from its logged
    hyperparameters: stage k starts at round(n · the fractions before it), the extension at n
    (train_gpt.py's Schedule), and the run ends at its last step. Logs from before the stage table
    (V1-V4: `stage_batch_tokens` and friends, one entry per stage and the extension) had three
    equal stages."""
    hp = run.hyperparameters
    try:
        n = hp["num_scheduled_iterations"]
        if "stages" in hp:
            fractions = [st["fraction"] for st in hp["stages"][:-1]]
            tapers = [st.get("taper", False) for st in hp["stages"][:-1]]  # TAPER_FRACTION's row (T5.5)
        else:
            fractions = [1 / 3] * (len(hp["stage_batch_tokens"]) - 1)
            tapers = [False] * len(fractions)
    except (KeyError, TypeError):
        return []
    starts = [round(n * sum(fractions[:k])) for k in range(len(fractions))] + [n]
    ends = starts[1:] + [run.total]
    labels = ["taper" if taper else f"stage {k + 1}" for k, taper in enumerate(tapers)] + ["extension"]
    return [(label, a, min(b, run.total)) for label, a, b in zip(labels, starts, ends) if a < min(b, run.total)]


def stage_ms_per_step(run: Run) -> dict[str, float]:
    """Label -> ms per step within that stage: the train_time difference between the stage's first
    and end step lines over the steps between (NaN where either step was not logged)."""
    out = {}
    for label, a, b in stage_bounds(run):
        ta, tb = run.train_ms.get(a), run.train_ms.get(b)
        out[label] = (tb - ta) / (b - a) if ta is not None and tb is not None else math.nan
    return out


def stage_means(runs: list[Run]) -> dict[str, float]:
    """Per-stage ms/step averaged over runs (stages of the first run's schedule)."""
    per_run = [stage_ms_per_step(r) for r in runs]
    return {label: statistics.fmean(p.get(label, math.nan) for p in per_run) for label in per_run[0]}


def stage_table(groups: dict[str, list[Run]]) -> list[str]:
    """Markdown rows: ms/step per stage for each named group of runs (means over its runs)."""
    means = {name: stage_means(runs) for name, runs in groups.items()}
    labels = list(next(iter(means.values())))
    if not labels:
        return []
    out = ["| ms/step | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for name, m in means.items():
        out.append(f"| {name} | " + " | ".join("n/a" if math.isnan(m.get(x, math.nan)) else f"{m[x]:.2f}"
                                                for x in labels) + " |")
    return out


def summarize(runs: list[Run], target: float, baseline: list[Run] | None = None) -> dict:
    losses, times = [r.final_loss for r in runs], [r.train_time for r in runs]
    s = {"n": len(runs), "target": target, "losses": losses, "times": times,
         "loss_mean": statistics.fmean(losses), "loss_std": _std(losses),
         "time_mean": statistics.fmean(times), "time_std": _std(times),
         "t": math.nan, "p": math.nan, "df": len(runs) - 1, "baseline": None,
         "seeds": [r.hyperparameters.get("seed") for r in runs]}
    if len(runs) >= 2:
        from scipy import stats as st
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = st.ttest_1samp(losses, target, alternative="less")
        s["t"], s["p"] = float(res.statistic), float(res.pvalue)
    if baseline is not None:
        s["baseline_n"] = len(baseline)
        if len(runs) >= 2 and len(baseline) >= 2:
            s["baseline"] = {"time": welch(times, [r.train_time for r in baseline]),
                             "loss": welch(losses, [r.final_loss for r in baseline])}
        s["paired"] = paired_by_seed(runs, baseline)
    return s


def paired_by_seed(new: list[Run], base: list[Run]) -> dict | None:
    """Final val loss paired by SEED: runs of one seed start from the same initialization and read the
    same data, so their difference drops the seed-to-seed spread that Welch's test carries. Per-seed
    differences new − base over the seeds each side ran exactly once, their mean and a paired t-test;
    None when fewer than two seeds pair up."""
    def once(runs):
        seeds = [r.hyperparameters.get("seed") for r in runs]
        return {x: r.final_loss for x, r in zip(seeds, runs) if x is not None and seeds.count(x) == 1}
    a, b = once(new), once(base)
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    from scipy import stats as st
    new_losses, base_losses = [a[x] for x in seeds], [b[x] for x in seeds]
    diffs = [n - m for n, m in zip(new_losses, base_losses)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        two = st.ttest_rel(new_losses, base_losses)
        less = st.ttest_rel(new_losses, base_losses, alternative="less")
    return {"seeds": seeds, "diffs": diffs, "diff": statistics.fmean(diffs), "t": float(two.statistic),
            "df": len(seeds) - 1, "p_two_sided": float(two.pvalue), "p_less": float(less.pvalue)}


def fmt_p(p: float) -> str:
    return "n/a" if math.isnan(p) else (f"{p:.2e}" if p < 1e-4 else f"{p:.4f}")


def fmt_pm(mean: float, std: float, nd: int) -> str:
    return f"{mean:.{nd}f}" if math.isnan(std) else f"{mean:.{nd}f} ± {std:.{nd}f}"


def reached(loss: float, target: float) -> bool:
    """A final val loss (or a mean of them) at or below the target; 1e-9 absorbs a mean's rounding."""
    return loss <= target + 1e-9


def runs_table(runs: list[Run], target: float | None = None) -> str:
    """Markdown rows per run; with a target, whether its final val loss reached it (<= target)."""
    masked = any(not math.isnan(r.unmasked_final_loss) for r in runs)  # VAL_MASK=1: a column for the plain loss
    out = ["| run_id | log | final val loss |" + (" without the mask |" if masked else "")
           + " train time (s) |" + ("" if target is None else f" val loss <= {target} |")
           + " steps | peak memory allocated / reserved (MiB) |",
           "|---|---|---:|" + ("---:|" if masked else "") + "---:|" + ("" if target is None else "---|") + "---:|---:|"]
    for r in runs:
        unmasked = f" {r.unmasked_final_loss:.4f} |" if masked else ""
        hit = "" if target is None else f" {'yes' if reached(r.final_loss, target) else 'no'} |"
        out.append(f"| {r.run_id} | [{r.path.name}]({r.path.name}) | {r.final_loss:.4f} |{unmasked} "
                   f"{r.train_time:.3f} |{hit} {r.total} | {r.peak_allocated} / {r.peak_reserved} |")
    return "\n".join(out)


def target_line(s: dict) -> str:
    """The time at the loss target (what the contest pays for): the runs' mean train time when their mean
    final val loss reaches the target, and how many runs reached it."""
    t = s["target"]
    runs = f"{sum(reached(loss, t) for loss in s['losses'])} of {s['n']} runs reached it"
    if reached(s["loss_mean"], t):
        return f"- time at loss <= {t}: mean train time {s['time_mean']:.3f} s ({runs}); mean val {s['loss_mean']:.4f}"
    return (f"- time at loss <= {t}: not reached: mean val {s['loss_mean']:.4f} misses the target by "
            f"{s['loss_mean'] - t:.4f} ({runs}; mean train time {s['time_mean']:.3f} s)")


def run_target_lines(s: dict, names: list[str]) -> list[str]:
    """Per run (named in the order of s's runs): its train time and whether its final val loss reached the target."""
    t = s["target"]
    return [f"- {name}: train time {secs:.3f} s, final val loss {loss:.4f} "
            + (f"<= {t} (reached)" if reached(loss, t) else f"> {t} (missed)")
            for name, secs, loss in zip(names, s["times"], s["losses"])]


def repeated_data_lines(runs: list[Run], prefix: str, full_path: bool = False) -> list[str]:
    """A warning per run that read its train files more than once (its log's `data: starting pass N over
    M train files`, N >= 2): its later steps trained on tokens it had seen."""
    return [f"{prefix}repeated data: {r.path if full_path else r.path.name} read its training data more than once "
            f"(it started pass {r.data_passes} over its {r.train_file_count} train files)"
            for r in runs if r.data_passes >= 2]


def unmasked_lines(runs: list[Run]) -> list[str]:
    """With VAL_MASK=1 (docs/TECHNIQUES.md T4.5) the final val loss is the masked one: the same forwards'
    loss without the mask, from the logs' `unmasked` lines."""
    losses = [r.unmasked_final_loss for r in runs if not math.isnan(r.unmasked_final_loss)]
    if not losses:
        return []
    spread = f", std {_std(losses):.4f}" if len(losses) >= 2 else ""
    share = "" if len(losses) == len(runs) else f" ({len(losses)} of the {len(runs)} runs)"
    mean = statistics.fmean(losses)
    return [f"- final val loss without validation masking (the loss above is masked, VAL_MASK=1): mean {mean:.4f}"
            + spread + share]


def summary_lines(s: dict) -> list[str]:
    out = [f"- runs: {s['n']}",
           f"- final val loss: mean {s['loss_mean']:.4f}, std {s['loss_std']:.4f}" if s["n"] >= 2 else
           f"- final val loss: {s['loss_mean']:.4f}",
           f"- train time: mean {s['time_mean']:.3f} s, std {s['time_std']:.3f} s" if s["n"] >= 2 else
           f"- train time: {s['time_mean']:.3f} s", target_line(s)]
    if s["n"] >= 2:
        verdict = "yes" if s["p"] < 0.01 else "no"
        out.append(f"- one-sided one-sample t-test, H1: mean final val loss < {s['target']}: "
                   f"t = {s['t']:.4f}, df = {s['df']}, p = {fmt_p(s['p'])} (p < 0.01: {verdict})")
        out.append(seed_line(s["seeds"]))
    else:
        out.append(f"- t-test against target {s['target']}: needs >= 2 runs (have {s['n']})")
    return out


SEED_NOTE = ("runs of one seed start from the same initialization, so the t-test sees GPU nondeterminism "
             "but not initialization variance and overstates its confidence; prove a record with one SEED "
             "per run (on the proxy: std 0.0011 within a seed, 0.0017 across seeds, "
             "records/experiments/2026-11-23_SeedSpreadH100)")


def seed_line(seeds: list) -> str:
    """The runs' initialization seeds (SEED; None: not in the log), and a caution when runs repeat one."""
    shown = ", ".join("?" if x is None else str(x) for x in seeds)
    known = [x for x in seeds if x is not None]
    if len(set(known)) < len(known):
        return f"- seeds: {shown}. Caution: {SEED_NOTE}"
    return f"- seeds: {shown}" + (" (one per run)" if len(known) == len(seeds) else "")


def baseline_lines(s: dict, base_name: str) -> list[str]:
    if "baseline_n" not in s:
        return []
    out = ["", f"## Against baseline {base_name}", ""]
    b = s["baseline"]
    if b is None:
        return out + [f"Welch's t-test needs >= 2 runs on each side (new: {s['n']}, baseline: {s['baseline_n']})."]
    out += [f"Welch's t-test (unequal variances), new ({s['n']} runs) vs baseline ({s['baseline_n']} runs); "
            "difference = new − baseline.", "",
            "| metric | new mean | baseline mean | difference | t | df | p (two-sided) | p (one-sided, new lower) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, label, nd in (("time", "train time (s)", 3), ("loss", "final val loss", 4)):
        w = b[key]
        out.append(f"| {label} | {w['new_mean']:.{nd}f} | {w['base_mean']:.{nd}f} | {w['diff']:+.{nd}f} "
                   f"| {w['t']:.4f} | {w['df']:.2f} | {fmt_p(w['p_two_sided'])} | {fmt_p(w['p_less'])} |")
    return out + paired_lines(s.get("paired"))


def paired_lines(paired: dict | None) -> list[str]:
    if paired is None:
        return ["", "Paired by seed: needs >= 2 seeds that each side ran once (SEED / SEEDS)."]
    seeds, diffs = paired["seeds"], paired["diffs"]
    return ["", f"Paired by seed (final val loss, new − baseline, seeds {', '.join(map(str, seeds))}): "
            f"{' / '.join(f'{d:+.4f}' for d in diffs)}, mean {paired['diff']:+.4f}; paired t = {paired['t']:.4f}, "
            f"df = {paired['df']}, p (two-sided) = {fmt_p(paired['p_two_sided'])}, "
            f"p (one-sided, new lower) = {fmt_p(paired['p_less'])}."]


def setup_lines(runs: list[Run]) -> list[str]:
    r = runs[0]
    ga = f", grad_accum_steps {r.grad_accum_steps}" if r.grad_accum_steps else ""
    host = [f"- host CPU: {joined(runs, 'host_cpu')}"] if any(x.host_cpu for x in runs) else []
    capped = sorted({x.hyperparameters.get("gpu_memory_gib") or 0 for x in runs} - {0})
    cap = [f"- GPU memory: the allocator capped at {' / '.join(f'{c:g}' for c in capped)} GiB (GPU_MEMORY_GIB)"] \
        if capped else []
    return [f"- hardware: {r.hardware}", *host, *cap, f"- mode: {r.mode} (world_size {r.world_size}{ga})",
            f"- data: {r.data}", f"- software: {joined(runs, 'software')}"]


def val_loss_figure(runs: list[Run], target: float, title: str):
    """The matplotlib figure of val_loss.png: val loss against training time and against step, one
    line per run labelled by its full run id (runs of one SEEDS= process differ only at the end)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    tail = [loss for r in runs for step, _, loss in r.val if step > 0 and math.isfinite(loss)]
    for r in runs:
        steps, secs, losses = zip(*r.val)
        axes[0].plot(secs, losses, marker=".", label=r.run_id)
        axes[1].plot(steps, losses, marker=".", label=r.run_id)
    for ax, xlabel in zip(axes, ("training time (s)", "step")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
        if tail:
            lo, hi = min(tail + [target]), max(tail + [target])
            ax.set_ylim(lo - 0.05 * (hi - lo + 0.1), hi + 0.05 * (hi - lo + 0.1))
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(runs: list[Run], out: Path, target: float, title: str) -> None:
    fig = val_loss_figure(runs, target, title)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)


def write_stats(folder: Path, runs: list[Run], target: float, baseline_dir: Path | None = None,
                plot: bool = True, root: Path = REPO_ROOT, final_windows: str | None = None) -> dict:
    """statistics.md (and val_loss.png) of `runs`; final_windows: score every run, baseline too, by
    that bench/eval_windows.py setting instead of its final validation."""
    runs = scored_by_final_windows(runs, final_windows)
    baseline = (scored_by_final_windows(load_runs(baseline_dir, root), final_windows) if baseline_dir is not None
                else None)
    s = summarize(runs, target, baseline)
    cmd = f"python records/tool.py stats {rel(folder, root)} --target {target}" + (
        f" --baseline {rel(baseline_dir, root)}" if baseline_dir is not None else "") + ("" if plot else " --no-plot") + (
        f" --final-windows {shlex.quote(final_windows)}" if final_windows else "")
    mixed = mixed_overrides(runs)
    scored = ([f"Final val loss: each log's `final_windows {final_windows}` line (bench/eval_windows.py), not "
               "its run's final validation.", ""] if final_windows else [])
    md = [f"# Statistics: {folder.name}", "", f"Generated from {len(runs)} log(s) by `{cmd}`.", "", *scored,
          *setup_lines(runs), "", "## Runs", "", runs_table(runs, target), "", "## Summary", "", *summary_lines(s),
          *unmasked_lines(runs), *([f"- Warning: {mixed}"] if mixed else []), *repeated_data_lines(runs, "- Warning: "),
          *baseline_lines(s, baseline_dir.name if baseline_dir else "")]
    stages = stage_table({folder.name: runs, **({baseline_dir.name: baseline} if baseline else {})})
    if stages:
        md += ["", "## ms/step per stage", "", "Train-time differences between the step lines at each stage's "
               "start and end (means over runs).", "", *stages]
    if baseline and (baseline[0].hardware, baseline[0].mode, baseline[0].data) != (runs[0].hardware, runs[0].mode, runs[0].data):
        md += ["", "Note: the baseline ran on different hardware/mode/data "
               f"({baseline[0].hardware}, {baseline[0].mode}, {baseline[0].data.split()[0]}); the comparison is not like for like."]
    if plot:
        md += ["", "![val loss](val_loss.png)"]
    (folder / "statistics.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    if plot:
        plot_runs(runs, folder / "val_loss.png", target, folder.name)
    return s


# ---------------------------------------------------------------- record folders

def record_sequence(folder: Path) -> int:
    """The record's sequence among the records of its date: record.json's {"sequence": N} (N >= 1),
    which `new` writes; 0 for a folder without the file (made before it existed)."""
    f = folder / RECORD_JSON
    if not f.is_file():
        return 0
    try:
        sequence = json.loads(f.read_text(encoding="utf-8"))["sequence"]
    except (OSError, ValueError, KeyError, TypeError):
        sequence = None
    if type(sequence) is not int or sequence < 1:
        raise RecordsError(f'{f}: expected {{"sequence": N}} with a whole number N >= 1 (the record\'s place '
                           "among the records of its date)")
    return sequence


def record_key(folder: Path) -> tuple[str, int, str]:
    """The order of records: date, then sequence within the date (record.json, written by `new`, so
    a record made later on a day comes later whatever its name), then name (ties, and folders
    without record.json: sequence 0, before the numbered ones of their date)."""
    date, name = RECORD_RE.match(folder.name).groups()
    return date, record_sequence(folder), name


def list_records(records_dir: Path) -> list[Path]:
    """Record folders (YYYY-MM-DD_Name) in record order (record_key)."""
    if not records_dir.is_dir():
        return []
    found = [p for p in records_dir.iterdir() if p.is_dir() and RECORD_RE.match(p.name)]
    return sorted(found, key=record_key)


def next_sequence(records_dir: Path, date: str) -> int:
    """The sequence of a new record of `date`: one more than the largest among that date's records."""
    return 1 + max((record_sequence(p) for p in list_records(records_dir) if record_key(p)[0] == date), default=0)


def predecessor(records_dir: Path, key: tuple[str, int, str]) -> Path | None:
    """The last record before `key` (a record_key) in record order."""
    before = [p for p in list_records(records_dir) if record_key(p) < key]
    return before[-1] if before else None


def resolve_record(arg: str, records_dir: Path) -> Path:
    p = Path(arg)
    if not p.is_dir():
        p = records_dir / arg
    if not p.is_dir() or not RECORD_RE.match(p.name):
        raise RecordsError(f"{arg}: not a record folder (expected records/YYYY-MM-DD_Name)")
    return p


def read_source(folder: Path) -> list[str]:
    f = folder / "train_gpt.py"
    if not f.is_file():
        raise RecordsError(f"{f}: missing")
    return f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)


def unified(a: list[str], b: list[str], fa: str, fb: str) -> list[str]:
    out = []
    for ln in difflib.unified_diff(a, b, fa, fb):
        out.append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
    return out


def diff_stat(diff: list[str]) -> tuple[int, int]:
    body = [ln for ln in diff if not ln.startswith(("+++", "---"))]
    return sum(ln.startswith("+") for ln in body), sum(ln.startswith("-") for ln in body)


def rel(p: Path, root: Path) -> str:
    """p relative to the repo root where possible (keeps generated files free of local paths)."""
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return p.name


# ---------------------------------------------------------------- table

def record_row(folder: Path, repo: Path | None = None) -> str:
    runs = load_runs(folder, repo)
    date, name = RECORD_RE.match(folder.name).groups()
    times = [x.train_time for x in runs]
    loss = statistics.fmean(x.final_loss for x in runs)
    r = runs[0]
    return (f"| {date} | [{name}](records/{folder.name}) | {fmt_pm(statistics.fmean(times), _std(times), 1)} "
            f"| {loss:.4f} | {len(runs)} | {r.hardware} | {r.mode} | {r.data.split()[0] if r.data else ''} |")


def make_table(records_dir: Path, repo: Path | None = None) -> str:
    rows = ["| date | name | time (s, mean ± std) | final val loss (mean) | runs | hardware | mode | data |",
            "|---|---|---:|---:|---:|---|---|---|"]
    rows += [record_row(p, repo) for p in list_records(records_dir)]
    return "\n".join(rows) + "\n"


def split_readme(text: str, readme: Path) -> tuple[str, str, str]:
    a, b = text.find(TABLE_START), text.find(TABLE_END)
    if a < 0 or b < 0 or b < a or text.count(TABLE_START) > 1 or text.count(TABLE_END) > 1:
        raise RecordsError(f"{readme}: needs exactly one '{TABLE_START}' line followed by one '{TABLE_END}' line")
    a += len(TABLE_START)
    return text[:a], text[a:b], text[b:]


# ---------------------------------------------------------------- commands

def find_folder(arg: str, root: Path, recorded: bool = False) -> Path:
    """A folder as given (unless recorded: statistics.md names it relative to the repository root),
    relative to the repository root, or a record's name in records/."""
    for p in ([] if recorded else [Path(arg)]) + [root / arg]:
        if p.is_dir():
            return p
    return resolve_record(arg, root / "records")


def recorded_options(md: Path, text: str) -> dict:
    """target, baseline, no_plot and final_windows of the `stats` command named in statistics.md's
    'Generated ... by' line."""
    m = GENERATED_RE.search(text)
    if not m:
        raise RecordsError(f"{md} has no 'Generated ... by `python records/tool.py stats ...`' line, so its target "
                           "and baseline are unknown: move it away to write a new one")
    options = {"target": None, "baseline": None, "no_plot": False, "final_windows": None}
    tokens = iter(shlex.split(m.group(1))[1:])
    for token in tokens:
        if token == "--no-plot":
            options["no_plot"] = True
        elif token in ("--target", "--baseline", "--final-windows") and (value := next(tokens, None)) is not None:
            options[token[2:].replace("-", "_")] = value
        else:
            raise RecordsError(f"{md}: cannot read {token!r} in the command of its 'Generated ... by' line")
    try:
        options["target"] = float(options["target"]) if options["target"] is not None else None
    except ValueError:
        raise RecordsError(f"{md}: --target {options['target']!r} of its 'Generated ... by' line is not a number") from None
    return options


def cmd_stats(args) -> int:
    """Options not given keep the values of the existing statistics.md (its 'Generated ... by' command),
    so regenerating a record's statistics never drops its target or baseline."""
    folder = Path(args.dir)
    runs = load_runs(folder, args.root)
    md = folder / "statistics.md"
    before = md.read_text(encoding="utf-8") if md.is_file() else None
    kept = recorded_options(md, before) if before is not None else {}
    target = args.target if args.target is not None else kept.get("target") or DEFAULT_TARGET
    baseline = args.baseline or kept.get("baseline")
    no_plot = args.no_plot or kept.get("no_plot", False)
    final_windows = args.final_windows or kept.get("final_windows")
    for option, given, old in (("--target", args.target, kept.get("target")),
                               ("--baseline", args.baseline, kept.get("baseline")),
                               ("--final-windows", args.final_windows, kept.get("final_windows"))):
        if given is not None and old is not None and given != old:
            print(f"note: {md} was made with {option} {old}; now {given}")
    base = find_folder(baseline, args.root, recorded=args.baseline is None) if baseline else None
    mixed = mixed_overrides(runs)
    if mixed:
        print(f"warning: {mixed}", file=sys.stderr)
    s = write_stats(folder, runs, target, base, plot=not no_plot, root=args.root, final_windows=final_windows)
    print(f"{folder}: {s['n']} run(s), {runs[0].hardware}, {runs[0].mode}, data {runs[0].data.split()[0]}")
    print("\n".join(run_target_lines(s, [r.path.name for r in runs]) + summary_lines(s)
                    + repeated_data_lines(runs, "warning: ", full_path=True)
                    + baseline_lines(s, base.name if base else "")))
    after = md.read_text(encoding="utf-8")
    if before is None:
        print(f"wrote {md}")
    elif before == after:
        print(f"{md}: unchanged")
    else:
        changed = sum(ln[:1] in "+-" for ln in difflib.ndiff(before.splitlines(), after.splitlines()))
        print(f"updated {md} (lines added or removed: {changed}; git diff shows them)")
    if not no_plot:
        print(f"wrote {folder / 'val_loss.png'}")
    return 0


def cmd_new(args) -> int:
    if not NAME_RE.match(args.name):
        raise RecordsError(f"record name {args.name!r} must be CamelCase (letters and digits, starting upper-case)")
    try:
        date = datetime.date.fromisoformat(args.date).isoformat() if args.date else datetime.date.today().isoformat()
    except ValueError:
        raise RecordsError(f"--date {args.date!r}: expected YYYY-MM-DD") from None
    records_dir = Path(args.records_dir) if args.records_dir else args.root / "records"
    folder = records_dir / f"{date}_{args.name}"
    if folder.exists():
        raise RecordsError(f"{folder}: already exists")
    logs = [Path(x) for x in args.logs]
    runs = parse_arm(logs, args.root)
    if mixed := mixed_overrides(runs):
        print(f"warning: {mixed}", file=sys.stderr)
    lease_logs = [Path(x) for x in args.baseline or []]
    if lease_logs:
        check_lease_baseline(lease_logs, runs, logs, args.root)
    import matplotlib  # noqa: F401  (tool extras: fail before creating anything)
    import scipy  # noqa: F401
    sequence = next_sequence(records_dir, date)
    prev = predecessor(records_dir, (date, sequence, args.name))
    baseline = None
    if lease_logs:
        baseline = folder / LEASE_BASELINE
    elif prev is not None:
        try:
            prev_runs = load_runs(prev, args.root)
            if (prev_runs[0].hardware, prev_runs[0].mode, prev_runs[0].data) == (runs[0].hardware, runs[0].mode, runs[0].data):
                baseline = prev
        except RecordsError:
            pass
    folder.mkdir(parents=True)
    try:
        for p in logs:  # a record keeps full logs: a slim one is written back in full
            (folder / p.name).write_bytes(full_bytes(p.read_bytes(), str(p), args.root))
        if lease_logs:
            (folder / LEASE_BASELINE).mkdir()
            for p in lease_logs:
                (folder / LEASE_BASELINE / p.name).write_bytes(full_bytes(p.read_bytes(), str(p), args.root))
        (folder / "train_gpt.py").write_bytes(runs[0].source)
        (folder / RECORD_JSON).write_text(json.dumps({"sequence": sequence}) + "\n", encoding="utf-8")
        runs = load_runs(folder, args.root)
        s = write_stats(folder, runs, args.target, baseline, root=args.root)
        (folder / "README.md").write_text(new_readme(folder, runs, s, prev, baseline), encoding="utf-8")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    print(f"created {folder}: {len(runs)} log(s), train_gpt.py, {RECORD_JSON} (sequence {sequence} of {date}), "
          "statistics.md, val_loss.png, README.md")
    print("\n".join(summary_lines(s)))
    print(f"next: edit {folder / 'README.md'} (describe the change), then `python records/tool.py table --write`")
    return 0


LEASE_BASELINE = "baseline"  # new --baseline: the baseline's logs from the record's own lease, in this subfolder


def parse_arm(logs: list[Path], root: Path, what: str = "") -> list[Run]:
    """The runs of one arm's logs for `new` (the record's, or `what` = "--baseline: " the baseline's): *.txt, names
    of their own, one train_gpt.py source, one hardware, mode and data."""
    for p in logs:
        if p.suffix != ".txt":
            raise RecordsError(f"{what}{p}: log files must be named *.txt")
    if len({p.name for p in logs}) != len(logs):
        raise RecordsError(f"{what}two logs have the same file name")
    runs = [parse_log(p, repo=root) for p in logs]
    for r in runs[1:]:
        if r.source != runs[0].source:
            raise RecordsError(f"{what}logs come from different sources: the train_gpt.py embedded in {runs[0].path} "
                               f"differs from the one in {r.path}")
    check_consistent(runs)
    return runs


def check_lease_baseline(lease_logs: list[Path], runs: list[Run], logs: list[Path], root: Path) -> None:
    """new --baseline's logs: parse_arm's checks, no run id of the record's, the record's hardware, mode and data."""
    base_runs = parse_arm(lease_logs, root, "--baseline: ")
    if {r.run_id for r in base_runs} & {r.run_id for r in runs}:
        raise RecordsError("--baseline: a baseline log has the run id of one of the record's logs (given twice?)")
    key = (runs[0].hardware, runs[0].mode, runs[0].data)
    if (base_runs[0].hardware, base_runs[0].mode, base_runs[0].data) != key:
        raise RecordsError(f"--baseline: {lease_logs[0]} ran on other hardware, mode or data than {logs[0]} "
                           f"({base_runs[0].hardware}, {base_runs[0].mode}; the record: {key[0]}, {key[1]}): "
                           "a baseline for the record's times runs beside it, in its lease")


def new_readme(folder: Path, runs: list[Run], s: dict, prev: Path | None, baseline: Path | None) -> str:
    date, name = RECORD_RE.match(folder.name).groups()
    r = runs[0]
    md = [f"# {name} ({date})", "", "## Changes against the previous record", ""]
    if prev is None:
        md += ["This is the first record: there is no previous record to compare with.", "",
               "TODO: describe the setup of this record."]
    else:
        d = unified(read_source(prev), read_source(folder), f"records/{prev.name}/train_gpt.py",
                    f"records/{folder.name}/train_gpt.py")
        plus, minus = diff_stat(d)
        md += [f"Previous record: [{prev.name}](../{prev.name}/).", "",
               "TODO: describe what changed against the previous record and why it helps.", "",
               f"`train_gpt.py` against the previous record: +{plus} −{minus} lines "
               f"(`python records/tool.py diff records/{folder.name}`)."]
    md += ["", "## Setup", "", f"- hardware: {r.hardware}",
           f"- mode: {r.mode} (world_size {r.world_size}" + (f", grad_accum_steps {r.grad_accum_steps})" if r.grad_accum_steps else ")"),
           f"- data: {r.data}",
           f"- Python: {joined(runs, 'python')}",
           f"- PyTorch: {joined(runs, 'torch')} (CUDA {joined(runs, 'cuda')})",
           f"- Triton: {joined(runs, 'triton')}"]
    if any(x.driver for x in runs):
        md.append(f"- NVIDIA driver: {joined(runs, 'driver')}")
    if any(x.host_cpu for x in runs):
        md.append(f"- host CPU: {joined(runs, 'host_cpu')}")
    md += ["", "## Results", "", runs_table(runs, s["target"]), "", *summary_lines(s)]
    if baseline is not None and baseline.parent == folder and s.get("baseline"):
        md += baseline_lines(s, f"in the same lease ([{baseline.name}/]({baseline.name}/))")
    elif baseline is not None and s.get("baseline"):
        md += baseline_lines(s, f"[{baseline.name}](../{baseline.name}/)")
        md += ["", f"{baseline.name} ran in another lease: its times compare with these only as far as the "
               "lease-to-lease spread allows (`new --baseline LOGS` takes a baseline run beside the record)."]
    elif prev is not None and baseline is None:
        md += ["", f"Not compared with {prev.name}: it ran on different hardware, mode or data (or has no usable logs)."]
    md += ["", "Details: [statistics.md](statistics.md).", "", *reproduce_lines(folder, runs), "",
           "![val loss](val_loss.png)"]
    return "\n".join(md) + "\n"


REPRODUCE_DROPS = ("RUN_ID", "LOG_DIR", "SEED", "SEEDS", "TOKENIZER_DIR")  # the seeds are listed; data/gpt2 is the default


def reproduce_command(r: Run, seeds: list[int]) -> list[str]:
    """The runs' command on a user's machine: their overrides with the data at the repository's
    paths (proxy: data/proxy/, the shards the runs read; FineWeb: the file's defaults), every seed.
    Two lines joined by &&: `train_gpt.py --check` with those settings first (settings, input files,
    GPUs, in one process, as run.sh does), so a bad machine gives one line, not torchrun's report."""
    kind, env = r.data.split(" ", 1)[0], []
    for token in shlex.split(r.overrides):
        key, _, value = token.partition("=")
        if key in REPRODUCE_DROPS or (key in ("TRAIN_FILES", "VAL_FILES") and kind == "FineWeb"):
            continue
        if key in ("TRAIN_FILES", "VAL_FILES") and kind == "proxy":
            value = "data/proxy/" + os.path.basename(value)
            if key == "TRAIN_FILES" and "*" in value and 0 < r.train_file_count <= 9:
                value = value.replace("*", f"00000[1-{r.train_file_count}]", 1)  # the shards the run cycled over
        env.append(f"{key}={shlex.quote(value)}")
    env.append("SEEDS=" + ",".join(map(str, seeds)))
    settings = " ".join(env)
    return [f"{settings} WORLD_SIZE={r.world_size} python train_gpt.py --check &&",
            f"{settings} torchrun --standalone --nproc_per_node={r.world_size} train_gpt.py"]


def reproduce_lines(folder: Path, runs: list[Run]) -> list[str]:
    r = runs[0]
    kind = r.data.split(" ", 1)[0]
    seeds = sorted({int(x.hyperparameters.get("seed", 0)) for x in runs})
    md = ["## Reproduce", ""]
    prepare = {"proxy": ("The proxy corpus is not in the repository: `python data/proxy_corpus.py` rebuilds it from its "
                         "public sources into `data/proxy/` and checks every shard against `data/proxy_manifest.json`.",
                         "python data/proxy_corpus.py"),
               "FineWeb": ("`python data/cached_fineweb10B.py 9` downloads the FineWeb shards into the file's default "
                           "paths.", "python data/cached_fineweb10B.py 9")}.get(kind)
    if prepare:
        md += [prepare[0], ""]
    else:
        md += [f"The runs read their own data ({r.data}): point TRAIN_FILES / VAL_FILES at yours.", ""]
    md += ["From the repository root, run this folder's `train_gpt.py` in place of the root's (defaults in the "
           "file; the logs echo every hyperparameter); `git checkout train_gpt.py` puts main's back. "
           "`--check` first checks the settings, the input files and the GPUs in one process, so a machine "
           "that cannot run it says why in one line:", "", "```bash",
           *([prepare[1]] if prepare else []), f"cp records/{folder.name}/train_gpt.py train_gpt.py",
           *reproduce_command(r, seeds), "```"]
    if kind != "FineWeb" or r.world_size != 8 or r.mode != "full-batch":
        md += ["", f"**Not a FineWeb 8-GPU result**: every number above is {kind} data, {r.mode}, {r.hardware}."]
    return md


def cmd_diff(args) -> int:
    records_dir = args.root / "records"
    recs = list_records(records_dir)
    if args.dir:
        cur = resolve_record(args.dir, records_dir)
    elif recs:
        cur = recs[-1]
    else:
        raise RecordsError(f"no record folders in {records_dir}")
    if args.working:
        work = args.root / "train_gpt.py"
        if not work.is_file():
            raise RecordsError(f"{work}: missing")
        a, b = read_source(cur), work.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        fa, fb = f"records/{cur.name}/train_gpt.py", "train_gpt.py"
    else:
        prev = predecessor(cur.parent, record_key(cur))
        if prev is None:
            raise RecordsError(f"{cur.name} is the first record: no previous record to diff against")
        a, b = read_source(prev), read_source(cur)
        fa, fb = f"records/{prev.name}/train_gpt.py", f"records/{cur.name}/train_gpt.py"
    d = unified(a, b, fa, fb)
    sys.stdout.writelines(d)
    if not d:
        print(f"no differences between {fa} and {fb}", file=sys.stderr)
    return 0


def cmd_table(args) -> int:
    table = make_table(args.root / "records", args.root)
    if not (args.write or args.check):
        sys.stdout.write(table)
        return 0
    readme = args.root / "README.md"
    if not readme.is_file():
        raise RecordsError(f"{readme}: missing")
    text = readme.read_text(encoding="utf-8")
    head, block, tail = split_readme(text, readme)
    if args.write:
        new = head + "\n" + table + tail
        if new != text:
            readme.write_text(new, encoding="utf-8")
            print(f"updated the records table in {readme}")
        else:
            print(f"records table in {readme} already up to date")
        return 0
    current, generated = block.strip().splitlines(), table.strip().splitlines()
    if current == generated:
        print(f"records table in {readme} is in sync with records/")
        return 0
    for line in difflib.unified_diff(current, generated, "README.md (records table)", "generated from records/",
                                     lineterm=""):
        print(line)
    print(f"records table in {readme} is out of date: run `python records/tool.py table --write`", file=sys.stderr)
    return 1


def ablation_groups(runs: list[Run], baseline: str = "defaults") -> dict[str, list[Run]]:
    """Runs grouped by the environment overrides that not every run shares ("defaults": none); the
    group named `baseline` must be among them."""
    tokens = [configuration(r) for r in runs]
    shared = set.intersection(*tokens)
    groups: dict[str, list[Run]] = {}
    for r, own in zip(runs, tokens):
        groups.setdefault(" ".join(sorted(own - shared)) or "defaults", []).append(r)
    if baseline not in groups:
        wanted = ("no run with only the shared overrides: add a run of the defaults to compare against"
                  if baseline == "defaults" else f"no run has exactly the overrides {baseline!r} beside the shared ones")
        raise RecordsError(f"{wanted} (overrides seen: {', '.join(sorted(groups))}; --baseline names another)")
    return groups


def ablation_table(runs: list[Run], baseline: str = "defaults") -> str:
    """Final val loss and train time per configuration against the baseline configuration (the
    defaults unless named), its difference paired by seed where two or more seeds pair up, then val
    loss at every validation step (means over each one's runs)."""
    check_consistent(runs)
    for r in runs[1:]:
        if r.source != runs[0].source:
            raise RecordsError(f"{r.path} and {runs[0].path} ran different train_gpt.py sources: "
                               "an ablation compares switches of one source")
    baseline = " ".join(sorted(baseline.split())) or "defaults"
    groups = ablation_groups(runs, baseline)
    base_loss = statistics.fmean(r.final_loss for r in groups[baseline])
    base_time = statistics.fmean(r.train_time for r in groups[baseline])
    order = sorted(groups, key=lambda g: (g != baseline, -statistics.fmean(r.final_loss for r in groups[g])))
    vs = "vs defaults" if baseline == "defaults" else f"vs {baseline}"
    out = [f"| overrides | runs | final val loss | {vs} | paired by seed (seeds, p two-sided) | train time (s) | {vs} |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for g in order:
        loss = statistics.fmean(r.final_loss for r in groups[g])
        secs = statistics.fmean(r.train_time for r in groups[g])
        paired = paired_by_seed(groups[g], groups[baseline]) if g != baseline else None
        pairs = "" if g == baseline else "n/a" if paired is None else (
            f"{paired['diff']:+.4f} ({len(paired['seeds'])}, p {fmt_p(paired['p_two_sided'])})")
        out.append(f"| {g} | {len(groups[g])} | {loss:.4f} | {loss - base_loss:+.4f} | {pairs} | {secs:.2f} | "
                   f"{100 * (secs / base_time - 1):+.1f}% |")
    stages = stage_table({g: groups[g] for g in order})
    out += ["", *stages] if stages else []
    steps = sorted(set.intersection(*({s for s, _, _ in r.val} for r in runs)))
    out += ["", "| overrides | " + " | ".join(f"step {s}" for s in steps) + " |",
            "|---|" + "---:|" * len(steps)]
    for g in order:
        means = [statistics.fmean(loss for r in groups[g] for s, _, loss in r.val if s == step) for step in steps]
        out.append(f"| {g} | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    return "\n".join(out) + "\n"


def cmd_ablation(args) -> int:
    runs = scored_by_final_windows([parse_log(p, repo=args.root) for p in args.logs], args.final_windows)
    sys.stdout.write(ablation_table(runs, args.baseline))
    return 0


LOSS_KINDS = {"train": "train loss", "val": "val loss"}
DEFAULT_TOLERANCE = 5e-3  # compare's bound without --noise: bf16 reorderings of the tiny CPU runs stay below it


def logged_losses(run: Run, kind: str) -> dict[int, float]:
    """step -> train loss (TRAIN_LOSS_EVERY lines) or val loss."""
    return run.train_losses if kind == "train" else {step: loss for step, _, loss in run.val}


def largest_difference(a: Run, b: Run, kind: str, steps: list[int]) -> tuple[float, int]:
    """(max |a - b| of the kind's losses over steps, the step where it occurs)."""
    la, lb = logged_losses(a, kind), logged_losses(b, kind)
    step = max(steps, key=lambda s: abs(la[s] - lb[s]))
    return abs(la[step] - lb[step]), step


def check_noise_pair(a: Run, b: Run, option: str = "--noise") -> None:
    """Refuse a pair of noise runs that are not runs of one configuration: for --noise, run_id and log_dir
    aside (the same seed: the nondeterminism floor); for --repeats, the seeds aside too (repeats of one
    configuration with different seeds are a seed-noise floor)."""
    free = ("run_id", "log_dir") + (("seed", "seeds") if option == "--repeats" else ())
    ha, hb = ({k: v for k, v in r.hyperparameters.items() if k not in free} for r in (a, b))
    differ = sorted(k for k in ha.keys() | hb.keys() if ha.get(k) != hb.get(k))
    differ += [attr for attr in ("hardware", "mode", "world_size") if getattr(a, attr) != getattr(b, attr)]
    if differ and option == "--repeats":
        raise RecordsError(f"--repeats logs {a.path} and {b.path} differ in {', '.join(differ)}: the repeats must be "
                           "runs of one configuration (they may differ only in seed, seeds, run_id and log_dir)")
    if differ:
        raise RecordsError(f"--noise logs {a.path} and {b.path} differ in {', '.join(differ)}: "
                           "the noise floor needs two runs of one configuration")


def verdict(diff: float, floor: float | None, tolerance: float | None) -> tuple[str, bool]:
    """A difference judged against the noise floor (when there is one) and the tolerance."""
    if floor is None:
        tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
        if diff <= tolerance:
            return f"within tolerance {tolerance:g} ({diff:.4f})", True
        return f"beyond tolerance {tolerance:g} by {diff - tolerance:.4f} ({diff:.4f})", False
    if diff <= floor:
        return f"within noise ({diff:.4f} <= {floor:.4f})", True
    if tolerance is not None and diff <= tolerance:
        return f"beyond noise by {diff - floor:.4f} but within tolerance {tolerance:g} ({diff:.4f})", True
    return f"beyond noise by {diff - floor:.4f} ({diff:.4f} vs {floor:.4f})", False


def comparison(runs: list[Run], noise: list[tuple[Run, Run]], kinds: list[str],
               tolerance: float | None, repeats: list[Run] | None = None) -> tuple[str, bool]:
    """Per-step equivalence of runs that should compute the same training (1 GPU with accumulation
    against 2, 4 or 8 GPUs): for each run against the first, the largest difference of each kind of
    loss over the steps every log has, judged against the same difference between the --noise pairs
    (repeats of one configuration: the nondeterminism floor) or, without them, against the tolerance.
    With repeats (--repeats), every run is a candidate measured against each repeat, the noise pairs
    are all pairs of repeats (which may differ in their seeds: a seed-noise floor), and a candidate's
    difference is the median over the repeats: a run of
    the repeats' own distribution lies as far from them as they lie from each other, whichever
    repeat happens to be the outlier."""
    if repeats:
        noise = list(itertools.combinations(repeats, 2))
    for a, b in noise:
        check_noise_pair(a, b, "--repeats" if repeats else "--noise")
    logs = runs + [r for pair in noise for r in pair]
    if "train" in kinds:
        for r in logs:
            if not r.train_losses:
                raise RecordsError(f"{r.path}: no train_loss in its step lines; rerun with TRAIN_LOSS_EVERY=1 "
                                   "(or compare val losses alone: --only val)")
    steps = {}
    for kind in kinds:
        steps[kind] = sorted(set.intersection(*(set(logged_losses(r, kind)) for r in logs)))
        if not steps[kind]:
            raise RecordsError(f"the logs have no {LOSS_KINDS[kind]} step in common")
    floor = {kind: max((largest_difference(a, b, kind, steps[kind])[0] for a, b in noise), default=None)
             for kind in kinds}

    def setup(r: Run) -> str:
        return f"{r.mode}, world {r.world_size}, accumulation {r.grad_accum_steps}"

    def row(label: str, r: Run, cells) -> str:
        return (f"| {label} | {setup(r)} | {r.last_step} | {r.step_avg_ms:.2f} | "
                + " | ".join(f"{d:.4f} ({s})" for d, s in cells) + " |")

    out = ["| log | setup | steps | ms/step | " + " | ".join(f"max abs {LOSS_KINDS[k]} diff (step)" for k in kinds) + " |",
           "|---|---|---:|---:|" + "---:|" * len(kinds)]
    references = repeats or runs[:1]
    if not repeats:
        out.append(f"| {runs[0].path} (base) | {setup(runs[0])} | {runs[0].last_step} | {runs[0].step_avg_ms:.2f} |"
                   + " |" * len(kinds))
    for a, b in noise:
        out.append(row(f"noise: {a.path} vs {b.path}", a, [largest_difference(a, b, kind, steps[kind]) for kind in kinds]))
    verdicts, ok = [], True
    for r in (runs if repeats else runs[1:]):
        diffs = {kind: [] for kind in kinds}
        for ref in references:
            cells = [largest_difference(r, ref, kind, steps[kind]) for kind in kinds]
            out.append(row(f"{r.path} vs {ref.path}" if repeats else str(r.path), r, cells))
            for kind, (d, _) in zip(kinds, cells):
                diffs[kind].append(d)
        judged = [(kind, *verdict(statistics.median(diffs[kind]), floor[kind], tolerance)) for kind in kinds]
        ok &= all(good for _, _, good in judged)
        how = f" (median over {len(references)} repeats)" if repeats else ""
        verdicts.append(f"{r.path}{how}: " + "; ".join(f"{LOSS_KINDS[kind]} {text}" for kind, text, _ in judged))
    counted = ", ".join(f"{len(steps[k])} {LOSS_KINDS[k]} steps" for k in kinds)
    return "\n".join(out + ["", f"Over the steps every log has ({counted}):", *verdicts]) + "\n", ok


def planned_last_step(run: Run) -> int:
    """The step of the run's last validation as planned: STOP_AFTER's (hyperparameters' stop_after)
    when it is set, else the schedule's last (the step lines' total)."""
    stop_after = run.hyperparameters.get("stop_after")
    return stop_after if type(stop_after) is int and stop_after > 0 else run.total


def parse_finished_log(path, repo: Path | None = None) -> Run:
    """A log that reached its planned last step: a complete run, or one stopped early on purpose
    (STOP_AFTER, which validates there); an interrupted run is refused in one line."""
    run = parse_log(path, complete=False, repo=repo)
    if not run.total:
        raise RecordsError(f"{run.path}: incomplete run: no step lines (it stopped before its first step)")
    planned = planned_last_step(run)
    if not any(step == planned for step, _, _ in run.val):
        where = (f"it stopped at step {run.last_step}/{planned}, before its planned last step (interrupted?)"
                 if run.last_step < planned else f"no validation at its last step {planned} (interrupted in it?)")
        raise RecordsError(f"{run.path}: incomplete run: {where}; compare reads complete runs and runs stopped "
                           "early with STOP_AFTER")
    return run


def cmd_compare(args) -> int:
    if args.repeats is not None:
        if args.noise:
            raise RecordsError("give --repeats or --noise, not both: --repeats takes every pair of its runs as noise")
        if len(args.repeats) < 2:
            raise RecordsError("--repeats needs at least two runs of one configuration (three make a sturdier floor)")
    elif len(args.logs) < 2:
        raise RecordsError("give at least two logs: the base and one to compare with it (or --repeats LOGS...)")
    runs = [parse_finished_log(p, args.root) for p in args.logs]
    noise = [(parse_finished_log(a, args.root), parse_finished_log(b, args.root)) for a, b in args.noise or []]
    repeats = [parse_finished_log(p, args.root) for p in args.repeats] if args.repeats is not None else None
    kinds = [args.only] if args.only else list(LOSS_KINDS)
    report, ok = comparison(runs, noise, kinds, args.tolerance, repeats)
    sys.stdout.write(report)
    judged = "noise" if noise or repeats else "tolerance"
    print(f"all within {judged}" if ok else f"a difference lies beyond {judged} (exit code 1)")
    return 0 if ok else 1


def stage_report(run: Run) -> list[str]:
    """Lines for `stages`: each stage's ms/step over the step indices it covers (from the logged stage
    table, stage_bounds; cut at the last step of a run that stopped early), then the train time."""
    out = [f"{run.path} (run_id {run.run_id})"]
    bounds = stage_bounds(run)
    if not run.total:
        return out + ["  no step lines"]
    if not bounds:
        out.append("  no stage table in the logged hyperparameters (num_scheduled_iterations and stages)")
    for label, first, end in bounds:
        reached = min(end, run.last_step)
        if reached <= first:
            out.append(f"  {label} (steps {first}-{end - 1}): not reached")
            continue
        part = "" if reached == end else f" of {first}-{end - 1}, stopped at step {reached}"
        ta, tb = run.train_ms.get(first), run.train_ms.get(reached)
        ms = "n/a (a step line at its ends is missing)" if ta is None or tb is None else \
            f"{(tb - ta) / (reached - first):.2f} ms/step"
        out.append(f"  {label} (steps {first}-{reached - 1}{part}): {ms}")
    if math.isfinite(run.train_time):
        out.append(f"  total train_time {run.train_time:.3f} s ({run.total} steps)")
    else:
        planned = planned_last_step(run)
        how = (f"stopped early with STOP_AFTER={planned}" if planned < run.total and run.last_step == planned
               else "interrupted")
        out.append(f"  train_time {run.train_ms[run.last_step] / 1000:.3f} s at step {run.last_step} of {run.total} "
                   f"({how})")
    return out


def cmd_stages(args) -> int:
    runs = [parse_log(p, complete=False, repo=args.root) for p in args.logs]
    for run in runs:
        print("\n".join(stage_report(run)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python records/tool.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=REPO_ROOT,
                   help="repository root holding README.md, records/ and train_gpt.py (default: this tool's repo)")
    common = argparse.ArgumentParser(add_help=False)  # lets --root also follow the subcommand
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stats", parents=[common], help="statistics.md and val_loss.png for a folder of logs")
    s.add_argument("dir", help="folder holding the *.txt logs (full, slim or xz-compressed as *.txt.xz)")
    s.add_argument("--target", type=float,
                   help=f"val loss target of the t-test (default: the existing statistics.md's, else {DEFAULT_TARGET})")
    s.add_argument("--baseline", help="folder of baseline logs for Welch's t-tests, e.g. the previous record "
                                      "(default: the existing statistics.md's, else none)")
    s.add_argument("--final-windows", metavar="SETTING",
                   help="score every run (baseline too) by its log's `final_windows SETTING` line from "
                        "bench/eval_windows.py, e.g. 'short:6 long:32 yarn:0' (kept like --target)")
    s.add_argument("--no-plot", action="store_true", help="do not draw val_loss.png (kept when statistics.md was "
                                                          "made so)")
    s.set_defaults(func=cmd_stats)
    n = sub.add_parser("new", parents=[common], help="create records/<date>_<NAME>/ from logs")
    n.add_argument("name", help="CamelCase record name")
    n.add_argument("logs", nargs="+", help="the run logs (*.txt) of one train_gpt.py source")
    n.add_argument("--date", help="YYYY-MM-DD (default: today)")
    n.add_argument("--records-dir", help="records folder (default: <root>/records)")
    n.add_argument("--target", type=float, default=DEFAULT_TARGET, help=f"val loss target (default {DEFAULT_TARGET})")
    n.add_argument("--baseline", nargs="+", metavar="LOG",
                   help=f"the baseline's logs from the record's own lease (e.g. the previous record's train_gpt.py run "
                        f"beside it), kept in {LEASE_BASELINE}/ and compared in statistics.md and the README "
                        "(default: the previous record's folder, where it shares hardware, mode and data)")
    n.set_defaults(func=cmd_new)
    d = sub.add_parser("diff", parents=[common], help="unified diff of a record's train_gpt.py against the previous record")
    d.add_argument("dir", nargs="?", help="record folder or its name (default: the latest record)")
    d.add_argument("--working", action="store_true", help="diff the repo-root train_gpt.py against DIR instead")
    d.set_defaults(func=cmd_diff)
    t = sub.add_parser("table", parents=[common], help="the records table for README.md")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="replace the table between the markers in README.md")
    g.add_argument("--check", action="store_true", help="exit 1 if README.md's table is out of date")
    t.set_defaults(func=cmd_table)
    a = sub.add_parser("ablation", parents=[common],
                       help="final val loss and time per set of overrides against the defaults, from logs of one source")
    a.add_argument("logs", nargs="+", help="run logs (*.txt): defaults and runs with switches overridden (e.g. XSA=0)")
    a.add_argument("--baseline", default="defaults",
                   help="the overrides of the runs to compare against, e.g. 'ATTENTION_BACKEND=varlen' "
                        "(default: the runs with none beside the shared ones)")
    a.add_argument("--final-windows", metavar="SETTING",
                   help="score every run by its log's `final_windows SETTING` line from bench/eval_windows.py")
    a.set_defaults(func=cmd_ablation)
    c = sub.add_parser("compare", parents=[common],
                       help="per-step loss differences and ms/step of runs that should match (1 vs 2, 4, 8 GPUs), "
                            "judged against the spread of repeated runs")
    c.add_argument("logs", nargs="+", help="TRAIN_LOSS_EVERY=1 logs, complete or stopped early with STOP_AFTER "
                                           "(not interrupted ones); the first is the base, unless --repeats")
    c.add_argument("--repeats", nargs="+", metavar="LOG",
                   help="repeated runs of the reference configuration (e.g. 1 GPU; the same seed for the "
                        "nondeterminism floor, different seeds for a seed-noise floor): each log is compared with "
                        "every repeat, judged by the median difference against the largest difference between two "
                        "repeats")
    c.add_argument("--noise", nargs=2, action="append", metavar=("LOG_A", "LOG_B"),
                   help="two runs of one configuration (same seed): their largest difference is the noise floor "
                        "the others are judged against; repeat for more pairs (the largest counts)")
    c.add_argument("--tolerance", type=float,
                   help=f"largest accepted difference without --noise (default {DEFAULT_TOLERANCE:g}); with "
                        "--noise, differences beyond the noise floor but within it pass")
    c.add_argument("--only", choices=list(LOSS_KINDS), help="compare only train or only val losses")
    c.set_defaults(func=cmd_compare)
    g = sub.add_parser("stages", parents=[common],
                       help="ms/step of each stage of the logged stage table, and the train time, per log")
    g.add_argument("logs", nargs="+", help="run logs (*.txt), complete or stopped early (STOP_AFTER, interrupted)")
    g.set_defaults(func=cmd_stages)
    sl = sub.add_parser("slim", parents=[common],
                        help="replace the train_gpt.py source embedded in logs by a line naming its git commit and "
                             "blob (where git has that text), in place; `full` restores them")
    sl.add_argument("paths", nargs="+", metavar="PATH",
                    help="logs, .tar.xz archives of logs, or folders (their *.txt, *.out, *.log and *.tar.xz files, "
                         "searched down; record folders keep full logs)")
    sl.set_defaults(func=cmd_slim)
    fu = sub.add_parser("full", parents=[common], help="rebuild the byte-exact original of slim logs from git, in place")
    fu.add_argument("paths", nargs="+", metavar="PATH", help="slim logs, .tar.xz archives of logs, or folders")
    fu.add_argument("--stdout", action="store_true", help="write the one log's original to stdout, leaving the file")
    fu.set_defaults(func=cmd_full)
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        try:
            code = args.func(args)
        except RecordsError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:  # the reader left early (`tool.py diff | head`): stop quietly, as `cat` does
        quiet_stdout()
        return 128 + 13  # a shell's status for a process ended by SIGPIPE


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so the output still buffered for the closed pipe is dropped at exit
    instead of raising there (Python's documented way to handle SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured)
        pass


if __name__ == "__main__":
    sys.exit(main())
