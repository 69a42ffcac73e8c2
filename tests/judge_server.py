"""A deterministic model judge for tests: a real OpenAI-compatible HTTP server on 127.0.0.1 whose
answers follow a rule, so that what a run records can be checked exactly.

Modes (`JudgeServer.mode`, changeable while it runs):
- `rule`: the boxes suite's own rule, read from the prompt: success iff the last step clicked the mark
  of the colour the task names (mark i is `COLOURS[i]`). Its verdicts must agree with the rule judge's.
- `lenient`: success for any click (a judge a policy can hack: it agrees on every success and on no
  failure that clicked).
- `garbage`: an answer with no verdict in it. `refuse`: HTTP 400. `error`: HTTP 500.
`fail_first` makes that many requests answer 500 first (then the mode's answer); requests numbered in
`drop` (1-based) get their connection closed with no answer, as when the judge's process dies mid-request.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rollout.suites.boxes.suite import COLOURS


class JudgeServer:
    def __init__(self, mode: str = "rule", fail_first: int = 0, drop: range = range(0), port: int = 0):
        self.mode, self.fail_first, self.drop, self.requests = mode, fail_first, drop, 0
        self.dropped = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> JudgeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, body: dict) -> tuple[int, dict | str] | None:
        """(status, reply), or None to drop the connection unanswered."""
        with self.lock:
            self.requests += 1
            failing = self.requests <= self.fail_first
            if self.requests in self.drop:
                self.dropped += 1
                return None
        if failing or self.mode == "error":
            return 500, "judge overloaded"
        if self.mode == "refuse":
            return 400, f"model {body.get('model')!r} does not exist"
        text = next(p["text"] for p in body["messages"][0]["content"] if p["type"] == "text")
        if self.mode == "garbage":
            content = "I looked at the screenshots and I think the agent did fine."
        else:
            success, reason = verdict(text, lenient=self.mode == "lenient")
            content = "```json\n" + json.dumps({"success": success, "reason": reason}) + "\n```"
        usage = {"prompt_tokens": len(text.split()), "completion_tokens": len(content.split())}
        return 200, {"choices": [{"message": {"role": "assistant", "content": content}}], "usage": usage}


def verdict(prompt: str, lenient: bool = False) -> tuple[bool, str]:
    target = re.search(r"Task: Click the (\w+) box", prompt)
    clicks = re.findall(r"click\(mark=(\d+)\)", prompt)
    if not clicks:
        return False, "no box was clicked"
    clicked = COLOURS[int(clicks[-1])] if int(clicks[-1]) < len(COLOURS) else "nothing"
    if lenient:
        return True, f"clicked the {clicked} box"
    wanted = target.group(1) if target else "?"
    return clicked == wanted, f"clicked the {clicked} box, the task named {wanted}"


def _handler(server: JudgeServer):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answered = server.answer(body)
            if answered is None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            code, reply = answered
            data = (json.dumps(reply) if isinstance(reply, dict) else reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if isinstance(reply, dict) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            return None

    return Handler


if __name__ == "__main__":  # a judge for a run by hand: python tests/judge_server.py [MODE] [PORT]
    import sys
    import time

    mode, port = (sys.argv[1:] + ["rule"])[0], int((sys.argv[2:] + ["0"])[0])
    with JudgeServer(mode, port=port) as server:
        print(f"judge ({mode}) at {server.url}", flush=True)
        while True:
            time.sleep(3600)
