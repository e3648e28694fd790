"""A faithful-enough fake of the KFP v2beta1 API server: an HTTP server on loopback that records
every request and answers the calls `kfp.Client.create_run_from_pipeline_package` makes."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

from .fake_http import JsonHandler


class FakeKfp:
    def __init__(self):
        self.requests: list[dict] = []
        self.experiments: list[dict] = []
        fake = self

        class Handler(JsonHandler):
            def _record(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = raw.decode(errors="replace")
                fake.requests.append({"method": self.command, "path": self.path, "body": body})
                return body

            def do_GET(self):
                self._record()
                path = self.path.split("?")[0]
                if path.endswith("/healthz"):
                    return self._reply(200, {"multi_user": False})
                if path.endswith("/experiments"):
                    return self._reply(200, {"experiments": fake.experiments, "total_size": len(fake.experiments)})
                if "/experiments/" in path:
                    return self._reply(200, fake.experiments[0] if fake.experiments else {})
                return self._reply(404, {"error": f"fake KFP: no GET {path}"})

            def do_POST(self):
                body = self._record() or {}
                path = self.path.split("?")[0]
                if path.endswith("/experiments"):
                    exp = {"experiment_id": f"exp-{len(fake.experiments) + 1}", "display_name": body.get("display_name")}
                    fake.experiments.append(exp)
                    return self._reply(200, exp)
                if path.endswith("/runs"):
                    return self._reply(200, {**body, "run_id": "run-42", "state": "PENDING"})
                return self._reply(404, {"error": f"fake KFP: no POST {path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
