"""Checkpoint roots in object storage against a real S3 server (moto's, started here on a
free loopback port, in its own process): upload, list, verify and fetch; partial,
hostile and lying buckets refused; an upload killed midway and a server gone mid-upload
leave nothing complete; wrong endpoint, missing bucket and wrong credentials said
clearly, and the secret key never in what dtlab says."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dtlab.control.object_store import Bucket, ObjectStoreError
from dtlab.records.checkpoints import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    checksum_text,
    file_problem,
    read_manifest,
)

pytestmark = pytest.mark.timeout(120)

SECRET = "dtlabPlantedSecretKey0123456789abcdefXYZ"  # searched for in what dtlab says
KEY_ID = "AKIADTLABTESTKEY0001"
START_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's S3 server in a process of its own (stopped by its pid)."""

    def __init__(self, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def client(self, key_id: str = KEY_ID, secret: str = SECRET):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )


def s3_env(monkeypatch, tmp_path, endpoint: str, key_id: str = KEY_ID) -> None:
    """The standard variables dtlab reads, and no profile of this machine's."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def server():
    s = MotoServer()
    yield s
    s.stop()


@pytest.fixture
def bucket(server, monkeypatch, tmp_path):
    s3_env(monkeypatch, tmp_path, server.url)
    name = f"ckpt-{time.monotonic_ns()}"
    server.client().create_bucket(Bucket=name)
    return Bucket(f"s3://{name}/team/run1", tmp_path / "work")


def make_folder(folder: Path, step: int, files: dict[str, bytes], world: int = 2) -> Path:
    """A checkpoint folder as the ranks write one (manifest last)."""
    folder.mkdir(parents=True)
    entries = []
    for i, (name, data) in enumerate(files.items()):
        (folder / name).write_bytes(data)
        import xxhash

        entries.append(
            {
                "name": name,
                "size": len(data),
                "xxh3": checksum_text(xxhash.xxh3_64_intdigest(data)),
                "rank": i % world,
            }
        )
    manifest = {
        "format": FORMAT,
        "step": step,
        "created": time.time(),
        "world_size": world,
        "loss": 1.5,
        "model": {"params": []},
        "ranks": {"0": {}},
        "files": entries,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def sample(tmp_path, step=40, n=3, size=1000) -> Path:
    files = {f"rank-{i}.pt": os.urandom(size) for i in range(n)}
    return make_folder(tmp_path / f".partial-step-{step:07d}-abcd", step, files)


def put(server, bucket: Bucket, key: str, data: bytes) -> None:
    server.client().put_object(Bucket=bucket.bucket, Key=f"{bucket.prefix}/{key}", Body=data)


def test_upload_list_verify_fetch(bucket, tmp_path):
    folder = sample(tmp_path)
    saved = bucket.upload(folder, 40)
    assert saved.ok and saved.url == f"{bucket.url}/step-0000040"
    again = bucket.upload(folder, 40)  # the same step twice (a replay): a second name
    assert again.url == f"{bucket.url}/step-0000040-2"
    listed = sorted(bucket.catalogue(verify=True), key=lambda c: c.where)  # same manifest
    assert [(c.step, c.status, c.url) for c in listed] == [
        (40, "complete", saved.url),
        (40, "complete", again.url),
    ]
    assert listed[0].size_bytes == 3000 and listed[0].ranks == (0, 1) and listed[0].loss == 1.5
    fetched = bucket.fetch(listed[0])
    for entry in read_manifest(fetched)["files"]:
        assert file_problem(fetched, entry) is None
        assert (fetched / entry["name"]).read_bytes() == (folder / entry["name"]).read_bytes()
    bucket.forget_fetched(fetched)
    assert not fetched.exists()
    bucket.remove(listed[1])
    assert [c.url for c in bucket.catalogue()] == [saved.url]


def test_objects_without_a_manifest_list_as_partial_and_never_load(bucket, server, tmp_path):
    put(server, bucket, "step-0000050/rank-0.pt", b"x" * 700)
    (partial,) = bucket.catalogue()
    assert partial.status == "partial" and partial.size_bytes == 700
    assert "no manifest" in partial.problem
    with pytest.raises(CheckpointError, match="no manifest"):
        bucket.fetch(partial)


def test_a_hostile_bucket_is_refused_unopened(bucket, server, tmp_path):
    good = bucket.upload(sample(tmp_path), 40)
    # an object nested in a checkpoint, one with a name dtlab never writes
    put(server, bucket, "step-0000041/sub/rank-0.pt", b"x")
    put(server, bucket, "step-0000041/manifest.json", b"{}")
    # a manifest naming a file outside its folder
    data = json.loads((sample(tmp_path / "b", step=42) / MANIFEST).read_text())
    data["files"][0]["name"] = "../step-0000040/rank-0.pt"
    put(server, bucket, "step-0000042/manifest.json", json.dumps(data).encode())
    # a checkpoint whose object is not the size its manifest lists
    lie = bucket.upload(sample(tmp_path / "c", step=43), 43)
    put(server, bucket, "step-0000043/rank-1.pt", b"short")
    # ... and one whose object has the size but other bytes
    swapped = bucket.upload(sample(tmp_path / "d", step=44), 44)
    put(server, bucket, "step-0000044/rank-2.pt", os.urandom(1000))
    listed = {c.step: c for c in bucket.catalogue()}
    assert listed[40].ok
    assert listed[41].status == "corrupt" and "'sub/rank-0.pt'" in listed[41].problem
    assert listed[42].status == "corrupt" and "not a plain name" in listed[42].problem
    assert listed[43].status == "corrupt" and "has 5 bytes, the manifest says 1000" in (
        listed[43].problem
    )
    assert listed[44].ok  # sizes agree; only the checksum tells
    verified = {c.step: c for c in bucket.catalogue(verify=True)}
    assert verified[44].status == "corrupt" and "checksum" in verified[44].problem
    with pytest.raises(CheckpointError, match="has 5 bytes"):
        bucket.fetch(listed[43])
    with pytest.raises(CheckpointError, match=r"rank-2\.pt has checksum .* \(corrupted\)"):
        bucket.fetch(swapped)
    assert list(bucket.fetched.glob("*")) == []  # nothing kept of a refused fetch
    assert bucket.fetch(good).is_dir() and lie.url


def test_a_bucket_url_is_checked():
    for url in ("s3://", "s3://Bad_Bucket/x", "s3://bucket/../x", "s3://bucket/a//b"):
        with pytest.raises(ObjectStoreError, match="is not s3://BUCKET/PREFIX"):
            Bucket(url, Path("/tmp/x"))


UPLOADER = """
import sys
from pathlib import Path
from dtlab.control.object_store import Bucket
Bucket(sys.argv[1], Path(sys.argv[2])).upload(Path(sys.argv[3]), 60)
"""


def objects(server, bucket: Bucket) -> list[str]:
    found = server.client().list_objects_v2(Bucket=bucket.bucket, Prefix=bucket.prefix)
    return [o["Key"] for o in found.get("Contents", [])]


def test_an_upload_killed_midway_leaves_nothing_complete(bucket, server, tmp_path):
    files = {f"part-{i:03d}.distcp": os.urandom(200_000) for i in range(60)}
    folder = make_folder(tmp_path / "staged", 60, files)
    proc = subprocess.Popen(
        [sys.executable, "-c", UPLOADER, bucket.url, str(tmp_path / "w"), str(folder)],
        env=os.environ.copy(),
    )
    try:
        end = time.monotonic() + 60
        while len(objects(server, bucket)) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the upload finished before it was killed"
    (partial,) = bucket.catalogue()
    assert partial.status == "partial" and partial.size_bytes > 0
    assert not any(k.endswith(MANIFEST) for k in objects(server, bucket))


def test_the_server_gone_mid_upload_is_said_and_the_local_copy_kept(monkeypatch, tmp_path):
    own = MotoServer()
    try:
        s3_env(monkeypatch, tmp_path, own.url)
        own.client().create_bucket(Bucket="gone")
        bucket = Bucket("s3://gone/x", tmp_path / "work")
        files = {f"part-{i:03d}.distcp": os.urandom(200_000) for i in range(80)}
        folder = make_folder(tmp_path / "staged", 70, files)
        failed: list[BaseException] = []

        def upload():
            try:
                bucket.upload(folder, 70)
            except BaseException as e:
                failed.append(e)

        thread = threading.Thread(target=upload)
        thread.start()
        end = time.monotonic() + 60
        while len(objects(own, bucket)) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        own.stop()
        started = time.monotonic()
        thread.join(timeout=100)
        assert not thread.is_alive(), "the upload hung on a server that is gone"
        took = time.monotonic() - started
    finally:
        own.stop()
    (error,) = failed
    assert isinstance(error, ObjectStoreError), error
    assert "cannot be reached" in str(error) and "AWS_ENDPOINT_URL" in str(error)
    assert SECRET not in str(error)
    assert took < 90
    for entry in read_manifest(folder)["files"]:  # the local copy is as the ranks wrote it
        assert file_problem(folder, entry) is None


def test_wrong_endpoint_and_missing_bucket_say_what_to_do(bucket, monkeypatch, tmp_path):
    missing = Bucket("s3://no-such-bucket-here/x", tmp_path / "w")
    with pytest.raises(ObjectStoreError, match="'no-such-bucket-here' does not exist") as e:
        missing.upload(sample(tmp_path), 1)
    assert SECRET not in str(e.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    nowhere = Bucket(bucket.url, tmp_path / "w")
    started = time.monotonic()
    with pytest.raises(ObjectStoreError, match="cannot be reached: check AWS_ENDPOINT_URL") as e:
        nowhere.catalogue()
    assert time.monotonic() - started < 60
    assert SECRET not in str(e.value)


def test_wrong_credentials_are_refused_and_never_printed(monkeypatch, tmp_path):
    # moto checks signatures once its first (setup) requests are done
    own = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    try:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=own.url,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
            region_name="us-east-1",
        )
        iam.create_user(UserName="dtlab")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="dtlab", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="dtlab")["AccessKey"]
        own.client(key["AccessKeyId"], key["SecretAccessKey"]).create_bucket(Bucket="locked")
        s3_env(monkeypatch, tmp_path, own.url, key_id=key["AccessKeyId"])  # a wrong secret
        bucket = Bucket("s3://locked/x", tmp_path / "w")
        with pytest.raises(ObjectStoreError, match="credentials were refused") as e:
            bucket.upload(sample(tmp_path), 1)
        assert SECRET not in str(e.value) and "AWS_SECRET_ACCESS_KEY" in str(e.value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        assert Bucket("s3://locked/x", tmp_path / "w2").upload(sample(tmp_path / "b"), 1).ok
    finally:
        own.stop()


def test_a_policy_that_may_read_but_not_write_is_said_and_leaves_nothing(monkeypatch, tmp_path):
    """Credentials that are valid but whose policy denies writes (a read-only role):
    the save says the bucket's policy refused it; what the bucket holds still lists and
    loads with them."""
    own = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "6"})  # the IAM setup below
    try:
        import boto3

        iam = boto3.client("iam", endpoint_url=own.url, aws_access_key_id="setup",
                           aws_secret_access_key="setup", region_name="us-east-1")  # fmt: skip
        keys = {}
        deny_writes = {"Effect": "Deny", "Action": ["s3:PutObject", "s3:DeleteObject"],
                       "Resource": "*"}  # fmt: skip
        for user, extra in (("writer", []), ("reader", [deny_writes])):
            iam.create_user(UserName=user)
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}, *extra],
            }
            iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps(policy))
            keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
        writer = own.client(keys["writer"]["AccessKeyId"], keys["writer"]["SecretAccessKey"])
        writer.create_bucket(Bucket="shared")
        s3_env(monkeypatch, tmp_path, own.url, key_id=keys["writer"]["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["writer"]["SecretAccessKey"])
        first = Bucket("s3://shared/x", tmp_path / "w").upload(sample(tmp_path / "a", step=10), 10)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["reader"]["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["reader"]["SecretAccessKey"])
        reader = Bucket("s3://shared/x", tmp_path / "r")
        with pytest.raises(ObjectStoreError, match="may not do this.*the bucket's policy") as e:
            reader.upload(sample(tmp_path / "b", step=20), 20)
        assert keys["reader"]["SecretAccessKey"] not in str(e.value)
        assert [(c.step, c.status) for c in reader.catalogue()] == [(10, "complete")]
        assert reader.fetch(first).is_dir()  # what it may read, it reads
    finally:
        own.stop()


def test_a_sibling_prefix_is_not_listed(bucket, server, tmp_path):
    server.client().put_object(
        Bucket=bucket.bucket, Key=f"{bucket.prefix}x/step-0000001/manifest.json", Body=b"{}"
    )
    saved = bucket.upload(sample(tmp_path), 40)
    assert [c.url for c in bucket.catalogue()] == [saved.url]


def test_the_root_from_the_environment_and_what_a_bucket_root_refuses(monkeypatch):
    from dtlab.control.checkpointing import Checkpointing
    from dtlab.control.errors import OptionError

    monkeypatch.setenv("DTLAB_CHECKPOINT_DIR", "s3://env-bucket/a/b/")
    ck = Checkpointing(None, None)  # type: ignore[arg-type]  # no rank is asked here
    root = ck.checkpoint_root
    assert isinstance(root, Bucket) and root.url == "s3://env-bucket/a/b"
    assert ck.checkpoint_root is root  # one connection, not one per use
    with pytest.raises(OptionError, match="periodic saves go to a local folder"):
        ck.checkpoint_every(5)
    with pytest.raises(OptionError, match="is not s3://BUCKET/PREFIX"):
        ck.checkpoint_root = "s3://no/../up"


def test_a_deepspeed_save_is_copied_once_complete_and_checked_when_fetched_back(
    bucket, server, tmp_path
):
    """A folder as engine.save_checkpoint leaves it: a tag folder per save and `latest`.
    A tag newer than `latest` (a save under way) is not copied; a copy whose object was
    changed in the bucket is refused when fetched, and nothing is put in place."""
    from dtlab.control import deepspeed_copies as ds

    save = tmp_path / "ckpt"
    parts = {"mp_rank_00_model_states.pt": os.urandom(3000),
             "zero_pp_rank_0_mp_rank_00_optim_states.pt": os.urandom(5000)}  # fmt: skip
    for tag in ("global_step2", "global_step4"):
        (save / tag).mkdir(parents=True)
        for name, data in parts.items():
            (save / tag / name).write_bytes(data)
    (save / "latest").write_text("global_step2")
    written = (save / "latest").stat().st_mtime
    for f in (save / "global_step4").iterdir():  # being written after `latest`
        os.utime(f, (written + 10, written + 10))
    assert ds.complete_tags(save) == [("global_step2", 2, 8000)]
    copied = ds.upload(bucket, save, "global_step2")
    assert copied.ok and copied.url == f"{bucket.url}/deepspeed/global_step2"
    assert [(c.tag, c.status) for c in ds.catalogue(bucket)] == [("global_step2", "complete")]
    assert ds.latest_tag(bucket) == "global_step2"
    back = ds.restore(bucket, tmp_path / "other")
    assert {p.name: p.read_bytes() for p in back.iterdir()} == parts
    assert (tmp_path / "other" / "latest").read_text() == "global_step2"
    changed = bytearray(parts["mp_rank_00_model_states.pt"])
    changed[100] ^= 1
    put(server, bucket, "deepspeed/global_step2/mp_rank_00_model_states.pt", bytes(changed))
    with pytest.raises(CheckpointError, match="checksum"):
        ds.restore(bucket, tmp_path / "third")
    assert not (tmp_path / "third" / "global_step2").exists()
    assert not list((tmp_path / "third").glob(".partial-*"))
    put(server, bucket, "deepspeed/global_step2/manifest.json", b'{"format": "x"}')
    [(tag, status)] = [(c.tag, c.status) for c in ds.catalogue(bucket)]
    assert (tag, status) == ("global_step2", "corrupt")


class Throttling:
    """An HTTP server in front of moto (a thread of this test, on loopback) that answers
    a request 503 SlowDown, as S3 does when throttling, whenever ``throttle(k)`` says so
    for the k-th time the same request (method and path) comes (counted from 1), and
    passes the others on unchanged (per request, so concurrent uploads do not change
    which tries are throttled)."""

    SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>")  # fmt: skip

    def __init__(self, upstream: str, throttle) -> None:
        import http.client
        import http.server

        self.seen = self.throttled = 0
        self.asked: dict[tuple[str, str], int] = {}  # (method, path): how often
        lock, outer = threading.Lock(), self
        host, port = upstream.removeprefix("http://").split(":")

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if "chunked" not in self.headers.get("Transfer-Encoding", ""):
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = b""
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                while self.rfile.readline().strip():  # trailers, then the blank line
                    pass
                return body

            def _any(self):
                body = self._body()
                with lock:
                    outer.seen += 1
                    asked = (self.command, self.path)
                    outer.asked[asked] = outer.asked.get(asked, 0) + 1
                    slow = throttle(outer.asked[asked])
                    outer.throttled += slow
                if slow:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(outer.SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(outer.SLOWDOWN)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    dropped = ("transfer-encoding", "content-length", "expect")
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                length = reply.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))  # HEAD: the object's
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_throttling_is_retried_with_backoff_and_past_its_bound_said(server, monkeypatch, tmp_path):
    """A server that throttles every request's first try (and third...): saves, listings
    and fetches succeed (each request tried again after a wait). One that throttles
    every request: the save fails after a bounded number of tries, saying that the
    storage throttles."""
    from dtlab.control import object_store

    server.client().create_bucket(Bucket="throttled")
    every_other = Throttling(server.url, lambda k: k % 2 == 1)
    try:
        s3_env(monkeypatch, tmp_path, every_other.url)
        bucket = Bucket("s3://throttled/x", tmp_path / "w1")
        info = bucket.upload(sample(tmp_path / "a", n=6), 40)
        assert [(c.step, c.status) for c in bucket.catalogue(verify=True)] == [(40, "complete")]
        assert bucket.fetch(info).is_dir()
        assert every_other.throttled > 10 and every_other.seen >= 2 * every_other.throttled
    finally:
        every_other.stop()
    monkeypatch.setattr(object_store, "ATTEMPTS", 2)  # a smaller bound: a quicker test
    monkeypatch.setattr(object_store, "RETRIES", 2)
    always = Throttling(server.url, lambda k: True)
    try:
        s3_env(monkeypatch, tmp_path, always.url)
        bucket = Bucket("s3://throttled/y", tmp_path / "w2")
        with pytest.raises(ObjectStoreError, match="each was tried up to 4 times") as e:
            bucket.catalogue()
        assert SECRET not in str(e.value) and "throttling" in str(e.value)
        assert set(always.asked.values()) == {4}, always.asked  # each request: 2 x 2 tries
    finally:
        always.stop()
