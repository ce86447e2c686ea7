"""The repository stands on its own: nothing in it points outside it.

Walks every file git knows of in the checkout (tracked, plus untracked files
that are not ignored, so that a new file is checked before it is committed)
and fails on:

- a reference to the shared folder that sits next to a development checkout
  (the parent-relative form and the absolute one): documentation and code
  must use the repository's own copies (docs/DESIGN.md);
- a relative link or image in a Markdown file that resolves outside the
  repository root, or to a path that does not exist in the checkout.

Run: /usr/bin/python3 -m pytest -q tests/repo
"""
import os
import re
import subprocess
import urllib.parse

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.realpath(os.path.dirname(os.path.dirname(HERE)))

# Spelled in pieces so that this file does not match its own patterns.
_SHARED = "sha" + "red"
FORBIDDEN = [
    ("../" + _SHARED, re.compile(re.escape("../" + _SHARED) + r"\b")),
    ("/work/" + _SHARED, re.compile(re.escape("/work/" + _SHARED) + r"\b")),
]

# Folders skipped when the tree is walked without git (build outputs, caches).
_WALK_SKIP = {".git", "__pycache__", ".pytest_cache", "foreshock-data"}


def repo_files(root=ROOT):
    """Paths (relative, '/'-separated) of the files of the checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True).stdout
        paths = sorted({p for p in out.decode("utf-8", "surrogateescape").split("\0") if p})
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            dirnames[:] = [d for d in dirnames if d not in _WALK_SKIP and
                           not (rel_dir == "." and d.startswith("build"))]
            for name in filenames:
                paths.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
        paths.sort()
    # Deleted in the working tree but still in the index: nothing to read.
    return [p for p in paths if os.path.isfile(os.path.join(root, p))]


def read_text(path):
    """The file's text, or None for a binary file (it holds a NUL byte)."""
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    return data.decode("utf-8", "replace")


def outside_references(text):
    """(line number, the forbidden string) for each reference to the shared folder."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in FORBIDDEN:
            if pattern.search(line):
                hits.append((number, name))
    return hits


_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target "title") and ![alt](target); the target may be <wrapped>.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\s*\)")
# [label]: target
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_links(text):
    """(line number, target) of every link and image outside code blocks and code spans."""
    links = []
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        line = _INLINE_CODE.sub("", line)
        for match in _INLINE_LINK.finditer(line):
            links.append((number, match.group(1)))
        match = _REFERENCE_DEF.match(line)
        if match:
            links.append((number, match.group(1)))
    return links


def link_problem(md_path, target, root=ROOT):
    """Why the relative link `target` of the Markdown file `md_path` (relative to
    `root`) is bad, or None when it is fine or not a relative file link."""
    target = target.strip()
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1].strip()
    if not target or target.startswith("#") or target.startswith("//") or _SCHEME.match(target):
        return None  # same-page anchor, or a URL (http:, mailto:, ...)
    path = urllib.parse.unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return None
    if path.startswith("/"):
        return "absolute path (links must be relative to the file)"
    base = os.path.dirname(os.path.join(root, md_path))
    resolved = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([resolved, root]) != root:
        return "resolves outside the repository"
    if not os.path.exists(resolved):
        return "no such file in the repository"
    return None


def test_the_checkout_has_files():
    files = repo_files()
    assert "README.md" in files and "tests/repo/test_no_outside_refs.py" in files, files[:20]


def test_no_reference_to_the_shared_folder():
    bad = []
    for rel in repo_files():
        text = read_text(os.path.join(ROOT, rel))
        if text is None:
            continue
        bad += [f"{rel}:{number}: refers to {name}" for number, name in outside_references(text)]
    assert not bad, "references to a path outside the repository:\n" + "\n".join(bad)


def test_markdown_links_stay_inside_and_exist():
    bad = []
    for rel in repo_files():
        if not rel.lower().endswith((".md", ".markdown")):
            continue
        text = read_text(os.path.join(ROOT, rel))
        if text is None:
            continue
        for number, target in markdown_links(text):
            problem = link_problem(rel, target)
            if problem:
                bad.append(f"{rel}:{number}: ({target}) {problem}")
    assert not bad, "bad relative links in Markdown files:\n" + "\n".join(bad)


# The checks themselves, on made-up input.

@pytest.mark.parametrize("line", [
    "see [design](../" + _SHARED + "/DESIGN.md)",
    "open('/work/" + _SHARED + "/DESIGN.md')",
])
def test_outside_reference_is_found(line):
    assert outside_references("ok\n" + line + "\n") == [(2, outside_references(line)[0][1])]


def test_docs_reference_is_not_an_outside_reference():
    assert outside_references("see docs/DESIGN.md §6 and a shared/ folder of the repo") == []


def test_markdown_link_extraction():
    text = "\n".join([
        "[a](docs/DESIGN.md) and ![img](docs/ui.png \"title\")",
        "`[not a link](nowhere.md)`",
        "```",
        "[in a code block](nowhere.md)",
        "```",
        "[ref]: deploy/foreshock.yaml",
        "[url](https://example.com/x.md) [anchor](#layout)",
    ])
    assert markdown_links(text) == [(1, "docs/DESIGN.md"), (1, "docs/ui.png"),
                                    (6, "deploy/foreshock.yaml"),
                                    (7, "https://example.com/x.md"), (7, "#layout")]


@pytest.mark.parametrize("md_path,target,problem", [
    ("README.md", "docs/DESIGN.md", None),
    ("README.md", "docs/PERFORMANCE.md#sizing", None),
    ("README.md", "deploy/docker/", None),
    ("docs/EVALUATION.md", "../README.md", None),
    ("README.md", "https://example.com/", None),
    ("README.md", "#metrics", None),
    ("README.md", "../" + _SHARED + "/DESIGN.md", "resolves outside the repository"),
    ("docs/EVALUATION.md", "../../x.md", "resolves outside the repository"),
    ("README.md", "docs/NO_SUCH_FILE.md", "no such file in the repository"),
    ("README.md", "/etc/passwd", "absolute path (links must be relative to the file)"),
])
def test_link_problem(md_path, target, problem):
    assert link_problem(md_path, target) == problem
