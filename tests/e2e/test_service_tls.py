"""Transport settings of the public port of a real `serve`. Mutual TLS: a client with a
certificate signed by the configured client CA is served; without one, with one from another CA,
or in plaintext, the handshake is refused (certificates are made here with the `openssl` command
line). The OpenAI-compatible HTTP port speaks the same mutual TLS. The message size bound: a larger
request is refused."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.v1 import generation_pb2_grpc
from tests.e2e.conftest import start_server
from tests.e2e.harness import token_request

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

MAX_MESSAGE_BYTES = 16 * 1024
_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def _make_ca(folder: Path, name: str) -> None:
    _openssl(folder, "req", "-x509", *_EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def _issue(folder: Path, ca: str, name: str, extensions: str) -> None:
    (folder / f"{name}.ext").write_text(extensions + "\n")
    _openssl(folder, "req", *_EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    _make_ca(folder, "ca")
    _make_ca(folder, "other-ca")
    _issue(folder, "ca", "server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    _issue(folder, "ca", "client", "extendedKeyUsage=clientAuth")
    _issue(folder, "other-ca", "stranger", "extendedKeyUsage=clientAuth")
    return folder


def _credentials(certs: Path, client: str | None) -> grpc.ChannelCredentials:
    root = (certs / "ca.pem").read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=(certs / f"{client}.key").read_bytes(),
                                        certificate_chain=(certs / f"{client}.pem").read_bytes())


@pytest.fixture(scope="module")
def mtls_server(llama_checkpoint, tmp_path_factory, certs):
    server = start_server(llama_checkpoint, tmp_path_factory, "mtls", "--num-kv-blocks", "64",
                          "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
                          "--tls-client-ca", str(certs / "ca.pem"), "--max-message-size", str(MAX_MESSAGE_BYTES),
                          credentials=_credentials(certs, "client"), http_port=True)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


def test_client_with_the_right_certificate_is_served(mtls_server):
    response = mtls_server.stub.Generate(token_request([1, 2, 3, 4], max_tokens=3), timeout=60)
    assert len(response.completions[0].token_ids) == 3
    assert mtls_server.health() == health_pb2.HealthCheckResponse.SERVING
    serving = [event for event in mtls_server.log_events() if event["event"] == "frontend_serving"]
    assert serving[0]["tls"] == "mutual"


@pytest.mark.parametrize("client", [None, "stranger", "plaintext"])
def test_handshake_is_refused_without_an_accepted_client_certificate(mtls_server, certs, client):
    target = f"127.0.0.1:{mtls_server.port}"
    if client == "plaintext":
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, _credentials(certs, client))
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(token_request([1, 2, 3, 4], max_tokens=3), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()


def test_message_over_the_size_bound_is_refused(mtls_server):
    fits = token_request([7] * 1000, max_tokens=1)  # about 1 KB
    assert len(mtls_server.stub.Generate(fits, timeout=60).completions[0].token_ids) == 1
    too_large = token_request([7] * 1000, max_tokens=1, stop=["x" * 200] * 100)  # about 20 KB
    assert too_large.ByteSize() > MAX_MESSAGE_BYTES
    with pytest.raises(grpc.RpcError) as info:
        mtls_server.stub.Generate(too_large, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()


def _https_context(certs: Path, client: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if client is not None:
        context.load_cert_chain(str(certs / f"{client}.pem"), str(certs / f"{client}.key"))
    return context


def test_http_port_speaks_the_same_mutual_tls(mtls_server, certs):
    url = f"https://127.0.0.1:{mtls_server.http_port}"
    body = json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 3}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body)
    with urllib.request.urlopen(request, context=_https_context(certs, "client"), timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 3
    for client in (None, "stranger"):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            with urllib.request.urlopen(f"{url}/v1/models", context=_https_context(certs, client), timeout=10) as r:
                r.read()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{mtls_server.http_port}/v1/models", timeout=10).read()
