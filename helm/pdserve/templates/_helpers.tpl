{{/*
Named templates of the pdserve chart: names, labels, images, which features are on (this file); the parts of a
pdserve pod: environment, flags, volumes, probes, init container (_pod.tpl); the worker pods (_worker.tpl).
Components: router, prefill, decode, redis, test. Each object is named "<fullname>-<component>" and labelled
with pdserve.componentLabels; pods are selected by pdserve.selectorLabels.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>" (just the release when it already contains the chart name), or fullnameOverride.
     Cut to 47 characters so that "<fullname>-<component>-<suffix>" stays within 63. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>": (dict "root" $ "component" "router"). */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .component }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* Labels of a component's objects: (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* What selects a component's pods (never changes between releases: Deployment selectors are immutable). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The service account of the pods. */}}
{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The pdserve image: repository:tag or repository@digest; the tag defaults to the cpu or cuda flavour. */}}
{{- define "pdserve.image" -}}
{{- $tag := default (ternary "cuda" "cpu" .Values.gpu.enabled) .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The bundled Redis image. */}}
{{- define "pdserve.redisImage" -}}
{{- if .Values.redis.image.digest }}
{{- printf "%s@%s" .Values.redis.image.repository .Values.redis.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.redis.image.repository .Values.redis.image.tag }}
{{- end }}
{{- end }}

{{/* Names of the chart's Secrets and ConfigMaps. */}}
{{- define "pdserve.configName" -}}{{ include "pdserve.fullname" . }}-config{{- end }}
{{- define "pdserve.redisSecretName" -}}{{ include "pdserve.fullname" . }}-redis{{- end }}
{{- define "pdserve.authSecretName" -}}
{{- default (printf "%s-auth" (include "pdserve.fullname" .)) .Values.auth.existingSecret }}
{{- end }}
{{- define "pdserve.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "pdserve.fullname" .)) .Values.tls.existingSecret }}
{{- end }}

{{/* Whether API keys are configured ("true" or ""). */}}
{{- define "pdserve.apiKeysOn" -}}
{{- if or .Values.auth.apiKeys .Values.auth.existingSecret }}true{{ end }}
{{- end }}

{{/* Whether JWTs are accepted ("true" or ""). */}}
{{- define "pdserve.jwtOn" -}}
{{- if .Values.auth.jwt.existingSecret }}true{{ end }}
{{- end }}

{{/* Probe style of a port: "grpc" or "http". (dict "root" $ "tls" BOOL): tls says whether the gRPC port has TLS. */}}
{{- define "pdserve.probeType" -}}
{{- if eq .root.Values.probes "auto" }}
{{- ternary "http" "grpc" .tls }}
{{- else }}
{{- .root.Values.probes }}
{{- end }}
{{- end }}

{{/* A number as a Kubernetes quantity: integers as they are, fractions in milli-units (0.7 -> 700m). */}}
{{- define "pdserve.quantity" -}}
{{- $milli := round (mulf (float64 .) 1000) 0 | int64 }}
{{- if eq (mod $milli 1000) 0 }}
{{- div $milli 1000 }}
{{- else }}
{{- printf "%dm" $milli }}
{{- end }}
{{- end }}
