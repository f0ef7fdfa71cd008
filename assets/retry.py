"""Retries of the stages that talk to services: SGLang, S3 and the MLflow server.

A stage that fails on a transient error (connection refused or reset, a timeout, an S3 or
MLflow 5xx, an SGLang server still restarting) is retried by Dagster's retry policy with
exponential backoff; every stage is safe to re-run (finished work is kept, writes are atomic
and idempotent). A failure that another attempt cannot fix (bad input, a broken contract, a
misconfigured server, a request the server rejects, a drafter serving refuses, a failed
training child, a storage error such as a key outside the root) fails at once:
:func:`fail_fast_on_permanent_errors` turns it into ``Failure(allow_retries=False)``, which
bypasses the policy, so nobody waits three backoffs for a bad record.

Storage: :class:`~pipeline.storage.StorageError` is permanent, its subclass
:class:`~pipeline.storage.StorageUnavailable` (the store could not be reached) is not; nor
are the ``OSError``/``ConnectionError`` that fsspec raises for transient trouble.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from dagster import Backoff, Failure, Jitter, RetryPolicy

RETRY_DELAY_S = 5.0  # before the first retry; then 10 s, 20 s (± jitter)


def service_retry_policy(delay: float = RETRY_DELAY_S) -> RetryPolicy:
    return RetryPolicy(max_retries=3, delay=delay, backoff=Backoff.EXPONENTIAL,
                       jitter=Jitter.PLUS_MINUS)


SERVICE_RETRY = service_retry_policy()


@cache
def permanent_errors() -> tuple[type[BaseException], ...]:
    """The error types no retry can fix. Imported on the first failure, not when the
    definitions load: the stage modules that define them pull in torch."""
    from pipeline.capture.engine_http import EngineConfigError, EngineRejectedError
    from pipeline.capture.stage import ExtractionError
    from pipeline.release.backend import ServingRefused
    from pipeline.release.promotion import PromotionError
    from pipeline.release.register import ReleaseError
    from pipeline.snapshot.sieve import SnapshotError
    from pipeline.storage import StorageError
    from pipeline.training.launch import TrainingFailed

    return (ValueError, TypeError, LookupError, FileNotFoundError, NotADirectoryError,
            SnapshotError, ExtractionError, EngineConfigError, EngineRejectedError,
            TrainingFailed, ReleaseError, PromotionError, ServingRefused, StorageError)


@cache
def transient_errors() -> tuple[type[BaseException], ...]:
    """Subclasses of permanent errors that another attempt can fix."""
    from pipeline.storage import StorageUnavailable

    return (StorageUnavailable,)


def is_permanent(error: BaseException) -> bool:
    """A promotion that moved nothing is as permanent as its cause (an SGLang server still
    restarting: retried; a drafter it refuses: not), failed extraction parts as their
    errors; anything else by its type, the transient subclasses of permanent types (an
    unreachable store) excepted."""
    from pipeline.capture.parallel import PartFailed
    from pipeline.release.promotion import PromotionNotApplied

    if isinstance(error, PromotionNotApplied):
        return error.__cause__ is not None and is_permanent(error.__cause__)
    if isinstance(error, PartFailed):  # as permanent as every part's error
        return all(_permanent_by_name(f.error_types) for f in error.failures)
    return isinstance(error, permanent_errors()) and not isinstance(error, transient_errors())


def _permanent_by_name(error_types: tuple[str, ...]) -> bool:
    """The rule above for an error known by its class names (a child process's); no
    names (a child that died without answering) is not permanent."""
    def named(classes: tuple[type[BaseException], ...]) -> bool:
        return any(f"{c.__module__}.{c.__qualname__}" in error_types for c in classes)

    return named(permanent_errors()) and not named(transient_errors())


@contextmanager
def fail_fast_on_permanent_errors() -> Iterator[None]:
    """Let transient errors reach the retry policy; fail at once on permanent ones."""
    try:
        yield
    except Exception as e:
        if is_permanent(e):
            raise Failure(description=f"{type(e).__name__}: {e}", allow_retries=False) from e
        raise
