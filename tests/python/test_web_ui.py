"""The web UI (ui/index.html, served by foreshockd at / on its metrics port) in
headless Chromium, against a real daemon fed by a real faulted training run of
the demo model (lowprec x64 injected at step 500: alerts from ~step 540).

Asserted from the DOM Chromium renders (--dump-dom): the runs page lists the
run; the run page renders the loss chart with the first-alert and divergence
markers (the divergence step the page computes must equal demo/train.py's
docs/DESIGN.md §6.3 rule on the same losses), a qk_increment_entropy heatmap
with cells and alert markers, a band over every alert episode's firing (or
never-fired pending) interval on the series it concerns, and one alert row
per episode with its probable cause. The run page's screenshot goes to the test's tmp dir, or to docs/ui.png
with FORESHOCK_UPDATE_SCREENSHOT=1.

Needs Debian's `chromium` package: without it these tests FAIL (CI installs it).
"""
import html.parser
import json
import os
import shutil
import struct
import subprocess
import urllib.parse
import urllib.request

import pytest

from conftest import ROOT, Daemon, foreshockd_binary, wait_until

UI_FILE = os.path.join(ROOT, "ui", "index.html")
SCREENSHOT = os.path.join(ROOT, "docs", "ui.png")
RUN = "ui-lowprec"
JOB = "ui-e2e"
STEPS = 750
TRAIN_ARGS = ["--run-id", RUN, "--job", JOB, "--seed", "0", "--steps", str(STEPS),
              "--fault", "lowprec", "--fault-step", "500", "--fault-strength", "64",
              "--lowprec-on", "both", "--log-every", "0", "--no-alerts"]

CHROMIUM_PACKAGE = "chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
                  "--enable-logging=stderr", "--v=0"]


# ----------------------------------------------------------------- chromium

def chromium_binary():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"headless Chromium is required for the web UI test: install Debian's "
                f"`{CHROMIUM_PACKAGE}` package (apt-get install -y --no-install-recommends "
                f"{CHROMIUM_PACKAGE})")


class Chromium:
    """One headless Chromium process per call, each with its own profile under tmp."""

    def __init__(self, binary, tmp_path):
        self.binary = binary
        self.tmp_path = tmp_path
        self.calls = 0

    def run(self, url, *args, timeout_s=120):
        self.calls += 1
        home = self.tmp_path / f"chromium-{self.calls}"
        home.mkdir()
        env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / "config"),
                   XDG_CACHE_HOME=str(home / "cache"))
        cmd = [self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={home / 'profile'}", *args, url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (f"chromium exited with {proc.returncode}: {' '.join(cmd)}\n"
                                      + proc.stderr[-3000:])
        # --enable-logging=stderr prints the page's console as INFO:CONSOLE lines
        uncaught = [line for line in proc.stderr.splitlines()
                    if ":CONSOLE" in line and "Uncaught" in line]
        assert not uncaught, f"JavaScript errors on {url}:\n" + "\n".join(uncaught)
        return proc.stdout

    def dom(self, url, page, attempts=3):
        """The rendered DOM once <body data-ready="1" data-page=page>; retried with
        more virtual time if the page had not finished its fetches."""
        budget_ms = 20000
        for _ in range(attempts):
            root = parse_dom(self.run(url, f"--virtual-time-budget={budget_ms}", "--dump-dom"))
            body = root.find("body")
            assert body is not None, "no <body> in the dumped DOM"
            if body.attrs.get("data-ready") == "1" and body.attrs.get("data-page") == page:
                return root
            budget_ms *= 2
        error = root.find(id="error")
        pytest.fail(f"{url}: the page did not render (body {body.attrs}, "
                    f"error: {error.text() if error else None})")

    def screenshot(self, url, path):
        self.run(url, "--virtual-time-budget=20000", "--window-size=1400,1800",
                 f"--screenshot={path}")


# ---------------------------------------------------------------- DOM parsing

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    @property
    def classes(self):
        return (self.attrs.get("class") or "").split()

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self):
        yield self
        for c in self.children:
            if isinstance(c, Node):
                yield from c.iter()

    def find_all(self, tag=None, cls=None, id=None, **attrs):
        """Descendants (and self) by tag, class, id and attributes (data_x -> data-x)."""
        attrs = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [n for n in self.iter()
                if (tag is None or n.tag == tag) and (cls is None or cls in n.classes)
                and (id is None or n.attrs.get("id") == id)
                and all(n.attrs.get(k) == v for k, v in attrs.items())]

    def find(self, tag=None, **kw):
        found = self.find_all(tag, **kw)
        return found[0] if found else None


class _TreeBuilder(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", [], None)
        self.current = self.root

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Node(tag, attrs, self.current))

    def handle_endtag(self, tag):
        node = self.current
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(data)


def parse_dom(text):
    builder = _TreeBuilder()
    builder.feed(text)
    builder.close()
    return builder.root


# ------------------------------------------------------------------ fixtures

