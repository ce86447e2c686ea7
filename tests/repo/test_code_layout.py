"""Where the code lives stays livable (issue 35): checks a reader could do by
hand, on the source tree only.

- no source file outside tests/ over 800 lines;
- no function over 150 lines in store/, alerts/ or server/ (top-level and
  out-of-line member definitions: a line at column 0 that opens a function,
  to its closing brace at column 0);
- detectors/ is pure math: it includes nothing from server/, alerts/ or
  store/;
- inside server/, includes only go down the layers of SERVER_LAYERS (a
  folder may include its own files and those of the folders before it; the
  top-level files, daemon.cc and foreshockd.cc, wire everything together and
  nothing includes them but each other);
- the state codec lives in codec/ alone and includes nothing of the project;
- what the wire contract means (wire/) is one library the daemon and
  foreshockctl both link: it includes nothing from server/, alerts/, store/
  or ctl/, and ctl/ includes nothing from server/.

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


# server/'s folders, lowest first (docs/DESIGN.md §2.11): what every
# component shares (the metric table, the clock), authentication, the HTTP
# server, the detector pipeline (workers, export, store, run lifecycle), the
# alerting fed by it, ingest feeding the pipeline, and queries over all.
SERVER_LAYERS = ("common", "security", "http", "pipeline", "alerting", "ingest", "query")
_SERVER_INCLUDE = re.compile(r'\s*#\s*include\s+"server/([^"]+)"')


def server_layer(path_in_server):
    """The layer index of a path under server/ (top-level files: above all)."""
    folder = path_in_server.split("/")[0] if "/" in path_in_server else None
    return len(SERVER_LAYERS) if folder is None else SERVER_LAYERS.index(folder)


def upward_server_includes(path, text):
    """The includes of `path` (under server/) that climb to a later layer."""
    here = server_layer(path[len("server/"):])
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        m = _SERVER_INCLUDE.match(line)
        if m and server_layer(m.group(1)) > here:
            out.append(f"{path}:{n}: {line.strip()}")
    return out


def test_server_includes_only_go_down_its_layers():
    folders = {p.split("/")[1] for p in sources()
               if p.startswith("server/") and p.count("/") >= 2}
    assert folders <= set(SERVER_LAYERS), f"place these in SERVER_LAYERS: {folders - set(SERVER_LAYERS)}"
    upward = [hit for p in sources() if p.startswith("server/") and p.endswith((".h", ".cc"))
              for hit in upward_server_includes(p, read(p))]
    assert not upward, "\n".join(upward)


def test_the_codec_is_one_neutral_module():
    codec = [p for p in sources() if p.startswith("codec/") and p.endswith((".h", ".cc"))]
    assert codec == ["codec/state_codec.h"]
    own = [line for line in read(codec[0]).split("\n") if re.match(r'\s*#\s*include\s+"', line)]
    assert not own, f"the codec includes nothing of the project: {own}"
    copies = [p for p in sources() if p.endswith((".h", ".cc")) and
              re.search(r"class \w+ *(final *)?\{\n *public:\n *virtual ~\w+\(\) = default;\n"
                        r" *virtual void Append\(std::string_view", read(p))]
    assert copies == ["codec/state_codec.h"], f"a second checkpoint sink interface: {copies}"


_PROJECT_INCLUDE = re.compile(r'\s*#\s*include\s+"([a-z_]+)/')


def includes_from(path, text, folders):
    """The includes of `path` that name a file in one of `folders`."""
    return [f"{path}:{n}: {line.strip()}" for n, line in enumerate(text.split("\n"), 1)
            if (m := _PROJECT_INCLUDE.match(line)) and m.group(1) in folders]


def test_the_wire_contract_is_one_library_for_the_daemon_and_foreshockctl():
    wire = [p for p in sources() if p.startswith("wire/") and p.endswith((".h", ".cc"))]
    assert "wire/validation.h" in wire and "wire/rank_scalars.h" in wire, wire
    bad = [hit for p in wire for hit in includes_from(p, read(p), {"server", "alerts", "store", "ctl"})]
    bad += [hit for p in sources() if p.startswith("ctl/") and p.endswith((".h", ".cc"))
            for hit in includes_from(p, read(p), {"server"})]
    assert not bad, "\n".join(bad)


# The checks themselves, on made-up input.

def test_an_include_from_a_named_folder_is_caught():
    text = '#include "wire/validation.h"\n#include "server/ingest/validation.h"\n#include <map>\n'
    assert includes_from("ctl/backtest.cc", text, {"server"}) == [
        'ctl/backtest.cc:2: #include "server/ingest/validation.h"']
    assert includes_from("ctl/backtest.cc", text, {"store"}) == []


def test_an_upward_server_include_is_caught():
    text = '#include "server/common/metrics.h"\n#include "server/alerting/alert_hub.h"\n'
    assert upward_server_includes("server/pipeline/x.cc", text) == [
        'server/pipeline/x.cc:2: #include "server/alerting/alert_hub.h"']
    assert upward_server_includes("server/daemon.cc", text) == []
    assert upward_server_includes("server/common/m.cc", '#include "server/daemon.h"\n') == [
        'server/common/m.cc:1: #include "server/daemon.h"']


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
