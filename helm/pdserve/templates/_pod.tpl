{{/*
The parts of every pdserve pod (router, prefill, decode): environment, security flags, volumes and their mounts,
the tiny-model init container, topology spread, probes. Context: (dict "root" $ ...) where a template takes one.
*/}}

{{/* The Redis URL every service gets as PDSERVE_REDIS_URL (env entries; it may carry a password, so it comes
     from a Secret or from $(REDIS_PASSWORD)). */}}
{{- define "pdserve.redisEnv" -}}
{{- if .Values.redis.enabled }}
{{- $host := printf "%s-redis" (include "pdserve.fullname" .) }}
{{- if not .Values.redis.auth.enabled }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://%s:%d/0" $host (int .Values.redis.port) | quote }}
{{- else if .Values.redis.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.auth.existingSecret }}
      key: {{ .Values.redis.auth.existingSecretPasswordKey }}
- name: PDSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" $host (int .Values.redis.port) | quote }}
{{- else }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: redis-url
{{- end }}
{{- else if .Values.redis.external.existingSecret }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else }}
{{- $_ := required "redis.enabled is false: set redis.external.url or redis.external.existingSecret" .Values.redis.external.url }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: redis-url
{{- end }}
{{- end }}

{{/* Environment of every pdserve container. */}}
{{- define "pdserve.commonEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
{{ include "pdserve.redisEnv" . }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The downward-API variables the workers' flags use: $(POD_NAME) is the registry id, $(POD_IP) the advertised
     host. */}}
{{- define "pdserve.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* Flags every service gets for the security settings: API keys, JWTs, mTLS (and the KV key for workers).
     (dict "root" $ "worker" BOOL). */}}
{{- define "pdserve.securityArgs" -}}
{{- $v := .root.Values }}
{{- if include "pdserve.apiKeysOn" .root }}
- --api-key-file=/etc/pdserve/auth/api-keys
{{- end }}
{{- if include "pdserve.jwtOn" .root }}
{{- if $v.auth.jwt.secretKey }}
- --jwt-secret-file=/etc/pdserve/jwt/secret
{{- end }}
{{- if $v.auth.jwt.publicKeyKey }}
- --jwt-public-key-file=/etc/pdserve/jwt/public-key.pem
{{- end }}
{{- with $v.auth.jwt.issuer }}
- {{ printf "--jwt-issuer=%s" . | quote }}
{{- end }}
{{- with $v.auth.jwt.audience }}
- {{ printf "--jwt-audience=%s" . | quote }}
{{- end }}
{{- end }}
{{- if $v.tls.enabled }}
- --tls-cert-file=/etc/pdserve/tls/tls.crt
- --tls-key-file=/etc/pdserve/tls/tls.key
- --tls-ca-file=/etc/pdserve/tls/ca.crt
{{- with $v.tls.serverName }}
- {{ printf "--tls-server-name=%s" . | quote }}
{{- end }}
{{- end }}
{{- if and .worker $v.kvEncryption.existingSecret }}
- --kv-encryption-key-file=/etc/pdserve/kv-key/kv.key
{{- end }}
{{- end }}

{{/* Volume mounts of every pdserve container: the model (read-only), the settings, /tmp and the secrets. */}}
{{- define "pdserve.commonMounts" -}}
{{- $v := .root.Values }}
- name: model
  mountPath: {{ $v.model.volume.mountPath }}
  readOnly: true
- name: config
  mountPath: /etc/pdserve/config
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if include "pdserve.apiKeysOn" .root }}
- name: api-keys
  mountPath: /etc/pdserve/auth
  readOnly: true
{{- end }}
{{- if include "pdserve.jwtOn" .root }}
- name: jwt
  mountPath: /etc/pdserve/jwt
  readOnly: true
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- if and .worker $v.kvEncryption.existingSecret }}
- name: kv-key
  mountPath: /etc/pdserve/kv-key
  readOnly: true
{{- end }}
{{- if .worker }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/* Volumes of every pdserve pod (matching pdserve.commonMounts). */}}
{{- define "pdserve.commonVolumes" -}}
{{- $v := .root.Values }}
- name: model
{{- if eq $v.model.volume.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ required "model.volume.claimName is required for model.volume.type=persistentVolumeClaim" $v.model.volume.claimName }}
    readOnly: true
{{- else if eq $v.model.volume.type "hostPath" }}
  hostPath:
    path: {{ required "model.volume.hostPath is required for model.volume.type=hostPath" $v.model.volume.hostPath }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ $v.model.volume.sizeLimit }}
{{- end }}
- name: config
  configMap:
    name: {{ include "pdserve.configName" .root }}
