"""The gateway in the Helm chart: on by default, its objects as the other components', readiness on /health, the
drain budget, API keys from a Secret, HTTPS/mTLS from the chart's TLS modes, open to the ingress only, metrics on
the metrics port, an Ingress for SSE; and with ``gateway.enabled: false`` none of it.

The lint, the strict validation at 1.29 and the newest version, the golden renders and the real config check of
the gateway's arguments run in tests/repo/test_chart.py, over every value set (the gateway is on in all of them,
``examples/gateway-ingress.yaml`` with its Ingress, HPA, API keys and CORS).
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
import yaml

from tests.support.chart import (
    API_KEYS_DIR,
    CERT_MANAGER_API,
    CHART,
    GATEWAY_EXAMPLE,
    KUBE_VERSIONS,
    METRICS_PORT,
    NAMESPACE,
    OPERATOR_API,
    RELEASE,
    TLS_CERT_MANAGER,
    TLS_DIR,
    TLS_SERVER_NAME,
    arg,
    deployment,
    helm_binary,
    labels_match,
    objects,
    overrides,
    pod_spec,
    render,
    selects,
    validation_errors,
)

GATEWAY = f"{RELEASE}-gateway"
PORT = 8000  # values.yaml gateway.port
HEALTH_PORT = 8081  # values.yaml healthPort
ROUTERS = f"{RELEASE}-router-headless.{NAMESPACE}.svc.cluster.local:50051"
EXAMPLE = yaml.safe_load((CHART / "examples" / f"{GATEWAY_EXAMPLE}.yaml").read_text())
# Every optional object of the gateway and of the release that could name it, on at once.
EVERYTHING = (
    overrides(
        networkPolicy__enabled=True,
        monitoring__podMonitor__enabled=True,
        gateway__autoscaling__enabled=True,
        gateway__ingress__enabled=True,
        gateway__ingress__host="llm.example.com",
        gateway__apiKeys__existingSecret="keys",
    )
    + TLS_CERT_MANAGER
)
APIS = (OPERATOR_API, CERT_MANAGER_API)


def gateway_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = pod_spec(docs, "gateway")["containers"]
    assert container["name"] == "gateway" and container["args"][0] == "gateway"
    return container


def owned_by_gateway(doc: dict[str, Any]) -> bool:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "gateway"


def test_the_gateway_is_on_by_default_with_deployment_service_and_pdb(helm: str) -> None:
    docs = render(helm, "defaults")
    mine = sorted((doc["kind"], doc["metadata"]["name"]) for doc in docs if owned_by_gateway(doc))
    assert mine == [("Deployment", GATEWAY), ("PodDisruptionBudget", GATEWAY), ("Service", GATEWAY)]
    spec = deployment(docs, "gateway")["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    service = objects(docs, "Service")[GATEWAY]["spec"]
    assert service["type"] == "ClusterIP"
    assert service["ports"] == [{"name": "http", "port": PORT, "targetPort": "http", "appProtocol": "http"}]
    assert labels_match(service["selector"], spec["template"]["metadata"]["labels"])
    assert {"name": "http", "containerPort": PORT} in gateway_container(docs)["ports"]
    pdb = objects(docs, "PodDisruptionBudget")[GATEWAY]["spec"]
    assert pdb["maxUnavailable"] == 1 and labels_match(pdb["selector"]["matchLabels"], spec["selector"]["matchLabels"])


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_gateway_object_validates_strictly(helm: str, kube: str) -> None:
    docs = render(helm, "defaults", EVERYTHING, kube=kube, api_versions=APIS)
    kinds = sorted(doc["kind"] for doc in docs if owned_by_gateway(doc))
    assert kinds == [
        "Certificate",
        "Deployment",
        "HorizontalPodAutoscaler",
        "Ingress",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
    ]
    assert validation_errors(docs, kube) == []


def test_gateway_disabled_renders_none_of_its_objects_and_no_one_names_it(helm: str) -> None:
    docs = render(helm, "defaults", EVERYTHING + overrides(gateway__enabled=False), api_versions=APIS)
    assert not [d["metadata"]["name"] for d in docs if owned_by_gateway(d) or "gateway" in d["metadata"]["name"]]
    # Neither the routers' policy lets it in, nor does the PodMonitor look for it.
    router_policy = objects(docs, "NetworkPolicy")[f"{RELEASE}-router"]["spec"]
    peers = [peer for rule in router_policy["ingress"] for peer in rule.get("from", [])]
    components = [p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") for p in peers]
    assert "gateway" not in components and "prober" in components
    (monitor,) = objects(docs, "PodMonitor").values()
    assert monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["router", "worker", "prober"]
    # And existingSecret mode asks for no gateway Secret.
    three = {c: f"mesh-{c}-tls" for c in ("router", "worker", "prober")}
    docs = render(
        helm, "defaults", overrides(tls__mode="existingSecret", tls__existingSecrets=three, gateway__enabled=False)
    )
    assert sorted(objects(docs, "Deployment")) == [f"{RELEASE}-{c}" for c in ("prober", "router", "worker")]


def test_the_gateway_streams_to_every_ready_router_through_the_headless_service(helm: str) -> None:
    docs = render(helm, "defaults")
    container = gateway_container(docs)
    assert arg(container, "--routers") == ROUTERS
    headless = objects(docs, "Service")[f"{RELEASE}-router-headless"]["spec"]
    assert headless["clusterIP"] == "None" and headless["ports"][0]["port"] == 50051
    assert arg(container, "--host") == "0.0.0.0" and arg(container, "--port") == str(PORT)


def test_readiness_is_health_on_the_health_port_and_a_drain_never_fails_liveness(helm: str) -> None:
    container = gateway_container(render(helm, "defaults"))
    assert arg(container, "--health-port") == str(HEALTH_PORT)
    assert {"name": "health", "containerPort": HEALTH_PORT} in container["ports"]
    # /health answers 503 from SIGTERM on: readiness (and startup) drop the pod at once.
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "health"}, probe
    # Liveness only asks that the port answers, which it does while draining.
    assert container["livenessProbe"]["tcpSocket"] == {"port": "health"}
    assert container["livenessProbe"]["failureThreshold"] >= 2


@pytest.mark.parametrize("value_set", ["defaults", GATEWAY_EXAMPLE])
def test_the_drain_fits_in_the_termination_grace(helm: str, value_set: str) -> None:
    docs = render(helm, value_set)
    container = gateway_container(docs)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep = float(command[1])
    drain = [float(arg(container, flag)) for flag in ("--drain-grace-s", "--drain-tail-s", "--stop-grace-s")]
    assert (sleep, *drain) == (10, 30, 2, 2)
    assert pod_spec(docs, "gateway")["terminationGracePeriodSeconds"] >= sleep + sum(drain)


def test_drain_values_reach_the_args_and_a_budget_at_its_limit_renders(helm: str) -> None:
    values = overrides(
        gateway__drain={"preStopSleepSeconds": 5, "graceSeconds": 120, "tailSeconds": 3, "stopGraceSeconds": 1},
        gateway__terminationGracePeriodSeconds=129,
    )
    docs = render(helm, "defaults", values)
    container = gateway_container(docs)
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert [arg(container, f) for f in ("--drain-grace-s", "--drain-tail-s", "--stop-grace-s")] == ["120", "3", "1"]
    assert pod_spec(docs, "gateway")["terminationGracePeriodSeconds"] == 129


def test_api_keys_come_from_the_secret_mounted_whole(helm: str) -> None:
    assert not [a for a in gateway_container(render(helm, "defaults"))["args"] if a.startswith("--api-keys")]
    docs = render(helm, GATEWAY_EXAMPLE)
    container = gateway_container(docs)
    keys = EXAMPLE["gateway"]["apiKeys"]
    assert arg(container, "--api-keys-file") == f"{API_KEYS_DIR}/api-keys"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == API_KEYS_DIR]
    assert mount["readOnly"] is True and "subPath" not in mount
    (volume,) = [v for v in pod_spec(docs, "gateway")["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"] == {"secretName": keys["existingSecret"], "defaultMode": 0o440}
    other = render(helm, "defaults", overrides(gateway__apiKeys={"existingSecret": "k", "key": "keys.txt"}))
    assert arg(gateway_container(other), "--api-keys-file") == f"{API_KEYS_DIR}/keys.txt"


def test_cors_origins_and_the_default_model_reach_the_args(helm: str) -> None:
    assert not [a for a in gateway_container(render(helm, "defaults"))["args"] if a.startswith("--cors")]
    values = overrides(gateway__corsOrigins=["https://a.example", "http://localhost:5173"], gateway__defaultModel="m")
    container = gateway_container(render(helm, "defaults", values))
    assert arg(container, "--cors-origins") == "https://a.example,http://localhost:5173"
    assert arg(container, "--default-model") == "m"


@pytest.mark.parametrize("service_mode", ["mtls", "tls"])
def test_https_follows_the_charts_tls_modes(helm: str, service_mode: str) -> None:
    docs = render(helm, "defaults", TLS_CERT_MANAGER + overrides(tls__serviceMode=service_mode), api_versions=APIS)
    container = gateway_container(docs)
    assert arg(container, "--tls-mode") == service_mode  # HTTPS on its port; mtls: callers present a certificate
    assert [arg(container, f) for f in ("--tls-cert", "--tls-key", "--tls-ca")] == [
        f"{TLS_DIR}/tls.crt",
        f"{TLS_DIR}/tls.key",
        f"{TLS_DIR}/ca.crt",
    ]
    assert arg(container, "--tls-server-name") == TLS_SERVER_NAME  # it reaches routers by IP
    assert objects(docs, "Service")[GATEWAY]["spec"]["ports"][0]["appProtocol"] == "https"
    # Its own identity, and the names the ingress may verify it by.
    spec = objects(docs, "Certificate")[GATEWAY]["spec"]
    assert spec["uris"] == ["spiffe://tokenmesh/gateway"]
    assert {TLS_SERVER_NAME, GATEWAY, f"{GATEWAY}.{NAMESPACE}.svc"} <= set(spec["dnsNames"])
    assert {"server auth", "client auth"} <= set(spec["usages"])
    # The probes stay plaintext: the kubelet presents no client certificate.
    assert "scheme" not in container["readinessProbe"]["httpGet"]


def test_the_network_policy_opens_the_gateway_to_the_ingress_only(helm: str) -> None:
    docs = render(helm, GATEWAY_EXAMPLE)
    policy = objects(docs, "NetworkPolicy")[GATEWAY]["spec"]
    labels = deployment(docs, "gateway")["spec"]["template"]["metadata"]["labels"]
    assert labels_match(policy["podSelector"]["matchLabels"], labels) and policy["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["ingress"]}
    assert by_port == {PORT: EXAMPLE["networkPolicy"]["gatewayFrom"], HEALTH_PORT: None}, "metricsFrom is empty"
    # The routers let the gateway in.
    router = objects(docs, "NetworkPolicy")[f"{RELEASE}-router"]["spec"]
    peers = [p for rule in router["ingress"] if rule["ports"][0]["port"] == 50051 for p in rule.get("from", [])]
    assert [p for p in peers if "podSelector" in p and labels_match(p["podSelector"]["matchLabels"], labels)]
    scraped = render(helm, GATEWAY_EXAMPLE, overrides(networkPolicy__metricsFrom=[{"namespaceSelector": {}}]))
    rules = objects(scraped, "NetworkPolicy")[GATEWAY]["spec"]["ingress"]
    assert {"ports": [{"port": METRICS_PORT, "protocol": "TCP"}], "from": [{"namespaceSelector": {}}]} in rules


def test_metrics_are_on_the_metrics_port_and_the_pod_monitor_scrapes_them(helm: str) -> None:
    docs = render(helm, "defaults", overrides(monitoring__podMonitor__enabled=True), api_versions=(OPERATOR_API,))
    container = gateway_container(docs)
    assert arg(container, "--metrics-port") == str(METRICS_PORT) != str(PORT)
    assert {"name": "metrics", "containerPort": METRICS_PORT} in container["ports"]
    (monitor,) = objects(docs, "PodMonitor").values()
    assert selects(monitor["spec"]["selector"], deployment(docs, "gateway")["spec"]["template"]["metadata"]["labels"])
    off = gateway_container(render(helm, "defaults", overrides(metrics__enabled=False)))
    assert not [a for a in off["args"] if a.startswith("--metrics")]
    assert "metrics" not in [p["name"] for p in off["ports"]]


def test_the_example_ingress_passes_server_sent_events_on_at_once(helm: str) -> None:
    docs = render(helm, GATEWAY_EXAMPLE)
    ingress = objects(docs, "Ingress")[GATEWAY]
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[f"nginx.ingress.kubernetes.io/{timeout}"]) >= 3600, timeout
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    (rule,) = spec["rules"]
    assert rule["host"] == "llm.example.com" and spec["tls"][0]["hosts"] == ["llm.example.com"]
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    assert path["backend"]["service"] == {"name": GATEWAY, "port": {"name": "http"}}
    assert [p["name"] for p in objects(docs, "Service")[GATEWAY]["spec"]["ports"]] == ["http"]
    # The example autoscales the gateway, so the Deployment leaves the count to the HPA.
    hpa = objects(docs, "HorizontalPodAutoscaler")[GATEWAY]["spec"]
    assert hpa["scaleTargetRef"]["name"] == GATEWAY and (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert "replicas" not in deployment(docs, "gateway")["spec"]
    assert objects(render(helm, "defaults"), "Ingress") == {}


@pytest.mark.parametrize("enabled", [True, False])
def test_the_notes_tell_the_gateways_curl_command_while_it_is_on(enabled: bool) -> None:
    # helm v3's `install --dry-run=client` still asks a cluster for its version; v4's does not.
    done = subprocess.run(
        [
            str(helm_binary("helm4")),
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--dry-run=client",
            "--set-json",
            f"gateway.enabled={json.dumps(enabled)}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    forward = f"kubectl -n {NAMESPACE} port-forward svc/{GATEWAY} {PORT}:{PORT}"
    curl = f"curl -N http://127.0.0.1:{PORT}/v1/chat/completions"
    assert (forward in notes, curl in notes, "gateway(s)" in notes) == (enabled, enabled, enabled), notes
