"""The local HTTP server the web suites serve their pages from."""

from __future__ import annotations

import logging
import sys
from http.server import ThreadingHTTPServer

log = logging.getLogger("awrl.rollout.http")


class QuietHTTPServer(ThreadingHTTPServer):
    """A threading server whose client disconnects are debug-level log lines, not tracebacks: a browser
    context closed at the end of an episode routinely drops requests still in flight."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):  # BrokenPipeError, ConnectionResetError, ...
            log.debug("client %s went away: %s", client_address, exc)
            return
        super().handle_error(request, client_address)
