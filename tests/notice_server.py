"""A local metadata server for the preemption-notice tests: a real HTTP server on 127.0.0.1
(a free port chosen by the OS) that answers as each provider's documentation shows
(``tidal.preemption``'s module doc), and refuses what the provider would refuse.

``NoticeServer.notice`` switches the notice on, for a path (the URL form's ``/w{worker}``)
or for every provider path; ``errors`` makes the next N requests answer 500. Every request
is recorded (``requests``: method, path, monotonic time).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "AQAEAtokenFromImdsV2=="
VM_NAME = "spot-vm-7"
AWS_ACTION = {"action": "terminate", "time": "2026-01-01T00:02:00Z"}


class NoticeServer:
    def __init__(self) -> None:
        self.noticed: set[str] = set()  # paths (or "*") that announce a notice
        self.errors = 0  # the next N requests answer 500
        self.expired_tokens: set[str] = set()  # AWS tokens answered 401
        self.requests: list[tuple[str, str, float]] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_PUT(self) -> None:
                owner._answer(self, "PUT")

            def do_GET(self) -> None:
                owner._answer(self, "GET")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def notice(self, path: str = "*") -> None:
        with self.lock:
            self.noticed.add(path)

    def paths(self) -> list[str]:
        with self.lock:
            return [p for _, p, _ in self.requests]

    # -- the answers ------------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, method: str) -> None:
        with self.lock:
            self.requests.append((method, h.path, time.monotonic()))
            if self.errors:
                self.errors -= 1
                return self._send(h, 500, "internal error")
            on = "*" in self.noticed or h.path.split("?")[0] in self.noticed
        path, _, query = h.path.partition("?")
        if path == "/latest/api/token":  # AWS IMDSv2: PUT only, with a TTL header
            if method != "PUT" or not h.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._send(h, 400 if method == "PUT" else 405, "")
            return self._send(h, 200, TOKEN)
        if path == "/latest/meta-data/spot/instance-action":
            token = h.headers.get("X-aws-ec2-metadata-token")
            if token != TOKEN or token in self.expired_tokens:
                return self._send(h, 401, "")
            return self._send(h, 200, json.dumps(AWS_ACTION)) if on else self._send(h, 404, "")
        if path == "/computeMetadata/v1/instance/preempted":  # GCP
            if h.headers.get("Metadata-Flavor") != "Google":
                return self._send(h, 403, "Missing Metadata-Flavor:Google header.")
            return self._send(h, 200, "TRUE" if on else "FALSE")
        if path.startswith("/metadata/"):  # Azure
            if h.headers.get("Metadata") != "true" or "api-version=" not in query:
                return self._send(h, 400, '{"error": "Bad request"}')
            if path == "/metadata/instance/compute/name" and "format=text" in query:
                return self._send(h, 200, VM_NAME)
            if path == "/metadata/scheduledevents":
                return self._send(h, 200, json.dumps(self.azure_events(on)))
            return self._send(h, 404, "")
        if path.startswith("/w"):  # the URL form: AWS's answer, one path per worker
            return self._send(h, 200, json.dumps(AWS_ACTION)) if on else self._send(h, 404, "")
        return self._send(h, 404, "")

    @staticmethod
    def azure_events(on: bool) -> dict:
        other = {  # another VM's event of the same scale set: not ours
            "EventId": "B1",
            "EventType": "Preempt",
            "ResourceType": "VirtualMachine",
            "Resources": ["another-vm"],
            "EventStatus": "Scheduled",
            "NotBefore": "Mon, 19 Sep 2026 18:29:47 GMT",
        }
        ours = {**other, "EventId": "A7", "Resources": [VM_NAME]}
        return {"DocumentIncarnation": 2 if on else 1, "Events": [other, ours] if on else [other]}

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: str) -> None:
        data = body.encode()
        h.send_response(status)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
