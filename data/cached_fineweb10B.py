"""Download the GPT-2 token shards of FineWeb from the Hugging Face hub: resumable and verified.

Fetches <prefix>val_000000.bin and the first N train shards <prefix>train_000001.bin ...
(about 100M tokens each) of a kjj0/*-gpt2 dataset repo into data/<dataset>/. GPT-2's tokenizer
files (encoder.json, vocab.bpe; the training script's prefix-token loss reads encoder.json) are kept
in the repository's data/gpt2/; where they are absent or damaged they are fetched from the
openai-community/gpt2 model repo. Complete files are skipped; an interrupted download continues
from its .part file on the next run. Every file is checked (a shard's size and header, a tokenizer
file's sha256) before it takes its final name. Folders are created only when a file is written.
HF_ENDPOINT selects the hub (or a mirror); with HF_HUB_OFFLINE=1 nothing is downloaded and
the command only checks that the files are present.
"""
import argparse
import http.client
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from huggingface_hub import constants, hf_hub_url
from huggingface_hub.utils import build_hf_headers
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # shards.py lies beside this file, whether it is run as a script or imported
import gpt2_files  # noqa: E402
import shards  # noqa: E402

# name -> (dataset repo, file prefix, number of train shards in the repo; each ~100M tokens)
DATASETS = {
    "fineweb10B": ("kjj0/fineweb10B-gpt2", "fineweb_", 103),
    "fineweb100B": ("kjj0/fineweb100B-gpt2", "fineweb_", 1030),
    "finewebedu10B": ("kjj0/finewebedu10B-gpt2", "finewebedu_", 99),
}
DEFAULT_TRAIN_SHARDS = 9  # ~900M tokens
# GPT-2's BPE files on the hub: local name -> name in the model repo (same contents as OpenAI's files)
TOKENIZER_REPO = "openai-community/gpt2"
TOKENIZER_FILES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}
CHUNK_BYTES = 1 << 20
TIMEOUT_S = 60  # a request that stalls this long counts as a network failure
NETWORK_ERRORS = (OSError, http.client.HTTPException)  # URLError, HTTPError, timeouts and resets are OSErrors


class DownloadError(Exception):
    """A failure whose message is shown to the user as is (no traceback)."""


class HubRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects keeping the method (urllib would turn a HEAD into a GET), but, like
    huggingface_hub, let a HEAD follow only relative ones: the hub answers HEAD of a large file with a
    redirect to a CDN link signed for GET only, and gives the size there in X-Linked-Size."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if req.get_method() == "HEAD" and urllib.parse.urlsplit(headers.get("Location", "")).netloc:
            return None  # urllib then raises HTTPError carrying the redirect's headers
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.method = req.get_method()
        return new


OPENER = urllib.request.build_opener(HubRedirect)


def open_url(url, method="GET", start=0):
    request = urllib.request.Request(url, method=method)
    for key, value in build_hf_headers().items():  # user agent, and the token if the user is logged in
        if key.lower() == "authorization":
            request.add_unredirected_header(key, value)  # never forward the token to a redirect target
        else:
            request.add_header(key, value)
    if start:
        request.add_header("Range", f"bytes={start}-")
    return OPENER.open(request, timeout=TIMEOUT_S)


def network_failure(name, url, err):
    if isinstance(err, urllib.error.HTTPError):
        what = f"HTTP {err.code} {err.reason}" + (" (no such file on the hub)" if err.code == 404 else "")
    else:
        what = getattr(err, "reason", None) or err  # URLError wraps the underlying socket error
    return DownloadError(
        f"could not download {name} from {url}: {what}\n"
        f"Check your connectivity and HF_ENDPOINT (now {constants.ENDPOINT}), then rerun: "
        f"finished files and .part files are kept, so the download resumes.")


def is_complete(path):
    """True if `path` is a valid shard; an invalid one is reported and will be downloaded again."""
    if not os.path.exists(path):
        return False
    try:
        shards.read_header(path)
        return True
    except shards.ShardError as err:
        tqdm.write(f"warning: {err}; downloading it again")
        return False


