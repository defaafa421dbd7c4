"""data/proxy_corpus.py on small synthetic source repositories (no network: a loopback server stands
in for codeload.github.com), its manifest checks, and the committed manifest."""
import importlib.util
import io
import json
import pathlib
import re
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
BOS = 50256
LONG = "The river ran past the old mill, and the miller's children watched the boats go by. " * 12


@pytest.fixture(scope="module")
def pc():
    spec = importlib.util.spec_from_file_location("proxy_corpus", REPO_ROOT / "data" / "proxy_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def encoding(pc):
    return pc.tokenize_docs.load_gpt2(pc.gpt2_files.DEFAULT_DIR)


# ----------------------------------------------------------------------------------------------------
# synthetic repositories

def wiki_file(*articles):
    return "".join(f'<doc id="{i}" url="x" title="T{i}">\nTitle {i}\n{text}\n</doc>\n'
                   for i, text in enumerate(articles))


def book(body, title="A Book"):
    return (f"The Project Gutenberg EBook of {title}\r\n\r\nProduced by Some Volunteer\r\n\r\n"
            f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\r\n\r\n"
            f"Produced by Jane Doe and the Online Distributed Proofreading Team\r\n\r\n{body}\r\n\r\n"
            f"This paragraph mentions Project Gutenberg and goes.\r\n\r\n"
            f"*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\r\n\r\nLicence text that goes.\r\n")


def paragraphs(tag, n):
    return "\r\n\r\n".join(f"{tag} paragraph {k}: {LONG}" for k in range(n))


AUTHORS = [f"Author{k:02d}, Test" for k in range(8)]  # sorted(...)[5::33] = Author05: the val author

SOURCES = {
    "wiki": {
        "README.md": "not read",
        "text/AA/wiki_00": wiki_file("Short article.", f"Kept<br>article with <ref name=\"a\">markup</ref> {LONG}"),
        "text/AA/wiki_01": wiki_file(f"Second train article. {LONG}"),
        "text/AD/wiki_90": wiki_file(f"A validation article. {LONG}"),
    },
    "imdb": {
        "aclImdb/test/pos/0_9.txt": "Great film!<br /><br />Loved it &amp; more. " + LONG,
        "aclImdb/test/neg/0_1.txt": "Dull film. " + LONG,
        "aclImdb/train/pos/1_8.txt": "A fine train review. " + LONG,
        "aclImdb/train/neg/1_2.txt": "Dull film. " + LONG,  # a duplicate of a val review: dropped from train
        "aclImdb/train/unsup/2_0.txt": "Unlabelled review. " + LONG,
        "aclImdb/train/labeledBow.feat": "not read",
    },
    "gut": {
        **{f"{a}/book.txt": book(paragraphs(a, 30), a) for a in AUTHORS},
        f"{AUTHORS[1]}/secret.txt": "This is a COPYRIGHTED Project Gutenberg eBook\n" + book(paragraphs("C", 3)),
        f"{AUTHORS[2]}/.DS_Store": "binary junk",
        "Shakespeare, William/The Complete Works of William Shakespeare.txt": book(paragraphs("Excluded", 5)),
        "README.md": "not read",
    },
}


def tarball(files, top):
    """A GitHub-style tar.gz: every file under one top folder."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def archives():
    return {name: tarball(files, f"{name}-0123") for name, files in SOURCES.items()}


def members(pc, tmp_path, name, data):
    path = tmp_path / f"{name}.tar.gz"
    path.write_bytes(data)
    return pc.read_source(name, pc.archive_members(str(path)))


@pytest.fixture(scope="module")
def documents(pc, archives, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sources")
    files = {name: members(pc, tmp, name, data)[0] for name, data in archives.items()}
    return pc.corpus_documents(files, seed=1337)


# ----------------------------------------------------------------------------------------------------
# cleaning and splitting

def test_archive_keeps_only_the_files_the_corpus_reads(pc, archives, tmp_path):
    files, digest = members(pc, tmp_path, "gut", archives["gut"])
    assert "README.md" not in files and not any(p.startswith("Shakespeare") for p in files)
    assert f"{AUTHORS[2]}/.DS_Store" in files  # read (it makes a folder an author) but never a book
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert sorted(members(pc, tmp_path, "wiki", archives["wiki"])[0]) == ["text/AA/wiki_00", "text/AA/wiki_01",
                                                                         "text/AD/wiki_90"]
    imdb = members(pc, tmp_path, "imdb", archives["imdb"])[0]
    assert "aclImdb/train/labeledBow.feat" not in imdb and len(imdb) == 5


def test_wikipedia_cleaning_and_split(documents):
    wiki = [d for d in documents if d[0] == "wiki"]
    assert [d[1] for d in wiki] == ["train", "train", "val"]  # the short article is skipped
    kept = wiki[0][3]
    assert kept.startswith("Title 1\nKept\narticle with markup The river")  # <br> -> newline, <ref> tags gone
    assert "<" not in kept and not kept.endswith("\n")


def test_imdb_cleaning_split_and_duplicates(documents):
    imdb = {d[2]: d for d in documents if d[0] == "imdb"}
    assert imdb["test/pos/0_9.txt"][1] == "val" and imdb["test/neg/0_1.txt"][1] == "val"
    assert imdb["test/pos/0_9.txt"][3].startswith("Great film!\n\nLoved it & more. ")
    assert "train/neg/1_2.txt" not in imdb  # the same text as a val review
    assert imdb["train/unsup/2_0.txt"][1] == "train"


def test_gutenberg_cleaning_chunking_and_split(documents):
    gut = [d for d in documents if d[0] == "gut"]
    assert {d[2].split("/")[0] for d in gut if d[1] == "val"} == {AUTHORS[5]}
    assert not any("secret" in d[2] or "Excluded" in d[3] for d in gut)  # copyrighted, excluded by name
    for _, _, _, text in gut:
        assert "Gutenberg" not in text and "Produced by" not in text and "Licence" not in text
        assert "\r" not in text and 200 <= len(text) <= 6000 + 1500
    per_book = [d for d in gut if d[2].startswith(AUTHORS[0] + "/")]
    assert len(per_book) >= 2  # a 30-paragraph book (11,000 characters) becomes several documents
    text = "\n\n".join(d[3] for d in per_book)
    assert text == "\n\n".join(f"{AUTHORS[0]} paragraph {k}: {LONG.rstrip()}" for k in range(30))


def test_chunking_follows_the_seed(pc):
    paras = [f"p{k} " + "x" * 700 for k in range(40)]
    a, b, c = (pc.chunk_book(paras, pc.random.Random(s)) for s in ("1337/chunk/A/f", "1337/chunk/A/f", "7"))
    assert a == b and a != c and sum(map(len, a)) == 40
    assert all(len("\n\n".join(chunk)) <= pc.CHUNK_MAX for chunk in a[:-1])  # the last may take a short tail


def test_streams_and_shards(pc, documents, encoding, monkeypatch):
    budgets = {"val": 300, "train": 700}
    streams = pc.build_streams(documents, encoding, budgets=budgets)
    again = pc.build_streams(documents, encoding, budgets=budgets)
    assert all(np.array_equal(streams[s], again[s]) for s in budgets)  # deterministic
    assert len(streams["val"]) == 300 and streams["val"][0] == BOS and streams["train"][0] == BOS
    val_text = encoding.decode(streams["val"].tolist())
    assert "A validation article" in val_text or "Great film" in val_text or AUTHORS[5] in val_text
    assert "Second train article" not in val_text
    assert "A validation article" not in encoding.decode(streams["train"].tolist())
    assert len(streams["train"]) == 700
    monkeypatch.setattr(pc, "SHARD_TOKENS", 256)
    train = pc.split_shards("train", streams["train"])
    assert [(n, len(t)) for n, t in train] == [("proxy_train_000001.bin", 256), ("proxy_train_000002.bin", 256),
                                               ("proxy_train_000003.bin", 188)]
    assert np.array_equal(np.concatenate([t for _, t in train]), streams["train"])
    assert [n for n, _ in pc.split_shards("val", streams["val"])] == ["proxy_val_000000.bin"]


def error_lines(capsys):
    """The `error:` lines the command wrote to stderr (progress bars aside), after checking there is no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------------------------------
# manifest verification

def test_verification_passes_a_good_shard_and_names_a_damaged_one(pc, shards, tmp_path, capsys):
    path = tmp_path / "proxy_val_000000.bin"
    shards.write_shard(path, np.arange(100, dtype=np.uint16))
    manifest = {"sources": {}, "shards": {path.name: {"sha256": pc.sha256_file(path), "bytes": path.stat().st_size,
                                                      "tokens": 100}}}
    assert pc.verify(str(tmp_path), manifest) == 0
    data = bytearray(path.read_bytes())
    data[1100] ^= 1
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert pc.verify(str(tmp_path), manifest) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: {path}: sha256 ")
    path.write_bytes(bytes(data[:-2]))
    assert pc.shard_defect(str(path), manifest["shards"][path.name]) == "1,222 bytes, the manifest says 1,224"
    path.unlink()
    assert pc.shard_defect(str(path), manifest["shards"][path.name]) == "missing"


def test_committed_manifest_lists_the_seven_proxy_shards(pc):
    manifest = json.loads((REPO_ROOT / "data" / "proxy_manifest.json").read_text())
    names = [f"proxy_train_{i:06d}.bin" for i in range(1, 7)] + ["proxy_val_000000.bin"]
    assert sorted(manifest["shards"]) == sorted(names)
    for name, entry in manifest["shards"].items():
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]), name
        assert entry["bytes"] == 1024 + 2 * entry["tokens"]
        assert entry["tokens"] == (4_194_304 if "val" in name else 16_777_216)
    assert sorted(manifest["sources"]) == ["gut", "imdb", "wiki"]
    for source in manifest["sources"].values():
        assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
        assert re.fullmatch(r"[0-9a-f]{64}", source["content_sha256"])
        assert pc.archive_url(source) == f"https://codeload.github.com/{source['repo']}/tar.gz/{source['commit']}"
    assert pc.load_manifest()["shards"] == manifest["shards"]


