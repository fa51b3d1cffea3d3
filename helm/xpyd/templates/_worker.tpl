{{/*
A worker Deployment (prefill or decode). Call with (dict "root" $ "role" "prefill").

The worker binds 0.0.0.0 and advertises its pod IP: that address goes into its etcd key
/workers/{role}/{ip}/{port} and into the request ids peers use to reach its signal plane and
KV listener. On SIGTERM it revokes its etcd lease first (the proxy stops routing to it within
milliseconds), then drains for up to drain.seconds; terminationGracePeriodSeconds covers both.
That revoke is the worker's leaving etcd: no preStop hook is needed for it (nothing reaches a worker through
a Service, whose endpoints would lag; the proxy follows etcd), and SIGTERM is its first step.
*/}}
{{- define "xpyd.worker" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $w := index $root.Values $role -}}
{{- $tokenSecret := include "xpyd.clusterTokenSecretName" $root -}}
{{- $gpu := gt (int $w.devices.gpu) 0 -}}
{{- $efa := gt (int $w.devices.efa) 0 -}}
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
        {{- include "xpyd.configChecksum" (dict "root" $root "component" $role) | trim | nindent 8 }}
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
      terminationGracePeriodSeconds: {{ include "xpyd.terminationGrace" (dict "root" $root "preStop" 0) }}
      {{- with $w.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with include "xpyd.scheduling" (dict "root" $root "component" $role "values" $w) | trim }}{{ . | nindent 6 }}{{ end }}
      {{- with include "xpyd.initContainers" (dict "root" $root "steps" (include "xpyd.modelDownload" (dict "root" $root)) "extra" $w.initContainers) | trim }}{{ . | nindent 6 }}{{ end }}
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
            # the device follows devices.gpu; the KV backend is the release's kvBackend (both roles agree)
            - --device={{ ternary "cuda" "cpu" $gpu }}
            - --kv-backend={{ $root.Values.kvBackend }}
            {{- if include "xpyd.modelPath" $root }}
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
            - --drain-timeout={{ $root.Values.drain.seconds }}
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
            {{- with include "xpyd.acceptedTokenSecretName" $root }}
            - name: XPYD_CLUSTER_TOKEN_ACCEPT
              valueFrom:
                secretKeyRef:
                  name: {{ . }}
                  key: {{ $root.Values.clusterToken.accept.secretKey }}
            {{- end }}
            {{- if $efa }}
            # EFA through libfabric (NIXL's transport where the image's NIXL/UCX reaches it)
            - name: FI_PROVIDER
              value: efa
            - name: FI_EFA_FORK_SAFE
              value: "1"
            {{- if $gpu }}
            - name: FI_EFA_USE_DEVICE_RDMA
              value: "1"
            {{- end }}
            {{- end }}
            {{- with $w.extraEnv }}
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
            {{- include "xpyd.workerSecurityContext" (dict "root" $root "efa" $efa) | nindent 12 }}
          volumeMounts:
            - name: cache
              mountPath: /var/cache/xpyd
            - name: tmp
              mountPath: /tmp
            {{- if $w.shmSize }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- if or $root.Values.model.volume $root.Values.model.download.source }}
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            {{- end }}
            {{- with $w.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
        {{- with $w.extraContainers }}
        {{- toYaml . | nindent 8 }}
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
        {{- with $w.shmSize }}
        # /dev/shm: the shm KV backend's pools, torch's shared tensors (memory: counts toward the memory limit)
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ . }}
        {{- end }}
        {{- if $root.Values.model.download.source }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ include "xpyd.modelClaimName" $root }}
        {{- else if $root.Values.model.volume }}
        - name: model
          {{- toYaml $root.Values.model.volume | nindent 10 }}
        {{- end }}
        {{- with $w.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}
