"""Where weight versions live between the trainer and the inference workers: a directory or S3.

    store = open_store("runs/demo/weights")          # a local or shared (NFS) directory
    store = open_store("file:///mnt/shared/weights")
    store = open_store("s3://my-bucket/runs/demo")  # boto3; AWS_ENDPOINT_URL for MinIO etc.

A store is a flat key -> bytes map with four calls (``protocols.WeightStore``; ``put``
also takes an iterable of chunks, written in order as they come). Writes
are atomic: a reader sees a whole object or none (a directory writes a hidden temp file
``.<name>.tmp-<host>-<pid>-<rand>`` and renames it; an S3 PUT is atomic). Readers find
versions by listing, so no object is ever updated in place. The temp files of a writer
killed mid-put are removed when a directory store is next opened (``paths.remove_stale_temps``).
Errors name the store and the key.

Test: ``pytest tests/unit/sync/test_store.py`` (S3 through moto).
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from opencomposer.paths import remove_stale_temps, temp_name


class StoreError(RuntimeError):
    """A store that cannot be reached or read (names the store and the key)."""


class FileStore:
    """Keys are relative paths under ``root`` (created if missing)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.uri = f"file://{self.root.resolve()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.uri}: cannot create the store's directory: {e}") from None
        for dirpath, _dirs, _files in os.walk(self.root):  # what a killed put left
            remove_stale_temps(Path(dirpath))

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"{self.uri}: key {key!r} must be relative, without '..'")
        return self.root / key

    def put(self, key: str, data: bytes | Iterable[bytes]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(path)
        try:
            with open(tmp, "wb") as f:
                f.writelines([data] if isinstance(data, (bytes, bytearray, memoryview)) else data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)  # only left when writing failed

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(f"{self.uri}: no object {key!r}") from None

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        top = base if base.is_dir() else base.parent
        if not top.exists():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(top):
            for f in files:
                if not f.startswith("."):
                    key = (Path(dirpath) / f).relative_to(self.root).as_posix()
                    if key.startswith(prefix):
                        keys.append(key)
        return sorted(keys)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            if path.parent != self.root:
                try:  # a version's folder goes with its last object
                    path.parent.rmdir()
                except OSError:
                    pass  # not empty yet, or already gone


class S3Store:
    """Keys under ``s3://bucket/prefix``. Credentials and endpoint come from boto3's usual
    sources (environment, ``~/.aws``, instance roles; ``AWS_ENDPOINT_URL``)."""

    def __init__(self, bucket: str, prefix: str = "", client=None):
        try:
            import boto3
        except ImportError:
            raise StoreError("s3:// stores need boto3: pip install 'opencomposer[s3]'") from None
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = client or boto3.client("s3")
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError
        self._errors = (BotoCoreError, ClientError)
        self._transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=16)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn, **kw):
        try:
            return fn(Bucket=self.bucket, **kw)
        except self._errors as e:
            code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404"):
                raise KeyError(f"{self.uri}: no object {key!r}") from None
            raise StoreError(f"{self.uri}: {what} {key!r} failed: {e}") from None

    def put(self, key: str, data: bytes | Iterable[bytes]) -> None:
        # a managed transfer: parts of 64 MiB uploaded in parallel, so objects past a single
        # PUT's 5 GB limit (a large model's full snapshot) go through too; chunks are spooled
        # to a temporary file past 256 MiB rather than held in memory
        whole = isinstance(data, (bytes, bytearray, memoryview))
        with io.BytesIO(data) if whole else tempfile.SpooledTemporaryFile(max_size=256 << 20) as body:
            if not whole:
                for chunk in data:
                    body.write(chunk)
                body.seek(0)
            self._call("put", key, lambda Bucket, Key: self.client.upload_fileobj(
                body, Bucket, Key, Config=self._transfer), Key=self._key(key))

    def get(self, key: str) -> bytes:
        buf = io.BytesIO()
        self._call("get", key, lambda Bucket, Key: self.client.download_fileobj(
            Bucket, Key, buf, Config=self._transfer), Key=self._key(key))
        return buf.getvalue()

    def list(self, prefix: str = "") -> list[str]:
        keys, token, cut = [], None, len(self._key(""))
        while True:
            kw = {"Prefix": self._key(prefix)}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", prefix, self.client.list_objects_v2, **kw)
            keys += [o["Key"][cut:] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(keys)
            token = page["NextContinuationToken"]

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # S3's batch limit
            objs = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            self._call("delete", keys[i], self.client.delete_objects, Delete={"Objects": objs, "Quiet": True})


def open_store(uri: str | Path):
    """``s3://bucket/prefix``, ``file:///path`` or a plain path."""
    uri = str(uri)
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[5:].partition("/")
        if not bucket:
            raise StoreError(f"store {uri!r}: expected s3://bucket[/prefix]")
        return S3Store(bucket, prefix)
    if "://" in uri and not uri.startswith("file://"):
        raise StoreError(f"store {uri!r}: expected s3://bucket/prefix, file:///path or a directory")
    return FileStore(uri.removeprefix("file://"))
