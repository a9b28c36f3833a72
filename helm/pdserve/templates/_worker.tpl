{{/*
The pod template of the worker pools (prefill Deployment, decode StatefulSet): one template, so both roles run
the same flags, probes, drain and GPU settings.
*/}}

{{/* The pod template of a worker pool, shared by the prefill Deployment and the decode StatefulSet.
     (dict "root" $ "role" "prefill"). */}}
{{- define "pdserve.workerPodTemplate" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $role := .role }}
{{- $w := index $v $role }}
{{- $ctx := dict "root" $root "component" $role }}
metadata:
  labels:
    {{- include "pdserve.componentLabels" $ctx | nindent 4 }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- with $w.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
  automountServiceAccountToken: false
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  # SIGTERM starts the drain: preStop wait + --drain-timeout-s + 15 s to stop.
  terminationGracePeriodSeconds: {{ add $w.preStopSleepS $w.drainTimeoutS 15 }}
  {{- if and $v.gpu.enabled $v.gpu.runtimeClassName }}
  runtimeClassName: {{ $v.gpu.runtimeClassName }}
  {{- end }}
  {{- $nodeSelector := $w.nodeSelector }}
  {{- if $v.gpu.enabled }}
  {{- $nodeSelector = merge (deepCopy $w.nodeSelector) $v.gpu.nodeSelector }}
  {{- end }}
  {{- with $nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $tolerations := $w.tolerations }}
  {{- if $v.gpu.enabled }}
  {{- $tolerations = concat $w.tolerations $v.gpu.tolerations }}
  {{- end }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "pdserve.topologySpread" $ctx | nindent 2 }}
  {{- with include "pdserve.buildTinyInit" $root }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $role }}
      image: {{ include "pdserve.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["pdserve"]
      args:
        - {{ $role }}
        - --config=/etc/pdserve/config/{{ $role }}.yaml
        - --model={{ $v.model.path }}
        - --dtype={{ $v.model.dtype }}
        - --quantization={{ $v.model.quantization }}
        - --device={{ ternary "cuda" "cpu" $v.gpu.enabled }}
        - --host=0.0.0.0
        - --port={{ $w.grpcPort }}
        - --metrics-port={{ $w.metricsPort }}
        - --advertise-host=$(POD_IP)
        - --worker-id=$(POD_NAME)
        - --drain-timeout-s={{ $w.drainTimeoutS }}
        {{- include "pdserve.securityArgs" (dict "root" $root "worker" true) | nindent 8 }}
        {{- range $w.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- include "pdserve.podEnv" $root | nindent 8 }}
        {{- include "pdserve.commonEnv" $root | nindent 8 }}
      ports:
        - name: grpc
          containerPort: {{ $w.grpcPort }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $w.metricsPort }}
          protocol: TCP
      {{- $probeType := include "pdserve.probeType" (dict "root" $root "tls" $v.tls.enabled) }}
      {{- include "pdserve.probes" (dict "root" $root "type" $probeType "grpcPort" $w.grpcPort "httpPort" $w.metricsPort "startup" $w.startupProbe) | nindent 6 }}
      lifecycle:
        preStop:
          exec:
            command: ["sleep", {{ $w.preStopSleepS | quote }}]
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      resources:
        {{- $resources := deepCopy $w.resources }}
        {{- if $v.gpu.enabled }}
        {{- $requests := default dict $resources.requests }}
        {{- $limits := default dict $resources.limits }}
        {{- $_ := set $requests "nvidia.com/gpu" 1 }}
        {{- $_ := set $limits "nvidia.com/gpu" 1 }}
        {{- $_ := set $resources "requests" $requests }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        {{- include "pdserve.commonMounts" (dict "root" $root "worker" true) | nindent 8 }}
  volumes:
    {{- include "pdserve.commonVolumes" (dict "root" $root "worker" true) | nindent 4 }}
{{- end }}
