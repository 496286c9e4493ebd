"""deploy/kubernetes/pagedserve.yaml agrees with our command line and with itself, like
tests/test_compose.py for compose.yaml: every container's args are accepted by `pagedserve`,
each replica pod is one scheduler with its tensor-parallel ranks on the pod's loopback (one GPU
each), the frontends resolve the headless Service of the replica pods at the scheduler's port,
the probes ask what the frontend answers (HTTP /health, grpc.health.v1), and each container mounts
only the items of the pagedserve-internal Secret its role needs."""

from __future__ import annotations

from pathlib import Path

import yaml

from pagedserve.cli import build_parser
from pagedserve.frontend.upstream.readiness import GENERATION_SERVICE
from pagedserve.frontend.upstream.replica_set import is_dns_name
from pagedserve.security.internal_token import INTERNAL_TOKEN_FILE_ENV
from pagedserve.security.zmq_curve import KEY_FILES, ROLE_ENVS

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kubernetes" / "pagedserve.yaml"


def _documents() -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def _parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"pagedserve rejects {argv} (exit {exc.code})") from None


def _containers(workload: dict) -> dict[str, dict]:
    return {container["name"]: container for container in workload["spec"]["template"]["spec"]["containers"]}


def _port(container: dict, name: str) -> int:
    (port,) = [port["containerPort"] for port in container["ports"] if port["name"] == name]
    return port


def _matches(selector: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(key) == value for key, value in selector.items())


def test_every_container_command_is_accepted_by_the_cli():
    commands = set()
    for (kind, _), doc in _documents().items():
        if kind in ("Deployment", "StatefulSet"):
            for container in _containers(doc).values():
                commands.add(_parse([str(arg) for arg in container["args"]]).command)
    assert commands == {"scheduler", "worker", "frontend"}


def test_each_replica_pod_is_one_scheduler_with_its_ranks():
    docs = _documents()
    (replica,) = [doc for (kind, _), doc in docs.items() if kind == "StatefulSet"]
    containers = _containers(replica)
    args = {name: _parse([str(arg) for arg in container["args"]]) for name, container in containers.items()}
    (scheduler_name,) = [name for name, parsed in args.items() if parsed.command == "scheduler"]
    scheduler = args[scheduler_name]
    workers = {name: parsed for name, parsed in args.items() if parsed.command == "worker"}
    assert scheduler.tensor_parallel_size == len(workers) >= 1
    assert sorted(parsed.rank for parsed in workers.values()) == list(range(len(workers)))
    for name, parsed in workers.items():
        assert parsed.tensor_parallel_size == len(workers), name
        assert parsed.plan_address == scheduler.plan_address and parsed.result_address == scheduler.result_address
        assert parsed.plan_address.startswith("tcp://127.0.0.1:"), "ranks reach their scheduler on the pod's loopback"
        assert containers[name]["resources"]["limits"]["nvidia.com/gpu"] == 1, name
    assert len({parsed.dist_init_address for parsed in workers.values()}) == 1
    assert _port(containers[scheduler_name], "scheduler") == scheduler.port
    assert replica["spec"]["replicas"] >= 2
    assert len({parsed.model for parsed in args.values()}) == 1

    service = docs[("Service", replica["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None", "the frontends resolve one address per replica pod"
    assert _matches(service["spec"]["selector"], replica)
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == scheduler.port


def test_frontends_resolve_the_replicas_and_probe_what_the_frontend_answers():
    docs = _documents()
    (replica,) = [doc for (kind, _), doc in docs.items() if kind == "StatefulSet"]
    replicas_service = docs[("Service", replica["spec"]["serviceName"])]
    (frontend_deployment,) = [doc for (kind, _), doc in docs.items() if kind == "Deployment"]
    assert frontend_deployment["spec"]["replicas"] >= 2
    (container,) = _containers(frontend_deployment).values()
    frontend = _parse([str(arg) for arg in container["args"]])
    (address,) = frontend.scheduler_address.split(",")
    host, port = address.rsplit(":", 1)
    assert host.split(".")[0] == replicas_service["metadata"]["name"] and is_dns_name(address)
    assert int(port) == replicas_service["spec"]["ports"][0]["port"]
    assert frontend.routing == "prefix"

    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["httpGet"]["path"] == "/health"
    assert _port(container, readiness["httpGet"]["port"]) == frontend.http_port
    assert liveness["grpc"]["port"] == frontend.port and liveness["grpc"]["service"] == ""
    assert GENERATION_SERVICE in MANIFEST.read_text()
    grace = frontend_deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > frontend.shutdown_timeout

    (public,) = [doc for (kind, name), doc in docs.items() if kind == "Service" and doc is not replicas_service]
    assert _matches(public["spec"]["selector"], frontend_deployment)
    assert {p["targetPort"] for p in public["spec"]["ports"]} == {"grpc", "http"}


def test_each_container_mounts_only_the_secret_items_of_its_role():
    """The internal token and CURVE keys come from the Secret as files (`python -m
    pagedserve.security.zmq_curve DIR` names them); each container gets only the items of its role."""
    for (kind, _), doc in _documents().items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        volumes = {volume["name"]: volume for volume in doc["spec"]["template"]["spec"]["volumes"]}
        for name, container in _containers(doc).items():
            role = _parse([str(arg) for arg in container["args"]]).command
            files = {}  # path in the container -> Secret key
            for mount in container.get("volumeMounts", []):
                secret = volumes[mount["name"]].get("secret")
                if secret is not None:
                    assert secret["secretName"] == "pagedserve-internal" and mount.get("readOnly"), name
                    files.update({f"{mount['mountPath']}/{item['path']}": item["key"] for item in secret["items"]})
            env = {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}
            expected = {f"{key}_FILE": KEY_FILES[key] for key in ROLE_ENVS[role]}
            if role in ("scheduler", "frontend"):
                expected[INTERNAL_TOKEN_FILE_ENV] = "internal-token"
            assert {variable: files.get(path) for variable, path in env.items()} == expected, name
            assert sorted(files.values()) == sorted(expected.values()), f"{name} mounts items it does not use"
