"""Where tests find WebShop's 1,000-product catalog: $WEBSHOP_SOURCE (what `make data` copies), else $WEBSHOP_DATA
(where `make data` put it), else the copy the repository holds for its tests (tests/data/webshop, xz-compressed:
unpacked once into .cache/test-webshop-1000), so that the tests that need it run on any machine."""
from __future__ import annotations

import lzma
import os
import shutil
import tempfile
from pathlib import Path

REAL_CATALOG_FILE = "items_shuffle_1000.json"
HELD = Path(__file__).resolve().parents[1] / "data" / "webshop"
UNPACKED = Path(__file__).resolve().parents[2] / ".cache" / "test-webshop-1000"


def _unpacked_held_copy() -> str:
    """tests/data/webshop/*.json.xz unpacked into UNPACKED (once; a whole directory or none: tmp + rename)."""
    if (UNPACKED / REAL_CATALOG_FILE).is_file():
        return str(UNPACKED)
    UNPACKED.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".test-webshop-", dir=UNPACKED.parent))
    try:
        for packed in HELD.glob("*.json.xz"):
            with lzma.open(packed) as src, open(tmp / packed.name[:-len(".xz")], "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(tmp, UNPACKED)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (UNPACKED / REAL_CATALOG_FILE).is_file():      # (another session unpacked it meanwhile)
            raise
    return str(UNPACKED)


def real_catalog() -> str:
    for folder in (os.environ.get("WEBSHOP_SOURCE"), os.environ.get("WEBSHOP_DATA")):
        if folder and os.path.isfile(os.path.join(folder, REAL_CATALOG_FILE)):
            return folder
    return _unpacked_held_copy()
