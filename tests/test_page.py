"""The status page every node serves on --metrics-port: its round history in the data dir, the
views it shows (members, warnings, hidden addresses), its HTTP server, and what a person sees
in a real browser (Debian's chromium) on a page served by real nodes."""

from __future__ import annotations

import json
import logging
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from browser import Dom, Element, browse
from helpers import Node, free_port, poll, swarm_config
from prometheus_client import CollectorRegistry, make_wsgi_app

from neuronode.clock import ManualClock
from neuronode.config import NodeConfig
from neuronode.events import fields, record_fields
from neuronode.node.history import HISTORY_FILE, History, RoundRecord
from neuronode.node.page import Page, member_rows, shows_addresses, status_warnings
from neuronode.node.web import PageApp, Unavailable, serve
from neuronode.swarm.membership.table import PeerTable
from neuronode.swarm.node import SwarmNode

# ---- the round history in the data dir -------------------------------------------------------


def record(round_id: int, ids: tuple[str, ...] = ("a", "b")) -> RoundRecord:
    return RoundRecord(round=round_id, time_s=1000.0 + round_id, loss=5.0 - 0.01 * round_id, val_loss=None,
                       tokens_per_s=1500.0, sync_s=0.5, bytes_sent=1000 * round_id, bytes_received=900,
                       contributors=len(ids), contributor_ids=ids)


def test_history_survives_a_restart_and_drops_rounds_past_the_checkpoint(tmp_path: Path) -> None:
    history = History(tmp_path)
    for r in range(1, 6):
        history.add(record(r))
    history.save(history.records())
    again = History.load(tmp_path)
    assert again.records() == history.records()
    # Resumed from the round-3 checkpoint: rounds 4 and 5 belong to a past that did not stay.
    assert [r.round for r in History.load(tmp_path, up_to_round=3).records()] == [1, 2, 3]
    # Rounds trained again after going back replace the old ones.
    again.add(record(3, ids=("c",)))
    assert [(r.round, r.contributor_ids) for r in again.records()][-2:] == [(2, ("a", "b")), (3, ("c",))]


def test_history_is_bounded_keeps_its_start_and_recent_ids(tmp_path: Path) -> None:
    history = History(tmp_path, max_records=64, recent_ids=4)
    for r in range(1, 1001):
        history.add(record(r, ids=(f"member-{r}",)))
    rounds = [r.round for r in history.records()]
    assert len(rounds) <= 64 and rounds == sorted(rounds)
    assert rounds[0] == 1 and rounds[-32:] == list(range(969, 1001))  # the start stays, the newest half whole
    assert [r.round for r in history.records() if r.contributor_ids] == [997, 998, 999, 1000]
    assert all(r.contributors == 1 for r in history.records())  # the counts stay where the ids go
    history.save(history.records())
    assert (tmp_path / HISTORY_FILE).stat().st_size < 64 * 400


