"""Reading a Prometheus /metrics page in tests: what Ray's metrics agent serves, parsed into samples."""
from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One scraped line: `name{labels} value`."""

    name: str
    labels: dict[str, str]
    value: float


_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_prometheus_text(text: str) -> list[Sample]:
    """The samples of a Prometheus text-format page (comments skipped, label values unescaped)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if not match:
            raise ValueError(f"not a Prometheus sample line: {line[:200]!r}")
        name, raw_labels, value = match.groups()
        labels = {k: _unescape(v) for k, v in _LABEL_RE.findall(raw_labels or "")}
        samples.append(Sample(name, labels, float(value)))
    return samples


def scrape(url: str, timeout_s: float = 10.0) -> list[Sample]:
    """GET a /metrics page and parse it."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse_prometheus_text(resp.read().decode("utf-8"))
