"""The S3 server the object-storage tests run against (tests/_s3server.py) is real and
stays on this machine: it binds and talks to 127.0.0.1 only, checks signatures, and has
the semantics Ravex's S3 backend relies on (ranged reads, conditional puts, multipart
rules), each checked here with an independent client (boto3)."""

from __future__ import annotations

import uuid
from typing import Any

import _s3server
import boto3
import pytest
from botocore.client import Config
from botocore.exceptions import ClientError

MIB = 1 << 20


def client(server: Any, secret: str = _s3server.SECRET_KEY) -> Any:
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=_s3server.ACCESS_KEY, aws_secret_access_key=secret,
                        region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def code(err: ClientError) -> str:
    return str(err.response["Error"]["Code"])


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}/"


def test_it_binds_and_talks_to_the_loopback_only(s3_server: Any, prefix: str) -> None:
    c = client(s3_server)
    c.put_object(Bucket=s3_server.bucket, Key=prefix + "x", Body=b"abc")  # some traffic between its parts
    listening = s3_server.listening()
    assert listening, "no listening socket found for the server"
    assert {addr for addr, _ in listening} == {"127.0.0.1"}, listening
    peers = s3_server.connected()
    assert {addr for addr, _ in peers} <= {"127.0.0.1"}, f"connections beyond the loopback: {peers}"


def test_a_wrong_secret_is_refused(s3_server: Any, prefix: str) -> None:
    with pytest.raises(ClientError) as info:
        client(s3_server, secret="not-the-secret").put_object(Bucket=s3_server.bucket, Key=prefix + "x", Body=b"abc")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_ranged_reads_return_exactly_the_bytes_asked(s3_server: Any, prefix: str) -> None:
    c = client(s3_server)
    body = bytes(range(256)) * 1000
    c.put_object(Bucket=s3_server.bucket, Key=prefix + "blob", Body=body)
    got = c.get_object(Bucket=s3_server.bucket, Key=prefix + "blob", Range="bytes=1000-1999")
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert got["Body"].read() == body[1000:2000]


def test_a_conditional_put_is_refused_where_the_key_exists_or_changed(s3_server: Any, prefix: str) -> None:
    c, key = client(s3_server), prefix + "commit"
    first = c.put_object(Bucket=s3_server.bucket, Key=key, Body=b"one", IfNoneMatch="*")
    with pytest.raises(ClientError) as info:
        c.put_object(Bucket=s3_server.bucket, Key=key, Body=b"two", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412, code(info.value)
    with pytest.raises(ClientError) as info:
        c.put_object(Bucket=s3_server.bucket, Key=key, Body=b"two", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412, code(info.value)
    c.put_object(Bucket=s3_server.bucket, Key=key, Body=b"two", IfMatch=first["ETag"])
    assert c.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"two"


def test_multipart_parts_in_any_order_and_the_5_mib_floor(s3_server: Any, prefix: str) -> None:
    c, key = client(s3_server), prefix + "big"
    parts = [bytes([i]) * (5 * MIB) for i in range(2)] + [b"tail"]
    up = c.create_multipart_upload(Bucket=s3_server.bucket, Key=key)["UploadId"]
    etags = {}
    for n in (3, 1, 2):  # out of order, as the executor's threads finish them
        etags[n] = c.upload_part(Bucket=s3_server.bucket, Key=key, UploadId=up, PartNumber=n, Body=parts[n - 1])["ETag"]
    listed = c.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix).get("Contents", [])
    assert [o["Key"] for o in listed] == [], "an unfinished upload is visible"
    c.complete_multipart_upload(Bucket=s3_server.bucket, Key=key, UploadId=up,
                                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in (1, 2, 3)]})
    assert c.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"".join(parts)

    small = c.create_multipart_upload(Bucket=s3_server.bucket, Key=key + "-small")["UploadId"]
    tags = [c.upload_part(Bucket=s3_server.bucket, Key=key + "-small", UploadId=small, PartNumber=n, Body=b"x" * MIB)["ETag"]
            for n in (1, 2)]
    with pytest.raises(ClientError) as info:
        c.complete_multipart_upload(Bucket=s3_server.bucket, Key=key + "-small", UploadId=small,
                                    MultipartUpload={"Parts": [{"PartNumber": n, "ETag": t} for n, t in zip((1, 2), tags, strict=True)]})
    assert code(info.value) == "EntityTooSmall"
    c.abort_multipart_upload(Bucket=s3_server.bucket, Key=key + "-small", UploadId=small)
