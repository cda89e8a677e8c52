"""Rendering the Helm chart offline (helm v3 and v4) and checking what it renders, for tests/repo's chart tests.

``render`` caches each ``helm template`` run; ``validation_errors`` holds every object to the Kubernetes
schemas of a version (kubernetes-validate, strict) or, for the CRDs' kinds, to :data:`CRD_SHAPES`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tokenmesh"
GOLDEN = CHART / "tests" / "golden"
KUBERNETES_DOC = ROOT / "docs" / "kubernetes.md"
BIN = Path(sys.prefix) / "bin"  # scripts/install_helm.py puts helm3 and helm4 here

HELMS = ("helm3", "helm4")
TRITON_EXAMPLES = ("cpu-embedded", "external-triton", "gpu-sidecar")  # one per triton.mode
GATEWAY_EXAMPLE = "gateway-ingress"  # the gateway behind ingress-nginx, for SSE
EXAMPLES = (*TRITON_EXAMPLES, GATEWAY_EXAMPLE)
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
METRICS_PORT = 9090  # values.yaml metrics.port
ALERTS = CHART / "files" / "tokenmesh-alerts.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
# What a cluster with the Prometheus Operator serves (helm template --api-versions).
OPERATOR_API = "monitoring.coreos.com/v1"
# ... and one with cert-manager.
CERT_MANAGER_API = "cert-manager.io/v1"

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
def run_template(
    helm: str, value_set: str, extra: Overrides = (), kube: str = NEWEST, api_versions: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    command = [
        str(helm_binary(helm)),
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube,
    ]
    if value_set != "defaults":
        command += ["--values", str(CHART / "examples" / f"{value_set}.yaml")]
    for key, value in extra:
        command += ["--set-json", f"{key}={value}"]
    for api in api_versions:
        command += ["--api-versions", api]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def render_text(
    helm: str, value_set: str, extra: Overrides = (), kube: str = NEWEST, api_versions: tuple[str, ...] = ()
) -> str:
    done = run_template(helm, value_set, extra, kube, api_versions)
    assert done.returncode == 0, f"helm template failed:\n{done.stderr}"
    return done.stdout


@functools.cache
def _render(
    helm: str, value_set: str, extra: Overrides, kube: str, api_versions: tuple[str, ...]
) -> tuple[dict[str, Any], ...]:
    return tuple(doc for doc in yaml.safe_load_all(render_text(helm, value_set, extra, kube, api_versions)) if doc)


def render(
    helm: str, value_set: str, extra: Overrides = (), kube: str = NEWEST, api_versions: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The rendered objects (fresh copies: tests may change them)."""
    return json.loads(json.dumps(_render(helm, value_set, extra, kube, api_versions)))


# Every monitoring object on, in a cluster that has the Prometheus Operator's CRDs.
MONITORING = overrides(
    monitoring__podMonitor__enabled=True,
    monitoring__prometheusRule__enabled=True,
    monitoring__grafanaDashboard__enabled=True,
)


def render_monitoring(helm: str, value_set: str, extra: Overrides = (), kube: str = NEWEST) -> list[dict[str, Any]]:
    return render(helm, value_set, MONITORING + extra, kube, (OPERATOR_API,))


