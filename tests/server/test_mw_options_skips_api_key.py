"""Hostile review (2026-11-27). Every OPTIONS request skips the API key, preflight or not, CORS on or off: a client
without the key maps the routes (405 = exists, 404 = not) and gets past the Gate."""
from starlette.testclient import TestClient

from dflash_server.server.app import create_app
from dflash_server.server.config import ServerConfig
from dflash_server.server.state import ServerState

LOCAL = "http://localhost"


def test_plain_options_needs_the_key():
    for cors in ((), ("http://ok.example",)):
        state = ServerState(ServerConfig(model_name="m", api_key="k", cors_origins=cors))
        with TestClient(create_app(state), base_url=LOCAL) as c:
            for path in ("/slots", "/metrics", "/props", "/v1/models", "/tokenize", "/no-such-route"):
                r = c.options(path)
                assert r.status_code == 401, (cors, path, r.status_code, r.text)