def get_json(daemon, path, **params):
    query = ("?" + urllib.parse.urlencode(params)) if params else ""
    url = f"http://127.0.0.1:{daemon.metrics_port}/api/v1/{path}{query}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A daemon holding one finished lowprec training run: (daemon, train result)."""
    from demo import train
    tmp = tmp_path_factory.mktemp("web_ui")
    daemon = Daemon(foreshockd_binary(), str(tmp))
    daemon.start()
    try:
        args = train.parse_args(["--endpoint", daemon.endpoint, *TRAIN_ARGS])
        with open(tmp / "train.log", "w") as log:
            result = train.run(args, out=lambda *a: print(*a, file=log))

        def caught_up():
            runs = [r for r in get_json(daemon, "runs")["runs"] if r["run"] == RUN]
            return runs and int(runs[0]["last_step"]) == STEPS - 1
        assert wait_until(caught_up, timeout_s=30), get_json(daemon, "runs")
        alerts = get_json(daemon, "alerts", run=RUN, include_resolved="true")["alerts"]
        assert any(int(a["firing_step"]) >= 0 for a in alerts), \
            f"the faulted run raised no alert (divergence {result['divergence_step']}): {alerts}"
        yield daemon, result
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def chromium_path():
    # Module scope, listed first by the tests: a missing Chromium fails before the training.
    return chromium_binary()


@pytest.fixture
def chromium(chromium_path, tmp_path):
    return Chromium(chromium_path, tmp_path)


def page_url(daemon, fragment):
    return f"http://127.0.0.1:{daemon.metrics_port}/{fragment}"


# --------------------------------------------------------------------- tests

def test_ui_is_self_contained():
    """Works offline: no external scripts, styles, fonts or images."""
    with open(UI_FILE, encoding="utf-8") as f:
        text = f.read()
    lowered = text.lower()
    for needle in ("<script src", "<link", "@import", "url(http", "url(//", 'src="http',
                   "src='http", 'href="http', "href='http", 'src="//', 'href="//'):
        assert needle not in lowered, f"ui/index.html references an external resource: {needle}"
    assert "<script>" in lowered and "<style>" in lowered


