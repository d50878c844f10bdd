"""Load on `tunebench serve`, on loopback only: OpenAI clients streaming and not, clients that abandon their
stream halfway (they stop reading, then hang up), oversized and malformed bodies, and a page session that
chats and votes through Gradio's own client, all at once, bounded in count and in time, stopping by itself.

    .venv/bin/python benchmarks/serve_load.py                 # the tiny model, 60 s
    .venv/bin/python benchmarks/serve_load.py --model smollm2-135m-instruct --seconds 120

It starts the server as its own process (`tunebench serve`, with a login and an API key) so the RSS it reports
is the server's alone, and prints requests answered, refused (429/503) and failed, p50/p95 latency, the
page's answers while the API is saturated, and the server's RSS before and after. The pass conditions are the
issue's: nothing hangs past its deadline, nothing fails with a 500, the page answers, RSS grows within
--rss-bound-mb. tests/test_shared_server.py runs `load` for a few seconds against an in-process server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

DEADLINE_S = 90  # no request may take longer than this (a hang)
REFUSED_PAUSE_S = 0.2  # a refused client waits this long before it asks again (a real one honours Retry-After)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # answered | refused | failed | hung | bad-input-refused
    latencies: list[float] = field(default_factory=list)  # seconds, of the answered requests
    page: Counter = field(default_factory=Counter)  # the page session's answered | failed
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, seconds: float | None = None, page: bool = False, error: str | None = None):
        with self.lock:
            (self.page if page else self.outcomes)[outcome] += 1
            if seconds is not None and outcome == "answered" and not page:
                self.latencies.append(seconds)
            if error and len(self.errors) < 20:
                self.errors.append(error)

    def figures(self) -> dict:
        lat = sorted(self.latencies)
        return {**{k: self.outcomes[k] for k in ("answered", "refused", "failed", "hung", "bad-input-refused")},
                "p50_s": round(statistics.median(lat), 3) if lat else None,
                "p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
                "page_answered": self.page["answered"], "page_failed": self.page["failed"],
                "errors": self.errors[:5]}


def _request(port: int, path: str, body: bytes | None, key: str, read=None) -> tuple[int, bytes]:
    con = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    try:
        con.request("POST" if body is not None else "GET", path, body=body,
                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        response = con.getresponse()
        return response.status, (read(response) if read else response.read())
    finally:
        con.close()


def _classify(status: int) -> str:
    return "answered" if status == 200 else "refused" if status in (429, 503) else "failed"


def load(port: int, key: str, model: str, seconds: float, page_models: tuple[str, str] | None = None,
         streamers: int = 3, wholes: int = 2, abandoners: int = 1, max_tokens: int = 24) -> dict:
    """Every kind of client at once on 127.0.0.1:`port` for `seconds`; the tally's figures."""
    import openai

    tally = Tally()
    end = time.monotonic() + seconds
    chat = {"model": model, "messages": [{"role": "user", "content": "Tell me about orders."}], "max_tokens": max_tokens}

    def timed(kind: str, call):
        t0 = time.monotonic()
        try:
            outcome = call()
        except (openai.RateLimitError, openai.InternalServerError) as e:
            if getattr(e, "status_code", 0) not in (429, 503):
                tally.add("failed", error=f"{kind}: {e}")
                return
            tally.add("refused")
            time.sleep(REFUSED_PAUSE_S)
            return
        except openai.APIError as e:  # an error event inside a 200 stream: refused if it says so
            kind_ = ((getattr(e, "body", None) or {}).get("type") if isinstance(getattr(e, "body", None), dict) else None)
            if kind_ in ("rate_limit_error", "server_error") and "busy" in str(e):
                tally.add("refused")
                time.sleep(REFUSED_PAUSE_S)
            else:
                tally.add("failed", error=f"{kind}: {e}")
            return
        except (openai.APITimeoutError, TimeoutError, socket.timeout) as e:
            tally.add("hung", error=f"{kind}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - counted and shown, the load goes on
            tally.add("failed", error=f"{kind}: {type(e).__name__}: {e}")
            return
        tally.add(outcome, time.monotonic() - t0)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=DEADLINE_S)

    def streamer():
        while time.monotonic() < end:
            def call():
                text = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(**chat, stream=True) if c.choices)
                return "answered" if isinstance(text, str) else "failed"
            timed("stream", call)

    def whole():
        while time.monotonic() < end:
            timed("whole", lambda: "answered" if client.chat.completions.create(**chat).choices else "failed")

    def abandoner():  # reads the first event, stops reading for a while, then hangs up
        while time.monotonic() < end:
            def first_then_stall(response):
                response.fp.readline()
                time.sleep(2.0)
                return b""
            try:
                status, _ = _request(port, "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode(), key,
                                     first_then_stall)
                tally.add("answered" if status == 200 else _classify(status))
                if status != 200:
                    time.sleep(REFUSED_PAUSE_S)
            except (TimeoutError, socket.timeout) as e:
                tally.add("hung", error=f"abandon: {e}")

    def bad():  # oversized and malformed bodies: a 413/400 each, never a 500
        while time.monotonic() < end:
            for body in (b"{" + b" " * (2 * 2 ** 20) + b"}", b"{not json", json.dumps({**chat, "seed": 2 ** 70}).encode()):
                try:
                    status, _ = _request(port, "/v1/chat/completions", body, key)
                except ConnectionError:  # the server answered 413 and closed before the client had sent it all
                    status = 413
                except (TimeoutError, socket.timeout) as e:
                    tally.add("hung", error=f"bad body: {e}")
                    continue
                tally.add("bad-input-refused" if status in (400, 413) else "failed",
                          error=None if status in (400, 413) else f"bad body answered {status}")
            time.sleep(0.5)

    def page():  # a visitor of the page: chats, asks for an A/B pair and votes
        from gradio_client import Client

        visitor = Client(f"http://127.0.0.1:{port}/", auth=("ann", "s3cret-pw"), verbose=False)
        while time.monotonic() < end:
            try:
                visitor.predict(api_name="/lambda")  # Clear: a new conversation each time
                visitor.predict(f"base: {model}", "hello", 0.7, 0.9, 16, api_name="/on_chat")
                if page_models:
                    visitor.predict(*page_models, "Where is my order?", 0.7, 0.9, 16, api_name="/on_answers")
                    visitor.predict(api_name="/lambda_3")  # "A is better"
                tally.add("answered", page=True)
            except Exception as e:  # noqa: BLE001 - counted and shown
                tally.add("failed", page=True, error=f"page: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=f, daemon=True) for f in
               [streamer] * streamers + [whole] * wholes + [abandoner] * abandoners + [bad, page]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + DEADLINE_S + 30)
    if any(t.is_alive() for t in threads):
        tally.add("hung", error="a client thread never returned")
    return tally.figures()


