"""The two weight stores keep one contract: atomic put, get, list by prefix, delete."""

from __future__ import annotations

import pytest

from opencomposer.sync.store import FileStore, S3Store, StoreError, open_store


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        yield FileStore(tmp_path / "weights")
        return
    moto = pytest.importorskip("moto")
    import boto3
    with moto.mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="runs")
        yield S3Store("runs", "exp/7", client=boto3.client("s3", region_name="us-east-1"))


def test_put_get_list_delete(store):
    store.put("0001-a-full/rank0.bin", b"\x00" * 10)
    store.put("0001-a-full/rank0.json", b"{}")
    store.put("0002-a-delta/rank0.json", b"{}")
    store.put("0001-a-full/rank0.json", b'{"v": 2}')  # replaced whole
    assert store.get("0001-a-full/rank0.json") == b'{"v": 2}'
    assert store.list() == ["0001-a-full/rank0.bin", "0001-a-full/rank0.json", "0002-a-delta/rank0.json"]
    assert store.list("0001-") == ["0001-a-full/rank0.bin", "0001-a-full/rank0.json"]
    store.delete(["0001-a-full/rank0.bin", "0001-a-full/rank0.json", "never-written"])
    assert store.list() == ["0002-a-delta/rank0.json"]
    with pytest.raises(KeyError, match="no object '0001-a-full/rank0.json'"):
        store.get("0001-a-full/rank0.json")


def test_a_file_store_never_shows_a_half_written_object(tmp_path):
    store = FileStore(tmp_path)
    store.put("v/blob", b"x" * 1000)
    assert [p.name for p in (tmp_path / "v").iterdir()] == ["blob"]  # the temp file was renamed
    store.delete(["v/blob"])
    assert not (tmp_path / "v").exists()  # a folder goes with its last object
    with pytest.raises(StoreError, match="must be relative"):
        store.put("../outside", b"")


KILLED_PUT = r"""
import os, signal, sys
from opencomposer.sync.store import FileStore

def chunks():
    yield b"x" * 1000
    os.kill(os.getpid(), signal.SIGKILL)  # killed half way through the object

FileStore(sys.argv[1]).put("0001-a-full/rank0.bin", chunks())
"""


def test_a_killed_puts_temp_file_is_removed_when_the_store_is_opened_again(tmp_path):
    import subprocess
    import sys

    assert subprocess.run([sys.executable, "-c", KILLED_PUT, str(tmp_path)]).returncode == -9
    (left,) = (tmp_path / "0001-a-full").iterdir()
    assert left.name.startswith(".rank0.bin.tmp-")
    store = FileStore(tmp_path)
    assert store.list() == [] and list((tmp_path / "0001-a-full").iterdir()) == []


def test_open_store_reads_the_uri(tmp_path):
    assert isinstance(open_store(tmp_path / "a"), FileStore)
    assert open_store(f"file://{tmp_path}/b").root == tmp_path / "b"
    with pytest.raises(StoreError, match="expected s3://bucket/prefix"):
        open_store("gs://bucket/x")
    with pytest.raises(StoreError, match="expected s3://bucket"):
        open_store("s3:///x")


def test_an_unreachable_s3_store_is_an_error_naming_it(monkeypatch):
    pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    import boto3
    from botocore.config import Config
    client = boto3.client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=1))
    with pytest.raises(StoreError, match=r"s3://nobucket/p: put 'k' failed"):
        S3Store("nobucket", "p", client=client).put("k", b"")


def test_s3_objects_past_one_part_go_up_in_parts(tmp_path):
    moto = pytest.importorskip("moto")
    import boto3
    from boto3.s3.transfer import TransferConfig
    with moto.mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="runs")
        store = S3Store("runs", "big", client=client)
        store._transfer = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
        data = bytes(range(256)) * (11 << 12)  # 11 MiB: three parts
        store.put("blob", [data[:1000], data[1000:]])
        head = client.head_object(Bucket="runs", Key="big/blob")
        assert head["ETag"].strip('"').endswith("-3")  # a multipart upload's ETag counts its parts
        assert store.get("blob") == data
