"""Several proxies over one PostgreSQL memory: real mitmdump processes storing at once, each
arena catching up on what the others stored (memory/storage/database.py explains the write lock)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import pytest

from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from tests import postgres
from tests.conftest import start_proxy, stop_proxy
from tests.fake_provider import FakeProvider

TURNS = 6  # per user; each user talks to one proxy, every proxy at once


def ask(url: str, user: str, text: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="sk-ant-api03-proxies", max_retries=0)
    with client:
        client.messages.create(model="claude-opus-4-8", max_tokens=50,
                               metadata={"user_id": user},
                               messages=[{"role": "user", "content": text}])


@pytest.mark.parametrize("n", [2, 4])
def test_proxies_over_one_database_store_at_once_and_recall_what_the_others_stored(
        n: int, postgres_server: str, fake: FakeProvider,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    db = postgres.fresh_database(postgres_server, f"proxies_{n}")
    open_memory(db).close()  # migrated once, before the proxies race to open it
    proxies = [start_proxy(tmp_path_factory.mktemp(f"proxy{i}"), fake.url, db=db)
               for i in range(n)]
    try:
        # Every proxy stores at once: user i speaks only to proxy i, in new conversations.
        jobs = [(p.url, f"user-{i}", f"note {t} of user {i}: the harbour lantern is {i * 100 + t}")
                for i, p in enumerate(proxies) for t in range(TURNS)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: ask(*job), jobs))
        # A fact told to the first proxy is in the frame the last one sends upstream.
        ask(proxies[0].url, "carol", "My locker code at the marina is 4417, please remember it.")
        # The turn is committed on the proxy's writer thread a moment after the client has its
        # reply: another proxy can recall it only once it is in the database.
        assert len(proxies[0].wait_messages("carol", 2)) == 2
        ask(proxies[-1].url, "carol", "What was my locker code at the marina?")
        sent = fake.requests[-1].json
        assert "4417" in str(sent["messages"][:-1]) + str(sent.get("system", ""))
    finally:
        for p in proxies:
            stop_proxy(p)
    store = open_memory(db)
    try:
        rows = proxies[0].rows("SELECT count(*) FROM message WHERE role = 'user'")
        assert rows == [(n * TURNS + 2,)]  # every prompt stored once, whichever proxy took it
        assert check(store) == []
    finally:
        store.close()
    for p in proxies:
        assert b"Traceback" not in Path(p.log).read_bytes(), p.log.read_text()
