"""The Grafana dashboard: it round-trips through the foundation SDK, has the structure Grafana's
dashboard schema requires, is written where Ray's Grafana provisioning reads it, and is pushed with
grafana-client. No Grafana server can be installed here: the push goes to FakeGrafana below, a
loopback HTTP server implementing the one endpoint the push uses (POST /api/dashboards/db, bearer
token) plus GET /api/dashboards/uid/<uid> to read it back. (The queries themselves are run against a
real Prometheus in tests/test_metrics.py.)
"""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import free_port
from deployments import dashboards

TOKEN = "glsa_test_token"

# From Grafana's dashboard schema (grafana-foundation-sdk, jsonschema/dashboard.jsonschema.json, v11.6):
# the Dashboard object's properties (additionalProperties: false) and required ones; variable types.
DASHBOARD_PROPERTIES = {
    "id", "uid", "title", "description", "revision", "gnetId", "tags", "timezone", "editable", "graphTooltip",
    "time", "timepicker", "fiscalYearStartMonth", "liveNow", "weekStart", "refresh", "schemaVersion", "version",
    "panels", "templating", "annotations", "links", "snapshot"}
DASHBOARD_REQUIRED = {"schemaVersion", "templating", "annotations"}
VARIABLE_TYPES = {"query", "adhoc", "constant", "datasource", "interval", "textbox", "custom", "system"}


@pytest.fixture(scope="module")
def board():
    return dashboards.build_dashboard()


def test_dashboard_round_trips_through_the_sdk(board):
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    text = json.dumps(board)
    again = json.loads(json.dumps(Dashboard.from_json(json.loads(text)), cls=JSONEncoder))
    assert again == board  # from_json keeps only what the schema's model knows: nothing was dropped


def test_dashboard_matches_grafanas_dashboard_schema(board):
    assert DASHBOARD_REQUIRED <= set(board) <= DASHBOARD_PROPERTIES, set(board) ^ DASHBOARD_PROPERTIES
    assert isinstance(board["schemaVersion"], int) and isinstance(board["annotations"], dict)
    assert board["uid"] == dashboards.UID and 8 <= len(board["uid"]) <= 40
    for variable in board["templating"]["list"]:
        assert variable["type"] in VARIABLE_TYPES and variable["name"]
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "model", "application"} <= names

    ids, cells = set(), set()
    for panel in board["panels"]:
        assert panel["type"] == "timeseries" and panel["title"] and panel["id"] not in ids
        ids.add(panel["id"])
        g = panel["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy")
        assert g["h"] > 0 and 0 < g["w"] <= 24 and 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["y"] >= 0
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids)
        for target in panel["targets"]:
            assert target["expr"] and target["datasource"] == panel["datasource"]
            # every query uses only variables the dashboard defines (or Grafana's own)
            for word in target["expr"].split("$")[1:]:
                name = word.split('"')[0].split("]")[0]
                assert name in names or name == "__rate_interval", name


def test_dashboard_has_the_panels_operators_need(board):
    titles = {p["title"] for p in board["panels"]}
    assert {"Mean acceptance length", "Acceptance rate", "Acceptance by position", "Output tokens/s",
            "Time to first token", "Inter-token latency", "Block size", "Batch size per forward", "Replicas",
            "Queue lengths", "Accepted tokens by proposer"} <= titles
    queries = " ".join(expr for _, expr in dashboards.panel_queries(board))
    for metric in ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total",
                   "num_accepted_tokens_per_pos_total", "ttft_seconds_bucket", "itl_seconds_bucket"):
        assert f"ray_dflash_{metric}" in queries


# ---- files ---------------------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser()
    dashboards.add_arguments(parser)
    return parser.parse_args(argv)


def test_command_writes_the_file_and_into_rays_provisioning_folder(tmp_path, monkeypatch, board, capsys):
    session = tmp_path / "session_latest"
    (session / "metrics" / "grafana").mkdir(parents=True)  # what Ray's dashboard sets up in a session
    monkeypatch.setattr(dashboards, "RAY_SESSION_DIR", session)
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    dashboards.run(parse(["--out", str(tmp_path / "out")]))
    for folder in (tmp_path / "out", session / "metrics" / "grafana" / "dashboards"):
        assert json.loads((folder / dashboards.FILE_NAME).read_text()) == board
    assert capsys.readouterr().out.count("wrote ") == 2


