"""Where WebShop data comes from. `prepare(dest)` (what `make data` calls) puts the catalog into `dest`.
A run plays the catalog its env.source names (`catalog_dir`): "data", the one in $WEBSHOP_DATA (default
./data/webshop, what `make data` fills; refused when missing); "generated", the small generated sample shipped
in this package (sample/, made by sample_catalog.py). `resolve_data_dir` is for a WebShopEnv made by hand: an
explicit directory, else $WEBSHOP_DATA when it holds a catalog, else the sample.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from common.atomic_write import replaced_atomically
from env_servers.webshop.catalog import (ATTRIBUTE_FILES, HUMAN_GOALS_FILE, PRODUCT_FILES, REVIEWS_FILE,
                                          has_catalog, require_catalog)

SAMPLE_DIR = str(Path(__file__).resolve().parent / "sample")
_DATA_FILES = PRODUCT_FILES + ATTRIBUTE_FILES + (HUMAN_GOALS_FILE, REVIEWS_FILE, "README.md")

SOURCE_ENV = "WEBSHOP_SOURCE"       # a local folder holding the files: copied, nothing downloaded
BASE_URL_ENV = "WEBSHOP_BASE_URL"   # a mirror: each file is fetched from <base>/<file name>

# What `download` fetches: WebShop's 1,000-product setting (princeton-nlp/WebShop's setup.sh `-d small`,
# whose Google Drive ids these are) and its human instructions; never the full ~5.5 GB catalog.
DRIVE_IDS: dict[str, str] = {
    "items_shuffle_1000.json": "1EgHdxQ_YxqIQlvvq5iKlCrkEKR6-j0Ib",
    "items_ins_v2_1000.json": "1IduG0xl544V_A_jv3tHXC0kyFi7PnyBu",
    HUMAN_GOALS_FILE: "14Kb5SPBk_jfdLZ_CDBNitW98QLDlKR5O",
}
# Google Drive's direct-download link of a small file. Untested from here (no internet): the tests serve
# the files from a local HTTP server through $WEBSHOP_BASE_URL, the same code path.
DRIVE_URL = "https://drive.google.com/uc?export=download&id={id}"
# sha256 of each original file; a downloaded file must match it, whichever URL it came from.
# items_ins_v2_1000.json's was computed from a copy of the published file; the other two (4,467,013 and
# 5,137,548 bytes) are what several public projects pin for these Drive files, not checked from here.
DOWNLOAD_SHA256: dict[str, str] = {
    "items_shuffle_1000.json": "30a4765c3a327af72d9a9a95a6b2486d516f0fa1d3ecd83681901ce82a21b269",
    "items_ins_v2_1000.json": "f88a36314a397b53b3d9c3fa5878e5f7b26d35019a51ec83fbedeca61a948f6f",
    HUMAN_GOALS_FILE: "cf78667548a71786e1d9049c24b802e48e1084ad4bb021cae56ce1f6d96954a3",
}
_HOW_ELSE = (f"put items_shuffle_1000.json and items_ins_v2_1000.json (and {HUMAN_GOALS_FILE} for human goals) "
             f"in a folder and set {SOURCE_ENV} to it, or set {BASE_URL_ENV} to a mirror that serves them")


class DownloadError(RuntimeError):
    """A file could not be downloaded (network, HTTP) or was not the expected one. One line: what, from
    where, and how to provide the files instead."""


class ChecksumError(DownloadError):
    """A downloaded file's sha256 is not the expected one (it was not kept)."""


def default_source() -> str | None:
    """The local folder `make data` copies the catalog from: $WEBSHOP_SOURCE, else None (download)."""
    return os.environ.get(SOURCE_ENV) or None


def prepare(dest: str, source: str | None = None, base_url: str | None = None,
            sha256: dict[str, str] | None = None, log=lambda *_: None) -> str:
    """Put a WebShop catalog into `dest`: copy a local folder (`source`, else $WEBSHOP_SOURCE), else keep a
    catalog already there, else `download` the original files. Returns "copied", "kept" or "downloaded"."""
    source = source or default_source()
    if source:
        copy_catalog(dest, source)
        return "copied"
    if has_catalog(dest):
        return "kept"
    download(dest, base_url=base_url, sha256=sha256, log=log)
    return "downloaded"


