"""TLS and the API key at the router's edge: real gRPC over loopback with certificates made in the test
(trustme: a throwaway CA), a real cluster of the tiny checkpoint behind it."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.client import Client
from pdserve.config import CacheConfig, ClusterConfig, EngineConfig, PoolConfig
from pdserve.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from router.cluster import Cluster
from router.compose import build_router
from router.config import RouterConfig
from router.grpc_api import SERVICE_NAME
from router.server import Router

ROOT = Path(__file__).resolve().parents[2]
KEY = "s3cret-key-for-tests"
PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the router's certificate (for 127.0.0.1 and localhost) and a client certificate, as PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("pdserve-test-client")
    files = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key",
             "client_cert": d / "client.pem", "client_key": d / "client.key"}
    ca.cert_pem.write_to_path(files["ca"])
    server.cert_chain_pems[0].write_to_path(files["cert"])
    server.private_key_pem.write_to_path(files["key"])
    client.cert_chain_pems[0].write_to_path(files["client_cert"])
    client.private_key_pem.write_to_path(files["client_key"])
    (d / "api-key").write_text(KEY + "\n")
    files["key_file"] = d / "api-key"
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def cluster(ray_local, aloop, tiny_checkpoints):
    cache = CacheConfig(block_size=4, num_blocks=256)
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=cache)
    c = Cluster(ClusterConfig(engine=engine, prefill=PoolConfig(1, num_cpus=0.25), decode=PoolConfig(1, num_cpus=0.25)))
    aloop.run(c.start(), timeout=600)
    yield c
    aloop.run(c.shutdown())


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), cache=CacheConfig(block_size=4, num_blocks=256))
    return LLMEngine(engine).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids


def serve(aloop, cluster, **kw) -> Router:
    r = build_router(cluster, RouterConfig(port=0, **kw))
    aloop.run(r.start())
    return r


@pytest.fixture(scope="module")
def secure(aloop, cluster, pki):
    """TLS, an API key, /metrics over HTTPS and a plaintext health port."""
    r = serve(aloop, cluster, ssl_certfile=pki["cert"], ssl_keyfile=pki["key"], api_key=KEY, metrics_port=0,
              metrics_tls=True, health_port=0)
    yield r
    aloop.run(r.stop(grace=2))


def complete(target: str, **kw) -> list[int]:
    with Client(target, **kw) as c:
        return c.complete(token_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=60).token_ids


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def test_with_the_key_over_tls_it_serves(secure, pki, reference):
    assert complete(f"127.0.0.1:{secure.port}", ssl_ca_certs=pki["ca"], api_key=KEY) == reference
    # The name on the certificate, when the target is an address it does not carry.
    assert complete(f"127.0.0.1:{secure.port}", ssl_ca_certs=pki["ca"], api_key=KEY, server_name="localhost") == reference


def test_without_the_key_every_rpc_but_health_is_unauthenticated(secure, pki, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    target = f"127.0.0.1:{secure.port}"
    for key in (None, "wrong-key", KEY + "x"):
        with Client(target, ssl_ca_certs=pki["ca"], api_key=key) as c:
            assert code_of(lambda: list(c.generate(token_ids=PROMPT, max_tokens=4, timeout=10))) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: c.model_info(timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: c.cluster_status(timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            assert c.health(timeout=10) == "SERVING"  # probes and load balancers need no secret
            reflect = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            assert code_of(lambda: list(reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))) \
                == grpc.StatusCode.UNAUTHENTICATED
            # Refused before the request is parsed: bytes that are no GenerateRequest get the same answer.
            raw = c.channel.unary_stream(f"/{SERVICE_NAME}/Generate", request_serializer=None,
                                         response_deserializer=None)
            assert code_of(lambda: list(raw(b"\xff\xff\xff", timeout=10))) == grpc.StatusCode.UNAUTHENTICATED


def test_the_key_from_the_environment(secure, pki, reference, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert complete(f"127.0.0.1:{secure.port}", ssl_ca_certs=pki["ca"]) == reference


def test_a_plaintext_client_gets_nothing_and_the_server_stays_up(secure, pki, reference):
    target = f"127.0.0.1:{secure.port}"
    with Client(target, api_key=KEY) as c:  # no TLS
        assert code_of(lambda: c.model_info(timeout=5)) == grpc.StatusCode.UNAVAILABLE
        assert code_of(lambda: list(c.generate(token_ids=PROMPT, max_tokens=4, timeout=5))) == grpc.StatusCode.UNAVAILABLE
    # A certificate from another CA is refused too.
    other = trustme.CA()
    with other.cert_pem.tempfile() as wrong_ca:
        assert code_of(lambda: complete(target, ssl_ca_certs=wrong_ca, api_key=KEY)) == grpc.StatusCode.UNAVAILABLE
    assert complete(target, ssl_ca_certs=pki["ca"], api_key=KEY) == reference


def test_health_port_is_plaintext_and_health_only(secure):
    channel = grpc.insecure_channel(f"127.0.0.1:{secure.health_port}")
    try:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        info = channel.unary_unary(f"/{SERVICE_NAME}/GetModelInfo", request_serializer=pb.GetModelInfoRequest.SerializeToString,
                                   response_deserializer=pb.ModelInfo.FromString)
        assert code_of(lambda: info(pb.GetModelInfoRequest(), timeout=10)) == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()


def test_metrics_over_https(secure, pki):
    url = f"https://127.0.0.1:{secure.metrics_port}/metrics"
    body = urllib.request.urlopen(url, context=ssl.create_default_context(cafile=pki["ca"]), timeout=10).read()
    assert b"pdserve_requests" in body or b"pdserve_worker" in body
    with pytest.raises(Exception):  # plain HTTP to the TLS port
        urllib.request.urlopen(f"http://127.0.0.1:{secure.metrics_port}/metrics", timeout=10).read()


def test_client_certificates_required_with_ca_certs(aloop, cluster, pki, reference):
    r = serve(aloop, cluster, ssl_certfile=pki["cert"], ssl_keyfile=pki["key"], ssl_ca_certs=pki["ca"])
    try:
        target = f"127.0.0.1:{r.port}"
        assert code_of(lambda: complete(target, ssl_ca_certs=pki["ca"])) == grpc.StatusCode.UNAVAILABLE
        assert complete(target, ssl_ca_certs=pki["ca"], ssl_certfile=pki["client_cert"],
                        ssl_keyfile=pki["client_key"]) == reference
    finally:
        aloop.run(r.stop(grace=2))


def test_cli_takes_the_same_options(secure, pki):
    env = {**os.environ, "PDSERVE_API_KEY": ""}
    base = [sys.executable, "-m", "router.cli", "status", "--target", f"127.0.0.1:{secure.port}",
            "--ssl-ca-certs", pki["ca"]]
    ok = subprocess.run([*base, "--api-key-file", pki["key_file"]], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "prefill" in ok.stdout and "decode" in ok.stdout
    denied = subprocess.run(base, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr


def test_bad_edge_settings_fail_at_once(pki, tmp_path):
    with pytest.raises(ValueError, match="both"):
        RouterConfig(ssl_certfile=pki["cert"])
    with pytest.raises(ValueError, match="need --ssl-certfile"):
        RouterConfig(ssl_ca_certs=pki["ca"])
    with pytest.raises(FileNotFoundError):
        RouterConfig(ssl_certfile=str(tmp_path / "nope.pem"), ssl_keyfile=pki["key"])
    with pytest.raises(ValueError, match="empty"):
        RouterConfig(api_key="")
    from pdserve.client.grpc_client import read_api_key

    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(None, str(tmp_path / "empty"))


def test_the_http_api_takes_the_same_tls_and_key(aloop, cluster, pki):
    import httpx

    r = serve(aloop, cluster, ssl_certfile=pki["cert"], ssl_keyfile=pki["key"], api_key=KEY, http_port=0,
              served_model_name="tiny")
    try:
        base = f"https://127.0.0.1:{r.http_port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"]), timeout=30) as h:
            assert h.get(f"{base}/health").status_code == 200  # no key needed
            assert h.get(f"{base}/v1/models").status_code == 401
            # Refused before the body is read: garbage without the key is a 401, not a 400.
            garbage = h.post(f"{base}/v1/completions", content=b"\xff{not json", headers={"Authorization": "Bearer x"})
            assert garbage.status_code == 401 and garbage.json()["error"]["code"] == "invalid_api_key"
            ok = h.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
            done = h.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                "ignore_eos": True})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8
        with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port
            httpx.get(f"http://127.0.0.1:{r.http_port}/health", timeout=10)
    finally:
        aloop.run(r.stop(grace=2))