def remote_size(name, url):
    try:
        with open_url(url, method="HEAD") as response:
            headers = response.headers
    except urllib.error.HTTPError as err:
        if not 300 <= err.code < 400:
            raise network_failure(name, url, err) from None
        headers = err.headers  # the redirect to the CDN (not followed)
    except NETWORK_ERRORS as err:
        raise network_failure(name, url, err) from None
    length = headers.get("X-Linked-Size") or headers.get("Content-Length")
    if length is None:
        raise DownloadError(f"{url} did not report the size of {name} (no X-Linked-Size or Content-Length)")
    return int(length)


def part_size(part, size):
    """Bytes already in `part`; a .part larger than the remote file is stale and removed."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > size:
        os.remove(part)
        return 0
    return have


def download(name, url, part, size, bar):
    """Append the missing bytes of `name` to `part` (a Range request if part of it is there)."""
    start = part_size(part, size)
    if start < size:
        try:
            response = open_url(url, start=start)
        except NETWORK_ERRORS as err:
            raise network_failure(name, url, err) from None
        with response:
            if start and response.status != 206:  # the server ignored the Range header: start over
                bar.total += start
                bar.refresh()
                start = 0
            elif start and not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
                raise DownloadError(f"{url} answered the resume request for {name} with the wrong range "
                                    f"({response.headers.get('Content-Range')}); delete {part} and rerun")
            have = start
            os.makedirs(os.path.dirname(part) or ".", exist_ok=True)
            with open(part, "ab" if start else "wb") as f:
                while True:
                    try:
                        chunk = response.read(CHUNK_BYTES)
                    except NETWORK_ERRORS as err:
                        raise network_failure(name, url, err) from None
                    if not chunk:
                        break
                    f.write(chunk)
                    have += len(chunk)
                    bar.update(len(chunk))
        if have < size:
            raise DownloadError(
                f"the transfer of {name} from {url} stopped after {have:,} of {size:,} bytes.\n"
                f"Check your connectivity and rerun: the download resumes from {part}.")


def verify(name, part, size):
    """Check size and shard header of a finished .part file; delete it if it is bad."""
    try:
        actual = os.path.getsize(part)
        if actual != size:
            raise shards.ShardError(part, f"size mismatch: {actual:,} bytes, the hub says {size:,}")
        return shards.read_header(part)
    except shards.ShardError as err:
        os.remove(part)
        raise DownloadError(f"downloaded {name} is corrupt: {err.defect}. Deleted {part}; rerun to "
                            f"download it again, and if it fails the same way the hub's copy is bad.") from None


def fetch_all(repo, names, out_dir):
    urls = {name: hf_hub_url(repo, name, repo_type="dataset") for name in names}
    with ThreadPoolExecutor(max_workers=8) as pool:  # one HEAD per file, in parallel, for the sizes
        sizes = dict(zip(names, pool.map(lambda n: remote_size(n, urls[n]), names)))
    parts = {name: os.path.join(out_dir, name + ".part") for name in names}
    remaining = sum(sizes[n] - part_size(parts[n], sizes[n]) for n in names)
    amount = tqdm.format_sizeof(remaining, "B", 1024)
    print(f"downloading {len(names)} file(s), {amount}, from {repo} into {out_dir}")
    with tqdm(total=remaining, unit="B", unit_scale=True, unit_divisor=1024, desc="download") as bar:
        for name in names:
            download(name, urls[name], parts[name], sizes[name], bar)
            ntokens = verify(name, parts[name], sizes[name])
            os.replace(parts[name], os.path.join(out_dir, name))
            tqdm.write(f"{name}: {ntokens:,} tokens")


def tokenizer_missing(tokenizer_dir):
    """The tokenizer files that are absent or not GPT-2's (a damaged one is reported)."""
    defects = gpt2_files.defects(tokenizer_dir)
    for name, reason in defects.items():
        if reason != "missing":
            tqdm.write(f"warning: {os.path.join(tokenizer_dir, name)} is not GPT-2's {name} ({reason}); "
                       f"downloading it again")
    return list(defects)