def copy_catalog(dest: str, source: str) -> None:
    """Copy the WebShop files of `source` into `dest`. Files already there with the same size and mtime
    are left alone; a partial copy is never left under the final name."""
    require_catalog(source, f" (${SOURCE_ENV} or source=)")
    os.makedirs(dest, exist_ok=True)
    for name in _DATA_FILES:
        src = os.path.join(source, name)
        if not os.path.isfile(src):
            continue
        dst = os.path.join(dest, name)
        have, want = (os.stat(dst) if os.path.isfile(dst) else None), os.stat(src)
        if have is not None and (have.st_size, have.st_mtime_ns) == (want.st_size, want.st_mtime_ns):
            continue
        with replaced_atomically(dst) as tmp:
            shutil.copyfile(src, tmp)
            shutil.copystat(src, tmp)


def file_url(name: str, base_url: str | None = None) -> str:
    """Where `download` fetches `name`: <base_url>/<name> when a base URL is given (argument, else
    $WEBSHOP_BASE_URL), else the file's Google Drive link."""
    base_url = base_url if base_url is not None else os.environ.get(BASE_URL_ENV)
    if base_url:
        return f"{base_url.rstrip('/')}/{urllib.parse.quote(name)}"
    return DRIVE_URL.format(id=DRIVE_IDS[name])


def download(dest: str, base_url: str | None = None, sha256: dict[str, str] | None = None,
             timeout_s: float = 60.0, log=lambda *_: None) -> list[str]:
    """Download the files of `sha256` (name -> expected sha256; default DOWNLOAD_SHA256) into `dest`, all
    or nothing: staged in a hidden folder and moved into place only when every one matched. Files already
    there with the expected hash are not fetched again. Returns the names fetched; raises DownloadError
    (ChecksumError for a wrong file) with a one-line message."""
    sha256 = DOWNLOAD_SHA256 if sha256 is None else sha256
    os.makedirs(dest, exist_ok=True)
    fetched = []
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as staging:
        for name, want in sha256.items():
            final = os.path.join(dest, name)
            if os.path.isfile(final) and _file_sha256(final) == want:
                continue
            url = file_url(name, base_url)
            log(f"WebShop: downloading {name} from {_where(url)}")
            got, content_type = _fetch(url, os.path.join(staging, name), name, timeout_s)
            if got != want:
                hint = " (an HTML page: Google Drive's confirmation or quota page?)" \
                    if content_type == "text/html" else ""
                raise ChecksumError(f"WebShop: {name} from {url} is not the expected file{hint}: sha256 {got}, "
                                    f"expected {want}; nothing was kept. To provide the files otherwise, {_HOW_ELSE}")
            fetched.append(name)
        for name in fetched:
            os.replace(os.path.join(staging, name), os.path.join(dest, name))
    return fetched


def _fetch(url: str, path: str, name: str, timeout_s: float) -> tuple[str, str]:
    """Stream `url` into `path`; returns (sha256 hex, content type)."""
    digest = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "gigpo-rl (make data)"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response, open(path, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            return digest.hexdigest(), response.headers.get_content_type()
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"WebShop: cannot download {name}: {url} answered HTTP {exc.code} {_one_line(exc.reason)}; "
                            f"{_HOW_ELSE}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        # Connection refused, DNS failure, timeout, reset: no network, or none to that host.
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise DownloadError(f"WebShop: cannot download {name} from {_where(url)} ({_one_line(reason)}): no network? "
                            f"Without one, {_HOW_ELSE}") from None


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _where(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _one_line(reason) -> str:
    return " ".join(str(reason).split()) or type(reason).__name__


def default_data_dir() -> str:
    """$WEBSHOP_DATA, else ./data/webshop, as an absolute path (the driver hands it to every actor)."""
    return os.path.abspath(os.environ.get("WEBSHOP_DATA") or os.path.join("data", "webshop"))


def catalog_dir(source: str) -> str:
    """The catalog a run of env.source `source` plays: "data" -> default_data_dir(), "generated" -> the
    shipped sample."""
    return default_data_dir() if source == "data" else SAMPLE_DIR


def resolve_data_dir(data_dir: str | None) -> str:
    """The catalog directory to load (see module docstring)."""
    if data_dir is not None:
        require_catalog(data_dir)
        return data_dir
    env_dir = os.environ.get("WEBSHOP_DATA")
    if env_dir and has_catalog(env_dir):
        return env_dir
    return SAMPLE_DIR
