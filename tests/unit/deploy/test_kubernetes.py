"""deploy/kubernetes, checked offline: API schemas, references between resources, and engine
command lines that equal what agentkv's launcher runs.

The kustomizations use ``resources`` only (no generators, patches or transformers), so what they
render is exactly their files' YAML documents: ``load`` reads those, and
``test_kubectl_kustomize_renders_what_the_tests_check`` holds kubectl to that (skipped where
kubectl is not installed, failed there when ``CI`` is set). ``kubernetes-validate`` ships each
Kubernetes release's OpenAPI schemas as JSON Schema; strict mode also refuses fields the API does
not know (the API server would drop a misspelt ``replica:`` silently).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes_validate import utils as kubernetes_validate

from agentkv_server.bundle import launcher
from agentkv_server.bundle.launcher import EngineSpec
from agentkv_server.cli import build_parser
from agentkv_server.router.cli import settings_from_args
from agentkv_server.testing.conditions import require_binary
from agentkv_server.wire import ROUTER_URL_ENV, SECRET_ENV

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "deploy" / "kubernetes"
MONITORING = BASE / "monitoring"
DOCS = ROOT / "docs" / "deploy.md"

# The oldest and the newest Kubernetes release whose schemas the validator ships.
VERSIONS = (kubernetes_validate.all_versions()[0], kubernetes_validate.latest_version())
# The Secret operators create (docs/deploy.md), and its keys.
SECRET = "agentkv"
SECRET_KEYS = {"shared-secret", "api-keys"}
# Engine settings the pods take from the ConfigMap agentkv-engine.
MODEL_ENV, SERVED_NAME_ENV = "AGENTKV_MODEL_PATH", "AGENTKV_SERVED_MODEL"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"

Resource = dict[str, Any]


def load(directory: Path) -> list[Resource]:
    """What ``kubectl kustomize DIRECTORY`` renders, for a resources-only kustomization."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    extra = set(kustomization) - {"apiVersion", "kind", "resources"}
    assert not extra, f"{directory}: the tests render resources-only kustomizations, not {extra}"
    resources: list[Resource] = []
    for name in kustomization["resources"]:
        documents = yaml.safe_load_all((directory / name).read_text())
        resources += [document for document in documents if document]
    return resources


@pytest.fixture()
def base() -> list[Resource]:
    """A fresh copy per test: the negative tests break it."""
    return load(BASE)


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def label(resource: Resource) -> str:
    return f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"


def container(resources: list[Resource], kind: str, name: str, container_name: str) -> Resource:
    pod = find(resources, kind, name)["spec"]["template"]["spec"]
    (match,) = [c for c in pod["containers"] if c["name"] == container_name]
    return match


def workloads(resources: list[Resource]) -> list[Resource]:
    return [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]


def pod_labels(workload: Resource) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) or a Service's plain label map."""
    if not {"matchLabels", "matchExpressions"} & selector.keys():
        selector = {"matchLabels": selector}
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    return all(_matches(expression, labels) for expression in selector.get("matchExpressions", []))


def _matches(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, values = expression["key"], expression.get("values", [])
    return {
        "In": key in labels and labels[key] in values,
        "NotIn": labels.get(key) not in values,
        "Exists": key in labels,
        "DoesNotExist": key not in labels,
    }[expression["operator"]]


def container_ports(workload: Resource) -> set[str]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return {port["name"] for c in containers for port in c.get("ports", []) if "name" in port}


def selected(resources: list[Resource], selector: Mapping[str, Any]) -> list[Resource]:
    return [w for w in workloads(resources) if selects(selector, pod_labels(w))]


def service_url(resources: list[Resource], name: str, port_name: str = "http") -> str:
    ports = find(resources, "Service", name)["spec"]["ports"]
    (port,) = [p["port"] for p in ports if p["name"] == port_name]
    return f"http://{name}:{port}"


# --- API schemas -------------------------------------------------------------------------------


def schema_errors(resources: list[Resource], version: str) -> list[str]:
    """One line per resource that does not validate (or has no schema) at ``version``."""
    errors = []
    for resource in resources:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path) or "(top)"
            errors.append(f"{label(resource)} at {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{label(resource)}: {error.message}")
    return errors


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_validates_strictly(base: list[Resource], version: str) -> None:
    kinds = {r["kind"] for r in base}
    assert kinds >= {"ConfigMap", "Deployment", "NetworkPolicy", "Service", "StatefulSet"}
    assert schema_errors(base, version) == []


