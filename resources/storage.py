"""The storage resource: turns configuration and environment into a :class:`Storage`."""



from dagster import ConfigurableResource, Failure, InitResourceContext
from pydantic import Field

from pipeline.storage import Storage, StorageAccessError
from resources.env import resource_from_env
from resources.home import aerie_home, default_storage_url

_ENV = {
    "url": "AERIE_STORAGE_URL",
    "endpoint_url": "AWS_ENDPOINT_URL",
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "cache_dir": "AERIE_CACHE_DIR",
    "cache_max_gb": "AERIE_CACHE_MAX_GB",
    "timeout_s": "AERIE_STORAGE_TIMEOUT_S",
    "attempts": "AERIE_STORAGE_ATTEMPTS",
}
_SECRETS = ("access_key_id", "secret_access_key")

# what to change, per StorageAccessError.cause (the variables, and the resource's fields)
_FIX = {
    "local": "Set AERIE_STORAGE_URL (the storage resource's url) to a directory this user "
             "can write (file:///...) or to an s3:// URL",
    "credentials": "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the storage resource's "
                   "access_key_id and secret_access_key), and AWS_ENDPOINT_URL for a store "
                   "other than AWS",
    "bucket": "Create the bucket, or point AERIE_STORAGE_URL (the storage resource's url) at "
              "an existing one",
}


class StorageResource(ConfigurableResource):
    """Root of all large data (rollouts, shards, checkpoints): ``file://`` or ``s3://``."""

    url: str | None = Field(
        default=None, description="fsspec root URL; unset: file://$AERIE_HOME/storage")
    endpoint_url: str | None = Field(
        default=None, description="S3 endpoint (e.g. MinIO, moto); unset: AWS default")
    access_key_id: str | None = Field(default=None, description="S3 key id (via EnvVar)")
    secret_access_key: str | None = Field(default=None, description="S3 secret (via EnvVar)")
    cache_dir: str | None = Field(
        default=None, description="verified local copies of policies and drafters, named by "
                                  "content; unset: $AERIE_HOME/cache")
    cache_max_gb: str | None = Field(
        default=None, description="size bound of the cache (least recently used entries go "
                                  "first); unset: 64")
    timeout_s: float = Field(
        default=20.0, gt=0, description="S3: seconds to connect, and to wait for each answer; "
                                        "a store that stops answering fails an operation "
                                        "within about 2 x attempts x timeout_s")
    attempts: int = Field(
        default=3, ge=1, description="S3: attempts per request (botocore's standard retry "
                                     "mode: connection errors, timeouts, 5xx, throttling)")

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Fail the run before any step (and without retries) if the root is unusable."""
        try:
            self.checked()
        except StorageAccessError as e:
            raise Failure(description=str(e), allow_retries=False) from e

    def checked(self) -> Storage:
        """:meth:`build`, then :meth:`Storage.check_access`; an unusable root is a
        :class:`StorageAccessError` that names the settings to change."""
        try:
            storage = self.build()
            storage.check_access()
        except StorageAccessError as e:
            raise StorageAccessError(f"{e}. {_FIX[e.cause]}", e.cause) from e
        return storage

    def build(self) -> Storage:
        url = self.url or default_storage_url()
        options: dict = {}
        if url.startswith("s3://"):
            if self.endpoint_url:
                options["endpoint_url"] = self.endpoint_url
            if self.access_key_id:
                options["key"] = self.access_key_id
            if self.secret_access_key:
                options["secret"] = self.secret_access_key
            options["config_kwargs"] = {
                "connect_timeout": self.timeout_s, "read_timeout": self.timeout_s,
                "retries": {"max_attempts": self.attempts, "mode": "standard"}}
        cache_dir = self.cache_dir or aerie_home() / "cache"
        max_bytes = _gigabytes(self.cache_max_gb) if self.cache_max_gb else None
        return Storage(url, options, cache_dir=cache_dir, cache_max_bytes=max_bytes)


def storage_from_env() -> StorageResource:
    """A resource configured by the variables that are set; the S3 key id and secret as
    ``EnvVar``s, resolved by Dagster at run time, so they never enter run config, logs or
    metadata."""
    return resource_from_env(StorageResource, "", names=_ENV, secrets=_SECRETS)


def storage_from_environment() -> Storage:
    """The same storage, built outside Dagster (the CLI): values read from the environment;
    an unusable root is a :class:`StorageAccessError` naming the variables to set."""
    return resource_from_env(StorageResource, "", names=_ENV, secrets=_SECRETS,
                             outside_dagster=True).checked()


def _gigabytes(text: str) -> int:
    try:
        gb = float(text)
    except ValueError:
        raise ValueError(f"AERIE_CACHE_MAX_GB / cache_max_gb: {text!r} is not a number") from None
    if not gb > 0:
        raise ValueError(f"AERIE_CACHE_MAX_GB / cache_max_gb: {text!r} must be positive")
    return int(gb * 2**30)
