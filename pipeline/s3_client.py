"""How Aerie's S3 clients are made, so that a store that stops answering never hangs them.

- **No ``Expect: 100-continue``.** botocore adds it to every upload with a body (PutObject,
  UploadPart); aiohttp then waits for the server's "100 Continue" without any timeout, so
  a store that stopped answering hung the upload for ever (found by the fault campaign,
  tests/reliability/test_fault_campaign.py). :func:`s3_session` makes the clients send
  uploads whole and await the answer within the read timeout.
- **Bounded retries.** botocore retries as ``config_kwargs["retries"]`` says (the storage
  resource sets it); s3fs's own loop around it makes :data:`S3FS_ATTEMPTS` attempts
  instead of its default five, which multiplied every bound by five.
"""

from __future__ import annotations

import functools
from typing import Any

# one more attempt for what botocore does not retry: an answer cut or unparseable, a body cut
# while it is read
S3FS_ATTEMPTS = 2


@functools.cache
def s3_session(profile: str | None) -> Any:
    """The aiobotocore session of the S3 storages of ``profile`` (the one session option
    Aerie's storages take; s3fs makes none of its own once given one), without the
    ``Expect: 100-continue`` handler."""
    from aiobotocore.session import AioSession
    from botocore.handlers import add_expect_header

    session = AioSession(profile=profile)
    session.unregister("before-call.s3", add_expect_header)
    return session