def test_an_unknown_field_fails_validation(base: list[Resource]) -> None:
    decode = find(base, "StatefulSet", "agentkv-decode")
    decode["spec"]["replica"] = decode["spec"].pop("replicas")
    (error,) = schema_errors(base, VERSIONS[-1])
    assert error.startswith("StatefulSet/agentkv-decode") and "'replica'" in error


def test_a_wrong_type_fails_validation(base: list[Resource]) -> None:
    router = container(base, "Deployment", "agentkv-router", "router")
    router["ports"][0]["containerPort"] = "8000"
    (error,) = schema_errors(base, VERSIONS[-1])
    assert "containerPort" in error


def test_a_missing_required_field_fails_validation(base: list[Resource]) -> None:
    del find(base, "Service", "agentkv-router")["spec"]["ports"][0]["port"]
    (error,) = schema_errors(base, VERSIONS[0])
    assert "'port' is a required property" in error


def test_a_kind_without_a_schema_is_an_error_not_a_pass(base: list[Resource]) -> None:
    typo = copy.deepcopy(find(base, "Service", "agentkv-router"))
    typo["kind"] = "Servcie"
    assert len(schema_errors([typo], VERSIONS[-1])) == 1


# --- engines: the launcher's command and environment --------------------------------------------


def resolved_env(pod_container: Resource, resources: list[Resource]) -> dict[str, str]:
    """The container's environment: ConfigMap values read, other sources as placeholders."""
    env = {}
    for entry in pod_container.get("env", []):
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[entry["name"]] = find(resources, "ConfigMap", ref["name"])["data"][ref["key"]]
        elif "fieldRef" in source:
            env[entry["name"]] = f"<{source['fieldRef']['fieldPath']}>"
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[entry["name"]] = f"<secret {ref['name']}/{ref['key']}>"
    return env


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in command and args (``$$`` escapes a ``$``)."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return re.sub(r"\$\$|\$\((\w+)\)", substitute, text)


def launcher_spec(
    role: launcher.Role, pod_container: Resource, env: Mapping[str, str]
) -> EngineSpec:
    """The engine agentkv's launcher would start on a GPU with the pod's model and ports."""
    ports = {port["name"]: port["containerPort"] for port in pod_container["ports"]}
    return EngineSpec(
        role=role,
        model=Path(env[MODEL_ENV]),
        served_name=env[SERVED_NAME_ENV],
        port=ports["http"],
        side_channel_port=ports["nixl"],
        log_path=Path("/dev/stdout"),
        host="0.0.0.0",
        device="cuda",
        fresh_engine_id=True,
    )


def engine_drift(resources: list[Resource], role: launcher.Role) -> list[str]:
    """How the pool's engine container differs from the launcher's engine (nothing: [])."""
    engine = container(resources, "StatefulSet", f"agentkv-{role}", "engine")
    env = resolved_env(engine, resources)
    command = [expand(arg, env) for arg in [*engine["command"], *engine.get("args", [])]]
    spec = launcher_spec(role, engine, env)
    # The image's interpreter, then the launcher's arguments; flags after them are the
    # deployment's pass-through (the launcher's engine_args, which come last there too).
    expected = ["python3", *spec.command()[1:]]
    problems = []
    if command[: len(expected)] != expected:
        problems.append(f"{role}: command\n  manifest {command}\n  launcher {expected}")
    expected_env = {
        **spec.environment(base={}),
        # A pod listens on every address but must give pullers its own.
        SIDE_CHANNEL_HOST_ENV: "<status.podIP>",
        # As agentkv serve does: decode engines report streamed turns' holdings to the router.
        ROUTER_URL_ENV: service_url(resources, "agentkv-router"),
        SECRET_ENV: f"<secret {SECRET}/shared-secret>",
    }
    for name, value in expected_env.items():
        if env.get(name) != value:
            problems.append(f"{role}: env {name} is {env.get(name)!r}, launcher: {value!r}")
    return problems


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_pods_run_what_the_launcher_runs(base: list[Resource], role: launcher.Role) -> None:
    assert engine_drift(base, role) == []