- name: tmp
  emptyDir:
    sizeLimit: {{ $v.tmpSizeLimit }}
{{- if include "pdserve.apiKeysOn" .root }}
- name: api-keys
  secret:
    secretName: {{ include "pdserve.authSecretName" .root }}
    defaultMode: 0440
    items:
      - key: {{ $v.auth.existingSecretKey }}
        path: api-keys
{{- end }}
{{- if include "pdserve.jwtOn" .root }}
{{- if not (or $v.auth.jwt.secretKey $v.auth.jwt.publicKeyKey) }}
{{- fail "auth.jwt.existingSecret needs auth.jwt.secretKey or auth.jwt.publicKeyKey" }}
{{- end }}
- name: jwt
  secret:
    secretName: {{ $v.auth.jwt.existingSecret }}
    defaultMode: 0440
    items:
      {{- with $v.auth.jwt.secretKey }}
      - key: {{ . }}
        path: secret
      {{- end }}
      {{- with $v.auth.jwt.publicKeyKey }}
      - key: {{ . }}
        path: public-key.pem
      {{- end }}
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" .root }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if and .worker $v.kvEncryption.existingSecret }}
- name: kv-key
  secret:
    secretName: {{ $v.kvEncryption.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $v.kvEncryption.existingSecretKey }}
        path: kv.key
{{- end }}
{{- if .worker }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shmSizeLimit }}
{{- end }}
{{- end }}

{{/* The init container that builds the tiny demo model into the model volume (model.buildTiny). */}}
{{- define "pdserve.buildTinyInit" -}}
{{- $v := .Values }}
{{- if $v.model.buildTiny.enabled }}
{{- if ne $v.model.volume.type "emptyDir" }}
{{- fail "model.buildTiny.enabled needs model.volume.type=emptyDir (it writes into the volume)" }}
{{- end }}
- name: build-tiny-model
  image: {{ include "pdserve.image" . }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["pdserve"]
  args: ["model", "build-tiny", "--arch", {{ $v.model.buildTiny.arch | quote }}, "--out", {{ $v.model.path | quote }}]
  env:
    - name: HOME
      value: /tmp
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    requests:
      cpu: 500m
      memory: 512Mi
    limits:
      memory: 2Gi
  volumeMounts:
    - name: model
      mountPath: {{ $v.model.volume.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* topologySpreadConstraints of a component's pods: (dict "root" $ "component" "decode"). */}}
{{- define "pdserve.topologySpread" -}}
{{- $ctx := . }}
{{- if .root.Values.topologySpread.enabled }}
topologySpreadConstraints:
{{- range .root.Values.topologySpread.topologyKeys }}
  - maxSkew: {{ $ctx.root.Values.topologySpread.maxSkew }}
    topologyKey: {{ . }}
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "pdserve.selectorLabels" $ctx | nindent 8 }}
{{- end }}
{{- end }}
{{- end }}

{{/* Probes of a container. (dict "root" $ "type" "grpc|http" "grpcPort" N "httpPort" N "startup" .startupProbe).
     gRPC probes ask the service's grpc.health.v1 (SERVING once the model is loaded and the worker registered;
     NOT_SERVING while draining); HTTP probes ask /healthz (alive) and /readyz (ready for traffic). */}}
{{- define "pdserve.probes" -}}
{{- if eq .type "grpc" }}
startupProbe:
  grpc:
    port: {{ .grpcPort }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  grpc:
    port: {{ .grpcPort }}
  periodSeconds: 10
  failureThreshold: 6
  timeoutSeconds: 5
readinessProbe:
  grpc:
    port: {{ .grpcPort }}
  periodSeconds: 5
  failureThreshold: 2
  timeoutSeconds: 5
{{- else }}
startupProbe:
  httpGet:
    path: /healthz
    port: {{ .httpPort }}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .httpPort }}
  periodSeconds: 10
  failureThreshold: 6
  timeoutSeconds: 5
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ .httpPort }}
  periodSeconds: 5
  failureThreshold: 2
  timeoutSeconds: 5
{{- end }}
{{- end }}
