"""HTTP plumbing of Aerie's inference-engine clients (SGLang and vLLM hidden-state
capture, and acceptance measured on a running server: ``pipeline.evaluation.sglang_mode``):
one call with a hard deadline, the classification of every failure, and bounded retries
with jittered exponential backoff across a pool of server URLs.

Invariants:

- Every failure is classified. :class:`TransientFailure` (connection refused/reset/dropped,
  timeouts, HTTP 408/429/5xx, malformed JSON, and any response a validator flags as
  possibly flaky) is retried; :class:`EngineConfigError` (a misconfigured server)
  and other HTTP 4xx answers are raised at once, because asking again cannot help.
- Attempt ``k`` of request ``i`` goes to ``urls[(i + k) % len(urls)]``: requests spread
  round-robin over the pool and a retry fails over to the next server.
- A call never waits longer than ``timeout_s`` for the server to start answering, and
  gives up on a body still arriving after ``timeout_s`` (checked between chunks).
- Backoff is deterministic: the delay of attempt ``k`` of request ``i`` depends only on
  ``(seed, i, k)``, not on thread timing.
- Each thread owns its own :class:`requests.Session` (sessions are not thread-safe);
  connections are kept alive between calls of the same thread.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import requests
from requests.adapters import HTTPAdapter

logger = logging.getLogger(__name__)

T = TypeVar("T")
_CHUNK = 1 << 20
_RETRYABLE_STATUS = frozenset({408, 429})
_BAD_URL_ERRORS = (requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema,
                   requests.exceptions.MissingSchema)


class EngineError(RuntimeError):
    """Base of every error an engine client (SGLang, vLLM) raises."""


class EngineConfigError(EngineError):
    """A server is not launched the way capture needs (flags, mode, layer ids); never retried."""


class EngineRequestError(EngineError):
    """A request failed for good: a non-retryable HTTP error, or retries exhausted.

    ``url`` is the server of the last attempt, ``samples`` the batch indices the request
    carried and ``attempts`` one ``"URL: reason"`` line per try.
    """

    def __init__(self, message: str, *, url: str, samples: Sequence[int],
                 attempts: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.url = url
        self.samples = tuple(samples)
        self.attempts = tuple(attempts)


class EngineRejectedError(EngineRequestError):
    """The server answered the request with a client error (HTTP 4xx that is not a rate limit
    or a timeout): the same request will be refused again; never retried."""


class TransientFailure(Exception):
    """A failure worth retrying; ``sample`` is the batch index it concerns, when one does."""

    def __init__(self, reason: str, *, sample: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.sample = sample


@dataclass(frozen=True)
class RetryPolicy:
    """``max_retries`` extra attempts; delay ``min(cap, base·2^k)`` scaled by a jitter in
    ``[0.5, 1.5)`` drawn from ``Random(seed, request, attempt)``."""

    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    seed: int = 0

    def delay(self, request_index: int, attempt: int) -> float:
        jitter = random.Random(f"{self.seed}:{request_index}:{attempt}").random()
        return min(self.backoff_max_s, self.backoff_s * 2**attempt) * (0.5 + jitter)


@dataclass
class CallStats:
    """Counters a caller can log or test against (thread-safe through ``record``)."""

    attempts: int = 0
    retries: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    by_url: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, url: str, *, failed_reason: str | None = None, retry: bool = False) -> None:
        with self._lock:
            self.attempts += 1
            self.by_url[url] += 1
            if failed_reason is not None:
                self.failures[failed_reason.split(":", 1)[0]] += 1
            if retry:
                self.retries += 1


class JsonHttp:
    """Thread-local keep-alive sessions; ``post_json``/``get_json`` with a hard deadline."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float,
                 api_key: str | None = None) -> None:
        self.timeout_s = timeout_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.connect_timeout_s = connect_timeout_s
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            # No transport-level retries: every retry goes through call_with_retries.
            session.mount("http://", HTTPAdapter(max_retries=0))
            session.mount("https://", HTTPAdapter(max_retries=0))
            session.headers.update({"Content-Type": "application/json", **self._auth})
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()

    def post_json(self, url: str, path: str, payload: Any, *,
                  loads: Callable[[bytes], Any] = json.loads) -> Any:
        """The decoded answer; ``loads`` decodes the body (it raises ``ValueError`` on
        malformed JSON, which is a :class:`TransientFailure`)."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        return self._call("POST", url, path, body, loads=loads)

    def get_json(self, url: str, path: str) -> Any | None:
        """The decoded body, or ``None`` when the server has no such endpoint (404)."""
        return self._call("GET", url, path, None, missing_ok=True)

    def _call(self, method: str, url: str, path: str, body: bytes | None, *,
              missing_ok: bool = False, loads: Callable[[bytes], Any] = json.loads) -> Any:
        status, content = self.fetch(method, url, path, body)
        return self._decode(status, content, url + path, missing_ok, loads)

    def fetch(self, method: str, url: str, path: str, body: bytes | None = None
              ) -> tuple[int, bytes]:
        """One exchange under the deadline: ``(status, raw body)``, whatever the status.

        Transport failures and timeouts raise :class:`TransientFailure`, a malformed URL
        :class:`EngineConfigError`; judging the status is the caller's (see
        :func:`raise_for_status`), for endpoints that answer plain text such as
        ``/flush_cache``.
        """
        start = time.monotonic()
        try:
            resp = self._session().request(method, url + path, data=body, stream=True,
                                           timeout=(self.connect_timeout_s, self.timeout_s))
            try:
                chunks = []
                for chunk in resp.iter_content(_CHUNK):
                    chunks.append(chunk)
                    if time.monotonic() - start > self.timeout_s:
                        raise TransientFailure(f"timeout: no full reply within "
                                               f"{self.timeout_s:g}s")
                content = b"".join(chunks)
            finally:
                resp.close()
        except _BAD_URL_ERRORS as e:
            raise EngineConfigError(f"bad server URL {url!r}: {e}") from e
        except requests.exceptions.Timeout as e:
            raise TransientFailure(f"timeout: no reply within {self.timeout_s:g}s ({e})") from e
        except requests.exceptions.RequestException as e:
            reason = "timeout" if "timed out" in str(e).lower() else "connection"
            raise TransientFailure(f"{reason}: {type(e).__name__}: {e}") from e
        return resp.status_code, content

    @staticmethod
    def _decode(status: int, content: bytes, where: str, missing_ok: bool,
                loads: Callable[[bytes], Any] = json.loads) -> Any:
        if status == 404 and missing_ok:
            return None
        raise_for_status(status, content, where)
        try:
            return loads(content)
        except ValueError as e:
            raise TransientFailure(f"malformed JSON: {e} (first bytes {content[:60]!r})") from e


class EngineClient:
    """What every engine client holds until :meth:`close` (also a context manager): keep-alive
    sessions (``_http``), a retry policy (``_policy``), a thread pool (``_pool``) and
    ``stats`` (attempts, retries and failures per URL). ``config`` needs ``timeout_s``,
    ``connect_timeout_s``, ``api_key``, ``max_retries``, ``backoff_s``, ``backoff_max_s``,
    ``seed`` and ``max_concurrency``."""

    def __init__(self, config: Any, thread_name: str) -> None:
        self.config = config
        self.stats = CallStats()
        self._http = JsonHttp(timeout_s=config.timeout_s,
                              connect_timeout_s=config.connect_timeout_s, api_key=config.api_key)
        self._policy = RetryPolicy(config.max_retries, config.backoff_s, config.backoff_max_s,
                                   config.seed)
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix=thread_name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()


def raise_for_status(status: int, content: bytes, where: str) -> None:
    """Classify a non-200 answer of ``where`` (URL + path); return quietly on 200."""
    if status == 200:
        return
    message = _error_message(content)
    if status >= 500 or status in _RETRYABLE_STATUS:
        raise TransientFailure(f"HTTP {status}: {message}")
    if "enable-return-hidden-states" in message:
        raise EngineConfigError(
            f"server at {where} was not started with --enable-return-hidden-states "
            f"(or --return-hidden-states-mode full); it answered HTTP {status}: {message}")
    raise EngineRejectedError(f"{where} answered HTTP {status}: {message}", url=where,
                              samples=())


def _error_message(content: bytes) -> str:
    """SGLang answers errors as ``{"error": {"message": ...}}`` or FastAPI's ``{"message"}``."""
    try:
        body = json.loads(content)
    except ValueError:
        return content[:300].decode(errors="replace")
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:300]


