"""GPT-2's BPE files, encoder.json and vocab.bpe: their expected sizes and sha256.

One table for the download (cached_fineweb10B.py) and the tokenizer (tokenize_docs.py), which
check the files alike. The repository keeps a copy in data/gpt2/ (with the MIT LICENSE it came
with); the bytes are OpenAI's, the same files and hashes that tiktoken's "gpt2" encoding checks.
"""
import hashlib
import os

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2")
EXPECTED = {  # name -> (bytes, sha256)
    "encoder.json": (1_042_301, "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "vocab.bpe": (456_318, "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}


def defect(name, data):
    """Why `data` is not GPT-2's file `name`, or None when it is."""
    size, sha256 = EXPECTED[name]
    if len(data) != size:
        return f"{len(data):,} bytes, GPT-2's has {size:,}"
    actual = hashlib.sha256(data).hexdigest()
    return None if actual == sha256 else f"sha256 {actual}, GPT-2's is {sha256}"


def defects(folder):
    """{name: reason} for each of the files that is missing from `folder` or is not GPT-2's."""
    found = {}
    for name in EXPECTED:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                reason = defect(name, f.read())
        except FileNotFoundError:
            reason = "missing"
        except OSError as err:
            reason = f"unreadable ({err.strerror})"
        if reason:
            found[name] = reason
    return found
