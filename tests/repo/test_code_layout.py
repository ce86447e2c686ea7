"""Where the code lives stays livable (issue 35): checks a reader could do by
hand, on the source tree only.

- no source file outside tests/ over 800 lines;
- no function over 150 lines in store/, alerts/ or server/ (top-level and
  out-of-line member definitions: a line at column 0 that opens a function,
  to its closing brace at column 0);
- detectors/ is pure math: it includes nothing from server/, alerts/ or
  store/.

Exempt: ui/index.html, the web UI, is one self-contained page by design
(docs/DESIGN.md §2.11): the daemon serves its bytes as they are, and
tests/python/test_web_ui.py compares the served page with the file.

Run: /usr/bin/python3 -m pytest -q tests/repo
"""
import os
import re

import pytest

from test_no_outside_refs import ROOT, repo_files

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 150
SOURCE_SUFFIXES = (".cc", ".h", ".py", ".html", ".js", ".css")
EXEMPT_FILES = {"ui/index.html"}
FUNCTION_FOLDERS = ("store/", "alerts/", "server/")

_NOT_A_FUNCTION = re.compile(
    r"(namespace|struct|class|enum|union|extern|using|typedef|template\s*<[^>]*>\s*(struct|class))\b")


def function_lengths(text):
    """(first line, length in lines, signature) of each function defined at
    column 0 in C++ source `text`."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        opens = (line and not line[0].isspace() and "(" in line and
                 not line.startswith(("}", "//", "#", "/*", " *")) and
                 not _NOT_A_FUNCTION.match(line) and not line.rstrip().endswith("}") and
                 "=" not in line.split("(")[0])
        if opens:
            k = i  # the signature may span lines, up to its "{" (or a ";": a declaration)
            while k < len(lines) and not lines[k].rstrip().endswith(("{", ";")) and k - i < 8:
                k += 1
            if k < len(lines) and lines[k].rstrip().endswith("{"):
                j = k + 1
                while j < len(lines) and lines[j] != "}":
                    j += 1
                out.append((i + 1, j - i + 1, line.strip()))
                i = j + 1
                continue
        i += 1
    return out


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def sources():
    return [p for p in repo_files() if p.endswith(SOURCE_SUFFIXES) and not p.startswith("tests/")
            and not p.startswith("build")]


def test_no_source_file_is_over_800_lines():
    long = [(p, n) for p in sources() if p not in EXEMPT_FILES
            for n in [read(p).count("\n")] if n > MAX_FILE_LINES]
    assert not long, f"split these along their seams (at most {MAX_FILE_LINES} lines): {long}"


def test_no_function_is_over_150_lines_in_store_alerts_server():
    long = []
    for path in sources():
        if path.startswith(FUNCTION_FOLDERS) and path.endswith(".cc"):
            for first, length, signature in function_lengths(read(path)):
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{first} {length} lines: {signature}")
    assert not long, "\n".join(long)


def test_detectors_include_nothing_from_server_alerts_or_store():
    upward = []
    for path in sources():
        if path.startswith("detectors/"):
            for n, line in enumerate(read(path).split("\n"), 1):
                if re.match(r'\s*#\s*include\s+"(server|alerts|store)/', line):
                    upward.append(f"{path}:{n}: {line.strip()}")
    assert not upward, "\n".join(upward)


# The checks themselves, on made-up input.

def test_function_lengths_finds_definitions_and_skips_the_rest():
    text = "\n".join([
        "// int Commented(int x) {",
        "namespace foo {",
        "int Declared(int x);",
        "static const int kTable[] = {",
        "  1, 2};",
        "absl::Status Store::Append(const std::vector<Point>& points,",
        "                           bool sync) {",
        "  if (sync) {",
        "    return Sync();",
        "  }",
        "  return absl::OkStatus();",
        "}",
        "int OneLine() { return 1; }",
        "}  // namespace foo",
    ])
    assert function_lengths(text) == [
        (6, 7, "absl::Status Store::Append(const std::vector<Point>& points,")]


@pytest.mark.parametrize("body_lines,too_long", [(147, False), (149, True)])
def test_a_function_over_the_limit_is_caught(body_lines, too_long):
    text = "void F() {\n" + "  x();\n" * body_lines + "}\n"
    [(_, length, _)] = function_lengths(text)
    assert (length > MAX_FUNCTION_LINES) == too_long