def call_with_retries(fn: Callable[[str], T], *, urls: Sequence[str], request_index: int,
                      policy: RetryPolicy, stats: CallStats, what: str,
                      samples: Sequence[int]) -> T:
    """Run ``fn(url)`` until it returns, failing over along ``urls`` (see module invariants).

    ``what`` and ``samples`` only make the final error readable: it names every URL tried,
    the sample a validation failure concerned and each attempt's reason.
    """
    attempts: list[str] = []
    for attempt in range(policy.max_retries + 1):
        url = urls[(request_index + attempt) % len(urls)]
        try:
            result = fn(url)
        except TransientFailure as failure:
            where = "" if failure.sample is None else f" sample {failure.sample}:"
            attempts.append(f"{url}:{where} {failure.reason}")
            last = attempt == policy.max_retries
            stats.record(url, failed_reason=failure.reason, retry=not last)
            if last:
                sample_txt = ("" if failure.sample is None
                              else f"; the last failure concerned sample {failure.sample}")
                raise EngineRequestError(
                    f"{_target(what, samples)} failed after {len(attempts)} "
                    f"attempt(s){sample_txt}; last server {url}: {failure.reason}\n  "
                    + "\n  ".join(attempts),
                    url=url, samples=samples, attempts=attempts) from failure
            delay = policy.delay(request_index, attempt)
            logger.warning("%s: attempt %d at %s failed (%s); retrying in %.2fs",
                           what, attempt + 1, url, failure.reason, delay)
            time.sleep(delay)
        except EngineConfigError:
            stats.record(url, failed_reason="config")
            raise
        except EngineRequestError as e:
            stats.record(url, failed_reason="rejected")
            raise type(e)(f"{_target(what, samples)}: {e}", url=url, samples=samples,
                          attempts=[f"{url}: {e}"]) from e
        else:
            stats.record(url)
            return result
    raise AssertionError("unreachable")  # pragma: no cover


