{{/*
A worker Deployment (prefill or decode). Call with (dict "root" $ "role" "prefill").

The worker binds 0.0.0.0 and advertises its pod IP: that address goes into its etcd key
/workers/{role}/{ip}/{port} and into the request ids peers use to reach its signal plane and
KV listener. On SIGTERM it revokes its etcd lease first (the proxy stops routing to it within
milliseconds), then drains for up to drainTimeout; terminationGracePeriodSeconds covers both.
*/}}
{{- define "xpyd.worker" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $w := index $root.Values $role -}}
{{- $tokenSecret := include "xpyd.clusterTokenSecretName" $root -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "xpyd.fullname" $root }}-{{ $role }}
  labels:
    {{- include "xpyd.labels" (dict "root" $root "component" $role) | nindent 4 }}
spec:
  {{- if not (include "xpyd.replicasOwnedElsewhere" (dict "root" $root "role" $role)) }}
  replicas: {{ $w.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "xpyd.selectorLabels" (dict "root" $root "component" $role) | nindent 6 }}
  {{- with $w.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "xpyd.labels" (dict "root" $root "component" $role) | nindent 8 }}
        {{- with $w.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "xpyd.configChecksum" $root | nindent 8 }}
        {{- with $w.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "xpyd.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $w.terminationGracePeriodSeconds }}
      {{- with include "xpyd.scheduling" (dict "root" $root "component" $role "values" $w) | trim }}{{ . | nindent 6 }}{{ end }}
      {{- with include "xpyd.waitForEtcd" $root | trim }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: {{ $role }}
          image: {{ include "xpyd.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [xpyd]
          args:
            - {{ $role }}
            - --host=0.0.0.0
            - --advertise-host=$(POD_IP)
            - --port={{ $w.port }}
            {{- if eq $role "prefill" }}
            - --signal-port={{ $w.signalPort }}
            {{- end }}
            - --kv-port={{ $w.kvPort }}
            - --etcd=$(XPYD_ETCD)
            {{- if $root.Values.model.path }}
            - --model=$(XPYD_MODEL)
            {{- end }}
            {{- with $root.Values.model.servedModelName }}
            - --served-model-name={{ . }}
            {{- end }}
            - --dtype=$(XPYD_DTYPE)
            - --max-model-len=$(XPYD_MAX_MODEL_LEN)
            - --batch-size={{ $w.batchSize }}
            - --threads={{ $w.threads }}
            - --lease-ttl={{ $w.leaseTTL }}
            - --drain-timeout={{ $w.drainTimeout }}
            {{- if eq $role "prefill" }}
            - --kv-ttl={{ $w.kvTTL }}
            {{- else }}
            - --prefill-wait-timeout={{ $w.prefillWaitTimeout }}
            - --signal-timeout={{ $w.signalTimeout }}
            {{- end }}
            {{- range $w.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "xpyd.configMapName" $root }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- if $tokenSecret }}
            - name: XPYD_CLUSTER_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ $tokenSecret }}
                  key: {{ $root.Values.clusterToken.secretKey }}
            {{- end }}
            {{- with $w.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ $w.port }}
              protocol: TCP
            {{- if eq $role "prefill" }}
            - name: signal
              containerPort: {{ $w.signalPort }}
              protocol: TCP
            {{- end }}
            - name: kv
              containerPort: {{ $w.kvPort }}
              protocol: TCP
          # /health answers 503 until the model is loaded and warmed up, then 200.
          startupProbe:
            {{- include "xpyd.httpProbe" (dict "path" "/health" "port" "http" "timing" $w.probes.startup) | nindent 12 }}
          readinessProbe:
            {{- include "xpyd.httpProbe" (dict "path" "/health" "port" "http" "timing" $w.probes.readiness) | nindent 12 }}
          livenessProbe:
            {{- include "xpyd.httpProbe" (dict "path" "/health" "port" "http" "timing" $w.probes.liveness) | nindent 12 }}
          resources:
            {{- include "xpyd.resources" (dict "resources" $w.resources "devices" $w.devices) | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - name: cache
              mountPath: /var/cache/xpyd
            - name: tmp
              mountPath: /tmp
            {{- if $root.Values.model.volume }}
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        - name: cache
          emptyDir:
            {{- with $root.Values.cache.medium }}
            medium: {{ . }}
            {{- end }}
            sizeLimit: {{ $root.Values.cache.sizeLimit }}
        - name: tmp
          emptyDir:
            sizeLimit: 1Gi
        {{- with $root.Values.model.volume }}
        - name: model
          {{- toYaml . | nindent 10 }}
        {{- end }}
{{- end -}}
