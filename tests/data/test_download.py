"""End-to-end tests of data/cached_fineweb10B.py against a fake Hugging Face hub on loopback."""
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

REPO_PATH = "/datasets/kjj0/fineweb10B-gpt2/resolve/main/"  # what hf_hub_url makes for repo_type="dataset"
TOKENIZER_PATH = "/openai-community/gpt2/resolve/main/"  # the GPT-2 model repo
CDN_PATH = "/cdn/"
NAMES = ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
TOKENIZER_NAMES = ["vocab.json", "merges.txt"]  # saved as encoder.json, vocab.bpe


class FakeHub(ThreadingHTTPServer):
    """Serves `files` under REPO_PATH like the hub: by default it redirects to a "CDN" URL (absolute,
    answering GET only, as a presigned link does) and gives the size in X-Linked-Size; with
    use_cdn=False it serves the files directly. HEAD, GET and Range are supported."""

    def __init__(self, files):
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        self.files = dict(files)
        self.use_cdn = True
        self.requests = []  # (method, file name, Range header, whether it came to the CDN URL)
        self.cut_after = {}  # name -> bytes sent before the connection drops, on the next body GET of it
        self.ignore_range = False

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def gets(self):
        """(name, Range) of the GET requests that were answered with file contents."""
        return [(name, rng) for method, name, rng, at_cdn in self.requests
                if method == "GET" and at_cdn == self.use_cdn]


class FakeHubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.respond(send_body=False)

    def do_GET(self):
        self.respond(send_body=True)

    def respond(self, send_body):
        hub = self.server
        at_cdn = self.path.startswith(CDN_PATH)
        prefix = next((p for p in (CDN_PATH, REPO_PATH, TOKENIZER_PATH) if self.path.startswith(p)), None)
        name = self.path.removeprefix(prefix or "")
        hub.requests.append((self.command, name, self.headers.get("Range"), at_cdn))
        data = hub.files.get(name) if prefix else None
        if data is None:
            self.send_error(404, "Entry not found")
        elif hub.use_cdn and not at_cdn:
            self.send_response(302)
            self.send_header("Location", f"{hub.endpoint}{CDN_PATH}{name}")
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif at_cdn and not send_body:
            self.send_error(403, "signature is for GET")
        else:
            self.send_file(data, send_body)

    def send_file(self, data, send_body):
        hub = self.server
        name = self.path.rsplit("/", 1)[-1]
        start = 0
        if self.headers.get("Range") and not hub.ignore_range:
            start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if send_body:
            cut = hub.cut_after.pop(name, None)
            self.wfile.write(data[start:] if cut is None else data[start:start + cut])
            self.close_connection = cut is not None


def shard_bytes(shards, tmp_path, name, ntokens, seed):
    path = tmp_path / "gen" / name
    path.parent.mkdir(exist_ok=True)
    shards.write_shard(path, np.random.default_rng(seed).integers(0, 50257, ntokens, dtype=np.uint16))
    return path.read_bytes()


def tokenizer_bytes(repo_root):
    """The hub's vocab.json and merges.txt: the bytes of the repository's data/gpt2 files."""
    gpt2 = repo_root / "data" / "gpt2"
    return {"vocab.json": (gpt2 / "encoder.json").read_bytes(), "merges.txt": (gpt2 / "vocab.bpe").read_bytes()}


@pytest.fixture
def files(shards, tmp_path, repo_root):
    shard_files = {name: shard_bytes(shards, tmp_path, name, 700 + 300 * i, seed=i) for i, name in enumerate(NAMES)}
    return shard_files | tokenizer_bytes(repo_root)