def test_a_dropped_flag_is_drift(base: list[Resource]) -> None:
    container(base, "StatefulSet", "agentkv-decode", "engine")["args"].remove(
        "--enable-prompt-tokens-details"
    )
    (problem,) = engine_drift(base, "decode")
    assert problem.startswith("decode: command")
    assert engine_drift(base, "prefill") == []


def test_a_changed_launcher_is_drift(base: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "TOOL_CALL_PARSER", "llama3_json")
    assert len(engine_drift(base, "prefill")) == len(engine_drift(base, "decode")) == 1


def test_a_fixed_side_channel_address_is_drift(base: list[Resource]) -> None:
    engine = container(base, "StatefulSet", "agentkv-prefill", "engine")
    (entry,) = [e for e in engine["env"] if e["name"] == SIDE_CHANNEL_HOST_ENV]
    entry.pop("valueFrom")
    entry["value"] = "0.0.0.0"
    (problem,) = engine_drift(base, "prefill")
    assert SIDE_CHANNEL_HOST_ENV in problem


def test_a_side_channel_port_unlike_the_container_port_is_drift(base: list[Resource]) -> None:
    engine = container(base, "StatefulSet", "agentkv-decode", "engine")
    (nixl,) = [port for port in engine["ports"] if port["name"] == "nixl"]
    nixl["containerPort"] += 1
    (problem,) = engine_drift(base, "decode")
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in problem


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "x"}
    assert expand("$(A)-$(B)-$$(A)", env) == "x-$(B)-$(A)"


# --- references between resources ---------------------------------------------------------------


def reference_errors(resources: list[Resource]) -> list[str]:
    """Selectors that select nothing, names and ports that point nowhere."""
    errors = []
    for workload in workloads(resources):
        errors += _workload_errors(workload, resources)
    for service in (r for r in resources if r["kind"] == "Service"):
        errors += _service_errors(service, resources)
    for statefulset in (r for r in resources if r["kind"] == "StatefulSet"):
        governing = find(resources, "Service", statefulset["spec"]["serviceName"])
        if governing["spec"].get("clusterIP") != "None":
            errors.append(f"{label(statefulset)}: its Service must be headless (per-pod DNS)")
    for policy in (r for r in resources if r["kind"] == "NetworkPolicy"):
        errors += _policy_errors(policy, resources)
    return errors


