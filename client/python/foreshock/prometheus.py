"""Reading foreshockd's /metrics: a small parser of the Prometheus text format.

Enough for the daemon's own output (and tools/tests that read it): comments,
labels with escaped values, optional timestamps. Not a general OpenMetrics
parser.
"""
import math
import re
import urllib.request

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _parse_value(text):
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    return special[text] if text in special else float(text)


def parse(text):
    """Samples of a metrics page as a list of (name, labels dict, value)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, _, label_text, value = match.group(1, 2, 3, 4)
        labels = {}
        if label_text:
            pos = 0
            while pos < len(label_text):
                label = _LABEL.match(label_text, pos)
                if label is None:
                    raise ValueError(f"bad labels in {line!r}")
                labels[label.group(1)] = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)],
                                                label.group(2))
                pos = label.end()
        samples.append((name, labels, _parse_value(value)))
    return samples


def value(samples, name, **labels):
    """The one value of metric `name` whose labels include `labels`; None if absent."""
    want = {k: str(v) for k, v in labels.items()}
    found = [v for n, l, v in samples if n == name and all(l.get(k) == v for k, v in want.items())]
    if len(found) > 1:
        raise ValueError(f"{len(found)} samples of {name} match {labels}")
    return found[0] if found else None


def by_layer(samples, name, run):
    """{layer: value} of a per-layer metric of one run (head aggregate, no `head` label)."""
    return {int(l["layer"]): v for n, l, v in samples
            if n == name and l.get("run") == run and "layer" in l and "head" not in l}


def scrape(url, timeout=2.0):
    """Fetches and parses a /metrics page."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse(response.read().decode("utf-8"))
