{{/* Names, labels and the pieces every pod template shares. */}}

{{- define "tokenmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tokenmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>": call with (list $ "router"). */}}
{{- define "tokenmesh.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "tokenmesh.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "tokenmesh.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "tokenmesh.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tokenmesh.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" }}
{{ include "tokenmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: tokenmesh
{{- end -}}

{{- define "tokenmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tokenmesh.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tokenmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* "name.ns.svc.domain:port" of a headless Service: (list $ "worker" port). */}}
{{- define "tokenmesh.headlessAddress" -}}
{{- $root := index . 0 -}}
{{- printf "%s-headless.%s.svc.%s:%v" (include "tokenmesh.componentName" (list $root (index . 1))) $root.Release.Namespace $root.Values.discovery.clusterDomain (index . 2) -}}
{{- end -}}

{{/* Pod-level restricted security (Pod Security Standard "restricted"). */}}
{{- define "tokenmesh.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsUser }}
fsGroup: {{ .Values.runAsUser }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tokenmesh.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/*
The kubelet's gRPC probes on the health port: (list $ probes). Startup and
readiness ask "readiness" (NOT_SERVING while starting or draining), liveness
asks "liveness" (SERVING until the process stops, also while draining).
*/}}
{{- define "tokenmesh.probes" -}}
{{- $root := index . 0 -}}
{{- $probes := index . 1 -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  grpc:
    port: {{ $root.Values.healthPort }}
    service: {{ ternary "liveness" "readiness" (eq $kind "liveness") }}
  {{- toYaml (get $probes $kind) | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The preStop sleep that keeps a pod serving while discovery drops it. */}}
{{- define "tokenmesh.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ . }}"]
{{- end -}}

{{/* TOKENMESH_LOG_LEVEL and _FORMAT plus a component's own env: (list $ env). */}}
{{- define "tokenmesh.env" -}}
{{- $root := index . 0 -}}
env:
  - name: TOKENMESH_LOG_LEVEL
    value: {{ $root.Values.logLevel | quote }}
  - name: TOKENMESH_LOG_FORMAT
    value: {{ $root.Values.logFormat | quote }}
{{- with index . 1 }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Scheduling pass-through of a component's values, empty by default. */}}
{{- define "tokenmesh.scheduling" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Fields every pod spec starts with: (list $ component-values). */}}
{{- define "tokenmesh.podCommon" -}}
{{- $root := index . 0 -}}
serviceAccountName: {{ include "tokenmesh.serviceAccountName" $root }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "tokenmesh.podSecurityContext" $root | nindent 2 }}
{{- include "tokenmesh.scheduling" (index . 1) }}
{{- end -}}

{{/*
A container's resources plus the GPU limit: (list resources gpus). The
device plugin hands GPUs to the container that asks, so only the one that
runs Triton gets them.
*/}}
{{- define "tokenmesh.resources" -}}
{{- $res := deepCopy (default (dict) (index . 0)) -}}
{{- $gpus := int (index . 1) -}}
{{- if gt $gpus 0 -}}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" $gpus) (default (dict) $res.limits)) -}}
{{- end -}}
{{- with $res }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Fails unless the cluster serves the Prometheus Operator's CRDs: (list $ "monitoring.podMonitor.enabled"). */}}
{{- define "tokenmesh.requireOperatorCRDs" -}}
{{- $root := index . 0 -}}
{{- if not ($root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
{{- fail (printf "%s needs the Prometheus Operator's CRDs (API monitoring.coreos.com/v1), which the cluster does not serve: install the Prometheus Operator (e.g. kube-prometheus-stack) first (helm template: --api-versions monitoring.coreos.com/v1)" (index . 1)) -}}
{{- end -}}
{{- end -}}

{{/*
The chart's labels of a release-wide object plus the user's (which win on a
clash, and never repeat a key): (list $ extra-labels).
*/}}
{{- define "tokenmesh.extraLabels" -}}
{{- $labels := include "tokenmesh.labels" (list (index . 0) "mesh") | fromYaml -}}
{{- toYaml (merge (deepCopy (default (dict) (index . 1))) $labels) -}}
{{- end -}}

{{/*
TLS (tls.mode): every component mounts its own kubernetes.io/tls Secret as a
directory (never subPath: a subPath mount would not see renewed files).
*/}}
{{- define "tokenmesh.tls.enabled" -}}
{{- if ne .Values.tls.mode "disabled" }}true{{ end -}}
{{- end -}}

{{/*
The DNS SAN every certificate of the release carries, and the name routers,
the prober and the gateway verify (--tls-server-name): they reach pods by IP.
*/}}
{{- define "tokenmesh.tls.serverName" -}}
{{- printf "%s-mesh.%s.svc" (include "tokenmesh.fullname" . | trunc 58 | trimSuffix "-") .Release.Namespace -}}
{{- end -}}

{{/* The Secret of a component's certificate: (list $ "router"). */}}
{{- define "tokenmesh.tls.secretName" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- if eq $root.Values.tls.mode "existingSecret" -}}
{{- get $root.Values.tls.existingSecrets $component -}}
{{- else -}}
{{- printf "%s-tls" (include "tokenmesh.componentName" (list $root $component)) -}}
{{- end -}}
{{- end -}}

{{- define "tokenmesh.tls.dir" -}}/etc/tokenmesh/tls{{- end -}}

{{/* Where the gateway's API keys Secret is mounted, whole (gateway.apiKeys). */}}
{{- define "tokenmesh.gateway.apiKeysDir" -}}/etc/tokenmesh/api-keys{{- end -}}

{{/* The components of the release: the gateway while gateway.enabled. */}}
{{- define "tokenmesh.components" -}}
{{- toJson (concat (list "router" "worker" "prober") (ternary (list "gateway") (list) .Values.gateway.enabled)) -}}
{{- end -}}

{{/* A tokenmesh container's --tls-* args, one per line: (list $ "router"). */}}
{{- define "tokenmesh.tls.args" -}}
{{- $root := index . 0 -}}
{{- if include "tokenmesh.tls.enabled" $root -}}
{{- $dir := include "tokenmesh.tls.dir" $root }}
- --tls-mode={{ $root.Values.tls.serviceMode }}
- --tls-cert={{ $dir }}/tls.crt
- --tls-key={{ $dir }}/tls.key
- --tls-ca={{ $dir }}/ca.crt
{{- if has (index . 1) (list "router" "prober" "gateway") }}
- --tls-server-name={{ include "tokenmesh.tls.serverName" $root }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "tokenmesh.tls.volumeMount" -}}
{{- if include "tokenmesh.tls.enabled" . }}
- name: tls
  mountPath: {{ include "tokenmesh.tls.dir" . }}
  readOnly: true
{{- end -}}
{{- end -}}

{{/* The component's Secret as a volume: (list $ "router"). */}}
{{- define "tokenmesh.tls.volume" -}}
{{- $root := index . 0 -}}
{{- if include "tokenmesh.tls.enabled" $root }}
# The whole Secret as a directory: renewed certificates reach the services,
# which re-read the files.
- name: tls
  secret:
    secretName: {{ include "tokenmesh.tls.secretName" . }}
    defaultMode: 0440
{{- end -}}
{{- end -}}

{{/* "name", "name.ns", "name.ns.svc" and "name.ns.svc.domain" of a Service: (list $ service-name). */}}
{{- define "tokenmesh.serviceDNSNames" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $ns := $root.Release.Namespace -}}
- {{ $name }}
- {{ $name }}.{{ $ns }}
- {{ $name }}.{{ $ns }}.svc
- {{ $name }}.{{ $ns }}.svc.{{ $root.Values.discovery.clusterDomain }}
{{- end -}}
