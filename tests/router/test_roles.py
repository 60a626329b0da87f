"""Roles (#47, finding 1): control calls (the Weights service, HTTP control routes) need the admin credential;
an inference client cannot pause the cluster, load weights or join a trainer's group. Real gRPC and HTTP over
loopback, a real cluster of the tiny checkpoint; router.security.Access's table on its own first."""
from __future__ import annotations


import grpc
import httpx
import pytest
import trustme

from pdserve.client import Client
from pdserve.v1 import generation_pb2 as pb
from router.cluster import Cluster
from router.config import RouterConfig
from router.security import NEEDS_PEER, Access, Refusal, Role, is_loopback

from conftest import other_address
from served import Routers, tiny_1p1d

KEY, ADMIN = "inference-key-for-tests", "admin-key-for-tests"
PROMPT = [5, 17, 99, 3, 42, 7]
DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


def bearer(key):
    return f"Bearer {key}".encode() if key else None


def decide(access: Access, control: bool, key=None, peer="ipv4:10.1.2.3:5000", names=()):
    verdict = access.by_key(control, bearer(key))
    if verdict is NEEDS_PEER:
        verdict = access.by_peer(control, bearer(key), peer, names)
    return verdict.code if isinstance(verdict, Refusal) else verdict


def test_the_access_table():
    both = Access(KEY, ADMIN)
    assert decide(both, False, KEY) is Role.INFERENCE and decide(both, False, ADMIN) is Role.ADMIN
    assert decide(both, True, ADMIN) is Role.ADMIN
    assert decide(both, True, KEY) == DENIED  # the inference key: a control call is refused
    assert decide(both, True, None) == UNAUTH and decide(both, False, "wrong") == UNAUTH
    # Only an inference key: control has no credential at all.
    only = Access(KEY)
    assert decide(only, True, KEY) == DENIED and decide(only, True, KEY, peer="ipv4:127.0.0.1:1") == DENIED
    # Nothing configured (the local default): inference open; control to loopback peers only.
    none = Access()
    assert decide(none, False) is Role.INFERENCE and decide(none, False, "whatever") is Role.INFERENCE
    assert decide(none, True, peer="ipv4:127.0.0.1:4000") is Role.ADMIN
    assert decide(none, True, peer="ipv6:[::1]:4000") is Role.ADMIN
    assert decide(none, True, peer="ipv4:10.1.2.3:4000") == DENIED
    # Only an admin key: inference open, control with that key only.
    admin = Access(None, ADMIN)
    assert decide(admin, False) is Role.INFERENCE and decide(admin, True) == DENIED
    assert decide(admin, True, peer="ipv4:127.0.0.1:1") == DENIED and decide(admin, True, ADMIN) is Role.ADMIN
    # Certificates: a name on the list is admin, with or without a key; others are not.
    certs = Access(KEY, None, ("trainer",))
    assert decide(certs, True, names=[b"trainer"]) is Role.ADMIN
    assert decide(certs, True, KEY, names=[b"client"]) == DENIED
    assert decide(certs, False, names=[b"trainer"]) is Role.ADMIN and decide(certs, False, names=[b"x"]) == UNAUTH
    # The control port: network position is the credential unless an admin one exists; the public port of a
    # router with a control port refuses control whatever the key.
    assert decide(Access(control_port=True), True) is Role.ADMIN
    assert decide(Access(None, ADMIN, control_port=True), True) == DENIED
    assert decide(Access(KEY, ADMIN, control_elsewhere=True), True, ADMIN) == DENIED
    with pytest.raises(ValueError, match="differ"):
        Access(KEY, KEY)
    with pytest.raises(ValueError, match="differ"):
        RouterConfig(api_key=KEY, admin_api_key=KEY)
    with pytest.raises(ValueError, match="ssl-ca-certs"):
        RouterConfig(admin_client_names=("trainer",))
    assert is_loopback("ipv4:127.0.0.5:1") and is_loopback("127.0.0.1") and not is_loopback("ipv4:192.168.1.1:80")


# -- against a real router ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(ray_local, aloop, tiny_checkpoints):
    c = Cluster(tiny_1p1d(tiny_checkpoints["llama"]))
    aloop.run(c.start(), timeout=600)
    yield c
    aloop.run(c.shutdown())