def test_corrupt_history_is_set_aside_and_bad_records_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / HISTORY_FILE
    path.write_bytes(b"\x00{not json")
    with caplog.at_level(logging.WARNING):
        history = History.load(tmp_path)
    assert history.records() == []
    assert not path.exists() and (tmp_path / (HISTORY_FILE + ".bad")).read_bytes() == b"\x00{not json"
    assert [record_fields(r).get("event") for r in caplog.records] == ["history_unreadable"]

    good = record(2).to_json()
    path.write_text(json.dumps({"version": 1, "records": [
        good, {"round": "1"}, {**good, "round": 3, "loss": "NaN"}, {**good, "round": -4}, [1], None]}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        history = History.load(tmp_path)
    assert history.records() == [record(2)]
    assert [record_fields(r).get("event") for r in caplog.records] == ["history_unreadable"]
    assert record_fields(caplog.records[0])["skipped"] == 5
    # A history the node writes over is whole again.
    history.save(history.records())
    assert History.load(tmp_path).records() == [record(2)]


# ---- what the page shows --------------------------------------------------------------------


def peer_table() -> PeerTable:
    """Ours (id "self") with a reachable peer, one behind NAT carried by it, one that left."""
    table = PeerTable(self_id="self", dead_after_s=10.0, clock=ManualClock())
    table.heard_from("reach", "192.0.2.7:7420", round=4, param_digest="d4", digests={4: "d4"}, leaving=False)
    table.heard_from("home", "", round=4, param_digest="d4", digests={4: "other"}, leaving=False,
                     reachable=False, carried_by=("reach",))
    table.heard_from("gone", "198.51.100.9:7420", round=2, param_digest="d2", digests={2: "d2"}, leaving=True)
    return table


OWN = {"node_id": "self", "advertise": "203.0.113.5:7420", "reachable": "yes", "sessions": [], "round": 4,
       "agreement": "agree"}


@pytest.mark.parametrize("show", [True, False])
def test_member_rows(show: bool) -> None:
    recent = [record(3, ids=("self", "reach", "gone")), record(4, ids=("self", "reach"))]
    rows = member_rows(peer_table(), OWN, own_digests={4: "d4"}, late={"home"}, recent=recent, show_addresses=show)
    by_id = {row["node_id"]: row for row in rows}
    assert [row["node_id"] for row in rows] == ["self", "home", "reach", "gone"]  # us, the live, the rest
    assert by_id["self"]["self"] and by_id["self"]["address"] == "203.0.113.5:7420"  # ours: always shown
    assert by_id["reach"]["address"] == ("192.0.2.7:7420" if show else "")
    assert by_id["gone"]["address"] == ("198.51.100.9:7420" if show else "")
    assert (by_id["home"]["reachable"], by_id["home"]["carried_by"]) == (False, ["reach"])
    assert [by_id[i]["counted"] for i in ("self", "reach", "home", "gone")] == [
        [True, True], [True, True], [False, False], [True, False]]
    assert [by_id[i]["agreement"] for i in ("reach", "home", "gone")] == ["agree", "diverged", "unknown"]
    assert (by_id["home"]["late"], by_id["reach"]["late"]) == (True, False)
    assert (by_id["gone"]["alive"], by_id["gone"]["left"], by_id["reach"]["alive"]) == (False, True, True)


def test_banned_members_are_listed_known_or_not() -> None:
    table = peer_table()
    table.ban("reach", 60.0)
    table.ban("stranger", 60.0)
    rows = member_rows(table, OWN, own_digests={}, late=set(), recent=[], show_addresses=False)
    banned = {row["node_id"]: row["alive"] for row in rows if row["banned"]}
    assert banned == {"reach": False, "stranger": False}


def test_warnings_come_from_status_fields() -> None:
    alive = {"node_id": "p", "alive": True}
    calm = {"peers": [alive], "agreement": "agree", "reachable": "yes", "sessions": []}
    assert status_warnings(calm, min_peers=2) == []
    assert status_warnings({**calm, "peers": [{**alive, "alive": False}]}, min_peers=2) == ["min_peers"]
    assert status_warnings({**calm, "agreement": "diverged"}, min_peers=1) == ["diverged"]
    assert status_warnings({**calm, "reachable": "no", "sessions": ["p"]}, min_peers=1) == ["unreachable"]
    assert status_warnings({**calm, "reachable": "no"}, min_peers=3) == ["min_peers", "isolated"]


@pytest.mark.parametrize(("listen", "flag", "shown"), [
    ("127.0.0.1:7420", False, True), ("[::1]:7420", False, True), ("localhost:7420", False, True),
    ("0.0.0.0:7420", False, False), ("192.0.2.1:7420", False, False), ("0.0.0.0:7420", True, True)])
def test_addresses_hidden_beyond_loopback_unless_asked(listen: str, flag: bool, shown: bool) -> None:
    cfg = NodeConfig(listen=listen, open=True, page_show_addresses=flag)
    assert shows_addresses(cfg, cfg.listen.rpartition(":")[0].strip("[]")) is shown


@pytest.mark.parametrize("show", [True, False])
async def test_api_status_leaves_no_peer_address_where_hidden(show: bool, tmp_path: Path,
                                                             executor: ThreadPoolExecutor) -> None:
    """The whole /api/status document of a real (unstarted) swarm node that knows a peer, with a
    warning event naming the peer's address: the address appears nowhere unless shown."""
    swarm = SwarmNode(swarm_config("self"), executor=executor)
    swarm.table.heard_from("peer", "192.0.2.7:7420", round=0, param_digest="", digests={}, leaving=False)
    page = Page(cfg=NodeConfig(listen="0.0.0.0:7420", open=True, page_show_addresses=show), swarm=swarm,
                state=swarm.state, history=History(tmp_path), show_addresses=show)
    logging.getLogger().addHandler(page.events)
    try:
        logging.getLogger("neuronode.test").warning("peer at 192.0.2.7:7420 misbehaved",
                                                    extra=fields("test_warning", peer_id="peer"))
    finally:
        logging.getLogger().removeHandler(page.events)
    document = page.status()
    assert [(m["node_id"], m["alive"]) for m in document["members"]] == [("self", True), ("peer", True)]
    assert [(e["event"], e["peer_id"]) for e in document["events"]] == [("test_warning", "peer")]
    assert ("192.0.2.7" in json.dumps(document)) is show
    assert document["addresses_shown"] is show


def test_compose_publishes_each_nodes_page_on_this_machine_only() -> None:
    compose = yaml.safe_load((Path(__file__).parent.parent / "docker-compose.yml").read_text())
    published = {}
    for name, service in compose["services"].items():
        command = [str(c) for c in service.get("command", [])]
        if "--metrics-port" in command:
            port = command[command.index("--metrics-port") + 1]
            published[name] = [p for p in service.get("ports", []) if str(p).endswith(f":{port}")]
    assert len(published) >= 4
    hosts = {name: [p.rsplit(":", 2)[0] for p in ports] for name, ports in published.items()}
    assert all(h == ["127.0.0.1"] for h in hosts.values()), hosts
    assert len({p[0] for p in published.values()}) == len(published)  # one host port per node


def test_volunteer_doc_shows_the_page_and_how_to_open_it() -> None:
    docs = Path(__file__).parent.parent / "docs"
    text = (docs / "volunteer.md").read_text()
    assert "](img/page.png)" in text and (docs / "img" / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (docs / "img" / "page.png").stat().st_size < 200_000
    for needle in ("--metrics-port 9400", "http://localhost:9400/", "/api/status", "/api/history",
                   "--page-show-addresses", "http://localhost:9401/"):
        assert needle in text, needle


# ---- the HTTP server, and the page in a browser on hostile data ------------------------------

# Markup and script in every field a peer can name: shown as text, it is harmless.
HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1"><b>bold</b>&amp;'


def hostile_status() -> dict[str, Any]:
    member = {"self": False, "round": 3, "alive": True, "left": False, "last_seen_s": 1.5, "late": True,
              "banned": False, "counted": [True], "carried_by": [], "reachable": True}
    return {
        "node_id": "me" + HOSTILE, "round": 3, "phase": HOSTILE, "param_digest": HOSTILE, "agreement": HOSTILE,
        "swarm_id": HOSTILE, "advertise": HOSTILE, "loss": 2.5, "val_loss": None, "tokens_per_s": 10.0,
        "peers": [{"node_id": HOSTILE, "address": HOSTILE, "alive": True, "last_seen_s": 1.0}],
        "sessions": [HOSTILE], "reachable": "no", "min_peers": 3, "warnings": ["min_peers", "unreachable", HOSTILE],
        "codec": HOSTILE, "averaging": HOSTILE, "uptime_s": 5.0, "addresses_shown": True, "recent_rounds": [3],
        "members": [
            {**member, "node_id": "peer" + HOSTILE, "address": HOSTILE, "agreement": HOSTILE},
            {**member, "node_id": "nat" + HOSTILE, "address": "", "reachable": False, "carried_by": [HOSTILE],
             "agreement": "agree"},
        ],
        "events": [{"time_s": 1.0, "level": "warning", "event": HOSTILE, "round_id": 3, "peer_id": HOSTILE,
                    "message": HOSTILE}],
    }


@pytest.fixture
def page_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """The node's real HTTP server and page on 127.0.0.1, serving documents a test sets."""
    documents: dict[str, Any] = {}

    def source(path: str) -> Any:
        def read() -> dict[str, Any]:
            if path not in documents:
                raise Unavailable("not ready")
            return dict(documents[path])
        return read

    app = PageApp(metrics=make_wsgi_app(CollectorRegistry()),
                  api={p: source(p) for p in ("/api/status", "/api/history")})
    server = serve(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", documents
    finally:
        server.shutdown()
        server.server_close()


def get(url: str, method: str = "GET", host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_server_is_read_only_and_reflects_nothing(page_server: tuple[str, dict[str, Any]]) -> None:
    base, documents = page_server
    status, headers, body = get(base + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b'src="page.js"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
    assert get(base + "/page.js")[0] == get(base + "/page.css")[0] == 200
    assert get(base + "/metrics")[0] == 200
    assert get(base + "/api/status")[0] == 503  # the node not ready: no document, no traceback
    documents["/api/status"] = {"round": 1, "loss": 2.0}
    status, headers, body = get(base + "/api/status")
    assert status == 200 and headers["Content-Type"] == "application/json" and json.loads(body) == {"round": 1, "loss": 2.0}
    documents["/api/history"] = 5  # a reader that fails: 500, the details in the node's log only
    status, _, body = get(base + "/api/history")
    assert status == 500 and json.loads(body) == {"error": "see the node's log"}
    for method in ("POST", "PUT", "DELETE"):
        status, headers, _ = get(base + "/api/status", method=method)
        assert status == 405 and headers["Allow"] == "GET, HEAD"
    # A name pointed at 127.0.0.1 by someone else's web page (DNS rebinding) reads nothing.
    port = base.rsplit(":", 1)[1]
    for host, code in ((f"evil.example:{port}", 421), (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200),
                       (f"[::1]:{port}", 200), ("10.1.2.3", 200)):
        assert [get(base + path, host=host)[0] for path in ("/", "/api/status")] == [code, code], host
    assert get(base + "/metrics", host=f"evil.example:{port}")[0] == 200  # Prometheus scrapes by service name
    status, _, body = get(base + "/%3Cscript%3Ealert(1)%3C/script%3E?x=%3Cb%3E")
    assert status == 404 and b"script" not in body and b"<b>" not in body
    # The script never parses data as markup (what the browser test below shows, checked at the source).
    script = (Path(__file__).parent.parent / "neuronode" / "node" / "static" / "page.js").read_text()
    assert not any(sink in script for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("))


@pytest.mark.timeout(120)
def test_hostile_names_are_shown_as_text(page_server: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    base, documents = page_server
    documents["/api/status"] = hostile_status()
    documents["/api/history"] = {"rounds": [{**record(3).to_json(), "loss": HOSTILE}, record(4).to_json()]}
    dom = Dom(browse(base + "/", tmp_path / "profile")).root
    body = dom.find_all("body")[0]
    assert body.attrs.get("data-state") == "live", "the page's script did not render"
    assert "data-pwned" not in body.attrs
    # Nothing of the hostile markup became an element: no <img>, no <b>, anywhere.
    assert dom.find_all("img") == [] and dom.find_all("b") == []
    rows = dom.by_id("member-rows").find_all("tr")
    assert [r.find_all("td")[0].text for r in rows] == ["peer" + HOSTILE, "nat" + HOSTILE]
    assert rows[0].find_all("td")[1].text == HOSTILE
    assert rows[1].find_all("td")[1].text == "behind NAT, carried by " + HOSTILE
    assert dom.by_id("node-id").text == "me" + HOSTILE and dom.by_id("digest").text == HOSTILE
    warnings = dom.by_id("warning-list").find_all("li")
    assert [w.attrs["data-code"] for w in warnings] == ["min_peers", "unreachable", HOSTILE]
    assert HOSTILE in warnings[1].text and warnings[2].text == HOSTILE
    event = dom.by_id("events").find_all("li")[0]
    assert event.attrs["data-event"] == HOSTILE and event.text.count(HOSTILE) == 3
    # The loss curve: round 3's hostile "loss" is no number, so only round 4 is drawn.
    assert [c.attrs["data-round"] for c in points(dom, "chart-loss", "loss")] == ["4"]


def points(dom: Element, chart: str, series: str) -> list[Element]:
    """The points drawn for one series of one chart."""
    return [c for g in dom.by_id(chart).find_all("g", cls="series-" + series) for c in g.find_all("circle", cls="point")]


# ---- two real nodes, and the page as a person sees it ---------------------------------------

LIGHT = ("--batch-size", "8", "--seq-len", "64", "--task-option", "val_windows=4", "--inner-steps", "3")
# A peer's id is its own choice: one that is markup must reach the page as text.
HOSTILE_ID = "<img/src=x/onerror=document.body.dataset.pwned=1>&amp;"
ROUNDS = 3


def api(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return dict(json.loads(resp.read()))


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_page_of_a_two_node_swarm_in_a_browser(tmp_path: Path) -> None:
    """A (--min-peers 2, runs on) and B (a hostile id, 3 rounds) train together; B leaves, so A
    waits at round 3 for a second member: a page that holds still while the browser reads it."""
    port = free_port()
    a = Node(tmp_path, "a", *LIGHT, "--rounds", "0", "--min-peers", "2", "--metrics-port", str(port))
    b = Node(tmp_path, "b", *LIGHT, "--rounds", str(ROUNDS), "--min-peers", "2", "--node-id", HOSTILE_ID,
             "--peers", a.address)
    try:
        a.start()
        b.start()
        assert b.wait(240) == 0, b.log()[-4000:]

        def waiting() -> dict[str, Any] | None:
            s = api(port, "/api/status")
            settled = not any(p["alive"] for p in s["peers"])  # B's leave taken
            return s if (s["round"], s["phase"]) == (ROUNDS, "syncing") and "min_peers" in s["warnings"] \
                and settled else None

        status = poll(f"a to wait for --min-peers at round {ROUNDS}", waiting, timeout_s=60,
                      context=lambda: a.log()[-3000:])
        cli = a.status(live=True)
        # /api/status holds `neuronode status` (addresses shown: the page listens on loopback).
        assert set(cli) <= set(status)
        # What moves between the two reads: traffic, utilization, and the replica agreement (it
        # follows B's leave on a heartbeat, after the page showed B dead: "agree" then "unknown").
        moving = {"peers", "control_bytes_sent", "control_bytes_received", "utilization", "agreement"}
        for key in set(cli) - moving:
            assert status[key] == cli[key], key
        assert {status["agreement"], cli["agreement"]} <= {"agree", "unknown"}, (status["agreement"], cli["agreement"])
        assert [(p["node_id"], p["address"], p["alive"]) for p in status["peers"]] == [
            (p["node_id"], p["address"], p["alive"]) for p in cli["peers"]] == [(HOSTILE_ID, b.address, False)]
        history = api(port, "/api/history")["rounds"]
        assert [r["round"] for r in history] == list(range(1, ROUNDS + 1))
        assert all(r["contributors"] == 2 and r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in history), history

        dom = Dom(browse(f"http://127.0.0.1:{port}/", tmp_path / "profile")).root
        shot = tmp_path / "page.png"
        browse(f"http://127.0.0.1:{port}/", tmp_path / "profile", screenshot=shot, window="1280,1400")
        print(f"screenshot of the page: {shot}")

        body = dom.find_all("body")[0]
        assert body.attrs.get("data-state") == "live" and "data-pwned" not in body.attrs
        rows = dom.by_id("member-rows").find_all("tr")
        assert len(rows) == 2, [r.text for r in rows]
        ids = [r.find_all("td")[0] for r in rows]
        assert ids[0].text == cli["node_id"] + "this node" and ids[1].text == HOSTILE_ID
        assert dom.find_all("img") == []
        cells = [td.text for td in rows[1].find_all("td")]
        # Last seen: B's leave, "just now" when the browser reads the page within a second of it (CI, once).
        assert cells[1:5] == [b.address, str(ROUNDS), "yes", "left"] and (cells[5] == "just now" or cells[5].endswith(" ago")), cells
        assert cells[6].endswith(f"{ROUNDS}/{ROUNDS}") and cells[8] == "agree", cells  # counted, same parameters
        assert len(points(dom, "chart-loss", "loss")) == cli["round"] == ROUNDS
        assert len(points(dom, "chart-loss", "val_loss")) == ROUNDS
        assert len(points(dom, "chart-bytes", "bytes_sent")) == ROUNDS
        assert dom.by_id("digest").text == cli["param_digest"]
        assert [li.attrs["data-code"] for li in dom.by_id("warning-list").find_all("li")] == ["min_peers"]

        # The history is in the data dir: a restart keeps the curves.
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        assert a.wait(60) == 0, a.log()[-3000:]
        a.start()
        again = poll("a's page after a restart", lambda: api(port, "/api/history")["rounds"], timeout_s=60,
                     context=lambda: a.log()[-3000:])
        assert again == history
        a.proc.send_signal(signal.SIGTERM)
        assert a.wait(60) == 0, a.log()[-3000:]
    finally:
        for node in (a, b):
            node.kill()

