"""Credentials kept out of what people and files see: the one home of redaction.

`redact(url)` gives a URL with its password (in its user part, or a `password=` query parameter) replaced by
***, everything else kept; `redact_text(text)` does the same to every URL in free text (a command line, a
config override). Logs, error messages, job.json, the printed resume command and the tracker's config get
these; the password itself travels only inside URLs handed to the run's own processes."""
from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

REDACTED = "***"
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


def password_of(url: str) -> str | None:
    """The password in a URL (in its user part, or a `password=` query parameter), or None."""
    try:
        parts = urlsplit(url)
        if parts.password is not None:
            return unquote(parts.password)
        query = dict(parse_qsl(parts.query))
    except ValueError:
        return None
    return query.get("password")


def unsplit_url(parts, netloc: str, query: str) -> str:
    # urlunsplit drops the "//" of a unix:// URL without a user part; redis-py then reads no path.
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def redact(url: str) -> str:
    """`url` with its password replaced by *** (user, host, port and database kept), for anything a person
    or a file may see. A URL that does not parse comes back as a placeholder, never as itself."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, hostport = netloc.rsplit("@", 1)
            netloc = f"{userinfo.split(':', 1)[0]}:{REDACTED}@{hostport}"
        query = parse_qsl(parts.query, keep_blank_values=True)
        if any(key == "password" for key, _ in query):
            query = [(key, REDACTED if key == "password" else value) for key, value in query]
            return unsplit_url(parts, netloc, urlencode(query, safe="*"))
        return unsplit_url(parts, netloc, parts.query)
    except ValueError:
        return "(a URL that does not parse)"


def is_redacted(url: str) -> bool:
    return password_of(url) == REDACTED


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted (`redact`)."""
    return _URL_IN_TEXT.sub(lambda match: redact(match.group(0)), text)
