"""URIs: ``scheme://rest`` told from a plain path, and their parts (bucket, query)."""
from __future__ import annotations

import re
from typing import Optional, Tuple

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def split_uri(target: str) -> Tuple[Optional[str], str]:
    """(scheme, rest) of ``scheme://rest``, or (None, target) for a plain path."""
    m = _URI.match(target)
    if m is None:
        return None, target
    return m.group(1).lower(), target[m.end():]


def _strip_query(uri: str) -> str:
    return uri.split("?", 1)[0]


def _bucket_of(uri: str) -> str:
    """The bucket (container) of an object store's URI: what follows ``scheme://`` up to ``/``."""
    scheme, rest = split_uri(uri)
    return rest.split("/", 1)[0].split("?", 1)[0] if scheme is not None else ""
