"""A client that leaves while its request body is still being read: answered (to nobody) and
counted as 499, a client disconnect, with no server error and no traceback; the server serves on."""
import re
import socket
import time
from urllib.parse import urlparse

from tests.server.conftest import KEY, MODEL


def _count(metrics: str, name: str, **labels) -> float:
    total = 0.0
    for line in metrics.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _leave_mid_body(url: str) -> None:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {KEY}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n").encode()
                  + b'{"model": "tiny", "messages": [{"role": "user", "content": "')
        time.sleep(0.2)  # the server is reading the body when the client goes


def test_a_client_that_leaves_mid_body_is_a_499(server, http, caplog):
    before = http.get("/metrics").text
    for _ in range(3):
        _leave_mid_body(server)
    deadline = time.monotonic() + 10
    while True:
        after = http.get("/metrics").text
        left = _count(after, "lazyllm_http_requests_total", status="499") - \
            _count(before, "lazyllm_http_requests_total", status="499")
        if left >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == 3, after
    assert _count(after, "lazyllm_http_requests_total", status="500") == \
        _count(before, "lazyllm_http_requests_total", status="500")
    assert _count(after, "lazyllm_client_disconnects_total") - _count(before, "lazyllm_client_disconnects_total") == 3
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