# ----------------------------------------------------------------------------------------------------
# download (a loopback server for codeload.github.com)

class Codeload(ThreadingHTTPServer):
    """Serves `files` (path -> bytes) with Range support; cut_after[path] drops the connection after
    that many bytes of the next GET; ignore_range answers 200; no_length sends no Content-Length."""

    def __init__(self, files):
        super().__init__(("127.0.0.1", 0), CodeloadHandler)
        self.files, self.cut_after, self.ignore_range, self.no_length = dict(files), {}, False, False
        self.gets = []  # (path, Range header)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class CodeloadHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # a body without Content-Length ends when the connection closes

    def log_message(self, *args):
        pass

    def do_GET(self):
        server = self.server
        server.gets.append((self.path, self.headers.get("Range")))
        data = server.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start = 0
        if self.headers.get("Range") and not server.ignore_range:
            start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
        self.send_response(206 if start else 200)
        if not server.no_length:
            self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        cut = server.cut_after.pop(self.path, None)
        self.wfile.write(data[start:] if cut is None else data[start:start + cut])


@pytest.fixture
def codeload():
    server = Codeload({"/a.tar.gz": bytes(range(256)) * 400})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_download_resumes_from_the_part_file(pc, codeload, tmp_path):
    data = codeload.files["/a.tar.gz"]
    target = tmp_path / "a.tar.gz"
    codeload.cut_after["/a.tar.gz"] = 30_000
    with pytest.raises(pc.ProxyError, match=r"cannot reach .*stopped after 30,000 of 102,400 bytes; rerun to resume"):
        pc.download(codeload.url + "/a.tar.gz", str(target))
    assert (tmp_path / "a.tar.gz.part").stat().st_size == 30_000 and not target.exists()
    pc.download(codeload.url + "/a.tar.gz", str(target))
    assert codeload.gets[-1] == ("/a.tar.gz", "bytes=30000-")
    assert target.read_bytes() == data and not (tmp_path / "a.tar.gz.part").exists()


