"""Hostile review (2026-11-27). A 405 must carry an Allow header (RFC 9110 15.5.6); the app's HTTPException handler drops it."""
from starlette.testclient import TestClient

from dflash_server.server.app import create_app
from dflash_server.server.config import ServerConfig
from dflash_server.server.state import ServerState

LOCAL = "http://localhost"


def test_405_names_the_allowed_methods():
    with TestClient(create_app(ServerState(ServerConfig(model_name="m"))), base_url=LOCAL) as c:
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["message"]
        assert r.headers.get("allow") == "POST", dict(r.headers)
        r = c.put("/props", headers={"Content-Type": "application/json"})
        assert r.status_code == 405 and "GET" in r.headers.get("allow", ""), dict(r.headers)
