"""A store's failures that a user must act on (access denied, a missing bucket, an endpoint that
cannot be reached), said in plain words (:func:`plain_error`)."""
from __future__ import annotations

import re
from typing import Any, Optional

from .retry import is_io_failure
from .uris import _bucket_of, split_uri

# Failures a user must act on, as pyarrow's AWS, GCS and Azure clients, fsspec drivers and curl word them.
_DENIED = re.compile(
    r"ACCESS_DENIED|AccessDenied|Access Denied|HTTP status 40[13]\b|InvalidAccessKeyId|INVALID_ACCESS_KEY_ID|"
    r"SignatureDoesNotMatch|SIGNATURE_DOES_NOT_MATCH|ExpiredToken|EXPIRED_TOKEN|PERMISSION_DENIED|403 Forbidden|"
    r"UNAUTHENTICATED|Unauthorized")
_NO_BUCKET = re.compile(r"NO_SUCH_BUCKET|NoSuchBucket|[Bb]ucket does not exist|The specified bucket does not exist")
_UNREACHABLE = re.compile(r"Could not connect|Couldn't connect|Could not resolve|Couldn't resolve|Connection refused|"
                          r"Failed to connect|Cannot connect to host|Name or service not known")
_CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), AWS_PROFILE, or the "
                      "machine's role",
                "gs": "GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, or the machine's "
                      "service account",
                "abfs": "AZURE_STORAGE_ACCOUNT_NAME and its key, a SAS token, or the default Azure credential"}


def plain_error(e: BaseException, uri: str) -> Optional[OSError]:
    """A store's failure that the user must act on, in plain words naming ``uri`` (raise it from
    ``e``, which stays its cause), or None when ``e`` is none of them:

    * access denied, an unknown access key, a bad signature, an expired token: a PermissionError
      saying that the credentials were refused or lack permission, and where they come from;
    * a missing bucket: a FileNotFoundError saying that the bucket does not exist;
    * an endpoint that cannot be reached (connection refused, a host that does not resolve): a
      ConnectionError asking whether the endpoint is right (transient: it was retried first).
    """
    if getattr(e, "feeder_plain", False) or not isinstance(e, OSError) and not is_io_failure(e):
        return None
    text = " ".join(str(e).split())
    said = text if len(text) <= 300 else text[:297] + "..."
    scheme = split_uri(uri)[0] or ""
    out: OSError
    if _NO_BUCKET.search(text):
        out = FileNotFoundError(f"the bucket {_bucket_of(uri)!r} does not exist ({uri!r}): check its name, the "
                                f"account and the endpoint (the store said: {said})")
    elif isinstance(e, PermissionError) or _DENIED.search(text):
        where = _CREDENTIALS.get({"gcs": "gs", "s3a": "s3", "az": "abfs"}.get(scheme, scheme),
                                 "the filesystem's credentials")
        out = PermissionError(f"access denied to {uri!r}: the store refused the credentials, or they lack the "
                              f"permission for it; check the credentials ({where}) and the bucket's permissions "
                              f"(the store said: {said})")
    elif _UNREACHABLE.search(text):
        out = ConnectionError(f"cannot reach the store of {uri!r}: is the endpoint right and the server up? (the "
                              f"store's client said: {said})")
    else:
        return None
    marked: Any = out
    marked.feeder_plain = True  # already in plain words: not worded again, its cause not repeated
    return out