def fetch_tokenizer(names, tokenizer_dir):
    """Download the small tokenizer files whole, check them, then give them their final names."""
    for name in names:
        url = hf_hub_url(TOKENIZER_REPO, TOKENIZER_FILES[name])
        try:
            with open_url(url) as response:
                data = response.read()
        except NETWORK_ERRORS as err:
            raise network_failure(name, url, err) from None
        reason = gpt2_files.defect(name, data)
        if reason:
            raise DownloadError(f"{url} did not give a usable {name}: {reason}")
        os.makedirs(tokenizer_dir, exist_ok=True)
        part = os.path.join(tokenizer_dir, name + ".part")
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, os.path.join(tokenizer_dir, name))
        print(f"{name}: GPT-2 tokenizer file, {len(data):,} bytes, sha256 checked")


def remove_if_empty(folders):
    """Remove the folders that this run created and a failure left empty (e.g. a corrupt file deleted)."""
    for folder in folders:
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment: HF_ENDPOINT (hub URL or mirror), HF_HUB_OFFLINE=1 (only check local files), "
               "HF_TOKEN (optional). Exit status 0 when every requested file is present and verified.")
    parser.add_argument("num_train", nargs="?", type=int, default=DEFAULT_TRAIN_SHARDS, metavar="N",
                        help=f"number of train shards to fetch (default {DEFAULT_TRAIN_SHARDS}, ~100M tokens each; "
                             "at most " + ", ".join(f"{n} for {d}" for d, (_, _, n) in DATASETS.items()) + ")")
    parser.add_argument("--dataset", choices=DATASETS, default="fineweb10B",
                        help="which token set: " + ", ".join(f"{d} = {r}" for d, (r, _, _) in DATASETS.items())
                             + " (default fineweb10B)")
    parser.add_argument("--out-dir", help="destination folder (default: data/<dataset> beside this script)")
    parser.add_argument("--tokenizer-dir", default=gpt2_files.DEFAULT_DIR,
                        help="folder for GPT-2's encoder.json and vocab.bpe, fetched only where absent or damaged "
                             "(default: data/gpt2, the repository's copy; train_gpt.py's TOKENIZER_DIR)")
    args = parser.parse_args(argv)
    max_train = DATASETS[args.dataset][2]
    if not 0 <= args.num_train <= max_train:
        parser.error(f"N must be between 0 and {max_train} for {args.dataset}, got {args.num_train}")
    return args


def main(argv=None):
    args = parse_args(argv)
    repo, prefix, _ = DATASETS[args.dataset]
    out_dir = args.out_dir or os.path.join(HERE, args.dataset)
    names = [f"{prefix}val_000000.bin"] + [f"{prefix}train_{i:06d}.bin" for i in range(1, args.num_train + 1)]
    tokenizer_dir = args.tokenizer_dir
    missing = [name for name in names if not is_complete(os.path.join(out_dir, name))]
    missing_tokenizer = tokenizer_missing(tokenizer_dir)
    if not missing and not missing_tokenizer:
        print(f"all {len(names)} files already present and valid in {out_dir}, the tokenizer in {tokenizer_dir}")
        return 0
    if constants.HF_HUB_OFFLINE:
        absent = [os.path.join(out_dir, n) for n in missing] + [os.path.join(tokenizer_dir, n) for n in missing_tokenizer]
        print(f"error: HF_HUB_OFFLINE is set but {len(absent)} file(s) are missing: "
              f"{', '.join(absent)}\nUnset HF_HUB_OFFLINE to download them.", file=sys.stderr)
        return 1
    new_folders = [folder for folder in (out_dir, tokenizer_dir) if not os.path.exists(folder)]
    try:
        fetch_tokenizer(missing_tokenizer, tokenizer_dir)
        if missing:
            fetch_all(repo, missing, out_dir)
    except DownloadError as err:
        remove_if_empty(new_folders)
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        remove_if_empty(new_folders)
        print("interrupted; rerun to resume from the .part file", file=sys.stderr)
        return 130
    print(f"done: {len(names)} files in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
