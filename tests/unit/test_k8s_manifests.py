"""deploy/k8s: both overlays render with `kubectl kustomize`, and every object validates against the
Kubernetes API schema (kubernetes-validate's bundled, strict schemas: no cluster, nothing fetched)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
REPO = K8S.parents[1]
KUBERNETES_VERSION = "1.32"  # the oldest release we claim; kubectl's own client is 1.32 here
OVERLAYS = ("cpu", "gpu")


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


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def _container(objects, deployment: str) -> dict[str, Any]:
    return _one(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schema(rendered, overlay):
    kinds = set()
    for obj in rendered[overlay]:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        kinds.add(obj["kind"])
        assert obj["metadata"].get("namespace", "sie") == "sie"
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret",
            "ConfigMap"} <= kinds


def test_the_schema_check_catches_a_wrong_field(rendered):
    broken = yaml.safe_load(yaml.safe_dump(_one(rendered["cpu"], "Deployment", "sie-gateway")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
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


@pytest.mark.parametrize(("overlay", "kind"), [("gpu", "KIND_GPU"), ("cpu", "KIND_CPU")])
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