def test_daemon_serves_the_ui_file(trained):
    daemon, _ = trained
    with urllib.request.urlopen(page_url(daemon, ""), timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/html")
        served = response.read()
    with open(UI_FILE, "rb") as f:
        assert served == f.read(), "foreshockd serves another ui/index.html: rebuild foreshockd"


def test_runs_page_lists_the_run(chromium_path, chromium, trained):
    daemon, _ = trained
    dom = chromium.dom(page_url(daemon, "#/"), "runs")
    table = dom.find("table", id="runs")
    assert table is not None, "no table#runs"
    rows = table.find_all("tr", cls="run-row", data_run=RUN)
    assert len(rows) == 1, [r.attrs for r in table.find_all("tr", cls="run-row")]
    row = rows[0]
    link = row.find("a", cls="run-link")
    assert link.text() == RUN and link.attrs["href"] == "#/run/" + RUN
    assert row.find("td", cls="job").text() == JOB
    (api_run,) = [r for r in get_json(daemon, "runs")["runs"] if r["run"] == RUN]
    badge = row.find(cls="active-alerts")
    assert badge.attrs["data-count"] == api_run["active_alerts"], (badge.attrs, api_run)
    assert f"{STEPS - 1:,}" in row.find("td", cls="steps").text()


def test_run_page_renders_loss_heatmaps_and_alerts(chromium_path, chromium, trained):
    daemon, result = trained
    dom = chromium.dom(page_url(daemon, "#/run/" + RUN), "run")
    body = dom.find("body")
    assert body.attrs.get("data-run") == RUN and "data-error" not in body.attrs, body.attrs
    alerts = get_json(daemon, "alerts", run=RUN, include_resolved="true")["alerts"]

    # (a) the loss chart: every step, the first alert and the divergence marker
    chart = dom.find(id="loss-chart")
    assert chart is not None and chart.tag == "svg", "no svg#loss-chart"
    assert chart.attrs["data-points"] == str(STEPS)
    line = chart.find("path", cls="series-line")
    assert line is not None and line.attrs["d"].count("L") >= STEPS - 10
    first_firing = min(int(a["firing_step"]) for a in alerts if int(a["firing_step"]) >= 0)
    marker = chart.find(id="marker-first-alert")
    assert marker is not None and marker.attrs["data-step"] == str(first_firing), \
        (marker.attrs if marker else None, first_firing)
    divergence = chart.find(id="marker-divergence")
    if result["divergence_step"] is None:
        assert divergence is None, divergence.attrs
    else:  # the page's docs/DESIGN.md §6.3 rule agrees with demo/train.py's on the same losses
        assert divergence is not None, "no divergence marker"
        assert divergence.attrs["data-step"] == str(result["divergence_step"])
        assert "divergence (docs/DESIGN.md §6 rule)" in divergence.text()

    # (b) heatmaps: one per layer-level signal, rows = layers, with cells and alert markers
    heatmaps = {h.attrs["data-signal"]: h for h in dom.find_all("div", cls="heatmap")}
    assert "qk_increment_entropy" in heatmaps and "attention_max_logit" in heatmaps, list(heatmaps)
    for signal in ("qk_increment_entropy", "attention_max_logit"):
        heatmap = heatmaps[signal]
        assert heatmap.attrs["data-layers"] == "4", heatmap.attrs
        cells = heatmap.find_all("rect", cls="cell")
        assert cells and heatmap.attrs["data-cells"] == str(len(cells)), heatmap.attrs
        assert {r.attrs["data-layer"] for r in heatmap.find_all("g", cls="row")} == {"0", "1", "2", "3"}
        assert heatmap.find(cls="legend-min") and heatmap.find(cls="legend-max")
        markers = {(m.attrs["data-alertname"], m.attrs["data-layer"], m.attrs["data-step"])
                   for m in heatmap.find_all("path", cls="alert-marker")}
        for a in alerts:
            if a["signal"] == signal and a["layer"] != "all" and int(a["firing_step"]) >= 0:
                assert (a["alertname"], a["layer"], a["firing_step"]) in markers, (a, markers)

    # (c) every episode of an alert on a drawn series is a band over its
    # interval: on the layer's row of the signal's heatmap, or on the loss
    # chart (run-level loss signals); firing from firing_step to resolved_step, pending
    # (never fired) from pending_step to the step it cleared.
    def expected_bands(a):
        fired, ended = int(a["firing_step"]), int(a["resolved_step"])
        pending = int(a.get("pending_step", -1))
        start = pending if pending >= 0 else int(a["first_step"])
        out = set()
        if fired >= 0 and ended >= 0:
            out.add(("firing", str(fired), str(ended)))
        if fired < 0 and ended >= 0 and start >= 0:
            out.add(("pending", str(start), str(ended)))
        return out
    checked = 0
    for a in alerts:
        if a["layer"] == "all":
            if not a["signal"].startswith("loss"):  # the loss chart: loss, loss_over_running_min
                continue
            container = chart
        elif a["signal"] in heatmaps:
            container = heatmaps[a["signal"]]
        else:
            continue
        drawn = {(b.attrs["data-kind"], b.attrs["data-from"], b.attrs["data-to"])
                 for b in container.find_all("rect", data_alertname=a["alertname"],
                                             data_layer=a["layer"], data_episode=str(a["episode"]))
                 if {"episode-band", "heatmap-band"} & set(b.classes)}
        assert expected_bands(a) <= drawn, (a["alertname"], a["layer"], a["episode"], drawn)
        checked += len(expected_bands(a))
    assert checked > 0, "no alert episode to draw a band for"

    # (d) the alert list: one row per episode, with its probable cause
    table = dom.find("table", id="alerts")
    assert table is not None, "no table#alerts"
    rows = table.find_all("tr", cls="alert-row")
    assert len(rows) == len(alerts), ([r.attrs for r in rows], alerts)
    for a in alerts:
        matching = [r for r in rows if r.attrs["data-alertname"] == a["alertname"]
                    and r.attrs["data-layer"] == a["layer"]
                    and r.attrs["data-episode"] == str(a["episode"])
                    and r.attrs["data-attempt"] == str(a["attempt"])
                    and r.find("td", cls="first-step").text() == f"{int(a['first_step']):,}"]
        assert len(matching) == 1, (a, [r.attrs for r in rows])
        row = matching[0]
        assert row.attrs["data-state"] == a["state"]
        assert row.find("td", cls="alertname").text() == a["alertname"]
        assert row.find(cls="cause").text() == a["probable_cause"]
        assert row.find(cls="cause-state").text() == \
            ("settled" if a["probable_cause_settled"] else "provisional")
        assert row.find("td", cls="suggested-action").text() == a["suggested_action"]
        details = row.parent.children[row.parent.children.index(row) + 1]
        assert "alert-details" in details.classes
        assert details.find(cls="description").text() == a["description"]
    # The training closed its monitor, which ended the run: alerts that fired
    # are resolved now (resolved_reason run_ended).
    fired = [r for r in rows if r.attrs["data-state"] in ("firing", "resolved")]
    assert fired, "no alert row of an alert that fired"
    assert all(r.find(cls="cause").text() for r in fired)


def test_run_page_screenshot(chromium_path, chromium, trained, tmp_path):
    daemon, _ = trained
    update = os.environ.get("FORESHOCK_UPDATE_SCREENSHOT") == "1"
    path = SCREENSHOT if update else str(tmp_path / "ui.png")
    chromium.screenshot(page_url(daemon, "#/run/" + RUN), path)
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert struct.unpack(">II", head[16:24]) == (1400, 1800)
    assert os.path.getsize(path) > 20000, "the screenshot looks blank"