def _workload_errors(workload: Resource, resources: list[Resource]) -> list[str]:
    errors = []
    pod = workload["spec"]["template"]["spec"]
    if not selects(workload["spec"]["selector"], pod_labels(workload)):
        errors.append(f"{label(workload)}: selector does not select its own pods")
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for volume in volumes.values():
        if "configMap" in volume:
            find(resources, "ConfigMap", volume["configMap"]["name"])
    for c in pod["containers"]:
        ports = {port["name"] for port in c.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket") or {}
            if isinstance(action.get("port"), str) and action["port"] not in ports:
                errors.append(f"{label(workload)}: {probe} names no port {action['port']!r}")
        for mount in c.get("volumeMounts", []):
            if mount["name"] not in volumes:
                errors.append(f"{label(workload)}: no volume {mount['name']!r}")
        for entry in c.get("env", []):
            errors += _env_errors(label(workload), entry.get("valueFrom", {}), resources)
    return errors


def _env_errors(owner: str, source: Mapping[str, Any], resources: list[Resource]) -> list[str]:
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        if ref["key"] not in find(resources, "ConfigMap", ref["name"])["data"]:
            return [f"{owner}: ConfigMap {ref['name']} has no key {ref['key']!r}"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        if ref["name"] != SECRET or ref["key"] not in SECRET_KEYS:
            return [f"{owner}: Secret {ref['name']}/{ref['key']} is not one docs/deploy.md makes"]
    return []


def _service_errors(service: Resource, resources: list[Resource]) -> list[str]:
    pods = selected(resources, service["spec"]["selector"])
    if not pods:
        return [f"{label(service)}: selects no pods"]
    return [
        f"{label(service)}: {label(pod)} has no port {port['targetPort']!r}"
        for port in service["spec"]["ports"]
        for pod in pods
        if isinstance(port.get("targetPort"), str)
        and port["targetPort"] not in container_ports(pod)
    ]


def _policy_errors(policy: Resource, resources: list[Resource]) -> list[str]:
    targets = selected(resources, policy["spec"]["podSelector"])
    if not targets:
        return [f"{label(policy)}: applies to no pods"]
    errors = []
    for rule in policy["spec"].get("ingress", []):
        for peer in rule["from"]:
            # Peers in other namespaces (Prometheus) are not ours to check.
            if "namespaceSelector" not in peer and not selected(resources, peer["podSelector"]):
                errors.append(f"{label(policy)}: a peer selector selects no pods")
        for port in rule.get("ports", []):
            if any(port["port"] not in container_ports(pod) for pod in targets):
                errors.append(f"{label(policy)}: port {port['port']!r} missing on its pods")
    return errors


def router_errors(resources: list[Resource]) -> list[str]:
    """The router lists every engine pod, and its settings are valid and point at Redis."""
    pod = find(resources, "Deployment", "agentkv-router")["spec"]["template"]["spec"]
    (router,) = [c for c in pod["containers"] if c["name"] == "router"]
    argv = [*router["command"][1:], *router["args"]]
    args = build_parser(argv).parse_args(argv)
    errors = []
    for role, listed in (("prefill", args.prefill_urls or []), ("decode", args.decode_urls or [])):
        pool = find(resources, "StatefulSet", f"agentkv-{role}")
        service = pool["spec"]["serviceName"]
        ports = container(resources, "StatefulSet", f"agentkv-{role}", "engine")["ports"]
        (port,) = [p["containerPort"] for p in ports if p["name"] == "http"]
        names = [f"{pool['metadata']['name']}-{i}" for i in range(pool["spec"]["replicas"])]
        expected = [f"http://{name}.{service}:{port}" for name in names]
        if listed != expected:
            errors.append(f"router lists {role} {listed}, the pool has {expected}")
    mounted = _mounted_file(resources, pod, router, str(args.config))
    with tempfile.TemporaryDirectory() as directory:
        args.config = Path(directory) / "settings.json"
        args.config.write_text(mounted)
        settings = settings_from_args(args)
    if settings.port != router["ports"][0]["containerPort"] or settings.host != "0.0.0.0":
        errors.append(f"router listens on {settings.host}:{settings.port}, not its container port")
    redis = urlsplit(settings.redis_url or "")
    if f"http://{redis.hostname}:{redis.port}" != service_url(resources, "agentkv-redis", "redis"):
        errors.append(f"router's redis_url {settings.redis_url!r} is not the Redis Service")
    return errors


def _mounted_file(
    resources: list[Resource], pod: Resource, pod_container: Resource, path: str
) -> str:
    """The content of the ConfigMap key that ``pod_container`` sees at ``path``."""
    (mount,) = [m for m in pod_container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    data = find(resources, "ConfigMap", volume["configMap"]["name"])["data"]
    return data[path.removeprefix(mount["mountPath"] + "/")]


def test_resources_refer_to_each_other_correctly(base: list[Resource]) -> None:
    assert reference_errors(base) == []
    assert router_errors(base) == []


def test_a_service_selecting_nothing_is_caught(base: list[Resource]) -> None:
    find(base, "Service", "agentkv-redis")["spec"]["selector"]["app.kubernetes.io/component"] = "x"
    assert reference_errors(base) == ["Service/agentkv-redis: selects no pods"]


def test_a_misnamed_secret_key_is_caught(base: list[Resource]) -> None:
    engine = container(base, "StatefulSet", "agentkv-decode", "engine")
    (entry,) = [e for e in engine["env"] if e["name"] == SECRET_ENV]
    entry["valueFrom"]["secretKeyRef"]["key"] = "secret"
    (error,) = reference_errors(base)
    assert "agentkv/secret" in error


def test_scaling_a_pool_without_listing_its_pods_is_caught(base: list[Resource]) -> None:
    find(base, "StatefulSet", "agentkv-decode")["spec"]["replicas"] = 2
    (error,) = router_errors(base)
    assert "agentkv-decode-1.agentkv-decode" in error


def test_invalid_router_settings_are_caught(base: list[Resource]) -> None:
    data = find(base, "ConfigMap", "agentkv-router")["data"]
    data["settings.json"] = json.dumps({**json.loads(data["settings.json"]), "policy": "fast"})
    with pytest.raises(Exception, match="policy"):
        router_errors(base)


def test_service_monitors_scrape_existing_ports_with_the_shared_secret(
    base: list[Resource],
) -> None:
    monitors = load(MONITORING)
    assert {m["kind"] for m in monitors} == {"ServiceMonitor"}
    services = [r for r in base if r["kind"] == "Service"]
    scraped = set()
    for monitor in monitors:
        targets = [
            s for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert targets, f"{label(monitor)} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in targets)
            assert endpoint["path"] == "/metrics"
        scraped |= {s["metadata"]["name"] for s in targets}
    assert scraped == {"agentkv-router", "agentkv-prefill", "agentkv-decode"}
    # The router's /metrics needs the shared secret once API keys are set (docs/security.md).
    (endpoint,) = find(monitors, "ServiceMonitor", "agentkv-router")["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": SECRET, "key": "shared-secret"},
    }


@pytest.fixture
def kubectl() -> str:
    """kubectl's path: a skip without it, a failure where ``CI`` is set (docs/deploy.md)."""
    return require_binary("kubectl", "install kubectl 1.21 or newer (docs/deploy.md)")


@pytest.mark.parametrize("directory", [BASE, MONITORING], ids=["base", "monitoring"])
def test_kubectl_kustomize_renders_what_the_tests_check(kubectl: str, directory: Path) -> None:
    rendered = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True
    ).stdout

    def by_name(resources: list[Resource]) -> dict[str, Resource]:
        return {label(r): r for r in resources}

    assert by_name([r for r in yaml.safe_load_all(rendered) if r]) == by_name(load(directory))


# --- docs/deploy.md ------------------------------------------------------------------------------


def documented_overlay() -> Resource:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    documents = [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]
    (overlay,) = [doc for doc in documents if doc["kind"] == "Kustomization"]
    return overlay


def test_the_documented_overlay_renders_a_consistent_deployment(
    kubectl: str, tmp_path: Path
) -> None:
    overlay = documented_overlay()
    overlay["resources"] = [os.path.relpath(BASE, tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    rendered = subprocess.run(
        [kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    resources = [r for r in yaml.safe_load_all(rendered) if r]

    assert find(resources, "StatefulSet", "agentkv-decode")["spec"]["replicas"] == 2
    assert {r["metadata"]["namespace"] for r in resources} == {overlay["namespace"]}
    engine = container(resources, "StatefulSet", "agentkv-prefill", "engine")
    assert engine["image"] == "registry.example.com/agentkv-engine:0.1.0"
    assert engine["args"][-1] == "--max-model-len=32768"
    assert schema_errors(resources, VERSIONS[-1]) == []
    assert reference_errors(resources) == router_errors(resources) == []
    assert engine_drift(resources, "prefill") == engine_drift(resources, "decode") == []


def test_the_yaml_in_the_docs_validates() -> None:
    """Overlays must build on the base; everything else validates against the schemas."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    documents = [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]
    overlays = [doc for doc in documents if doc["kind"] == "Kustomization"]
    others = [doc for doc in documents if doc["kind"] != "Kustomization"]
    assert overlays and others
    for overlay in overlays:
        assert overlay["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert schema_errors(others, VERSIONS[0]) == []


def test_the_docs_create_the_secret_the_manifests_read() -> None:
    text = DOCS.read_text()
    command = re.search(rf"create secret generic {SECRET}\b(.*?)```", text, re.DOTALL)
    assert command, f"docs/deploy.md does not create the Secret {SECRET!r}"
    assert set(re.findall(r"--from-literal=([a-z-]+)=", command.group(1))) == SECRET_KEYS