# TLS (tls.mode): the Secrets one would make, or cert-manager's Certificates.
TLS_DIR = "/etc/tokenmesh/tls"
API_KEYS_DIR = "/etc/tokenmesh/api-keys"  # where the gateway's API keys Secret is mounted
TLS_SERVER_NAME = f"{RELEASE}-mesh.{NAMESPACE}.svc"  # on every certificate; what routers, prober, gateway verify
COMPONENTS = ("router", "worker", "prober", "gateway")  # the gateway is on by default
EXISTING_SECRETS = {component: f"mesh-{component}-tls" for component in COMPONENTS}
TLS_EXISTING = overrides(tls__mode="existingSecret", tls__existingSecrets=EXISTING_SECRETS)
TLS_CERT_MANAGER = overrides(tls__mode="certManager")
GIVEN_ISSUER = {"name": "mesh-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
# name -> (value set, overrides, --api-versions): each example once, both modes, both service modes.
TLS_CASES: dict[str, tuple[str, Overrides, tuple[str, ...]]] = {
    "existing-secret": ("defaults", TLS_EXISTING, ()),
    "existing-secret-tls-only": ("cpu-embedded", TLS_EXISTING + overrides(tls__serviceMode="tls"), ()),
    "cert-manager": ("gpu-sidecar", TLS_CERT_MANAGER, (CERT_MANAGER_API,)),
    "cert-manager-given-issuer": (
        "external-triton",
        TLS_CERT_MANAGER + overrides(tls__certManager__issuerRef=GIVEN_ISSUER),
        (CERT_MANAGER_API,),
    ),
}


def render_tls(helm: str, case: str, kube: str = NEWEST) -> list[dict[str, Any]]:
    value_set, extra, api_versions = TLS_CASES[case]
    return render(helm, value_set, extra, kube, api_versions)


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def deployment(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return objects(docs, "Deployment")[f"{RELEASE}-{component}"]


def pod_spec(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return deployment(docs, component)["spec"]["template"]["spec"]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def tokenmesh_containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = [
        c
        for doc in objects(docs, "Deployment").values()
        for c in containers(doc["spec"]["template"]["spec"])
        if c["image"] == IMAGE
    ]
    assert {c["args"][0] for c in found} == set(COMPONENTS)
    return found


def arg(container: dict[str, Any], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"{flag}=")]
    assert len(values) == 1, f"{container['name']}: expected one {flag}=..., args {container['args']}"
    return values[0]


def validation_errors(docs: list[dict[str, Any]], kube: str) -> list[str]:
    """Every object against the Kubernetes schemas of that version; unknown fields are errors.

    kubernetes-validate knows only built-in kinds: the Prometheus Operator's
    and cert-manager's (CRDs) are checked against CRD_SHAPES instead, as strictly.
    """
    errors = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        crd = CRD_SHAPES.get((doc.get("apiVersion"), doc.get("kind")))
        if crd is not None:
            errors += [f"{where}: {error}" for error in shape_errors(doc, crd)]
            continue
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{where} ({kube}): {'.'.join(map(str, error.path))}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{where}: {error.message}")
    return errors


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels and matchExpressions) against a pod's labels."""

    def expression(e: dict[str, Any]) -> bool:
        present, value = e["key"] in labels, labels.get(e["key"])
        return {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]

    return labels_match(selector.get("matchLabels", {}), labels) and all(
        expression(e) for e in selector.get("matchExpressions", [])
    )


# ------------------------------- the Prometheus Operator's and cert-manager's CRDs
#
# Structural shapes of PodMonitor and PrometheusRule (monitoring.coreos.com/v1)
# and of Certificate and Issuer (cert-manager.io/v1): the fields of their CRDs
# that the chart may use, each with its type. A field not listed is an error,
# as with kubernetes-validate --strict.


@dataclasses.dataclass(frozen=True)
class Obj:
    """An object with only these fields (name -> shape), the required ones present."""

    fields: dict[str, Any]
    required: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MapOf:
    """An object of any keys matching `keys`, each value of shape `values`."""

    values: Any
    keys: re.Pattern[str] = re.compile(r".+")


@dataclasses.dataclass(frozen=True)
class ListOf:
    items: Any
    min_items: int = 0


# A shape is a Python type, a frozenset (one of these values), a compiled pattern
# (a string matching it), a tuple (any one of these shapes), or Obj / MapOf / ListOf.
DURATION = re.compile(r"(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
METADATA = Obj(
    {
        "name": DNS_SUBDOMAIN,
        "namespace": DNS_SUBDOMAIN,
        "labels": MapOf(LABEL_VALUE, LABEL_KEY),
        "annotations": MapOf(str),
    },
    required=("name",),
)
LABEL_SELECTOR = Obj(
    {
        "matchLabels": MapOf(LABEL_VALUE, LABEL_KEY),
        "matchExpressions": ListOf(
            Obj(
                {
                    "key": LABEL_KEY,
                    "operator": frozenset({"In", "NotIn", "Exists", "DoesNotExist"}),
                    "values": ListOf(LABEL_VALUE),
                },
                required=("key", "operator"),
            )
        ),
    }
)
POD_METRICS_ENDPOINT = Obj(
    {
        "port": str,
        "portNumber": int,
        "path": str,
        "scheme": frozenset({"http", "https"}),
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": bool,
        "honorTimestamps": bool,
        "params": MapOf(ListOf(str)),
        "relabelings": ListOf(dict),
        "metricRelabelings": ListOf(dict),
    }
)
RULE = Obj(
    {
        "alert": str,
        "record": str,
        "expr": (str, int),
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": MapOf(str),
        "annotations": MapOf(str),
    },
    required=("expr",),
)
# cert-manager: Go durations (metav1.Duration) and the key usages its CRD enumerates.
GO_DURATION = re.compile(r"([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+")
KEY_USAGES = frozenset(
    {
        "signing",
        "digital signature",
        "content commitment",
        "key encipherment",
        "key agreement",
        "data encipherment",
        "cert sign",
        "crl sign",
        "encipher only",
        "decipher only",
        "any",
        "server auth",
        "client auth",
        "code signing",
        "email protection",
        "s/mime",
        "ipsec end system",
        "ipsec tunnel",
        "ipsec user",
        "timestamping",
        "ocsp signing",
        "microsoft sgc",
        "netscape sgc",
    }
)
ISSUER_REF = Obj({"name": DNS_SUBDOMAIN, "kind": str, "group": str}, required=("name",))
CERTIFICATE_SPEC = Obj(
    {
        "secretName": DNS_SUBDOMAIN,
        "commonName": str,
        "dnsNames": ListOf(str),
        "uris": ListOf(str),
        "ipAddresses": ListOf(str),
        "emailAddresses": ListOf(str),
        "duration": GO_DURATION,
        "renewBefore": GO_DURATION,
        "renewBeforePercentage": int,
        "usages": ListOf(KEY_USAGES),
        "isCA": bool,
        "issuerRef": ISSUER_REF,
        "privateKey": Obj(
            {
                "algorithm": frozenset({"RSA", "ECDSA", "Ed25519"}),
                "encoding": frozenset({"PKCS1", "PKCS8"}),
                "size": int,
                "rotationPolicy": frozenset({"Never", "Always"}),
            }
        ),
        "subject": Obj(
            {
                key: ListOf(str)
                for key in (
                    "organizations",
                    "organizationalUnits",
                    "countries",
                    "localities",
                    "provinces",
                    "streetAddresses",
                    "postalCodes",
                )
            }
        ),
        "secretTemplate": Obj({"labels": MapOf(LABEL_VALUE, LABEL_KEY), "annotations": MapOf(str)}),
        "revisionHistoryLimit": int,
        "encodeUsagesInRequest": bool,
    },
    required=("secretName", "issuerRef"),
)
CRL = {"crlDistributionPoints": ListOf(str)}
# An Issuer is exactly one kind of issuer: each alternative admits only its own field.
ISSUER_SPEC = (
    Obj({"selfSigned": Obj(CRL)}, required=("selfSigned",)),
    Obj(
        {
            "ca": Obj(
                {"secretName": DNS_SUBDOMAIN, **CRL, "ocspServers": ListOf(str), "issuingCertificateURLs": ListOf(str)},
                required=("secretName",),
            )
        },
        required=("ca",),
    ),
)
CRD_SHAPES: dict[tuple[str, str], Obj] = {
    (api, kind): Obj(
        {"apiVersion": frozenset({api}), "kind": frozenset({kind}), "metadata": METADATA, "spec": spec},
        required=("apiVersion", "kind", "metadata", "spec"),
    )
    for api, kind, spec in (
        (
            OPERATOR_API,
            "PodMonitor",
            Obj(
                {
                    "selector": LABEL_SELECTOR,
                    "namespaceSelector": Obj({"any": bool, "matchNames": ListOf(str)}),
                    "podMetricsEndpoints": ListOf(POD_METRICS_ENDPOINT, min_items=1),
                    "jobLabel": str,
                    "podTargetLabels": ListOf(str),
                    "sampleLimit": int,
                },
                required=("selector", "podMetricsEndpoints"),
            ),
        ),
        (
            OPERATOR_API,
            "PrometheusRule",
            Obj(
                {
                    "groups": ListOf(
                        Obj(
                            {
                                "name": str,
                                "interval": DURATION,
                                "limit": int,
                                "query_offset": DURATION,
                                "partial_response_strategy": str,
                                "rules": ListOf(RULE),
                            },
                            required=("name", "rules"),
                        ),
                        min_items=1,
                    )
                },
                required=("groups",),
            ),
        ),
        (CERT_MANAGER_API, "Certificate", CERTIFICATE_SPEC),
        (CERT_MANAGER_API, "Issuer", ISSUER_SPEC),
    )
}


def shape_errors(node: Any, shape: Any, path: str = "") -> list[str]:
    """Where `node` departs from `shape` (empty: it fits)."""
    where = path or "."
    if isinstance(shape, tuple):
        return [] if any(not shape_errors(node, s, path) for s in shape) else [f"{where}: {node!r} fits no shape"]
    if isinstance(shape, type):
        fits = isinstance(node, shape) and not (shape is int and isinstance(node, bool))
        return [] if fits else [f"{where}: expected {shape.__name__}, got {node!r}"]
    if isinstance(shape, frozenset):
        return [] if node in shape else [f"{where}: {node!r} is not one of {sorted(shape)}"]
    if isinstance(shape, re.Pattern):
        fits = isinstance(node, str) and shape.fullmatch(node) is not None
        return [] if fits else [f"{where}: {node!r} does not match {shape.pattern}"]
    if isinstance(shape, ListOf):
        if not isinstance(node, list):
            return [f"{where}: expected a list, got {node!r}"]
        short = [f"{where}: fewer than {shape.min_items} items"] if len(node) < shape.min_items else []
        return short + [e for i, item in enumerate(node) for e in shape_errors(item, shape.items, f"{path}[{i}]")]
    if not isinstance(node, dict):
        return [f"{where}: expected an object, got {node!r}"]
    if isinstance(shape, MapOf):
        return [
            e
            for key, value in node.items()
            for e in ([] if isinstance(key, str) and shape.keys.fullmatch(key) else [f"{where}: bad key {key!r}"])
            + shape_errors(value, shape.values, f"{path}.{key}")
        ]
    assert isinstance(shape, Obj), shape
    errors = [f"{path}.{key}: '{key}' was unexpected" for key in node if key not in shape.fields]
    errors += [f"{path}.{key}: required" for key in shape.required if key not in node]
    return errors + [
        e
        for key, value in node.items()
        if key in shape.fields
        for e in shape_errors(value, shape.fields[key], f"{path}.{key}")
    ]