@pytest.fixture
def hub(files):
    server = FakeHub(files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def download(repo_root, tmp_path, hub):
    """Run the download script (N=2 train shards into tmp_path/out, the tokenizer into tmp_path/gpt2
    unless tokenizer_dir says otherwise; None: the default) against the fake hub."""
    def run(*args, offline=False, tokenizer_dir=tmp_path / "gpt2"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf_home"),
                   NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        if offline:
            env["HF_HUB_OFFLINE"] = "1"
        command = [sys.executable, str(repo_root / "data" / "cached_fineweb10B.py"), *args,
                   *(["--tokenizer-dir", str(tokenizer_dir)] if tokenizer_dir else [])]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    return run


@pytest.fixture
def out(tmp_path):
    return tmp_path / "out"


def assert_clean_failure(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize("use_cdn", [True, False], ids=["via-cdn-redirect", "direct"])
def test_fresh_download_then_skip_then_offline(download, hub, files, out, tmp_path, use_cdn):
    hub.use_cdn = use_cdn
    result = download("2", "--out-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(NAMES)  # no .part left over
    for name in NAMES:
        assert (out / name).read_bytes() == files[name]
    assert sorted(name for name, _ in hub.gets()) == sorted(NAMES + TOKENIZER_NAMES)
    assert (tmp_path / "gpt2" / "encoder.json").read_bytes() == files["vocab.json"]
    assert (tmp_path / "gpt2" / "vocab.bpe").read_bytes() == files["merges.txt"]

    hub.requests.clear()
    again = download("2", "--out-dir", str(out))
    assert again.returncode == 0 and "already present" in again.stdout
    assert hub.requests == []

    offline = download("2", "--out-dir", str(out), offline=True)
    assert offline.returncode == 0 and "already present" in offline.stdout
    assert hub.requests == []


def test_resume_after_interrupted_transfer(download, hub, files, out):
    name = NAMES[2]
    hub.cut_after[name] = 1500
    first = download("2", "--out-dir", str(out))
    assert_clean_failure(first, name, "1,500", "rerun")
    assert (out / f"{name}.part").stat().st_size == 1500 and not (out / name).exists()

    hub.requests.clear()
    second = download("2", "--out-dir", str(out))
    assert second.returncode == 0, second.stderr
    assert hub.gets() == [(name, "bytes=1500-")]
    assert (out / name).read_bytes() == files[name] and not (out / f"{name}.part").exists()


def test_server_ignoring_range_restarts_cleanly(download, hub, files, out):
    name = NAMES[1]
    out.mkdir()
    stale = b"stale bytes that the server will not continue"
    (out / f"{name}.part").write_bytes(stale)
    hub.ignore_range = True
    result = download("2", "--out-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert (name, f"bytes={len(stale)}-") in hub.gets()
    for name in NAMES:
        assert (out / name).read_bytes() == files[name]


def test_missing_file_is_one_clear_error(download, hub, out, tmp_path):
    del hub.files[NAMES[2]]
    result = download("2", "--out-dir", str(out))
    assert_clean_failure(result, NAMES[2], "404", hub.endpoint, "HF_ENDPOINT")
    assert len(result.stderr.strip().splitlines()) <= 3
    assert (tmp_path / "gpt2" / "encoder.json").exists()  # fetched before the shards
    assert not out.exists()  # the sizes are asked first: nothing was written, so no empty folder is left


@pytest.mark.parametrize("damage, defect", [
    (lambda data: (99).to_bytes(4, "little") + data[4:], "bad magic number: expected 20240520, got 99"),
    (lambda data: data[:8] + (10**6).to_bytes(4, "little") + data[12:], "size mismatch"),
])
def test_corrupted_file_is_rejected(download, hub, out, damage, defect):
    name = NAMES[1]
    hub.files[name] = damage(hub.files[name])
    result = download("2", "--out-dir", str(out))
    assert_clean_failure(result, name, defect)
    assert not (out / name).exists() and not (out / f"{name}.part").exists()
    hub.files[NAMES[0]] = damage(hub.files[NAMES[0]])
    (out / NAMES[0]).unlink()
    out.rmdir()
    result = download("2", "--out-dir", str(out))
    assert_clean_failure(result, NAMES[0], defect)
    assert not out.exists()  # the folder this run made and emptied is removed


def test_offline_with_missing_files(download, hub, out):
    result = download("2", "--out-dir", str(out), offline=True)
    assert_clean_failure(result, "HF_HUB_OFFLINE", *NAMES, "encoder.json", "vocab.bpe")
    assert hub.requests == []


def test_tokenizer_alone_missing_or_damaged_is_fetched_again(download, hub, files, out, tmp_path):
    assert download("2", "--out-dir", str(out)).returncode == 0
    (tmp_path / "gpt2" / "encoder.json").write_text('{"a": 0}')  # not GPT-2's
    (tmp_path / "gpt2" / "vocab.bpe").unlink()
    hub.requests.clear()
    result = download("2", "--out-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert "is not GPT-2's encoder.json (8 bytes, GPT-2's has 1,042,301)" in result.stdout
    assert sorted(n for n, _ in hub.gets()) == sorted(TOKENIZER_NAMES)
    assert (tmp_path / "gpt2" / "encoder.json").read_bytes() == files["vocab.json"]


def test_bad_tokenizer_on_the_hub_is_one_clear_error(download, hub, out, tmp_path):
    hub.files["merges.txt"] = hub.files["merges.txt"].replace("\nĠ t\n".encode(), "\nĠ T\n".encode(), 1)  # same size
    result = download("2", "--out-dir", str(out))
    assert_clean_failure(result, "merges.txt", "did not give a usable vocab.bpe: sha256 ")
    assert (tmp_path / "gpt2" / "encoder.json").exists() and not (tmp_path / "gpt2" / "vocab.bpe").exists()
    assert not out.exists()  # nothing was written there
    hub.files["vocab.json"] = b"<html>not json</html>"
    (tmp_path / "gpt2" / "encoder.json").unlink()
    (tmp_path / "gpt2").rmdir()
    result = download("2", "--out-dir", str(out))
    assert_clean_failure(result, "vocab.json", "did not give a usable encoder.json: 21 bytes, GPT-2's has 1,042,301")
    assert not (tmp_path / "gpt2").exists() and not out.exists()


def test_repository_tokenizer_is_valid_and_never_downloaded(download, hub, out, repo_root):
    """The default --tokenizer-dir is the repository's data/gpt2: present and valid, so not fetched."""
    result = download("2", "--out-dir", str(out), tokenizer_dir=None)
    assert result.returncode == 0, result.stderr
    assert sorted(n for n, _ in hub.gets()) == sorted(NAMES)
    assert f"the tokenizer in {repo_root / 'data' / 'gpt2'}" in download("2", "--out-dir", str(out),
                                                                        tokenizer_dir=None).stdout


def test_too_many_shards_is_a_usage_error(download, hub, out):
    result = download("104", "--out-dir", str(out))
    assert result.returncode == 2 and "between 0 and 103" in result.stderr
    assert hub.requests == []
