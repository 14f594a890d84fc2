"""The app before the model is ready, and after loading failed (in-process, no model)."""
from starlette.testclient import TestClient

from dflash_server.server.app import create_app
from dflash_server.server.config import ServerConfig
from dflash_server.server.state import ServerState

LOCAL = "http://localhost"  # the server answers loopback Host names only (DNS rebinding)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_loading_then_failed():
    state = ServerState(ServerConfig(model_name="m"))
    with TestClient(create_app(state), base_url=LOCAL) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] and "loading" in r.json()["error"]["message"]
        r = c.post("/v1/messages", json={**CHAT, "model": "m"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        assert c.get("/props").json()["status"] == "loading"
        state.fail("weights are corrupt")
        r = c.get("/health")
        assert r.status_code == 500 and r.json()["error"] == "weights are corrupt"
        assert "failed to load" in c.post("/v1/chat/completions", json=CHAT).json()["error"]["message"]


def test_cors_off_by_default_and_on_when_asked():
    with TestClient(create_app(ServerState(ServerConfig())), base_url=LOCAL) as c:
        r = c.get("/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    with TestClient(create_app(ServerState(ServerConfig(cors_origins=("http://ok.example",)))),
                    base_url=LOCAL) as c:
        r = c.options("/v1/chat/completions", headers={"Origin": "http://ok.example",
                                                       "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
        r = c.get("/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_config_validation():
    import pytest

    for bad in ({"port": 70000}, {"max_queue": -1}, {"default_max_tokens": 0}, {"model_name": ""},
                {"default_temperature": 5}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def _serve(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "dflash_server", "serve", *args], capture_output=True, text=True,
                           timeout=120)


def test_cli_errors_are_one_line(tmp_path):
    for args, needle in ((["--model", str(tmp_path / "nope")], "no such file"),
                         (["--port", "99999"], "port")):
        r = _serve(*args)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr.lower(), r.stderr
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    r = _serve("--chat-template-file", str(bad))
    assert r.returncode == 2 and "does not compile" in r.stderr and len(r.stderr.strip().splitlines()) == 1