def _target(what: str, samples: Sequence[int]) -> str:
    return f"{what} for samples {list(samples)}" if len(samples) else what


def post_each(http: JsonHttp, urls: Sequence[str], path: str, payloads: Sequence[Any],
              parse: Callable[[Any], T], *, concurrency: int, policy: RetryPolicy,
              stats: CallStats, what: str) -> list[tuple[str, T]]:
    """POST each payload to ``path`` (request i first to ``urls[i % len(urls)]``, failing
    over as :func:`call_with_retries` does) with ``concurrency`` in flight, and ``parse``
    each answer (a :class:`TransientFailure` from it is retried). Returns (answering URL,
    parsed answer) in payload order; the first failure in payload order is raised, an
    :class:`EngineRequestError` whose ``samples`` is ``[i]``."""

    def one(i: int) -> tuple[str, T]:
        def attempt(url: str) -> tuple[str, T]:
            return url, parse(http.post_json(url, path, payloads[i]))

        return call_with_retries(attempt, urls=urls, request_index=i, policy=policy,
                                 stats=stats, what=what, samples=[i])

    with ThreadPoolExecutor(concurrency, thread_name_prefix="engine-post") as pool:
        futures = [pool.submit(one, i) for i in range(len(payloads))]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:  # the first failure in payload order
            error = f.exception() if f in done else None
            if error is not None:
                raise error
        return [f.result() for f in futures]


def json_int(x: Any) -> bool:
    """Whether a decoded JSON value is an integer (``True``/``False`` are not counts)."""
    return isinstance(x, int) and not isinstance(x, bool)
