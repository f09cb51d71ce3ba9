"""`make data` for WebShop without a local copy: the original files downloaded and checked by sha256.

The files come from a real HTTP server on 127.0.0.1 (the download's base URL is $WEBSHOP_BASE_URL, as for
a mirror), serving files this test writes: the shipped sample catalog under the original names and a
small human-instruction file; the expected hashes are given to the product's code (its table patched).
Google Drive itself is not reachable here; nothing in this file touches the network beyond 127.0.0.1.
"""
from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from env_servers import data as env_data
from env_servers.webshop import data as webshop_data
from env_servers.webshop.catalog import has_catalog, load_products
from env_servers.webshop.data import SAMPLE_DIR
from env_servers.webshop.goals import build_goals

REPO = Path(__file__).resolve().parents[2]
NAMES = ("items_shuffle_1000.json", "items_ins_v2_1000.json", "items_human_ins.json")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    requested: list[str]

    def log_message(self, *args):      # no request lines in the test output
        pass

    def do_GET(self):
        self.requested.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """A static file server on a free port of 127.0.0.1: (folder it serves, base URL, paths requested)."""
    root = tmp_path / "served"
    root.mkdir()
    requested: list[str] = []
    handler = type("Handler", (_Quiet,), {"requested": requested})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{httpd.server_address[1]}/data", requested
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def publish(root: Path) -> dict[str, str]:
    """Write the three files under root/data; returns name -> sha256 (the table the download checks)."""
    folder = root / "data"
    folder.mkdir()
    (folder / "items_shuffle_1000.json").write_bytes(Path(SAMPLE_DIR, "items_shuffle_sample.json").read_bytes())
    (folder / "items_ins_v2_1000.json").write_bytes(Path(SAMPLE_DIR, "items_ins_v2_sample.json").read_bytes())
    (folder / "items_human_ins.json").write_text(json.dumps({"B0SAMPLE00": [{
        "instruction": "i need a conditioner for sensitive skin", "instruction_attributes": ["sensitive skin"],
        "instruction_options": []}]}))
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in NAMES}


PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


@pytest.fixture
def no_local_copy(monkeypatch):
    """No local copy, no mirror, no proxy (the test server is reached directly)."""
    for name in ("WEBSHOP_SOURCE", "WEBSHOP_BASE_URL", *PROXY_VARS):
        monkeypatch.delenv(name, raising=False)


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.iterdir() if p.name.startswith("."))


def test_make_data_downloads_the_files_intact(server, tmp_path, monkeypatch, no_local_copy, capsys):
    root, base_url, requested = server
    expected = publish(root)
    monkeypatch.setattr(webshop_data, "DOWNLOAD_SHA256", expected)
    monkeypatch.setenv("WEBSHOP_BASE_URL", base_url)
    dest = tmp_path / "webshop"
    monkeypatch.setenv("WEBSHOP_DATA", str(dest))

    assert env_data.main(["prepare", "--only", "webshop"]) == 0      # what `make data` runs
    for name in NAMES:
        assert (dest / name).read_bytes() == (root / "data" / name).read_bytes(), name
    assert leftovers(dest) == []                       # the staging folder is gone
    assert sorted(requested) == sorted(f"/data/{name}" for name in NAMES)
    assert "downloaded and checked" in capsys.readouterr().out
    # The catalog loads, human goals included.
    assert has_catalog(str(dest)) and len(load_products(str(dest))) == 50
    goals, _ = build_goals(load_products(str(dest), human_goals=True), use_human_goals=True)
    assert [g.asin for g in goals] == ["B0SAMPLE00"]

    # A second run keeps the catalog and fetches nothing.
    requested.clear()
    assert env_data.main(["prepare", "--only", "webshop"]) == 0
    assert requested == [] and "kept as it is" in capsys.readouterr().out
    # A file already there with the expected hash is not fetched again.
    (dest / "items_human_ins.json").unlink()
    assert webshop_data.download(str(dest)) == ["items_human_ins.json"]
    assert requested == ["/data/items_human_ins.json"]


def test_a_corrupted_file_is_refused(server, tmp_path, monkeypatch, no_local_copy, capsys):
    root, base_url, _ = server
    expected = publish(root)
    served = root / "data" / "items_ins_v2_1000.json"
    served.write_bytes(served.read_bytes().replace(b"sensitive skin", b"sensitive skim", 1))   # one byte off
    monkeypatch.setattr(webshop_data, "DOWNLOAD_SHA256", expected)
    monkeypatch.setenv("WEBSHOP_BASE_URL", base_url)
    dest = tmp_path / "webshop"
    monkeypatch.setenv("WEBSHOP_DATA", str(dest))

    assert env_data.main(["prepare", "--only", "webshop"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "items_ins_v2_1000.json" in err and "sha256" in err and expected["items_ins_v2_1000.json"] in err
    # Nothing under a final name (the file before it, which matched, is not kept either), no staging left.
    assert sorted(p.name for p in dest.iterdir()) == []
    with pytest.raises(webshop_data.ChecksumError, match="items_ins_v2_1000.json"):
        webshop_data.download(str(dest))


def test_unreachable_server_one_line_and_exit_2(tmp_path, free_port):
    """`python -m env_servers.data prepare` (the `make data` entry) with the download's server unreachable."""
    dest = tmp_path / "webshop"
    env = {k: v for k, v in os.environ.items() if k not in ("WEBSHOP_SOURCE", *PROXY_VARS)}
    env.update(WEBSHOP_DATA=str(dest), WEBSHOP_BASE_URL=f"http://127.0.0.1:{free_port()}",
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "env_servers.data", "prepare", "--only", "webshop"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cannot download items_shuffle_1000.json" in lines[0] and "refused" in lines[0].lower()
    assert "WEBSHOP_SOURCE" in lines[0] and "WEBSHOP_BASE_URL" in lines[0]      # how to provide the files
    assert not has_catalog(str(dest))


def test_dns_failure_is_the_same_one_line_error(tmp_path, monkeypatch, no_local_copy):
    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(webshop_data.DownloadError) as info:
        webshop_data.prepare(str(tmp_path / "webshop"))      # the real Drive URLs: DNS fails first
    message = str(info.value)
    assert "\n" not in message and "drive.google.com" in message and "Name or service not known" in message
    assert "WEBSHOP_SOURCE" in message


def test_sources(tmp_path, monkeypatch, no_local_copy):
    """Drive links by default, a mirror's <base>/<name> with $WEBSHOP_BASE_URL; a local folder is copied,
    never downloaded; no default local folder (nothing beside the checkout is looked for)."""
    assert set(webshop_data.DRIVE_IDS) == set(webshop_data.DOWNLOAD_SHA256) == set(NAMES)
    assert webshop_data.file_url("items_ins_v2_1000.json") == \
        "https://drive.google.com/uc?export=download&id=1IduG0xl544V_A_jv3tHXC0kyFi7PnyBu"
    monkeypatch.setenv("WEBSHOP_BASE_URL", "https://mirror.example/webshop/")
    assert webshop_data.file_url("items_ins_v2_1000.json") == "https://mirror.example/webshop/items_ins_v2_1000.json"
    assert webshop_data.default_source() is None and env_data.default_alfworld_source() is None
    monkeypatch.setenv("WEBSHOP_SOURCE", SAMPLE_DIR)
    assert env_data.prepare_webshop(str(tmp_path / "webshop"), log=lambda *_: None) == str(tmp_path / "webshop")
    assert (tmp_path / "webshop" / "items_shuffle_sample.json").is_file()
