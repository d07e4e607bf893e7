"""Route the library's `app.*` loggers through Ray Serve's replica log handlers at INFO, so the
per-request lines, graph capture progress and the auto-tune table reach the replica logs."""

from __future__ import annotations

import logging


def route_app_logs() -> None:
    app_log = logging.getLogger("app")
    app_log.setLevel(logging.INFO)
    serve_log = logging.getLogger("ray.serve")
    for h in serve_log.handlers:
        if h not in app_log.handlers:
            app_log.addHandler(h)
    app_log.propagate = not serve_log.handlers