@pytest.fixture
def serve(aloop, cluster):
    routers = Routers(aloop, cluster)
    yield routers.start
    routers.close()


def code_of(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def control_codes(target: str, key: str | None, **tls) -> dict[str, grpc.StatusCode]:
    """The status of each control call (those that change nothing when refused, and Pause / Resume)."""
    with Client(target, api_key=key or "", **tls) as c:
        md = c.metadata
        return {
            "Pause": code_of(lambda: c.pause("abort", timeout=30)),
            "Resume": code_of(lambda: c.resume(timeout=30)),
            "GetWeightVersions": code_of(lambda: c.weight_versions(timeout=30)),
            "UpdateWeights": code_of(lambda: c.update_weights("/etc", 2**40, timeout=30)),
            "InitWeightGroup": code_of(lambda: c.weights.InitWeightGroup(
                pb.InitWeightGroupRequest(host="127.0.0.1", port=1, world_size=99, name="g", timeout_seconds=1),
                metadata=md, timeout=30)),
            "DestroyWeightGroup": code_of(lambda: c.weights.DestroyWeightGroup(pb.DestroyWeightGroupRequest(),
                                                                               metadata=md, timeout=30)),
        }


def generate_ok(target: str, key: str | None, **tls) -> bool:
    with Client(target, api_key=key or "", **tls) as c:
        return len(c.complete(token_ids=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True,
                              timeout=60).token_ids) == 4


def test_an_inference_key_cannot_pause_the_cluster(serve):
    """Finding 1 as found: one key for everything; Pause(abort) with it succeeded (every stream ended)."""
    r = serve(api_key=KEY)
    target = f"127.0.0.1:{r.port}"
    assert generate_ok(target, KEY)
    assert set(control_codes(target, KEY).values()) == {DENIED}
    assert not r.weights.paused
    assert generate_ok(target, KEY)


def test_with_both_keys_control_takes_the_admin_key_only(serve, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    r = serve(api_key=KEY, admin_api_key=ADMIN)
    target = f"127.0.0.1:{r.port}"
    assert set(control_codes(target, KEY).values()) == {DENIED}
    assert set(control_codes(target, None).values()) == {UNAUTH}
    with Client(target, api_key=ADMIN) as admin:
        assert admin.pause("keep", timeout=30).paused and r.weights.paused
        assert not admin.resume(timeout=30).paused
        with pytest.raises(grpc.RpcError) as e:  # past the role: the call's own checks answer
            admin.update_weights("/etc", 1, timeout=30)
        assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        # A trainer's group, made with the admin key: the workers join it.
        from pdserve.weights.trainer import WeightSync

        with WeightSync(channel=admin.channel, metadata=admin.metadata, timeout_s=60) as sync:
            assert len(sync.worker_ids) == 2
    assert generate_ok(target, ADMIN) and generate_ok(target, KEY)


def test_without_credentials_control_is_for_loopback_peers_only(serve):
    """The local default (no key) on an address others reach: inference for all, control for this host only."""
    address = other_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    r = serve(host="0.0.0.0")
    assert generate_ok(f"{address}:{r.port}", None)
    assert set(control_codes(f"{address}:{r.port}", None).values()) == {DENIED}
    assert not r.weights.paused
    with Client(f"127.0.0.1:{r.port}") as local:
        assert local.pause("keep", timeout=30).paused
        assert not local.resume(timeout=30).paused


def test_a_control_port_of_its_own(serve):
    r = serve(api_key=KEY, control_port=0)
    public, control = f"127.0.0.1:{r.port}", f"127.0.0.1:{r.control_port}"
    assert r.control_port and r.control_port != r.port
    with Client(public, api_key=KEY) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.pause(timeout=30)
        assert e.value.code() == DENIED and "control port" in e.value.details()
    with Client(control, api_key="") as c:  # no admin credential: reaching the port is the credential
        assert c.pause(timeout=30).paused
        assert not c.resume(timeout=30).paused
        with pytest.raises(grpc.RpcError) as e:  # control only there
            c.complete(token_ids=PROMPT, max_tokens=2, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    r2 = serve(api_key=KEY, admin_api_key=ADMIN, control_port=0)
    assert code_of(lambda: Client(f"127.0.0.1:{r2.control_port}", api_key="").pause(timeout=30)) == DENIED
    with Client(f"127.0.0.1:{r2.control_port}", api_key=ADMIN) as c:
        assert c.pause(timeout=30).paused and not c.resume(timeout=30).paused


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    files = {"ca": d / "ca.pem"}
    ca.cert_pem.write_to_path(files["ca"])
    for name, cert in (("server", ca.issue_cert("127.0.0.1", "localhost")), ("client", ca.issue_cert("client")),
                       ("trainer", ca.issue_cert("trainer"))):
        files[name] = d / f"{name}.pem"
        files[name + "_key"] = d / f"{name}.key"
        cert.cert_chain_pems[0].write_to_path(files[name])
        cert.private_key_pem.write_to_path(files[name + "_key"])
    return {k: str(v) for k, v in files.items()}


def test_an_admin_client_certificate(serve, pki):
    r = serve(ssl_certfile=pki["server"], ssl_keyfile=pki["server_key"], ssl_ca_certs=pki["ca"], api_key=KEY,
              admin_client_names=("trainer",))
    target = f"127.0.0.1:{r.port}"
    client = dict(ssl_ca_certs=pki["ca"], ssl_certfile=pki["client"], ssl_keyfile=pki["client_key"])
    trainer = dict(ssl_ca_certs=pki["ca"], ssl_certfile=pki["trainer"], ssl_keyfile=pki["trainer_key"])
    assert generate_ok(target, KEY, **client)
    assert set(control_codes(target, KEY, **client).values()) == {DENIED}
    with Client(target, api_key="", **trainer) as t:  # its certificate is its credential, no key needed
        assert t.pause(timeout=30).paused and not t.resume(timeout=30).paused
    assert generate_ok(target, "", **trainer)


async def _paused_route() -> dict:
    return {"ok": True}


def test_http_control_routes_take_the_admin_key(serve):
    """The hook HTTP control routes use (RL clients' /pause, /update_weights_from_disk, ...): a route added
    to Router.http_control is admin only; the inference key gets 403, the admin key the route."""
    r = serve(routes={"/control/test": _paused_route}, api_key=KEY, admin_api_key=ADMIN, http_port=0)
    base = f"http://127.0.0.1:{r.http_port}"
    with httpx.Client(timeout=30) as h:
        denied = h.post(f"{base}/control/test", headers={"Authorization": f"Bearer {KEY}"})
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
        assert h.post(f"{base}/control/test").status_code == 401
        ok = h.post(f"{base}/control/test", headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status_code == 200 and ok.json() == {"ok": True}
        assert h.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert h.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    # On a control HTTP port of its own: there only.
    r2 = serve(routes={"/control/test": _paused_route}, api_key=KEY, http_port=0, control_http_port=0)
    with httpx.Client(timeout=30) as h:
        assert h.post(f"http://127.0.0.1:{r2.http_port}/control/test",
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
        assert h.post(f"http://127.0.0.1:{r2.control_http_port}/control/test").json() == {"ok": True}
        assert h.get(f"http://127.0.0.1:{r2.control_http_port}/v1/models").status_code == 404


def test_the_cli_sends_the_admin_key(serve, monkeypatch, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    r = serve(api_key=KEY, admin_api_key=ADMIN)
    root = Path(__file__).resolve().parents[2]
    base = [sys.executable, "-m", "router.cli", "weights", "versions", "--target", f"127.0.0.1:{r.port}"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "PDSERVE_API_KEY": KEY}
    denied = subprocess.run(base, capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr  # the inference key is not sent
    ok = subprocess.run(base, capture_output=True, text=True, env={**env, "PDSERVE_ADMIN_API_KEY": ADMIN}, cwd=root,
                        timeout=120)
    assert ok.returncode == 0 and "weight version 0" in ok.stdout, ok.stderr
    (tmp_path / "k").write_text(KEY)
    wrong = subprocess.run([*base, "--api-key-file", str(tmp_path / "k")], capture_output=True, text=True, env=env,
                           cwd=root, timeout=120)
    assert wrong.returncode == 1 and "PERMISSION_DENIED" in wrong.stderr