def test_download_without_length_or_range_support(pc, codeload, tmp_path):
    codeload.no_length = codeload.ignore_range = True
    (tmp_path / "a.tar.gz.part").write_bytes(b"stale bytes")
    pc.download(codeload.url + "/a.tar.gz", str(tmp_path / "a.tar.gz"))  # the server restarts: so does the file
    assert (tmp_path / "a.tar.gz").read_bytes() == codeload.files["/a.tar.gz"]


def fake_manifest(pc, codeload, archives, tmp_path):
    """A manifest for the synthetic sources (served by codeload), with the shards one rebuild makes."""
    sources = {}
    for name, data in archives.items():
        source = {"repo": f"test/{name}", "commit": "0123"}
        codeload.files[f"/{source['repo']}/tar.gz/0123"] = data
        files, digest = members(pc, tmp_path, name, data)
        sources[name] = dict(source, files=len(files), content_sha256=digest)
    return {"sources": sources, "shards": {}}


@pytest.fixture
def small(pc, monkeypatch, codeload, archives, tmp_path):
    """proxy_corpus with tiny budgets, codeload on loopback and a manifest of the synthetic corpus."""
    monkeypatch.setattr(pc, "CODELOAD", codeload.url + "/{repo}/tar.gz/{commit}")
    monkeypatch.setattr(pc, "VAL_TOKENS", 300)
    monkeypatch.setattr(pc, "SHARD_TOKENS", 256)
    monkeypatch.setattr(pc, "TRAIN_SHARDS", 3)
    manifest = fake_manifest(pc, codeload, archives, tmp_path)
    reference = tmp_path / "reference"
    paths = pc.fetch_sources(manifest, str(tmp_path / "cache0"))
    names = {"proxy_val_000000.bin"} | {f"proxy_train_{i:06d}.bin" for i in (1, 2, 3)}
    pc.rebuild(paths, manifest, str(reference), names, threads=1)
    manifest["shards"] = {p.name: {"sha256": pc.sha256_file(p), "bytes": p.stat().st_size,
                                   "tokens": (p.stat().st_size - 1024) // 2} for p in reference.iterdir()}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(pc, "MANIFEST", str(tmp_path / "manifest.json"))
    return manifest


def test_end_to_end_build_skip_and_verify(pc, small, codeload, tmp_path, capsys):
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert sorted(small["shards"]) == ["proxy_train_000001.bin", "proxy_train_000002.bin", "proxy_train_000003.bin",
                                       "proxy_val_000000.bin"]
    codeload.gets.clear()
    assert pc.main(["--out-dir", str(out), "--cache-dir", str(cache), "--threads", "1"]) == 0
    assert "all matching the manifest" in capsys.readouterr().out
    assert len(codeload.gets) == 3 and len(list(cache.iterdir())) == 3
    for name in small["shards"]:
        assert (out / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()

    codeload.gets.clear()
    assert pc.main(["--out-dir", str(out), "--cache-dir", str(cache)]) == 0  # complete: nothing to do
    assert "already present" in capsys.readouterr().out and codeload.gets == []
    assert pc.main(["--out-dir", str(out), "--verify-only"]) == 0

    damaged = out / "proxy_train_000002.bin"
    damaged.write_bytes(damaged.read_bytes()[:-2] + b"\0\0")
    capsys.readouterr()
    assert pc.main(["--out-dir", str(out), "--verify-only"]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and "proxy_train_000002.bin: sha256" in err[0]
    assert pc.main(["--out-dir", str(out), "--cache-dir", str(cache), "--threads", "1"]) == 0  # rebuilt from the cache
    assert codeload.gets == [] and pc.verify(str(out), small) == 0


def test_rebuild_that_differs_is_reported_by_name(pc, small, tmp_path, capsys):
    small["shards"]["proxy_val_000000.bin"]["sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(small))
    assert pc.main(["--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache0"), "--threads", "1"]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and "proxy_val_000000.bin" in err[0] and "tiktoken" in err[0]


def test_changed_source_is_one_clear_error(pc, small, tmp_path, capsys):
    small["sources"]["imdb"]["content_sha256"] = "f" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(small))
    assert pc.main(["--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache0")]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and "not the imdb source" in err[0]
    assert not (tmp_path / "out").exists()


def test_damaged_archive_is_set_aside(pc, small, tmp_path, capsys):
    cached = tmp_path / "cache0" / "wiki-0123.tar.gz"
    cached.write_bytes(cached.read_bytes()[:200])
    assert pc.main(["--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache0")]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and "is damaged" in err[0] and "rerun to download it again" in err[0]
    assert not cached.exists() and (tmp_path / "cache0" / "wiki-0123.tar.gz.damaged").exists()


def test_offline_is_one_line_and_leaves_no_folders(pc, small, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(pc, "CODELOAD", "http://127.0.0.1:9/{repo}/tar.gz/{commit}")  # discard port: refused
    assert pc.main(["--out-dir", str(tmp_path / "new" / "out")]) == 1
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith("error: cannot reach http://127.0.0.1:9/")
    assert "rerun to resume" in err[0]
    assert not (tmp_path / "new").exists()


def test_help(tmp_path):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "data" / "proxy_corpus.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for option in ("--out-dir", "--cache-dir", "--verify-only", "proxy_manifest.json"):
        assert option in result.stdout
