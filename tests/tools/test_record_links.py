"""Every README under records/ links only files that exist in the repository."""
import re

import pytest

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
MD_NAME = re.compile(r"(?<![\w./-])([\w.-]+(?:/[\w.-]+)*\.md)\b")  # a bare file name such as NOTES.md
SCRIPT = re.compile(r"(?<![\w./-])((?:bench|data|docs|records|tests)/[\w./-]+\.py)\b")  # e.g. bench/stage_times.py


def readmes(repo_root):
    return sorted((repo_root / "records").glob("**/README.md"))


def prose(readme):
    """The README's text without fenced code blocks (a link inside one is not a link)."""
    return FENCE.sub("", readme.read_text(encoding="utf-8"))


def relative_targets(text):
    """Link targets that name a file in the repository: not URLs, not anchors, anchors stripped."""
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def test_records_have_readmes(repo_root):
    assert len(readmes(repo_root)) >= 7


def test_markdown_links_resolve(repo_root):
    broken = [f"{readme.relative_to(repo_root)}: {target}"
              for readme in readmes(repo_root) for target in relative_targets(prose(readme))
              if not (readme.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_bare_markdown_file_names_exist(repo_root):
    """A .md file named in the prose (e.g. `NOTES.md`) exists in the README's folder or below it, under
    the repository root, or in docs/."""
    missing = []
    for readme in readmes(repo_root):
        text = LINK.sub(" ", prose(readme))
        for name in set(MD_NAME.findall(text)):
            if not (any((base / name).exists() for base in (readme.parent, repo_root, repo_root / "docs"))
                    or any(readme.parent.rglob(name))):
                missing.append(f"{readme.relative_to(repo_root)}: {name}")
    assert not missing, "names of files that do not exist:\n" + "\n".join(sorted(missing))


def test_scripts_named_by_path_exist(repo_root):
    """A script named by its repository path (e.g. `python bench/profile_stages.py`) is in the repository."""
    missing = sorted(f"{readme.relative_to(repo_root)}: {path}" for readme in readmes(repo_root)
                     for path in set(SCRIPT.findall(readme.read_text(encoding="utf-8")))
                     if not (repo_root / path).exists())
    assert not missing, "scripts that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("text, expected", [
    ("see [stats](statistics.md) and ![plot](val_loss.png)", ["statistics.md", "val_loss.png"]),
    ("[web](https://example.com) [top](#results) [doc](../../docs/X.md#t1)", ["../../docs/X.md"]),
    ('[titled](a/b.txt "a title") [angle](<c d.md>)', ["a/b.txt"]),
])
def test_link_extraction(text, expected):
    assert list(relative_targets(text)) == expected
