"""The Helm chart, offline, with helm v3 and v4: lint, strict Kubernetes validation,
golden renders, refused values, and what the rendered objects promise.

Golden renders live in helm/tokenmesh/tests/golden/; after a deliberate chart
change, regenerate them with
``UPDATE_GOLDEN=1 .venv/bin/pytest -q tests/unit/test_chart.py -k golden``
and review the diff.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tokenmesh"
GOLDEN = CHART / "tests" / "golden"
README = ROOT / "README.md"
BIN = Path(sys.prefix) / "bin"  # scripts/install_helm.py puts helm3 and helm4 here

HELMS = ("helm3", "helm4")
EXAMPLES = ("cpu-embedded", "external-triton", "gpu-sidecar")
VALUE_SETS = ("defaults", *EXAMPLES)
RELEASE = NAMESPACE = "tokenmesh"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the
# newest whose schemas kubernetes-validate ships.
KUBE_VERSIONS = ("v1.29.0", f"v{kubernetes_validate.latest_version()}")
NEWEST = KUBE_VERSIONS[-1]
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
IMAGE = f"tokenmesh:{APP_VERSION}"  # the default image.tag
GPU = "nvidia.com/gpu"
COREDNS_TTL_S = 5  # the TTL of CoreDNS's kubernetes plugin, which cluster DNS answers carry

Overrides = tuple[tuple[str, str], ...]


# ---------------------------------------------------------------- helpers


def overrides(**values: Any) -> Overrides:
    """--set-json pairs, hashable for the render cache: overrides(worker__gpus=2)."""
    return tuple((key.replace("__", "."), json.dumps(value)) for key, value in values.items())


def helm_binary(name: str) -> Path:
    binary = BIN / name
    if not binary.is_file():
        pytest.fail(f"{binary} is missing: run `make venv` (scripts/install_helm.py installs helm3 and helm4)")
    return binary


@pytest.fixture(params=HELMS)
def helm(request: pytest.FixtureRequest) -> str:
    helm_binary(request.param)
    return request.param


@functools.cache
def run_template(helm: str, value_set: str, extra: Overrides = (),
                 kube: str = NEWEST) -> subprocess.CompletedProcess[str]:
    command = [str(helm_binary(helm)), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
               "--kube-version", kube]
    if value_set != "defaults":
        command += ["--values", str(CHART / "examples" / f"{value_set}.yaml")]
    for key, value in extra:
        command += ["--set-json", f"{key}={value}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def render_text(helm: str, value_set: str, extra: Overrides = (), kube: str = NEWEST) -> str:
    done = run_template(helm, value_set, extra, kube)
    assert done.returncode == 0, f"helm template failed:\n{done.stderr}"
    return done.stdout


@functools.cache
def _render(helm: str, value_set: str, extra: Overrides, kube: str) -> tuple[dict[str, Any], ...]:
    return tuple(doc for doc in yaml.safe_load_all(render_text(helm, value_set, extra, kube)) if doc)


def render(helm: str, value_set: str, extra: Overrides = (), kube: str = NEWEST) -> list[dict[str, Any]]:
    """The rendered objects (fresh copies: tests may change them)."""
    return json.loads(json.dumps(_render(helm, value_set, extra, kube)))


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def deployment(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return objects(docs, "Deployment")[f"{RELEASE}-{component}"]


def pod_spec(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return deployment(docs, component)["spec"]["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def tokenmesh_containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = [c for doc in objects(docs, "Deployment").values()
             for c in containers(doc["spec"]["template"]["spec"]) if c["image"] == IMAGE]
    assert {c["args"][0] for c in found} == {"router", "worker", "prober"}
    return found


def arg(container: dict[str, Any], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"{flag}=")]
    assert len(values) == 1, f"{container['name']}: expected one {flag}=..., args {container['args']}"
    return values[0]


def validation_errors(docs: list[dict[str, Any]], kube: str) -> list[str]:
    """Every object against the Kubernetes schemas of that version; unknown fields are errors."""
    errors = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{where} ({kube}): {'.'.join(map(str, error.path))}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{where}: {error.message}")
    return errors


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# ------------------------------------------------- lint, validation, golden


def test_default_image_tag_is_the_package_version() -> None:
    # The chart deploys the tokenmesh it ships with (the image is built as that version).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert APP_VERSION == project["version"]


def test_examples_are_the_three_triton_modes() -> None:
    assert sorted(p.stem for p in (CHART / "examples").glob("*.yaml")) == list(EXAMPLES)
    modes = {name: yaml.safe_load((CHART / "examples" / f"{name}.yaml").read_text())["triton"]["mode"]
             for name in EXAMPLES}
    assert modes == {"cpu-embedded": "embedded", "external-triton": "external", "gpu-sidecar": "sidecar"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(helm: str, value_set: str) -> None:
    command = [str(helm_binary(helm)), "lint", "--strict", str(CHART), "--kube-version", NEWEST]
    if value_set != "defaults":
        command += ["--values", str(CHART / "examples" / f"{value_set}.yaml")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_object_validates_strictly(helm: str, value_set: str, kube: str) -> None:
    docs = render(helm, value_set, kube=kube)
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 3
    assert validation_errors(docs, kube) == []


def test_strict_validation_rejects_a_misspelt_field() -> None:
    # What makes the test above worth having: a typo inside a probe is caught.
    docs = render("helm4", "defaults")
    pod_spec(docs, "router")["containers"][0]["readinessProbe"]["grpc"]["servce"] = "readiness"
    (error,) = validation_errors(docs, NEWEST)
    assert error.startswith(f"Deployment/{RELEASE}-router") and "'servce' was unexpected" in error


@pytest.mark.parametrize("example", EXAMPLES)
def test_golden_render(helm: str, example: str) -> None:
    rendered = render_text(helm, example)
    golden = GOLDEN / f"{example}.yaml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered)
    expected = golden.read_text() if golden.is_file() else ""
    diff = "".join(difflib.unified_diff(expected.splitlines(True), rendered.splitlines(True),
                                        str(golden.relative_to(ROOT)), f"{helm} template", n=2))
    if diff:
        pytest.fail(f"the render of examples/{example}.yaml changed; if that is meant, regenerate with "
                    f"UPDATE_GOLDEN=1 .venv/bin/pytest -q tests/unit/test_chart.py -k golden\n{diff[:6000]}")


# ----------------------------------------------------------- refused values

SIDECAR_IMAGE = {"repository": "nvcr.io/nvidia/tritonserver", "tag": "24.08-vllm-python-py3"}
BAD_VALUES = {
    "negative-gpu-count": (overrides(worker__gpus=-1), "worker.gpus"),
    "sidecar-without-image": (overrides(triton__mode="sidecar", triton__modelRepository__volume={"emptyDir": {}}),
                              "triton.image"),
    "sidecar-without-model-repository": (overrides(triton__mode="sidecar", triton__image=SIDECAR_IMAGE),
                                         "triton.modelRepository.volume"),
    "worker-grace-shorter-than-drain": (overrides(worker__terminationGracePeriodSeconds=49),
                                        "worker.terminationGracePeriodSeconds"),
    "router-grace-shorter-than-drain": (overrides(router__drain__graceSeconds=45),
                                        "router.terminationGracePeriodSeconds"),
    "prestop-shorter-than-discovery": (overrides(worker__drain__preStopSleepSeconds=14),
                                       "worker.drain.preStopSleepSeconds"),
    "unknown-top-level-key": (overrides(replicas=3), "replicas"),
    "misspelt-nested-key": (overrides(worker__gpu=1), "gpu"),
    "unknown-triton-mode": (overrides(triton__mode="remote"), "triton.mode"),
    "latest-image-tag": (overrides(image__tag="latest"), "image.tag"),
    "pdb-allowing-no-disruption": (overrides(worker__pdb__maxUnavailable=0), "worker.pdb.maxUnavailable"),
    "liveness-failing-at-once": (overrides(router__probes__liveness__failureThreshold=1),
                                 "router.probes.liveness.failureThreshold"),
    "external-without-url": (overrides(triton__mode="external"), "triton.external.url"),
    "external-with-gpus": (overrides(triton__mode="external", triton__external__url="triton:8001", worker__gpus=1),
                           "worker.gpus"),
    "autoscaling-without-cpu-request": (overrides(router__autoscaling__enabled=True, router__resources__requests=None),
                                        "router.resources.requests.cpu"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_fail_naming_the_value(helm: str, case: str) -> None:
    extra, name = BAD_VALUES[case]
    done = run_template(helm, "defaults", extra)
    assert done.returncode != 0, f"rendered despite {extra}"
    # helm v3 names schema errors worker.gpus, helm v4 /worker/gpus.
    pointer = "/" + name.replace(".", "/")
    assert name in done.stderr or pointer in done.stderr, done.stderr


def test_drain_budget_at_its_limit_renders(helm: str) -> None:
    # 20 s preStop + 30 s drain = 50 s: exactly enough is accepted.
    docs = render(helm, "defaults", overrides(worker__terminationGracePeriodSeconds=50))
    assert pod_spec(docs, "worker")["terminationGracePeriodSeconds"] == 50


# ------------------------------------------------------ what objects promise


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_probes_are_grpc_on_the_numeric_health_port(helm: str, value_set: str) -> None:
    for container in tokenmesh_containers(render(helm, value_set)):
        port = int(arg(container, "--health-port"))
        assert {"name": "health", "containerPort": port} in container["ports"]
        for probe, service in (("startupProbe", "readiness"), ("readinessProbe", "readiness"),
                               ("livenessProbe", "liveness")):
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
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:24.08-vllm-python-py3"
    assert triton["args"][:5] == ["tritonserver", "--model-repository=/models", "--grpc-port=8001",
                                  "--http-port=8000", "--metrics-port=8002"]
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
    docs = render(helm, value_set, overrides(router__replicas=1, worker__replicas=1))
    pdbs = objects(docs, "PodDisruptionBudget")
    assert sorted(pdbs) == [f"{RELEASE}-router", f"{RELEASE}-worker"]
    for name, pdb in pdbs.items():
        pods = [d for d in objects(docs, "Deployment").values()
                if labels_match(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
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
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert deployment(docs, "worker")["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
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
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["h200"]}]}]}}},
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
    assert sorted(policies) == [f"{RELEASE}-{c}" for c in ("prober", "router", "worker")]
    pod_labels = {c: deployment(docs, c)["spec"]["template"]["metadata"]["labels"]
                  for c in ("router", "worker", "prober")}

    def sources(component: str, port: int) -> list[Any]:
        policy = policies[f"{RELEASE}-{component}"]["spec"]
        assert labels_match(policy["podSelector"]["matchLabels"], pod_labels[component])
        rules = [r for r in policy["ingress"] if {"port": port, "protocol": "TCP"} in r["ports"]]
        return [peer for r in rules for peer in r.get("from", [{"anyone": True}])]

    def components(peers: list[Any]) -> set[str]:
        return {c for peer in peers if "podSelector" in peer
                for c, labels in pod_labels.items() if labels_match(peer["podSelector"]["matchLabels"], labels)}

    assert example["callers"][0] in sources("router", 50051)
    assert components(sources("router", 50051)) == {"prober"}
    assert components(sources("worker", 50061)) == {"router", "prober"}
    assert sources("worker", 8002) == example["metricsFrom"]
    for component in ("router", "worker", "prober"):
        assert sources(component, 8081) == [{"anyone": True}], "the kubelet's probes come from the node"


# ------------------------------------------- the services accept the args


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_container_args_pass_the_real_config_check(value_set: str) -> None:
    # The renders of both helms are byte-identical (test_golden_render), so one suffices.
    for container in tokenmesh_containers(render("helm4", value_set)):
        env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
        done = subprocess.run([str(BIN / "tokenmesh"), *container["args"], "--check-config"],
                              capture_output=True, text=True, env=env, timeout=60, check=False)
        assert done.returncode == 0, f"{container['name']} {container['args']}:\n{done.stderr}"


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
    done = subprocess.run([str(helm_binary("helm4")), "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                           "--dry-run=client"], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "KUBECONFIG": os.devnull})
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-router 50051:50051" in notes
    assert "grpcurl -plaintext -d" in notes and "127.0.0.1:50051 tokenmesh.v1.Inference/Generate" in notes


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for key, value in node.items() for p in leaf_paths(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def test_readme_documents_every_value() -> None:
    text = README.read_text()
    assert "## Deploy on Kubernetes" in text
    section = text.split("## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # A value is documented when it, or a group above it below the top level
    # (`worker.probes`), is named in backticks.
    def named(path: str) -> bool:
        parts = path.split(".")
        return any(f"`{'.'.join(parts[:n])}`" in section for n in range(min(2, len(parts)), len(parts) + 1))

    undocumented = [path for path in leaf_paths(values) if not named(path)]
    assert not undocumented, "README 'Deploy on Kubernetes' does not name: " + ", ".join(undocumented)
