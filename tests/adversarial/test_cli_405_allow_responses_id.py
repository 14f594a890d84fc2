"""Hostile review (HTTP): /v1/responses/{id} answers GET and DELETE (two routes); a 405 for
another method names only the first route's method (Allow: GET), so a client reading Allow
(RFC 9110 15.5.6: the methods the resource supports) never learns DELETE exists."""
from starlette.testclient import TestClient

from dflash_server.server.app import create_app
from dflash_server.server.config import ServerConfig
from dflash_server.server.state import ServerState


def test_405_on_a_stored_response_names_get_and_delete():
    with TestClient(create_app(ServerState(ServerConfig(model_name="m"))), base_url="http://localhost") as c:
        r = c.request("PATCH", "/v1/responses/resp_1", headers={"Content-Type": "application/json"}, content=b"{}")
        assert r.status_code == 405
        allow = {m.strip() for m in r.headers.get("allow", "").split(",")}
        assert {"GET", "DELETE"} <= allow, r.headers.get("allow")
