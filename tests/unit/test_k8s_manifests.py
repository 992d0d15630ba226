"""deploy/k8s: every overlay renders with `kubectl kustomize`, and every object validates against the
Kubernetes API schema (kubernetes-validate's bundled, strict schemas: no cluster, nothing fetched); the
inference-pool overlay's InferencePool and HTTPRoute (CRDs) validate against their upstream CRDs' openAPIV3Schema
(tests/unit/crd_schemas/, copied from the GIE and Gateway API releases), closed to unknown fields."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
REPO = K8S.parents[1]
KUBERNETES_VERSION = "1.32"  # the oldest release we claim; kubectl's own client is 1.32 here
OVERLAYS = ("cpu", "gpu", "inference-pool")
CENTRAL_GATEWAY_OVERLAYS = ("cpu", "gpu")  # the inference-pool overlay runs a gateway inside each Triton pod instead
CRD_SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render deploy/k8s"
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("auth.env"))
    (tree / "base" / "auth.env").write_text("SIE_AUTH_TOKENS=tok-a,tok-b\n")  # what docs/deploy.md has you write
    out = {}
    for overlay in OVERLAYS:
        result = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / overlay)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others: the API server drops (or, with
    strict field validation, refuses) an unknown field, and a typo should fail here as kubernetes-validate's does."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: _closed(v) for k, v in schema.items()}
    if closed.get("type") == "object" and "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


@pytest.fixture(scope="module")
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    out = {}
    for path in sorted(CRD_SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        schema = _closed(crd["openAPIV3Schema"])
        schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta itself is checked by kubectl's own types
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = jsonschema.Draft7Validator(schema)
    return out


def _validate(obj: dict[str, Any], crd_validators) -> None:
    validator = crd_validators.get((obj["apiVersion"], obj["kind"]))
    if validator is not None:
        validator.validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def _container(objects, deployment: str) -> dict[str, Any]:
    return _one(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schema(rendered, crd_validators, overlay):
    kinds = set()
    for obj in rendered[overlay]:
        _validate(obj, crd_validators)
        kinds.add(obj["kind"])
        assert obj["metadata"].get("namespace", "sie") == "sie"
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret",
            "ConfigMap"} <= kinds
    if overlay == "inference-pool":  # the two CRDs, each checked against its own upstream schema
        assert {(o["apiVersion"], o["kind"]) for o in rendered[overlay]} >= set(crd_validators) == {
            ("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}


def test_the_schema_check_catches_a_wrong_field(rendered):
    broken = yaml.safe_load(yaml.safe_dump(_one(rendered["cpu"], "Deployment", "sie-gateway")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", CENTRAL_GATEWAY_OVERLAYS)
def test_gateway_probes_drain_and_auth(rendered, overlay):
    objects = rendered[overlay]
    container = _container(objects, "sie-gateway")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    env = {e["name"]: e for e in container["env"]}
    graceful = int(env["GATEWAY_GRACEFUL_TIMEOUT"]["value"])
    pod = _one(objects, "Deployment", "sie-gateway")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > pause + graceful  # Kubernetes' SIGKILL never cuts the drain
    secret = _one(objects, "Secret", "sie-gateway-auth")
    ref = env["SIE_AUTH_TOKENS"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
    assert env["SIE_AUTH_MODE"]["value"] == "token"
    for kind in ("Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        _one(objects, kind, "sie-gateway")


def test_gateway_routing_file_is_one_the_gateway_reads(rendered, tmp_path):
    config_map = _one(rendered["cpu"], "ConfigMap", "sie-gateway-routing")
    mount = next(m for m in _container(rendered["cpu"], "sie-gateway")["volumeMounts"] if m["name"] == "routing")
    path = tmp_path / "routing.yaml"
    path.write_text(config_map["data"]["routing.yaml"])
    env = {"SIE_GATEWAY_CONFIG": str(path)}
    assert Path(mount["mountPath"]) / "routing.yaml" == Path("/etc/sie/routing.yaml")
    (pool,) = Settings.from_env(env).pools
    service = _one(rendered["cpu"], "Service", "sie-triton")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert pool.dns == f"{service['metadata']['name']}:{grpc_port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_triton_readiness_headless_service_and_queue_autoscaling(rendered, overlay):
    objects = rendered[overlay]
    container = _container(objects, "sie-triton")
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # a model that cannot be reloaded leaves Triton not ready (gateway/supervisor.py): liveness must see it
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert _one(objects, "Service", "sie-triton")["spec"]["clusterIP"] == "None"
    hpa = _one(objects, "HorizontalPodAutoscaler", "sie-triton")
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == {
        "sie_engine_num_requests_waiting", "sie_engine_kv_cache_usage_perc"}
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    assert served >= {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}


def test_gpu_overlay_adds_the_gpu_shared_memory_and_kind_gpu(rendered):
    gpu, cpu = _container(rendered["gpu"], "sie-triton"), _container(rendered["cpu"], "sie-triton")
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    volumes = {v["name"]: v for v in _one(rendered["gpu"], "Deployment", "sie-triton")["spec"]["template"]["spec"][
        "volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in gpu["volumeMounts"])
    assert {e["name"]: e["value"] for e in gpu["env"]}["SIE_INSTANCE_KIND"] == "KIND_GPU"


@pytest.mark.parametrize(("overlay", "kind"), [("gpu", "KIND_GPU"), ("cpu", "KIND_CPU"),
                                             ("inference-pool", "KIND_GPU")])
def test_triton_command_serves_each_model_with_the_overlays_instance_kind(rendered, tmp_path, overlay, kind):
    """Run the container's own start script with a fake `tritonserver` that reports the repository it got."""
    container = _container(rendered[overlay], "sie-triton")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "tritonserver"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in --model-repository=*) r="${a#*=}";; esac; done\n'
                    'grep -ho "kind: KIND_[A-Z]*" "$r"/*/config.pbtxt\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path),
           "SIE_MODEL_REPOSITORY": str(REPO / "model_repository"),
           **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
    result = subprocess.run(container["command"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    kinds = result.stdout.split("\n")[:-1]
    assert len(kinds) == len(list((REPO / "model_repository").glob("*/config.pbtxt")))
    assert set(kinds) == {f"kind: {kind}"}
    assert "KIND_CPU" in (REPO / "model_repository" / "smollm2_135m_instruct" / "config.pbtxt").read_text()


def test_the_crd_schema_check_catches_a_wrong_field_and_a_wrong_value(rendered, crd_validators):
    pool = _one(rendered["inference-pool"], "InferencePool", "sie-pool")
    typo = yaml.safe_load(yaml.safe_dump(pool))
    typo["spec"]["targetPorts"][0]["numbr"] = 8080
    wrong = yaml.safe_load(yaml.safe_dump(pool))
    wrong["spec"]["endpointPickerRef"]["failureMode"] = "Open"
    for broken in (typo, wrong):
        with pytest.raises(jsonschema.ValidationError):
            _validate(broken, crd_validators)
    route = yaml.safe_load(yaml.safe_dump(_one(rendered["inference-pool"], "HTTPRoute", "sie-pool")))
    route["spec"]["rules"][0]["backendRef"] = route["spec"]["rules"][0].pop("backendRefs")
    with pytest.raises(jsonschema.ValidationError):
        _validate(route, crd_validators)


def _pool_pod(objects) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    template = _one(objects, "Deployment", "sie-triton")["spec"]["template"]
    return template, {c["name"]: c for c in template["spec"]["containers"]}


def _port(container: dict[str, Any], name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name_or_number)


def test_inference_pool_pods_run_triton_and_a_gateway_that_talks_to_it_over_localhost(rendered, tmp_path):
    objects = rendered["inference-pool"]
    template, containers = _pool_pod(objects)
    assert list(containers) == ["triton", "gateway"]
    triton, gateway = containers["triton"], containers["gateway"]
    env = {e["name"]: e for e in gateway["env"]}
    assert env["TRITON_GRPC_URL"]["value"] == f"localhost:{_port(triton, 'grpc')}"
    assert env["SIE_ENGINE_METRICS_URL"]["value"] == f"http://localhost:{_port(triton, 'metrics')}/metrics"
    assert "SIE_GATEWAY_CONFIG" not in env  # no routing file: the one local Triton
    ready = gateway["readinessProbe"]["httpGet"]
    assert ready["path"] == "/readyz" and _port(gateway, ready["port"]) == int(env["GATEWAY_PORT"]["value"]) == 8080
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # the gateway's own settings loader reads this env as one pool whose one endpoint is the pod's Triton
    (pool,) = Settings.from_env({k: e["value"] for k, e in env.items() if "value" in e}).pools
    assert [e.url for e in pool.endpoints] == ["localhost:8001"]
    secret = _one(objects, "Secret", "sie-gateway-auth")
    ref = env["SIE_AUTH_TOKENS"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
    assert template["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    # the engine's KV-event topic is kv@<POD_NAME>@<model>: the pod's own name, from the downward API
    pod_name = {e["name"]: e for e in triton["env"]}["POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # port names are unique across a pod's containers (the API server refuses a pod that repeats one)
    names = [p["name"] for c in containers.values() for p in c["ports"]]
    assert len(names) == len(set(names))
    # the gateway's drain fits in the pod's grace period, as Triton's does
    pause = int(gateway["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert template["spec"]["terminationGracePeriodSeconds"] > pause + int(env["GATEWAY_GRACEFUL_TIMEOUT"]["value"])
    # the central gateway tier is gone: the pods themselves are the pool's endpoints
    assert not [o for o in objects if o["metadata"]["name"].startswith("sie-gateway-routing")
                or (o["kind"] in ("Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget")
                    and o["metadata"]["name"] == "sie-gateway")]


def test_inference_pool_selects_the_model_server_pods_and_names_the_epp(rendered):
    objects = rendered["inference-pool"]
    template, containers = _pool_pod(objects)
    pool = _one(objects, "InferencePool", "sie-pool")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    # no other pod in the namespace matches (the EPP's own pods, above all)
    for deployment in (o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] != "sie-triton"):
        assert not selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [_port(containers["gateway"], "openai")]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] in ("FailOpen", "FailClose")
    service = _one(objects, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]


def test_httproute_sends_to_the_inference_pool(rendered):
    objects = rendered["inference-pool"]
    route = _one(objects, "HTTPRoute", "sie-pool")
    pool = _one(objects, "InferencePool", "sie-pool")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def test_epp_serves_ext_proc_health_and_metrics_for_this_pool(rendered):
    objects = rendered["inference-pool"]
    pool = _one(objects, "InferencePool", "sie-pool")
    service = _one(objects, "Service", "sie-pool-epp")
    deployment = _one(objects, "Deployment", "sie-pool-epp")
    pod = deployment["spec"]["template"]
    (epp,) = pod["spec"]["containers"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {9002, 9003, 9090}
    for number, service_port in ports.items():
        assert _port(epp, service_port["targetPort"]) == number
    assert ports[9002]["appProtocol"] == "kubernetes.io/h2c"
    args = epp["args"]
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and "=" not in a}
    assert flag["--pool-name"] == pool["metadata"]["name"]
    assert flag["--pool-namespace"] == pool["metadata"]["namespace"] == "sie"
    assert flag["--pool-group"] == "inference.networking.k8s.io"
    assert (flag["--grpc-port"], flag["--grpc-health-port"]) == ("9002", "9003")
    assert epp["readinessProbe"]["grpc"]["port"] == 9003
    # the plugins file is the mounted ConfigMap's key, and its scorers are declared plugins
    mount = next(m for m in epp["volumeMounts"] if flag["--config-file"].startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = _one(objects, "ConfigMap", volume["configMap"]["name"])
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    config = yaml.safe_load(config_map["data"][Path(flag["--config-file"]).name])
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    scorers = {p["pluginRef"] for p in profile["plugins"]}
    assert scorers == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} and scorers <= declared
    # its ServiceAccount may read the pods and the pool
    account = pod["spec"]["serviceAccountName"]
    _one(objects, "ServiceAccount", account)
    binding = _one(objects, "RoleBinding", "sie-pool-epp")
    assert {"kind": "ServiceAccount", "name": account, "namespace": "sie"} in binding["subjects"]
    role = _one(objects, "Role", binding["roleRef"]["name"])
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
