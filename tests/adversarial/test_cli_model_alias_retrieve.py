"""Hostile review (HTTP): --model-alias names are accepted in requests ("model": "foo") but
GET /v1/models/foo is a 404 model_not_found: a client that retrieves its model before using
it (OpenAI SDK client.models.retrieve) is told the model it may use does not exist."""
from starlette.testclient import TestClient

from dflash_server.server.app import create_app
from dflash_server.server.config import ServerConfig
from dflash_server.server.state import ServerState


def test_an_alias_can_be_retrieved():
    state = ServerState(ServerConfig(model_name="m", model_aliases=("foo",)))
    assert state.config.accepts_model("foo")
    with TestClient(create_app(state), base_url="http://localhost") as c:
        assert c.get("/v1/models/m").status_code == 200
        r = c.get("/v1/models/foo")
        assert r.status_code == 200, r.text
        assert c.get("/v1/models/bar").status_code == 404   # not an alias: still unknown


def test_any_name_with_the_wildcard_alias():
    with TestClient(create_app(ServerState(ServerConfig(model_name="m", model_aliases=("*",)))),
                    base_url="http://localhost") as c:
        assert c.get("/v1/models/gpt-4o").status_code == 200
