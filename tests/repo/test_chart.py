"""The Helm chart, offline, with helm v3 and v4: lint, strict Kubernetes validation,
golden renders, refused values, and what the rendered objects promise.

Golden renders live in helm/tokenmesh/tests/golden/; after a deliberate chart
change, regenerate them with
``UPDATE_GOLDEN=1 .venv/bin/pytest -q tests/repo/test_chart.py -k golden``
and review the diff.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart import (
    ALERTS,
    API_KEYS_DIR,
    APP_VERSION,
    BIN,
    CERT_MANAGER_API,
    CHART,
    COMPONENTS,
    COREDNS_TTL_S,
    DASHBOARD,
    EXAMPLES,
    EXISTING_SECRETS,
    GATEWAY_EXAMPLE,
    GIVEN_ISSUER,
    GOLDEN,
    GPU,
    KEY_USAGES,
    KUBE_VERSIONS,
    KUBERNETES_DOC,
    METRICS_PORT,
    NAMESPACE,
    NEWEST,
    OPERATOR_API,
    RELEASE,
    ROOT,
    TLS_CASES,
    TLS_CERT_MANAGER,
    TLS_DIR,
    TLS_EXISTING,
    TLS_SERVER_NAME,
    VALUE_SETS,
    Overrides,
    arg,
    containers,
    deployment,
    helm_binary,
    labels_match,
    objects,
    overrides,
    pod_spec,
    render,
    render_monitoring,
    render_text,
    render_tls,
    run_template,
    selects,
    tokenmesh_containers,
    validation_errors,
)
from tokenmesh.router._quota_file import Limits, parse_quotas

# ------------------------------------------------- lint, validation, golden


def test_default_image_tag_is_the_package_version() -> None:
    # The chart deploys the tokenmesh it ships with (the image is built as that version).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert APP_VERSION == project["version"]


def test_examples_are_the_three_triton_modes_and_the_gateways_ingress() -> None:
    assert sorted(p.stem for p in (CHART / "examples").glob("*.yaml")) == sorted(EXAMPLES)
    modes = {
        name: yaml.safe_load((CHART / "examples" / f"{name}.yaml").read_text())["triton"]["mode"] for name in EXAMPLES
    }
    assert modes == {
        "cpu-embedded": "embedded",
        "external-triton": "external",
        "gpu-sidecar": "sidecar",
        GATEWAY_EXAMPLE: "embedded",
    }


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(helm: str, value_set: str) -> None:
    command = [str(helm_binary(helm)), "lint", "--strict", str(CHART), "--kube-version", NEWEST]
    if value_set != "defaults":
        command += ["--values", str(CHART / "examples" / f"{value_set}.yaml")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_lint_strict_with_tls(helm: str) -> None:
    # certManager needs the CRDs, which `helm lint` cannot be told of: existingSecret stands for both.
    command = [str(helm_binary(helm)), "lint", "--strict", str(CHART), "--kube-version", NEWEST]
    for key, value in TLS_EXISTING:
        command += ["--set-json", f"{key}={value}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_object_validates_strictly(helm: str, value_set: str, kube: str) -> None:
    docs = render(helm, value_set, kube=kube)
    kinds = sorted(doc["kind"] for doc in docs)
    # router, worker, prober and gateway; Services: the routers' two, the workers' headless one, the gateway's.
    assert kinds.count("Deployment") == 4 and kinds.count("Service") == 4
    assert validation_errors(docs, kube) == []


def test_strict_validation_rejects_a_misspelt_field() -> None:
    # What makes the test above worth having: a typo inside a probe is caught.
    docs = render("helm4", "defaults")
    pod_spec(docs, "router")["containers"][0]["readinessProbe"]["grpc"]["servce"] = "readiness"
    (error,) = validation_errors(docs, NEWEST)
    assert error.startswith(f"Deployment/{RELEASE}-router") and "'servce' was unexpected" in error


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_monitoring_objects_validate(helm: str, value_set: str, kube: str) -> None:
    docs = render_monitoring(helm, value_set, kube=kube)
    kinds = [doc["kind"] for doc in docs]
    assert [kinds.count(kind) for kind in ("PodMonitor", "PrometheusRule", "ConfigMap")] == [1, 1, 1]
    assert validation_errors(docs, kube) == []


def test_crd_shapes_reject_misspelt_and_mistyped_fields() -> None:
    # What makes the structural check worth having: the CRD objects are held to the same standard.
    docs = render_monitoring("helm4", "defaults")
    objects(docs, "PodMonitor")[RELEASE]["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    objects(docs, "PrometheusRule")[RELEASE]["spec"]["groups"][0]["rules"][0]["for"] = "2 minutes"
    objects(docs, "PrometheusRule")[RELEASE]["metadata"]["labels"]["release"] = ["prometheus"]
    errors = validation_errors(docs, NEWEST)
    assert len(errors) == 3, errors
    assert errors[0] == f"PodMonitor/{RELEASE}: .spec.podMetricsEndpoints[0].intervall: 'intervall' was unexpected"
    assert errors[1].startswith(f"PrometheusRule/{RELEASE}: .metadata.labels.release: ['prometheus'] does not match")
    assert errors[2].startswith(f"PrometheusRule/{RELEASE}: .spec.groups[0].rules[0].for: '2 minutes' does not match")


# name -> (value set, overrides, --api-versions): the examples, and the certManager objects.
GOLDEN_CASES: dict[str, tuple[str, Overrides, tuple[str, ...]]] = {
    **{example: (example, (), ()) for example in EXAMPLES},
    "tls-cert-manager": ("defaults", TLS_CERT_MANAGER, (CERT_MANAGER_API,)),
}


@pytest.mark.parametrize("example", GOLDEN_CASES)
def test_golden_render(helm: str, example: str) -> None:
    value_set, extra, api_versions = GOLDEN_CASES[example]
    rendered = render_text(helm, value_set, extra, api_versions=api_versions)
    golden = GOLDEN / f"{example}.yaml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered)
    expected = golden.read_text() if golden.is_file() else ""
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(True), rendered.splitlines(True), str(golden.relative_to(ROOT)), f"{helm} template", n=2
        )
    )
    if diff:
        pytest.fail(
            f"the render of {example} ({value_set} {extra}) changed; if that is meant, regenerate with "
            f"UPDATE_GOLDEN=1 .venv/bin/pytest -q tests/repo/test_chart.py -k golden\n{diff[:6000]}"
        )


# ----------------------------------------------------------- refused values

SIDECAR_IMAGE = {"repository": "nvcr.io/nvidia/tritonserver", "tag": "25.01-vllm-python-py3"}
BAD_VALUES = {
    "negative-gpu-count": (overrides(worker__gpus=-1), "worker.gpus"),
    "sidecar-without-image": (
        overrides(triton__mode="sidecar", triton__modelRepository__volume={"emptyDir": {}}),
        "triton.image",
    ),
    "sidecar-without-model-repository": (
        overrides(triton__mode="sidecar", triton__image=SIDECAR_IMAGE),
        "triton.modelRepository.volume",
    ),
    "worker-grace-shorter-than-drain": (
        overrides(worker__terminationGracePeriodSeconds=49),
        "worker.terminationGracePeriodSeconds",
    ),
    "router-grace-shorter-than-drain": (
        overrides(router__drain__graceSeconds=45),
        "router.terminationGracePeriodSeconds",
    ),
    "prestop-shorter-than-discovery": (
        overrides(worker__drain__preStopSleepSeconds=14),
        "worker.drain.preStopSleepSeconds",
    ),
    "unknown-top-level-key": (overrides(replicas=3), "replicas"),
    "misspelt-nested-key": (overrides(worker__gpu=1), "gpu"),
    "unknown-triton-mode": (overrides(triton__mode="remote"), "triton.mode"),
    "latest-image-tag": (overrides(image__tag="latest"), "image.tag"),
    "pdb-allowing-no-disruption": (overrides(worker__pdb__maxUnavailable=0), "worker.pdb.maxUnavailable"),
    "liveness-failing-at-once": (
        overrides(router__probes__liveness__failureThreshold=1),
        "router.probes.liveness.failureThreshold",
    ),
    "external-without-url": (overrides(triton__mode="external"), "triton.external.url"),
    "external-with-gpus": (
        overrides(triton__mode="external", triton__external__url="triton:8001", worker__gpus=1),
        "worker.gpus",
    ),
    "autoscaling-without-cpu-request": (
        overrides(router__autoscaling__enabled=True, router__resources__requests=None),
        "router.resources.requests.cpu",
    ),
    # Rendered without --api-versions: a cluster without the Prometheus Operator.
    "podmonitor-without-operator-crds": (
        overrides(monitoring__podMonitor__enabled=True),
        "monitoring.podMonitor.enabled",
    ),
    "prometheusrule-without-operator-crds": (
        overrides(monitoring__prometheusRule__enabled=True),
        "monitoring.prometheusRule.enabled",
    ),
    "metrics-port-on-the-health-port": (overrides(metrics__port=8081), "metrics.port"),
    "metrics-port-on-the-router-port": (overrides(metrics__port=50051), "metrics.port"),
    "metrics-port-on-tritons-port": (
        overrides(
            triton__mode="sidecar",
            triton__image=SIDECAR_IMAGE,
            triton__modelRepository__volume={"emptyDir": {}},
            metrics__port=8002,
        ),
        "metrics.port",
    ),
    "tenant-with-a-comma": (overrides(metrics__tenants=["acme,globex"]), "metrics.tenants"),
    "unknown-log-format": (overrides(logFormat="yaml"), "logFormat"),
    "scrape-interval-not-a-duration": (
        overrides(monitoring__podMonitor__interval="15 seconds"),
        "monitoring.podMonitor.interval",
    ),
    "misspelt-monitoring-key": (overrides(monitoring__podMonitor__enable=True), "enable"),
    "unknown-tls-mode": (overrides(tls__mode="spiffe"), "tls.mode"),
    "unknown-tls-service-mode": (overrides(tls__serviceMode="off"), "tls.serviceMode"),
    "existing-secret-without-names": (overrides(tls__mode="existingSecret"), "tls.existingSecrets.router"),
    "existing-secret-without-the-probers": (
        overrides(
            tls__mode="existingSecret", tls__existingSecrets={"router": "mesh-router-tls", "worker": "mesh-worker-tls"}
        ),
        "tls.existingSecrets.prober",
    ),
    # Rendered without --api-versions: a cluster without cert-manager.
    "cert-manager-without-its-crds": (TLS_CERT_MANAGER, "tls.mode"),
    "certificate-duration-in-days": (overrides(tls__certManager__duration="90d"), "tls.certManager.duration"),
    "misspelt-tls-key": (overrides(tls__existingSecret={"router": "mesh-router-tls"}), "existingSecret"),
    # The gateway's (on by default).
    "gateway-grace-shorter-than-drain": (
        overrides(gateway__terminationGracePeriodSeconds=43),  # 10 + 30 + 2 + 2 = 44
        "gateway.terminationGracePeriodSeconds",
    ),
    "gateway-port-on-the-health-port": (overrides(gateway__port=8081), "gateway.port"),
    "metrics-port-on-the-gateway-port": (overrides(metrics__port=8000), "metrics.port"),
    "gateway-autoscaling-without-cpu-request": (
        overrides(gateway__autoscaling__enabled=True, gateway__resources__requests=None),
        "gateway.resources.requests.cpu",
    ),
    "gateway-ingress-without-host": (overrides(gateway__ingress__enabled=True), "gateway.ingress.host"),
    "cors-origin-with-a-path": (overrides(gateway__corsOrigins=["https://app.example/"]), "gateway.corsOrigins"),
    "gateway-open-to-no-one-named": (overrides(networkPolicy__gatewayFrom=[]), "networkPolicy.gatewayFrom"),
    "existing-secret-without-the-gateways": (
        overrides(
            tls__mode="existingSecret",
            tls__existingSecrets={c: f"mesh-{c}-tls" for c in ("router", "worker", "prober")},
        ),
        "tls.existingSecrets.gateway",
    ),
    "misspelt-gateway-key": (overrides(gateway__replica=3), "replica"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_fail_naming_the_value(helm: str, case: str) -> None:
    extra, name = BAD_VALUES[case]
    done = run_template(helm, "defaults", extra)
    assert done.returncode != 0, f"rendered despite {extra}"
    # helm v3 names schema errors worker.gpus, helm v4 /worker/gpus.
    pointer = "/" + name.replace(".", "/")
    assert name in done.stderr or pointer in done.stderr, done.stderr


def test_pod_monitor_needs_the_metrics_it_scrapes(helm: str) -> None:
    done = run_template(
        helm,
        "defaults",
        overrides(monitoring__podMonitor__enabled=True, metrics__enabled=False),
        api_versions=(OPERATOR_API,),
    )
    assert done.returncode != 0
    assert "monitoring.podMonitor.enabled needs metrics.enabled" in done.stderr, done.stderr


def test_crd_refusal_says_what_to_install(helm: str) -> None:
    done = run_template(helm, "defaults", overrides(monitoring__podMonitor__enabled=True))
    assert "Prometheus Operator" in done.stderr and OPERATOR_API in done.stderr, done.stderr
    done = run_template(helm, "defaults", TLS_CERT_MANAGER)
    assert "install cert-manager" in done.stderr and CERT_MANAGER_API in done.stderr, done.stderr


def test_drain_budget_at_its_limit_renders(helm: str) -> None:
    # 20 s preStop + 30 s drain = 50 s: exactly enough is accepted.
    docs = render(helm, "defaults", overrides(worker__terminationGracePeriodSeconds=50))
    assert pod_spec(docs, "worker")["terminationGracePeriodSeconds"] == 50


# ------------------------------------------------------ what objects promise


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_probes_are_grpc_on_the_numeric_health_port(helm: str, value_set: str) -> None:
    # The gateway's are HTTP (/health on the same port number): tests/repo/test_chart_gateway.py.
    for container in [c for c in tokenmesh_containers(render(helm, value_set)) if c["args"][0] != "gateway"]:
        port = int(arg(container, "--health-port"))
        assert {"name": "health", "containerPort": port} in container["ports"]
        for probe, service in (
            ("startupProbe", "readiness"),
            ("readinessProbe", "readiness"),
            ("livenessProbe", "liveness"),
        ):
            assert container[probe]["grpc"] == {"port": port, "service": service}, (container["name"], probe)
        # A drain flips readiness only; one slow answer must not restart the pod.
        assert container["livenessProbe"]["failureThreshold"] >= 2


@pytest.mark.parametrize("value_set", ["defaults", "cpu-embedded", "gpu-sidecar"])
def test_workers_that_load_a_model_get_at_least_ten_minutes_to_start(helm: str, value_set: str) -> None:
    docs = render(helm, value_set)
    for container in containers(pod_spec(docs, "worker")):
        startup = container["startupProbe"]
        budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
        assert budget >= 600, (container["name"], startup)


def test_triton_sidecar_is_native_with_shm_and_model_repository(helm: str) -> None:
    example = yaml.safe_load((CHART / "examples" / "gpu-sidecar.yaml").read_text())
    spec = pod_spec(render(helm, "gpu-sidecar"), "worker")
    (triton,) = spec["initContainers"]
    assert triton["restartPolicy"] == "Always"
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:25.01-vllm-python-py3"
    assert triton["args"][:5] == [
        "tritonserver",
        "--model-repository=/models",
        "--grpc-port=8001",
        "--http-port=8000",
        "--metrics-port=8002",
    ]
    assert triton["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8000}
    assert triton["livenessProbe"]["failureThreshold"] >= 2
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in triton["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert mounts["/models"]["readOnly"] is True
    models = dict(volumes[mounts["/models"]["name"]])
    models.pop("name")
    assert models == example["triton"]["modelRepository"]["volume"]
    # The example's ConfigMap is made from the vLLM repository beside it (its header says how).
    for item in models["configMap"]["items"]:
        assert (CHART / "examples" / "vllm-model-repository" / item["path"]).is_file(), item
    (worker,) = spec["containers"]
    assert arg(worker, "--triton-url") == "127.0.0.1:8001"
    assert arg(worker, "--triton-metrics-url") == "http://127.0.0.1:8002/metrics"


def gpu_limits(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """GPU limits by container name; a GPU request without the limit is a chart bug."""
    every = [c for doc in objects(docs, "Deployment").values() for c in containers(doc["spec"]["template"]["spec"])]
    assert not [c["name"] for c in every if GPU in c.get("resources", {}).get("requests", {})]
    return {c["name"]: c["resources"]["limits"][GPU] for c in every if GPU in c.get("resources", {}).get("limits", {})}


def test_gpus_are_limits_only_where_asked(helm: str) -> None:
    for value_set in ("defaults", "cpu-embedded", "external-triton"):
        assert gpu_limits(render(helm, value_set)) == {}, value_set
    # Sidecar: the container that runs Triton holds the GPU, not the worker.
    assert gpu_limits(render(helm, "gpu-sidecar")) == {"triton": 1}
    embedded = render(helm, "cpu-embedded", overrides(worker__gpus=2))
    assert gpu_limits(embedded) == {"worker": 2}
    # The example's own limits stay beside the GPU.
    assert pod_spec(embedded, "worker")["containers"][0]["resources"]["limits"] == {"memory": "2Gi", GPU: 2}


def allowed_disruptions(pdb: dict[str, Any], replicas: int) -> int:
    """How many of `replicas` healthy pods the budget lets a drain evict (Kubernetes' rounding)."""
    spec = pdb["spec"]
    assert "minAvailable" not in spec, f"{pdb['metadata']['name']}: minAvailable blocks a one-replica drain"
    budget = spec["maxUnavailable"]
    if isinstance(budget, str):
        return math.ceil(replicas * int(budget.rstrip("%")) / 100)
    return min(int(budget), replicas)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pdbs_never_block_a_one_replica_drain(helm: str, value_set: str) -> None:
    docs = render(helm, value_set, overrides(router__replicas=1, worker__replicas=1, gateway__replicas=1))
    pdbs = objects(docs, "PodDisruptionBudget")
    assert sorted(pdbs) == [f"{RELEASE}-gateway", f"{RELEASE}-router", f"{RELEASE}-worker"]
    for name, pdb in pdbs.items():
        pods = [
            d
            for d in objects(docs, "Deployment").values()
            if labels_match(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert [d["metadata"]["name"] for d in pods] == [name]
        assert allowed_disruptions(pdb, 1) >= 1


def test_percentage_pdb_still_lets_one_pod_go(helm: str) -> None:
    docs = render(helm, "defaults", overrides(worker__replicas=1, worker__pdb__maxUnavailable="10%"))
    assert allowed_disruptions(objects(docs, "PodDisruptionBudget")[f"{RELEASE}-worker"], 1) == 1


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_drain_fits_in_the_termination_grace(helm: str, value_set: str) -> None:
    docs = render(helm, value_set)
    interval = float(arg(pod_spec(docs, "router")["containers"][0], "--discovery-interval-s"))
    for component in ("router", "worker"):
        spec = pod_spec(docs, component)
        (container,) = spec["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        sleep = float(command[1])
        assert sleep >= 2 * interval + COREDNS_TTL_S, "the pod stops before routers' discovery drops it"
        assert spec["terminationGracePeriodSeconds"] >= sleep + float(arg(container, "--drain-grace-s"))


def test_rollouts_never_lose_routers_nor_wait_for_spare_gpus(helm: str) -> None:
    docs = render(helm, "gpu-sidecar")
    assert deployment(docs, "router")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert deployment(docs, "worker")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    prober = deployment(docs, "prober")["spec"]
    assert prober["strategy"] == {"type": "Recreate"} and prober["replicas"] == 1


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_run_restricted(helm: str, value_set: str) -> None:
    for doc in objects(render(helm, value_set), "Deployment").values():
        spec = doc["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for container in containers(spec):
            where = f"{doc['metadata']['name']}/{container['name']}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert context.get("runAsUser", spec["securityContext"]["runAsUser"]) > 0, where
            tmp = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1 and tmp[0] in empty_dirs, where
            image_tag = container["image"].rsplit(":", 1)[-1]
            assert ":" in container["image"] and image_tag != "latest", where
            assert "command" not in container, f"{where}: the image's ENTRYPOINT runs"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_discovery_names_are_the_charts_headless_services(helm: str, value_set: str) -> None:
    docs = render(helm, value_set)
    services = objects(docs, "Service")

    def service_for(address: str, component: str) -> None:
        host, port = address.rsplit(":", 1)
        name, namespace, rest = host.split(".", 2)
        assert (namespace, rest) == (NAMESPACE, "svc.cluster.local")
        service = services[name]["spec"]
        assert service["clusterIP"] == "None"
        (target,) = [c for c in pod_spec(docs, component)["containers"] if c["name"] == component]
        assert labels_match(service["selector"], deployment(docs, component)["spec"]["template"]["metadata"]["labels"])
        assert {"name": "grpc", "containerPort": int(port)} in target["ports"]
        assert service["ports"][0]["port"] == int(port)

    router = pod_spec(docs, "router")["containers"][0]
    prober = pod_spec(docs, "prober")["containers"][0]
    assert arg(router, "--discovery") == arg(prober, "--discovery") == "dns"
    service_for(arg(router, "--workers"), "worker")
    service_for(arg(prober, "--workers"), "worker")
    service_for(arg(prober, "--routers"), "router")
    callers = services[f"{RELEASE}-router"]["spec"]
    assert callers["type"] == "ClusterIP" and "clusterIP" not in callers
    assert labels_match(callers["selector"], deployment(docs, "router")["spec"]["template"]["metadata"]["labels"])


SCHEDULING = ("runtimeClassName", "nodeSelector", "tolerations", "affinity")


def test_scheduling_is_passed_through_and_empty_by_default(helm: str) -> None:
    for doc in objects(render(helm, "defaults"), "Deployment").values():
        assert not set(SCHEDULING) & set(doc["spec"]["template"]["spec"]), doc["metadata"]["name"]
    wanted = {
        "runtimeClassName": "nvidia",
        "nodeSelector": {"pool": "h200"},
        "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["h200"]}]}]
                }
            }
        },
    }
    docs = render(helm, "defaults", overrides(**{f"worker__{key}": value for key, value in wanted.items()}))
    assert {key: pod_spec(docs, "worker")[key] for key in SCHEDULING} == wanted
    assert not set(SCHEDULING) & set(pod_spec(docs, "router"))


def test_router_autoscaling_is_optional(helm: str) -> None:
    defaults = render(helm, "defaults")
    assert objects(defaults, "HorizontalPodAutoscaler") == {}
    assert deployment(defaults, "router")["spec"]["replicas"] == 2
    docs = render(helm, "gpu-sidecar")
    hpa = objects(docs, "HorizontalPodAutoscaler")[f"{RELEASE}-router"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{RELEASE}-router"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    # The autoscaler owns the count: a replicas field would reset it on every upgrade.
    assert "replicas" not in deployment(docs, "router")["spec"]


def test_network_policies_are_optional_and_open_only_the_mesh_paths(helm: str) -> None:
    assert objects(render(helm, "defaults"), "NetworkPolicy") == {}
    docs = render(helm, "gpu-sidecar")
    example = yaml.safe_load((CHART / "examples" / "gpu-sidecar.yaml").read_text())["networkPolicy"]
    policies = objects(docs, "NetworkPolicy")
    assert sorted(policies) == [f"{RELEASE}-{c}" for c in sorted(COMPONENTS)]
    pod_labels = {c: deployment(docs, c)["spec"]["template"]["metadata"]["labels"] for c in COMPONENTS}

    def sources(component: str, port: int) -> list[Any]:
        policy = policies[f"{RELEASE}-{component}"]["spec"]
        assert labels_match(policy["podSelector"]["matchLabels"], pod_labels[component])
        rules = [r for r in policy["ingress"] if {"port": port, "protocol": "TCP"} in r["ports"]]
        return [peer for r in rules for peer in r.get("from", [{"anyone": True}])]

    def components(peers: list[Any]) -> set[str]:
        return {
            c
            for peer in peers
            if "podSelector" in peer
            for c, labels in pod_labels.items()
            if labels_match(peer["podSelector"]["matchLabels"], labels)
        }

    assert example["callers"][0] in sources("router", 50051)
    assert components(sources("router", 50051)) == {"prober", "gateway"}
    assert components(sources("worker", 50061)) == {"router", "prober"}
    assert sources("worker", 8002) == example["metricsFrom"]
    # The gateway's port: the ingress controller's namespace alone (the default networkPolicy.gatewayFrom).
    assert sources("gateway", 8000) == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    ]
    for component in COMPONENTS:
        assert sources(component, 8081) == [{"anyone": True}], "the kubelet's probes come from the node"
        assert sources(component, METRICS_PORT) == example["metricsFrom"], f"{component}: metrics not scrapable"

    # Without metrics, no metrics port is opened (Triton's stays).
    off = objects(render(helm, "gpu-sidecar", overrides(metrics__enabled=False)), "NetworkPolicy")
    ports = {
        name: [port for rule in policy["spec"]["ingress"] for port in rule["ports"]] for name, policy in off.items()
    }
    assert not [name for name, found in ports.items() if {"port": METRICS_PORT, "protocol": "TCP"} in found]
    assert {"port": 8002, "protocol": "TCP"} in ports[f"{RELEASE}-worker"]
    # Nor without anyone to scrape them (metricsFrom empty = no one).
    closed = render(helm, "gpu-sidecar", overrides(networkPolicy__metricsFrom=[]))
    for name, policy in objects(closed, "NetworkPolicy").items():
        assert not [r for r in policy["spec"]["ingress"] if {"port": METRICS_PORT, "protocol": "TCP"} in r["ports"]], (
            name
        )


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_tokenmesh_container_serves_metrics(helm: str, value_set: str) -> None:
    for container in tokenmesh_containers(render(helm, value_set)):
        assert arg(container, "--metrics-port") == str(METRICS_PORT)
        assert {"name": "metrics", "containerPort": METRICS_PORT} in container["ports"]
        assert not [a for a in container["args"] if a.startswith("--metrics-tenants")], "no tenants by default"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["TOKENMESH_LOG_LEVEL"], env["TOKENMESH_LOG_FORMAT"]) == ("INFO", "text")


def test_metrics_values_reach_every_container(helm: str) -> None:
    docs = render(
        helm, "gpu-sidecar", overrides(metrics__port=9100, metrics__tenants=["acme", "globex"], logFormat="json")
    )
    for container in tokenmesh_containers(docs):
        assert arg(container, "--metrics-port") == "9100"
        assert {"name": "metrics", "containerPort": 9100} in container["ports"]
        assert {"name": "TOKENMESH_LOG_FORMAT", "value": "json"} in container["env"]
        tenants = [a for a in container["args"] if a.startswith("--metrics-tenants")]
        assert tenants == (["--metrics-tenants=acme,globex"] if container["args"][0] == "router" else [])
    # Triton's own metrics port is not the tokenmesh one.
    (triton,) = pod_spec(docs, "worker")["initContainers"]
    assert [p["name"] for p in triton["ports"]] == ["triton-http", "triton-grpc", "triton-metrics"]

    off = render(helm, "defaults", overrides(metrics__enabled=False, metrics__tenants=["acme"]))
    for container in tokenmesh_containers(off):
        assert not [a for a in container["args"] if a.startswith("--metrics")], container["args"]
        assert "metrics" not in [p["name"] for p in container["ports"]]


def test_monitoring_objects_are_off_by_default(helm: str) -> None:
    kinds = {doc["kind"] for doc in render(helm, "defaults")}
    assert not kinds & {"PodMonitor", "PrometheusRule", "ConfigMap"}


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name: doc["spec"]["template"]["metadata"]["labels"] for name, doc in objects(docs, "Deployment").items()}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pod_monitor_scrapes_the_metrics_port_of_every_tokenmesh_pod(helm: str, value_set: str) -> None:
    docs = render_monitoring(helm, value_set, overrides(monitoring__podMonitor__labels={"release": "prometheus"}))
    (monitor,) = objects(docs, "PodMonitor").values()
    # Prometheus' podMonitorSelector picks it by the labels given; the chart's own stay.
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    spec = monitor["spec"]
    assert spec["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert "namespaceSelector" not in spec, "the PodMonitor's own namespace: the release's"
    selected = sorted(name for name, labels in pod_labels(docs).items() if selects(spec["selector"], labels))
    assert selected == [f"{RELEASE}-{c}" for c in sorted(COMPONENTS)]
    for name in selected:
        ports = [
            p
            for c in containers(pod_spec(docs, name.removeprefix(f"{RELEASE}-")))
            for p in c.get("ports", [])
            if p["name"] == "metrics"
        ]
        assert ports == [{"name": "metrics", "containerPort": METRICS_PORT}], name
    # Another release's pods (or a pod of another component) are not scraped twice.
    router = pod_labels(docs)[f"{RELEASE}-router"]
    assert not selects(spec["selector"], {**router, "app.kubernetes.io/instance": "other"})
    assert not selects(spec["selector"], {**router, "app.kubernetes.io/component": "mesh"})


def test_pod_monitor_interval_is_a_value(helm: str) -> None:
    docs = render_monitoring(helm, "defaults", overrides(monitoring__podMonitor__interval="1m30s"))
    (monitor,) = objects(docs, "PodMonitor").values()
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "1m30s"


def test_prometheus_rule_is_the_alerts_file(helm: str) -> None:
    docs = render_monitoring(helm, "defaults", overrides(monitoring__prometheusRule__labels={"role": "alert-rules"}))
    (rule,) = objects(docs, "PrometheusRule").values()
    assert rule["metadata"]["labels"]["role"] == "alert-rules"
    assert rule["spec"] == {"groups": yaml.safe_load(ALERTS.read_text())["groups"]}
    for group in rule["spec"]["groups"]:
        for each in group["rules"]:
            assert ("alert" in each) != ("record" in each), each
    # The file is the single source: no template holds a copy of a rule.
    for template in (CHART / "templates").iterdir():
        assert "TokenmeshWorkerDown" not in template.read_text(), template.name


def test_grafana_dashboard_is_a_config_map_for_the_sidecar(helm: str) -> None:
    docs = render_monitoring(helm, "defaults")
    (config_map,) = objects(docs, "ConfigMap").values()
    metadata = config_map["metadata"]
    assert metadata["labels"]["grafana_dashboard"] == "1"
    assert metadata["namespace"] == NAMESPACE
    assert config_map["data"] == {"tokenmesh.json": DASHBOARD.read_text().rstrip("\n")}
    assert json.loads(config_map["data"]["tokenmesh.json"])["uid"] == "tokenmesh"
    # No CRD involved: it renders without the operator, in Grafana's namespace when asked, with its label.
    elsewhere = render(
        helm,
        "defaults",
        overrides(
            monitoring__grafanaDashboard__enabled=True,
            monitoring__grafanaDashboard__namespace="monitoring",
            monitoring__grafanaDashboard__labels={"dashboards": "tokenmesh"},
        ),
    )
    (config_map,) = objects(elsewhere, "ConfigMap").values()
    assert config_map["metadata"]["namespace"] == "monitoring"
    # helm merges the given labels into the default one.
    assert {"grafana_dashboard": "1", "dashboards": "tokenmesh"}.items() <= config_map["metadata"]["labels"].items()
    assert validation_errors(elsewhere, NEWEST) == []


# -------------------------------------------------------------------- TLS


def tls_volume(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """The volume mounted at TLS_DIR in the container: exactly one mount, read-only, the whole volume."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"].startswith(TLS_DIR)]
    assert mount["mountPath"] == TLS_DIR and mount.get("readOnly") is True, mount
    # A subPath mount is a copy made at start: renewed certificates would never reach the pod.
    assert "subPath" not in mount and "subPathExpr" not in mount, mount
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume


def leaf_certificates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The components' Certificates by component (their identity), the CA's left out."""
    found = {}
    for certificate in objects(docs, "Certificate").values():
        if certificate["spec"].get("isCA"):
            continue
        (uri,) = certificate["spec"]["uris"]
        found[uri.removeprefix("spiffe://tokenmesh/")] = certificate
    return found


def test_tls_is_off_by_default(helm: str) -> None:
    for value_set in VALUE_SETS:
        docs = render(helm, value_set)
        assert not {"Certificate", "Issuer"} & {doc["kind"] for doc in docs}
        for doc in objects(docs, "Deployment").values():
            spec = doc["spec"]["template"]["spec"]
            # No Secret but the gateway's API keys (examples/gateway-ingress.yaml).
            secrets = [v["name"] for v in spec["volumes"] if "secret" in v]
            assert secrets in ([], ["api-keys"]), doc["metadata"]["name"]
            for container in containers(spec):
                assert not [a for a in container.get("args", []) if a.startswith("--tls")], container["args"]
                assert not [m for m in container["volumeMounts"] if m["mountPath"].startswith(TLS_DIR)]


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("case", TLS_CASES)
def test_tls_objects_validate(helm: str, case: str, kube: str) -> None:
    docs = render_tls(helm, case, kube)
    kinds = [doc["kind"] for doc in docs]
    own_ca = case == "cert-manager"
    # One per component (the gateway's too), and the chart's own CA's.
    expected = {"existing-secret": 0, "existing-secret-tls-only": 0, "cert-manager": 5, "cert-manager-given-issuer": 4}[
        case
    ]
    assert (kinds.count("Certificate"), kinds.count("Issuer")) == (expected, 2 if own_ca else 0)
    assert validation_errors(docs, kube) == []


@pytest.mark.parametrize("case", TLS_CASES)
def test_every_tokenmesh_container_gets_its_own_certificate_directory(helm: str, case: str) -> None:
    docs = render_tls(helm, case)
    _, extra, _ = TLS_CASES[case]
    service_mode = "tls" if ("tls.serviceMode", '"tls"') in extra else "mtls"
    certificates = leaf_certificates(docs)
    secrets = {}
    for component in COMPONENTS:
        spec = pod_spec(docs, component)
        (container,) = [c for c in spec["containers"] if c["name"] == component]
        assert arg(container, "--tls-mode") == service_mode
        assert (arg(container, "--tls-cert"), arg(container, "--tls-key"), arg(container, "--tls-ca")) == (
            f"{TLS_DIR}/tls.crt",
            f"{TLS_DIR}/tls.key",
            f"{TLS_DIR}/ca.crt",
        )
        # Routers, the prober and the gateway reach pods by IP: they verify the name every certificate carries.
        names = [a for a in container["args"] if a.startswith("--tls-server-name")]
        assert names == ([] if component == "worker" else [f"--tls-server-name={TLS_SERVER_NAME}"])
        volume = tls_volume(spec, container)
        assert set(volume) == {"name", "secret"}, volume
        assert "items" not in volume["secret"], "the whole Secret: tls.crt, tls.key and ca.crt"
        secrets[component] = volume["secret"]["secretName"]
        if certificates:
            assert secrets[component] == certificates[component]["spec"]["secretName"]
        # No other container (the Triton sidecar) sees the key; the probes stay plaintext (gRPC, the gateway's HTTP).
        for other in containers(spec):
            if other is not container:
                assert volume["name"] not in [m["name"] for m in other["volumeMounts"]], other["name"]
        readiness = container["readinessProbe"]
        if component == "gateway":
            assert readiness["httpGet"] == {"path": "/health", "port": "health"} and "scheme" not in readiness
            assert {"name": "health", "containerPort": int(arg(container, "--health-port"))} in container["ports"]
        else:
            assert readiness["grpc"]["port"] == int(arg(container, "--health-port"))
    if not certificates:
        assert secrets == EXISTING_SECRETS
    assert len(set(secrets.values())) == len(COMPONENTS), "one identity per component"


def test_cert_manager_certificates_carry_identity_and_names(helm: str) -> None:
    docs = render_tls(helm, "cert-manager")
    services = objects(docs, "Service")
    certificates = leaf_certificates(docs)
    assert sorted(certificates) == sorted(COMPONENTS)
    for component, certificate in certificates.items():
        spec = certificate["spec"]
        assert spec["uris"] == [f"spiffe://tokenmesh/{component}"]
        assert spec["usages"] == ["server auth", "client auth", "digital signature", "key encipherment"]
        assert (spec["duration"], spec["renewBefore"]) == ("2160h", "720h")
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        assert TLS_SERVER_NAME in spec["dnsNames"]
        # And the names of the component's Services, short to fully qualified.
        labels = deployment(docs, component)["spec"]["template"]["metadata"]["labels"]
        own = [name for name, service in services.items() if labels_match(service["spec"]["selector"], labels)]
        assert len(own) == {"router": 2, "worker": 1, "prober": 0, "gateway": 1}[component]
        assert sorted(spec["dnsNames"]) == sorted(
            [
                TLS_SERVER_NAME,
                *(
                    f"{name}{suffix}"
                    for name in own
                    for suffix in ("", f".{NAMESPACE}", f".{NAMESPACE}.svc", f".{NAMESPACE}.svc.cluster.local")
                ),
            ]
        )

    # The chart's own CA, cert-manager's bootstrap: self-signed Issuer -> CA Certificate -> CA Issuer.
    issuers = objects(docs, "Issuer")
    ((ca_name, ca),) = [(name, c) for name, c in objects(docs, "Certificate").items() if c["spec"].get("isCA")]
    assert ca_name == f"{RELEASE}-ca" and ca["spec"]["isCA"] is True
    assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never", "a renewed CA keeps what it signed trusted"
    assert ca["spec"]["duration"] == "87600h"
    self_signed = issuers[ca["spec"]["issuerRef"]["name"]]
    assert ca["spec"]["issuerRef"]["kind"] == "Issuer" and self_signed["spec"] == {"selfSigned": {}}
    for certificate in certificates.values():
        ref = certificate["spec"]["issuerRef"]
        assert (ref["kind"], ref["group"]) == ("Issuer", "cert-manager.io")
        assert issuers[ref["name"]]["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    assert len(issuers) == 2


def test_cert_manager_values_reach_the_certificates(helm: str) -> None:
    docs = render_tls(helm, "cert-manager-given-issuer")
    assert objects(docs, "Issuer") == {}, "the given issuer replaces the chart's CA"
    for certificate in objects(docs, "Certificate").values():
        assert certificate["spec"]["issuerRef"] == GIVEN_ISSUER and not certificate["spec"].get("isCA")
    values = overrides(
        tls__certManager__duration="720h",
        tls__certManager__renewBefore="240h",
        tls__certManager__ca__duration="43800h",
        tls__certManager__issuerRef={"name": ""},
        discovery__clusterDomain="mesh.example",
    )
    docs = render(helm, "defaults", TLS_CERT_MANAGER + values, api_versions=(CERT_MANAGER_API,))
    for certificate in objects(docs, "Certificate").values():
        spec = certificate["spec"]
        if spec.get("isCA"):
            assert spec["duration"] == "43800h"
            continue
        assert (spec["duration"], spec["renewBefore"]) == ("720h", "240h")
        assert spec["issuerRef"] == {"name": f"{RELEASE}-ca", "kind": "Issuer", "group": "cert-manager.io"}
        assert not [name for name in spec["dnsNames"] if name.endswith("cluster.local")]
    router = leaf_certificates(docs)["router"]["spec"]["dnsNames"]
    assert f"{RELEASE}-router.{NAMESPACE}.svc.mesh.example" in router


def test_crd_shapes_hold_certificates_and_issuers_too() -> None:
    docs = render_tls("helm4", "cert-manager")
    objects(docs, "Certificate")[f"{RELEASE}-router"]["spec"]["secretNme"] = "typo"
    objects(docs, "Certificate")[f"{RELEASE}-worker"]["spec"]["usages"].append("server-auth")
    objects(docs, "Issuer")[f"{RELEASE}-ca"]["spec"]["selfSigned"] = {}
    errors = validation_errors(docs, NEWEST)
    assert sorted(errors) == [
        f"Certificate/{RELEASE}-router: .spec.secretNme: 'secretNme' was unexpected",
        f"Certificate/{RELEASE}-worker: .spec.usages[4]: 'server-auth' is not one of {sorted(KEY_USAGES)}",
        f"Issuer/{RELEASE}-ca: .spec: {objects(docs, 'Issuer')[f'{RELEASE}-ca']['spec']!r} fits no shape",
    ], errors


def test_config_check_reads_the_certificate_files() -> None:
    # Why the args check points the paths at real files: the mount paths alone fail here.
    router = pod_spec(render_tls("helm4", "existing-secret"), "router")["containers"][0]
    done = subprocess.run(
        [str(BIN / "tokenmesh"), *router["args"], "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and f"--tls-cert {TLS_DIR}/tls.crt" in done.stderr, done.stderr


# ------------------------------------------- the services accept the args


CONFIG_CASES: dict[str, tuple[str, Overrides, tuple[str, ...]]] = {
    **{value_set: (value_set, (), ()) for value_set in VALUE_SETS},
    "metrics-tenants-json-logs": (
        "defaults",
        overrides(metrics__port=9100, metrics__tenants=["acme", "globex"], logFormat="json"),
        (),
    ),
    "metrics-off": ("gpu-sidecar", overrides(metrics__enabled=False), ()),
    "gateway-options": (
        "defaults",
        overrides(
            gateway__defaultModel="smollm2",
            gateway__corsOrigins=["https://chat.example.com", "http://localhost:5173"],
            gateway__apiKeys__existingSecret="keys",
            gateway__extraArgs=["--timeout-s=600"],
        ),
        (),
    ),
    **{f"tls-{name}": case for name, case in TLS_CASES.items()},
}


@pytest.fixture(scope="module")
def tls_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per component, a folder shaped like its mounted kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt)."""
    base = tmp_path_factory.mktemp("tls")
    done = subprocess.run(
        [str(BIN / "tokenmesh"), "certs", "--out", str(base / "made"), "--host", TLS_SERVER_NAME],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    dirs = {}
    for component in COMPONENTS:
        folder = dirs[component] = base / component
        folder.mkdir()
        for made, mounted in ((f"{component}.crt", "tls.crt"), (f"{component}.key", "tls.key"), ("ca.crt", "ca.crt")):
            (folder / mounted).write_bytes((base / "made" / made).read_bytes())
    return dirs


@pytest.fixture(scope="module")
def api_keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder shaped like the gateway's mounted API keys Secret (its key `api-keys`: the keys file)."""
    folder = tmp_path_factory.mktemp("api-keys")
    (folder / "api-keys").write_text(f"{'ab' * 32} team-a\n")
    return folder


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_container_args_pass_the_real_config_check(case: str, tls_dirs: dict[str, Path], api_keys_dir: Path) -> None:
    # The renders of both helms are byte-identical (test_golden_render), so one suffices.
    value_set, extra, api_versions = CONFIG_CASES[case]
    for container in tokenmesh_containers(render("helm4", value_set, extra, api_versions=api_versions)):
        env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
        # --check-config reads the certificate files and the keys file: the mounted Secrets' paths point at
        # real ones here.
        args = [
            a.replace(f"{TLS_DIR}/", f"{tls_dirs[container['args'][0]]}/").replace(
                f"{API_KEYS_DIR}/", f"{api_keys_dir}/"
            )
            for a in container["args"]
        ]
        done = subprocess.run(
            [str(BIN / "tokenmesh"), *args, "--check-config"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"{container['name']} {args}:\n{done.stderr}"
        if case.startswith("tls-"):
            assert f"tls_cert = '{tls_dirs[args[0]]}/tls.crt'" in done.stdout, done.stdout


# ------------------------------------------------------ schema, notes, docs


def test_values_schema_is_draft_07_and_self_contained() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["additionalProperties"] is False

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [*([node["$ref"]] if "$ref" in node else []), *(r for v in node.values() for r in refs(v))]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    found = refs(schema)
    assert found
    for ref in found:
        assert ref.startswith("#/definitions/") and ref.removeprefix("#/definitions/") in schema["definitions"], ref


def test_notes_tell_the_grpcurl_command() -> None:
    # helm v3's `install --dry-run=client` still asks a cluster for its version; v4's does not.
    done = subprocess.run(
        [str(helm_binary("helm4")), "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-router 50051:50051" in notes
    assert "grpcurl -plaintext -d" in notes and "127.0.0.1:50051 tokenmesh.v1.Inference/Generate" in notes


@pytest.mark.parametrize("service_mode", ["mtls", "tls"])
def test_notes_tell_the_tls_grpcurl_command(service_mode: str) -> None:
    command = [
        str(helm_binary("helm4")),
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--dry-run=client",
        "--set-json",
        f'tls.serviceMode="{service_mode}"',
    ]
    for key, value in TLS_EXISTING:
        command += ["--set-json", f"{key}={value}"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "KUBECONFIG": os.devnull}
    )
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "-plaintext" not in notes
    assert f"get secret {EXISTING_SECRETS['router']} -o jsonpath='{{.data.ca\\.crt}}'" in notes
    client = " -cert client.crt -key client.key" if service_mode == "mtls" else ""
    flags = f"grpcurl -cacert ca.crt{client} -authority {TLS_SERVER_NAME} \\\n"
    assert notes.count(flags) == 2, notes
    assert "127.0.0.1:50051 tokenmesh.v1.Inference/Generate" in notes


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for key, value in node.items() for p in leaf_paths(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def test_the_kubernetes_doc_documents_every_value() -> None:
    section = KUBERNETES_DOC.read_text()
    assert section.startswith("# Deploy on Kubernetes")
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    # A value is documented when it, or a group above it below the top level
    # (`worker.probes`), is named in backticks.
    def named(path: str) -> bool:
        parts = path.split(".")
        return any(f"`{'.'.join(parts[:n])}`" in section for n in range(min(2, len(parts)), len(parts) + 1))

    undocumented = [path for path in leaf_paths(values) if not named(path)]
    assert not undocumented, "docs/kubernetes.md does not name: " + ", ".join(undocumented)


def test_router_quotas_are_a_config_map_the_routers_read_and_reload(helm: str) -> None:
    defaults = render(helm, "defaults")
    assert f"{RELEASE}-router-quotas" not in objects(defaults, "ConfigMap")
    assert not any(a.startswith("--quota") for a in tokenmesh_containers(defaults)[0]["args"])
    tenants = {"search": {"tokens_per_minute": 1000000, "concurrent": 8}, "*": {"requests_per_minute": 0}}
    docs = render(
        helm, "defaults", overrides(router__quotas__tenants=tenants, router__quotas__redisUrl="redis://redis:6379/0")
    )
    text = objects(docs, "ConfigMap")[f"{RELEASE}-router-quotas"]["data"]["quotas.toml"]
    assert parse_quotas(text) == {"search": Limits(tokens=1000000, concurrent=8), "*": Limits(requests=0)}
    spec = pod_spec(docs, "router")
    [router] = [c for c in spec["containers"] if c["name"] == "router"]
    assert arg(router, "--quota-file") == "/etc/tokenmesh/quotas/quotas.toml"
    assert arg(router, "--quota-redis-url") == "redis://redis:6379/0"
    [mount] = [m for m in router["volumeMounts"] if m["name"] == "quotas"]
    assert mount["mountPath"] == "/etc/tokenmesh/quotas" and "subPath" not in mount  # a subPath is never updated
    [volume] = [v for v in spec["volumes"] if v["name"] == "quotas"]
    assert volume["configMap"]["name"] == f"{RELEASE}-router-quotas"
    assert validation_errors(docs, NEWEST) == []
