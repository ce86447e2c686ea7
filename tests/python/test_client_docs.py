"""The client README's API signature is Monitor's (issue 36): every parameter,
in order, with its default, so a user reading the README sees what the code
takes. Sizes written as "N MiB" stand for N << 20."""
import inspect
import os
import re

from foreshock import Monitor

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "..", "..", "client", "python", "README.md")


def documented_signature():
    text = open(README).read()
    api = text[text.index("## API"):]
    match = re.search(r"`Monitor\((.*?)\)`", api, re.S)
    assert match, "no `Monitor(...)` signature under ## API"
    params = []
    for part in " ".join(match.group(1).split()).split(","):
        part = part.strip()
        if part == "*":
            params.append(("*", None))
            continue
        name, _, default = part.partition("=")
        params.append((name.strip(), default.strip() or None))
    return params


def as_value(text):
    size = re.fullmatch(r"(\d+) MiB", text)
    if size:
        return int(size.group(1)) << 20
    return eval(text, {})  # literals only: None, True, numbers, strings, ()


# Defaulted to None in the code so that `endpoints=` can stand in for the
# endpoint, and checked at call time (TypeError without run_id and job): the
# README shows them as required.
REQUIRED = {"endpoint", "run_id", "job"}


def test_the_readme_signature_is_monitors():
    code = []
    for p in list(inspect.signature(Monitor.__init__).parameters.values())[1:]:
        if p.kind == p.KEYWORD_ONLY and "*" not in [n for n, _ in code]:
            code.append(("*", None))
        code.append((p.name, p.default))
    documented = documented_signature()
    assert [n for n, _ in documented] == [n for n, _ in code]
    for (name, text), (_, default) in zip(documented, code):
        if name == "*":
            continue
        if default is inspect.Parameter.empty or name in REQUIRED:
            assert text is None, (name, text)
        else:
            assert text is not None and as_value(text) == default, (name, text, default)
