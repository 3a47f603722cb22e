"""`perpetuity proxy` starts mitmdump with the addon and the settings it was given."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anthropic
from google import genai
from google.genai import types

from tests.conftest import free_port, owned
from tests.fake_provider import FakeProvider, Text

PERPETUITY = Path(sys.executable).with_name("perpetuity")


def test_perpetuity_proxy_serves_and_prints_the_harness_settings(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "cli.db"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    with FakeProvider() as fake:
        proc = subprocess.Popen(
            [str(PERPETUITY), "proxy", "--port", str(port), "--db", str(db),
             "--anthropic-upstream", fake.url, "--openai-upstream", fake.url,
             "--gemini-upstream", fake.url,
             "--set", f"confdir={tmp_path}", "-q"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        try:
            banner = [proc.stdout.readline() for _ in range(6)]
            assert f"listening on http://127.0.0.1:{port}" in banner[0]
            assert f"ANTHROPIC_BASE_URL=http://127.0.0.1:{port}" in "".join(banner)
            assert f'openai_base_url = "http://127.0.0.1:{port}/v1"' in "".join(banner)
            assert f"GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:{port}" in "".join(banner)
            fake.script(Text("via the CLI"))
            c = owned(anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="sk-ant-cli",
                                    max_retries=0))
            r = c.messages.create(model="claude-opus-4-8", max_tokens=5,
                                  messages=[{"role": "user", "content": "hi"}])
            assert r.content[0].text == "via the CLI"
            fake.script(Text("Gemini via the CLI"))
            g = owned(genai.Client(api_key="AIza-cli", http_options=types.HttpOptions(
                base_url=f"http://127.0.0.1:{port}")))
            assert g.models.generate_content(model="gemini-2.5-flash",
                                             contents="hi").text == "Gemini via the CLI"
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not db.exists():
                time.sleep(0.05)
            assert db.exists()
        finally:
            proc.terminate()
            proc.wait(10)
            proc.stdout.close()
