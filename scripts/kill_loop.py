"""Crash safety: kill -9 a proxy that is ingesting at full speed, restart it, and check that
every turn is stored exactly once.

Clients (threads, one conversation each) stream Anthropic turns through a real mitmdump with
the addon, as fast as the fake provider answers, each re-sending its whole history, as a
harness does. The proxy is killed with SIGKILL at a random moment, `kills` times, and
restarted on the same port and database; after each restart `memory check` runs against the
live memory. A request the kill cut (the proxy had it, no whole reply came back) is handled as
the failing run of issue 20 did: the unanswered turn stays in the history and its text is sent
again as the next turn (`--retry again`, the default: a user, or a harness, that carries on), or
the request is retried as it was sent (`--retry as-sent`: an SDK's retry). A request the proxy
never got (connection refused while it restarts) is retried as sent either way. At the end every
conversation is continued once more and the store is compared with what the clients sent and
received:
  - each user turn stored exactly once, in order ("twice" and "lost" count the others; a turn
    sent again after its unanswered copy is the same turn);
  - each reply the client received stored exactly once (a reply stored by the proxy whose
    bytes never reached the client before the kill is an "orphan": its turn was retried);
  - no partial message: every stored message's text is one the clients sent or received
    whole, or a reply cut by the kill (stored as incomplete).

    .venv/bin/python scripts/kill_loop.py [--kills 12] [--clients 2] [--seed 1] [--no-tools]
        [--retry again|as-sent] [--postgres [URL]] [--signal kill|term|both]
        [--faults surrogates,compressed]

`--signal term` stops the proxy with SIGTERM instead (it drains: the replies in flight finish
and are stored, so none is cut); `both` alternates. `--faults` adds what harnesses really send
(issue 41): `surrogates`, every third turn ends with half an emoji as Node writes it
(`"\\ud83d"`, stored as U+FFFD); `compressed`, every body goes gzip, deflate, br or zstd in turn.

`--postgres` stores in PostgreSQL: a fresh database on the server at URL, or on a server of its
own (tests/postgres.py) without one. Prints one JSON object; exit status 1 when a turn or reply
is stored twice or lost, out of order, partial, `memory check` found a violation, the log
holds a traceback, or a SIGTERM'd proxy did not exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perpetuity_core.memory.schema import open_memory
from tests import postgres  # noqa: E402
from tests.conftest import Proxy, free_port, start_proxy  # noqa: E402
from tests.fake_provider import FakeProvider, Text  # noqa: E402
from tests.postgres import other_connection  # noqa: E402

WORDS = ["garden", "violin", "harbour", "lantern", "copper", "meadow", "thunder", "pepper", "orbit", "canvas", "willow", "marble", "falcon", "ember", "quartz", "saddle"]


UNSENT = object()  # the proxy never took the request (down while it restarts)


CUT = " zebracorn-\ud83d"  # half an emoji, as Node's JSON.stringify writes a cut string
ENCODINGS = ("gzip", "deflate", "br", "zstd")


def mended(text: str) -> str:
    """What the store keeps of `text`: each lone surrogate as U+FFFD (wire.mend)."""
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


def compress(body: bytes, encoding: str) -> bytes:
    import gzip
    import zlib

    import brotli
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14
    except ImportError:
        from backports import zstd  # mitmproxy's own dependency before 3.14
    return {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
            "zstd": zstd.compress}[encoding](body)


class Client(threading.Thread):
    """One conversation, turn after turn; a turn the kill left unanswered is sent again."""

    def __init__(self, name: str, base: list[str], stop: threading.Event, seed: int,
                 again: bool, faults: frozenset[str] = frozenset()) -> None:
        super().__init__(daemon=True)
        self.name_ = name
        self.base = base  # [url]: the current proxy (the port stays, the process changes)
        self.stop = stop
        self.rng = random.Random(seed)
        self.again = again  # an unanswered turn's text sent again as the next turn
        self.history: list[dict] = []
        self.turns: list[str] = []  # each user turn once, however often it was sent
        self.failures = 0
        self.sent_again = 0
        self.faults = faults
        self.sent = 0  # requests sent (each compressed in turn, with `compressed`)

    def run(self) -> None:
        turn = 0
        while not self.stop.is_set():
            words = " ".join(self.rng.choices(WORDS, k=8))
            cut = CUT if "surrogates" in self.faults and turn % 3 == 1 else ""
            self.turn(f"{self.name_} turn {turn}: {words}{cut}", self.stop)
            turn += 1

    def turn(self, text: str, stop: threading.Event) -> None:
        """Send one user turn until its reply comes back whole (or `stop`)."""
        self.turns.append(text)
        self.history.append({"role": "user", "content": text})
        while not stop.is_set():
            reply = self.send()
            if isinstance(reply, str):
                self.history.append({"role": "assistant", "content": reply})
                return
            self.failures += 1
            if reply is None and self.again:
                # The proxy took the turn and died before its reply: the harness keeps the
                # unanswered turn and the same text goes again, as the next message.
                self.history.append({"role": "user", "content": text})
                self.sent_again += 1
            time.sleep(0.05)

    def send(self) -> str | object | None:
        """The whole history, streamed; the reply's text, None when the proxy took the request
        and no whole reply came back, UNSENT when it never took it."""
        body = {"model": "claude-opus-4-8", "max_tokens": 64, "stream": True,
                "messages": self.history}
        headers = {"x-api-key": "sk-ant-kill-loop", "anthropic-version": "2023-06-01",
                   "x-perpetuity-user": "kill-loop", "x-perpetuity-conversation": self.name_}
        raw = json.dumps(body).encode()  # ASCII escapes: a lone half goes as "\ud83d"
        if "compressed" in self.faults:
            encoding = ENCODINGS[self.sent % len(ENCODINGS)]
            raw, headers = compress(raw, encoding), {**headers, "content-encoding": encoding}
        self.sent += 1
        text, done = [], False
        try:
            with httpx.stream("POST", self.base[0] + "/v1/messages", content=raw,
                              headers={**headers, "content-type": "application/json"},
                              timeout=30) as r:
                if r.status_code != 200:
                    return None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event.get("type") == "content_block_delta":
                        text.append(event["delta"].get("text", ""))
                    elif event.get("type") == "message_stop":
                        done = True
        except httpx.ConnectError:
            return UNSENT
        except (httpx.HTTPError, json.JSONDecodeError):
            return None
        return "".join(text) if done else None


def check_memory(db: Path | str) -> list[str]:
    """`perpetuity memory check` against the live memory (a second process: this one)."""
    from perpetuity_core.memory.jobs.integrity import check

    store = open_memory(db)
    try:
        return check(store)
    finally:
        store.close()


def stored(db: Path | str) -> dict[str, list[tuple[str, str, int]]]:
    """Per conversation: (role, text, complete) of each stored message, in store order."""
    texts = ("string_agg(i.text, '' ORDER BY i.seq)" if isinstance(db, str)
             else "group_concat(i.text, '')")
    out: dict[str, list[tuple[str, str, int]]] = {}
    with other_connection(db) as con:
        for key, role, text, complete in con.execute(
                f"SELECT c.key, m.role, {texts}, m.complete FROM message m"
                " JOIN conversation c ON c.id = m.conversation_id"
                " JOIN item i ON i.message_id = m.id GROUP BY c.key, m.id ORDER BY m.id"
        ).fetchall():
            out.setdefault(key, []).append((role, text, bool(complete)))
    return out


def tally(clients: list[Client], db: Path | str) -> dict[str, int]:
    """Compare the store with what the clients sent and received."""
    got = stored(db)
    t = {"user_turns": 0, "user_twice": 0, "user_lost": 0, "replies": 0, "replies_twice": 0,
         "replies_lost": 0, "orphan_replies": 0, "cut_replies": 0, "partial_messages": 0,
         "out_of_order": 0}
    for c in clients:
        rows = got.get(c.name_, [])
        for role, key in (("user", "user"), ("assistant", "replies")):
            sent = [mended(t) for t in c.turns] if role == "user" else [
                m["content"] for m in c.history if m["role"] == role]
            have = [text for r, text, _ in rows if r == role]
            t["user_turns" if role == "user" else "replies"] += len(sent)
            for text in set(sent):
                n = have.count(text)
                t[f"{key}_twice"] += max(0, n - 1)
                t[f"{key}_lost"] += n == 0
            if role == "user" and [h for h in have if h in sent] != sent:
                t["out_of_order"] += 1
            for _text, complete in ((x, k) for r, x, k in rows if r == role and x not in sent):
                # A reply the client never got whole: stored complete, the orphan of a retried
                # turn; stored incomplete, a stream the kill cut. Anything else is partial.
                if role == "assistant":
                    t["orphan_replies" if complete else "cut_replies"] += 1
                else:
                    t["partial_messages"] += 1
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=12)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-gap", type=float, default=0.3, help="seconds of ingest before a kill")
    ap.add_argument("--max-gap", type=float, default=1.5)
    ap.add_argument("--retry", choices=["again", "as-sent"], default="again",
                    help="a turn the kill left unanswered: its text sent again as the next"
                    " turn (default), or the request retried as it was sent")
    ap.add_argument("--postgres", nargs="?", const="", default=None, metavar="URL",
                    help="store in PostgreSQL: a fresh database on this server (default: a"
                    " server of its own, tests/postgres.py)")
    ap.add_argument("--no-tools", action="store_true",
                    help="recall tools off: replies on mitmproxy's own stream, not the relay")
    ap.add_argument("--signal", choices=["kill", "term", "both"], default="kill",
                    help="stop the proxy with SIGKILL (default), SIGTERM (it drains), or each in"
                    " turn")
    ap.add_argument("--faults", default="", help="comma-separated: surrogates, compressed")
    args = ap.parse_args()
    if unknown := set(filter(None, args.faults.split(","))) - {"surrogates", "compressed"}:
        ap.error(f"unknown faults: {', '.join(sorted(unknown))}")
    extra = ("--set", "perpetuity_tools=false") if args.no_tools else ()
    rng = random.Random(args.seed)
    with contextlib.ExitStack() as stack:
        db: str | None = None
        if args.postgres is not None:
            if not (server := args.postgres):
                if why := postgres.unavailable():
                    print(f"kill_loop: no PostgreSQL server: {why}", file=sys.stderr)
                    return 2
                server = stack.enter_context(postgres.server("fsync=off"))
            db = postgres.fresh_database(server, f"kill_loop_{os.getpid()}")
        return run(args, extra, rng, db)


def run(args: argparse.Namespace, extra: tuple[str, ...], rng: random.Random,
        db: str | None) -> int:
    checks_failed: list[str] = []
    with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
        fake.script(*(Text(f"reply {i}: " + " ".join(rng.choices(WORDS, k=6)), chunks=3)
                      for i in range(200_000)))
        port = free_port()
        proxy: Proxy = start_proxy(Path(tmp), fake.url, *extra, port=port, db=db)
        base = [proxy.url]
        stop = threading.Event()
        injected = frozenset(filter(None, args.faults.split(",")))
        clients = [Client(f"conv-{i}", base, stop, args.seed * 100 + i, args.retry == "again",
                          injected) for i in range(args.clients)]
        for c in clients:
            c.start()
        restarts, unclean_exits = [], 0
        for k in range(args.kills):
            time.sleep(rng.uniform(args.min_gap, args.max_gap))
            term = args.signal == "term" or (args.signal == "both" and k % 2 == 1)
            os.kill(proxy.process.pid, signal.SIGTERM if term else signal.SIGKILL)
            if proxy.process.wait(60) != 0 and term:
                unclean_exits += 1  # a drained stop exits 0
            t0 = time.perf_counter()
            proxy = start_proxy(Path(tmp), fake.url, *extra, port=port, db=db)
            restarts.append(time.perf_counter() - t0)
            checks_failed += check_memory(proxy.db)
        stop.set()
        for c in clients:
            c.join(60)
        # Each conversation continued once: the whole history re-sent with one more turn
        # (given a minute: a proxy that never answers it loses the turn, and says so).
        last = threading.Event()
        threading.Timer(60, last.set).start()
        for c in clients:
            c.turn(f"{c.name_} continued after the kills", last)
        last.set()
        time.sleep(1.0)  # the last reply is written just after the client saw it
        checks_failed += check_memory(proxy.db)
        counts = tally(clients, proxy.db)
        faults = sum(counts[k] for k in ("user_twice", "user_lost", "replies_twice",
                                         "replies_lost", "partial_messages", "out_of_order"))
        tracebacks = proxy.log.read_bytes().count(b"Traceback")  # every run's: one log
        if tracebacks:
            sys.stderr.write(proxy.log.read_text(errors="replace"))
        result = {"ok": not faults and not checks_failed and not unclean_exits and not tracebacks,
                  "kills": args.kills, "signal": args.signal, "faults": sorted(injected),
                  "clients": args.clients, "tools": not args.no_tools, "retry": args.retry,
                  "backend": "postgresql" if db else "sqlite",
                  "failed_requests_retried": sum(c.failures for c in clients),
                  "turns_sent_again": sum(c.sent_again for c in clients),
                  **counts, "check_violations": checks_failed, "unclean_exits": unclean_exits,
                  "tracebacks": tracebacks,
                  "restart_s_p50": round(sorted(restarts)[len(restarts) // 2], 2)
                  if restarts else None}
        proxy.process.terminate()
        proxy.process.wait(10)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