def test_command_without_a_ray_session_writes_only_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(dashboards, "RAY_SESSION_DIR", tmp_path / "no-session")
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    assert dashboards.ray_dashboards_dir() is None
    dashboards.run(parse(["--out", str(tmp_path / "out")]))
    assert [p.name for p in (tmp_path / "out").iterdir()] == [dashboards.FILE_NAME]


# ---- push ----------------------------------------------------------------------------------


class FakeGrafana(ThreadingHTTPServer):
    """Grafana's dashboard API as far as the push uses it, on 127.0.0.1: POST /api/dashboards/db and
    GET /api/dashboards/uid/<uid>, with Grafana's status codes and messages; bearer TOKEN only."""

    def __init__(self):
        self.dashboards: dict[str, dict] = {}
        super().__init__(("127.0.0.1", free_port()), _GrafanaHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _GrafanaHandler(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        self._answer(401, {"message": "invalid API key", "traceID": ""})
        return False

    def do_POST(self):
        if not self._authorized():
            return
        if self.path != "/api/dashboards/db":
            return self._answer(404, {"message": "Not found"})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        board = body.get("dashboard")
        if not isinstance(board, dict) or not board.get("title"):
            return self._answer(400, {"message": "Dashboard title cannot be empty"})
        uid = board["uid"]
        if uid in self.server.dashboards and not body.get("overwrite"):
            return self._answer(412, {"message": "A dashboard with the same uid already exists", "status": "name-exists"})
        version = self.server.dashboards.get(uid, {}).get("version", 0) + 1
        self.server.dashboards[uid] = {**board, "version": version}
        self._answer(200, {"id": 1, "uid": uid, "url": f"/d/{uid}/dflash-serve", "status": "success", "version": version})

    def do_GET(self):
        if not self._authorized():
            return
        uid = self.path.removeprefix("/api/dashboards/uid/")
        if uid not in self.server.dashboards:
            return self._answer(404, {"message": "Dashboard not found"})
        self._answer(200, {"dashboard": self.server.dashboards[uid], "meta": {"url": f"/d/{uid}/dflash-serve"}})

    def log_message(self, *args):
        pass


@pytest.fixture
def grafana():
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_push_creates_then_replaces_the_dashboard(grafana, board, tmp_path, monkeypatch, capsys):
    from grafana_client import GrafanaApi

    monkeypatch.setattr(dashboards, "RAY_SESSION_DIR", tmp_path / "no-session")
    args = parse(["--out", str(tmp_path), "--grafana-url", grafana.url, "--grafana-token", TOKEN])
    dashboards.run(args)
    assert f"pushed {grafana.url}/d/{dashboards.UID}/dflash-serve" in capsys.readouterr().out
    dashboards.run(args)  # a second push overwrites
    stored = GrafanaApi.from_url(grafana.url, credential=TOKEN).dashboard.get_dashboard(dashboards.UID)["dashboard"]
    assert stored == {**board, "version": 2}


def test_push_with_a_wrong_token_says_so(grafana, board):
    with pytest.raises(dashboards.PushError, match=r"rejected the token \(401 Unauthorized\)"):
        dashboards.push(board, grafana.url, "wrong-token")
    assert grafana.dashboards == {}


def test_push_to_an_unreachable_url_says_so(board):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(dashboards.PushError, match=f"cannot reach Grafana at {url}"):
        dashboards.push(board, url, TOKEN, timeout_s=5)


def test_push_without_a_token_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    args = parse(["--out", str(tmp_path / "out"), "--grafana-url", "http://127.0.0.1:3000"])
    with pytest.raises(dashboards.PushError, match="needs --grafana-token"):
        dashboards.run(args)
    assert not (tmp_path / "out").exists()
