"""Where tests find WebShop's 1,000-product catalog when this machine has it: $WEBSHOP_SOURCE (what `make data`
copies), else $WEBSHOP_DATA (where `make data` put it). Nothing else is looked for (no folder beside the
checkout); without either, the tests that need it skip."""
from __future__ import annotations

import os

REAL_CATALOG_FILE = "items_shuffle_1000.json"
NO_REAL_CATALOG = "WebShop 1,000-product catalog not here: set WEBSHOP_SOURCE, or run `make data`"


def real_catalog() -> str | None:
    for folder in (os.environ.get("WEBSHOP_SOURCE"), os.environ.get("WEBSHOP_DATA")):
        if folder and os.path.isfile(os.path.join(folder, REAL_CATALOG_FILE)):
            return folder
    return None