def passed(figures: dict, rss_growth_mb: float, bound_mb: float) -> list[str]:
    """What failed the issue's pass conditions (empty: passed)."""
    problems = []
    if figures["hung"]:
        problems.append(f"{figures['hung']} request(s) hung past {DEADLINE_S} s")
    if figures["failed"]:
        problems.append(f"{figures['failed']} request(s) failed: {figures['errors']}")
    if not figures["page_answered"] or figures["page_failed"]:
        problems.append(f"the page answered {figures['page_answered']}, failed {figures['page_failed']}")
    if not figures["answered"]:
        problems.append("the API answered nothing")
    if rss_growth_mb > bound_mb:
        problems.append(f"the server's RSS grew {rss_growth_mb:.0f} MB, over {bound_mb:.0f}")
    return problems


def main() -> int:
    import psutil

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--rss-bound-mb", type=float, default=300)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = Path(tempfile.mkdtemp(prefix="serve-load-"))
    env = {**os.environ, "TUNEBENCH_AUTH": "ann:s3cret-pw", "TUNEBENCH_API_KEY": "sk-load-test"}
    server = subprocess.Popen([sys.executable, "-m", "tunebench", "serve", "--model", args.model, "--port", str(port),
                               "--ab-db", str(work / "ab.sqlite"), "--no-studio"], env=env, cwd=work,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:
            if line.startswith("OpenAI-compatible API"):
                break
        proc = psutil.Process(server.pid)
        load(port, "sk-load-test", args.model, 5, None)  # the model loaded and warm before RSS is read
        before = proc.memory_info().rss / 2 ** 20
        figures = load(port, "sk-load-test", args.model, args.seconds, None)
        after = proc.memory_info().rss / 2 ** 20
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps({"model": args.model, "seconds": args.seconds, **figures, "rss_before_mb": round(before),
                      "rss_after_mb": round(after)}, indent=1))
    problems = passed(figures, after - before, args.rss_bound_mb)
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
