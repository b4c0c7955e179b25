"""A user's exported proxy never sits between the job and its own servers (rollout/direct.py).

With http_proxy pointing at a proxy that does not answer and an empty no_proxy, plain urllib fails
to reach a server on 127.0.0.1 (the failure users met: SGLang's start-up request to itself), while
the project's own requests (ServerEndpoint, the health check, the rollout client's ServerAPI) reach
it; the environment of a server the project starts lists loopback and its host in no_proxy, and
keeps the proxy for every other host (downloads); the sbatch script's health checks go direct.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from requests.utils import should_bypass_proxies

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.direct import direct_env
from megatron_rl.rollout.server import ServerConfig, SGLangServer, http_ok
from megatron_rl.weights.endpoint import ServerEndpoint

DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, every connection is refused
SBATCH = Path(__file__).resolve().parents[2] / "slurm" / "megatron_rl.sbatch"


class _Handler(BaseHTTPRequestHandler):
    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.dumps({"path": self.path, "sent": json.loads(self.rfile.read(length) or b"null")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def server_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def dead_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, DEAD_PROXY)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "")


def test_own_requests_reach_the_server_past_a_dead_proxy(dead_proxy, server_url):
    # What a proxy-honouring client meets: a fresh opener reads the proxy variables now (urlopen's
    # global one keeps those of its first use, perhaps another test's, before the proxy was set).
    with pytest.raises(urllib.error.URLError):
        urllib.request.build_opener().open(server_url + "/health", timeout=5)

    assert http_ok(server_url + "/health")
    endpoint = ServerEndpoint(server_url)
    assert endpoint.get("/server_info")["path"] == "/server_info"
    assert endpoint.post("/begin_weight_update", {"selector": "all"})["sent"] == {"selector": "all"}

    async def rollout_client():
        client = RolloutClient([server_url], stall_timeout=None)
        try:
            api = client.server(server_url)
            return await api.get_server_info(), await api.health()
        finally:
            await client.close()

    info, healthy = asyncio.run(rollout_client())
    assert info["path"] == "/get_server_info" and healthy


def _bypassed(env: dict, url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname
    by_urllib = urllib.request.proxy_bypass_environment(host, {"no": env["no_proxy"]})
    by_requests = should_bypass_proxies(url, no_proxy=env["NO_PROXY"])
    assert by_urllib == by_requests, (url, by_urllib, by_requests)
    return by_urllib


def test_direct_env_lists_loopback_and_the_job_hosts_keeps_the_proxy():
    user = {"http_proxy": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "no_proxy": "corp.example", "NO_PROXY": "",
            "PATH": "/usr/bin"}
    env = direct_env(user, ["node7", "10.1.2.3"])
    assert env["http_proxy"] == env["HTTPS_PROXY"] == DEAD_PROXY and env["PATH"] == "/usr/bin"
    assert env["no_proxy"] == env["NO_PROXY"] == "corp.example,localhost,127.0.0.1,::1,node7,10.1.2.3"
    for url in ("http://127.0.0.1:30000/model_info", "http://localhost:30000", "http://node7:30016/health",
                "http://10.1.2.3:30000", "http://pip.corp.example/simple"):
        assert _bypassed(env, url), url
    for url in ("https://huggingface.co/api/models", "https://pypi.org/simple"):
        assert not _bypassed(env, url), url  # downloads still go through the user's proxy
    assert user["no_proxy"] == "corp.example"  # the caller's mapping is not changed
    assert direct_env(env, ["node7"]) == env  # idempotent: no entry twice
    star = direct_env({"NO_PROXY": "*", "http_proxy": DEAD_PROXY}, ["node7"])
    assert star["no_proxy"] == star["NO_PROXY"] == "*"  # no host through a proxy stays so


def test_a_started_server_asks_itself_direct(dead_proxy):
    server = SGLangServer(0, ServerConfig(model_path="m", host="10.0.0.5"), port=1, log_path=Path("unused.log"))
    env = server.environment()
    assert env["http_proxy"] == DEAD_PROXY
    assert _bypassed(env, "http://127.0.0.1:1/model_info") and _bypassed(env, "http://10.0.0.5:1/model_info")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_sbatch_health_checks_and_processes_go_direct():
    script = SBATCH.read_text()
    curls = [line for line in script.splitlines() if "curl " in line and not line.lstrip().startswith("#")]
    assert curls and all("--noproxy '*'" in line for line in curls), curls
    assert "export no_proxy NO_PROXY=$no_proxy" in script


def test_server_http_access_log_is_quiet_unless_asked():
    from megatron_rl.rollout.placement import quiet_http

    # SGLang's --log-level-http: the level of its uvicorn access log (a server's log shows none of
    # the requests of a run: tests/e2e/test_proxy.py); launch_server applies it
    base = ["--model-path", "m", "--device", "cpu"]
    assert quiet_http(base) == [*base, "--log-level-http", "warning"]
    for own in (["--log-level-http", "info"], ["--log-level-http=debug"]):
        assert quiet_http([*base, *own]) == [*base, *own]
