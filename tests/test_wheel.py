"""A wheel built from the repository runs `perpetuity proxy`: the package carries its addon, its
data and its entry point, and nothing reaches back into the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import anthropic
import pytest

from tests.conftest import free_port, query
from tests.fake_provider import FakeProvider, Text

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def build_wheel(out: Path) -> Path:
    """`pip wheel` of the checkout (setuptools comes from the package index; skip without it)."""
    done = subprocess.run([*PIP, "wheel", "--no-deps", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"cannot build a wheel here (no setuptools from the index?): "
                    f"{done.stderr.strip().splitlines()[-1:]}")
    (wheel,) = out.glob("perpetuity-*.whl")
    return wheel


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A new venv holding the wheel; its dependencies are read from this venv's site-packages
    (a path in a .pth file: the checkout's editable install there is not activated)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([*PIP, "--python", str(python), "install", "--no-deps", str(wheel)], check=True)
    # mitmproxy's console script, as its own install would write it next to the venv's Python.
    mitmdump = where / "bin" / "mitmdump"
    mitmdump.write_text(f"#!{python}\nimport sys\nfrom mitmproxy.tools.main import mitmdump\n"
                        "sys.exit(mitmdump())\n")
    mitmdump.chmod(0o755)
    return where


def test_a_wheel_runs_perpetuity_proxy(tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv", build_wheel(tmp_path / "dist"))
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import perpetuity_core; print(perpetuity_core.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the wheel's package, not the checkout

    port, db = free_port(), tmp_path / "memory.db"
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with FakeProvider() as fake:
        fake.script(Text("from the wheel"))
        proc = subprocess.Popen(
            [str(venv / "bin" / "perpetuity"), "proxy", "--port", str(port), "--db", str(db),
             "--anthropic-upstream", fake.url, "--openai-upstream", fake.url,
             "--set", f"confdir={tmp_path / 'mitm'}", "-q"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=tmp_path)
        try:
            assert proc.stdout is not None
            assert f"listening on http://127.0.0.1:{port}" in proc.stdout.readline()
            with anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="sk-ant-wheel",
                                     max_retries=0) as client:
                reply = client.messages.create(model="claude-opus-4-8", max_tokens=5,
                                               messages=[{"role": "user", "content": "hi"}])
            assert reply.content[0].text == "from the wheel"
        finally:
            proc.terminate()
            rest = proc.communicate(timeout=10)[0]
    assert proc.returncode == 0, rest
    assert "Traceback" not in rest, rest
    assert query(db, "select role from message order by id")[:1] == [("user",)]
