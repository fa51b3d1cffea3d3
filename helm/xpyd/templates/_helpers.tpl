{{/* Names, labels and small shared pieces. */}}

{{- define "xpyd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name; component names append "-proxy", "-prefill", ... (kept under 63). */}}
{{- define "xpyd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 48 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "xpyd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component. Call with (dict "root" $ "component" "prefill"). */}}
{{- define "xpyd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "xpyd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects. Call with (dict "root" $ "component" "prefill"). */}}
{{- define "xpyd.labels" -}}
helm.sh/chart: {{ include "xpyd.chart" .root }}
{{ include "xpyd.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: xpyd
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "xpyd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "xpyd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "xpyd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "xpyd.configMapName" -}}
{{- printf "%s-config" (include "xpyd.fullname" .) -}}
{{- end -}}

{{- define "xpyd.etcdName" -}}
{{- printf "%s-etcd" (include "xpyd.fullname" .) -}}
{{- end -}}

{{/* etcd's generation: its member count, and "p" with persistence (e.g. m1, m3p). */}}
{{- define "xpyd.etcdGeneration" -}}
{{- printf "m%d%s" (int .Values.etcd.replicas) (ternary "p" "" .Values.etcd.persistence.enabled) -}}
{{- end -}}

{{/* The pods of the current etcd generation (Services, PDB, the StatefulSet's selector). */}}
{{- define "xpyd.etcdSelectorLabels" -}}
{{ include "xpyd.selectorLabels" (dict "root" . "component" "etcd") }}
xpyd.io/etcd-generation: {{ include "xpyd.etcdGeneration" . | quote }}
{{- end -}}

{{- define "xpyd.etcdHeadlessName" -}}
{{- printf "%s-etcd-headless" (include "xpyd.fullname" .) -}}
{{- end -}}

{{/* HOST:PORT of etcd for the proxy and the workers. */}}
{{- define "xpyd.etcdEndpoint" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s.%s.svc.%s:%d" (include "xpyd.etcdName" .) .Release.Namespace .Values.clusterDomain (int .Values.etcd.clientPort) -}}
{{- else -}}
{{- .Values.etcd.external.endpoint -}}
{{- end -}}
{{- end -}}

{{/* Secret name and key of the API key / cluster token ("" when not configured). */}}
{{- define "xpyd.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "xpyd.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "xpyd.clusterTokenSecretName" -}}
{{- if .Values.clusterToken.existingSecret -}}
{{- .Values.clusterToken.existingSecret -}}
{{- else if or .Values.clusterToken.value .Values.clusterToken.generate -}}
{{- printf "%s-cluster-token" (include "xpyd.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the token the workers also accept (a rotation window), if any. */}}
{{- define "xpyd.acceptedTokenSecretName" -}}
{{- $a := .Values.clusterToken.accept -}}
{{- if $a.existingSecret -}}
{{- $a.existingSecret -}}
{{- else if $a.value -}}
{{- printf "%s-cluster-token-accept" (include "xpyd.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
The cluster token of a Secret the chart makes: clusterToken.value; else the token already in the release's
Secret (lookup: kept across upgrades); else 48 random characters (a first install, and every `helm
template`, which cannot look up). Resolved once per render (kept in .Values.clusterToken.resolved), so
the Secret and the pods' checksum see the same token.
*/}}
{{- define "xpyd.clusterTokenValue" -}}
{{- $t := .Values.clusterToken -}}
{{- if not (hasKey $t "resolved") -}}
{{- $token := $t.value -}}
{{- if not $token -}}
{{- $found := lookup "v1" "Secret" .Release.Namespace (include "xpyd.clusterTokenSecretName" .) | default dict -}}
{{- $token = dig "data" $t.secretKey "" $found | b64dec -}}
{{- end -}}
{{- $_ := set $t "resolved" (default (randAlphaNum 48) $token) -}}
{{- end -}}
{{- $t.resolved -}}
{{- end -}}

{{/*
A pod's terminationGracePeriodSeconds: its preStop sleep, then drain.seconds of draining, then
drain.marginSeconds to exit. Call with (dict "root" $ "preStop" 5).
*/}}
{{- define "xpyd.terminationGrace" -}}
{{- add (int .preStop) (int .root.Values.drain.seconds) (int .root.Values.drain.marginSeconds) -}}
{{- end -}}

{{/* An HTTP probe: the chart fixes path and port, values give the timing. */}}
{{- define "xpyd.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
{{- with .timing }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Container resources: the values' requests/limits plus the accelerator devices, which go into
both requests and limits (extended resources must be equal in both).
Call with (dict "resources" .resources "devices" .devices).
*/}}
{{- define "xpyd.resources" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- $requests := deepCopy (default dict $res.requests) -}}
{{- $limits := deepCopy (default dict $res.limits) -}}
{{- $names := dict "neuron" "aws.amazon.com/neuron" "efa" "vpc.amazonaws.com/efa" "gpu" "nvidia.com/gpu" -}}
{{- range $key, $resource := $names -}}
{{- $count := int (index (default dict $.devices) $key | default 0) -}}
{{- if gt $count 0 -}}
{{- $_ := set $requests $resource $count -}}
{{- $_ := set $limits $resource $count -}}
{{- end -}}
{{- end -}}
{{- if $requests -}}{{- $_ := set $res "requests" $requests -}}{{- end -}}
{{- if $limits -}}{{- $_ := set $res "limits" $limits -}}{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
A worker container's securityContext: containerSecurityContext, plus IPC_LOCK where EFA is requested (libfabric
pins the memory it registers). Call with (dict "root" $ "efa" true).
*/}}
{{- define "xpyd.workerSecurityContext" -}}
{{- $sc := deepCopy (default dict .root.Values.containerSecurityContext) -}}
{{- if .efa -}}
{{- $caps := deepCopy (default dict $sc.capabilities) -}}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/*
topologySpreadConstraints with labelSelector defaulting to the component's own pods.
Call with (dict "root" $ "component" "prefill" "constraints" .topologySpreadConstraints).
*/}}
{{- define "xpyd.topologySpread" -}}
{{- $selector := include "xpyd.selectorLabels" (dict "root" .root "component" .component) | fromYaml -}}
{{- $out := list -}}
{{- range .constraints -}}
{{- $c := deepCopy . -}}
{{- if not (hasKey $c "labelSelector") -}}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) -}}
{{- end -}}
{{- $out = append $out $c -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
A pod's affinity: the component's affinity value, plus
  antiAffinity soft|hard   its pods on different nodes (preferred, weight 100 | required)
  placement.workersTogether preferred|required (prefill and decode only): every worker pod of the release
                           in one placement.topologyKey domain (a zone, or a node label naming a placement
                           group), so KV never crosses it. One term for both roles, matching both: the
                           first worker pod may go anywhere (it matches its own term), the others follow.
Call with (dict "root" $ "component" "prefill" "values" .Values.prefill).
*/}}
{{- define "xpyd.affinity" -}}
{{- $a := deepCopy (default dict .values.affinity) -}}
{{- $own := include "xpyd.selectorLabels" (dict "root" .root "component" .component) | fromYaml -}}
{{- with .values.antiAffinity -}}
{{- $term := dict "labelSelector" (dict "matchLabels" $own) "topologyKey" "kubernetes.io/hostname" -}}
{{- $anti := deepCopy (default dict $a.podAntiAffinity) -}}
{{- if eq . "hard" -}}
{{- $_ := set $anti "requiredDuringSchedulingIgnoredDuringExecution" (append (default list $anti.requiredDuringSchedulingIgnoredDuringExecution) $term) -}}
{{- else -}}
{{- $_ := set $anti "preferredDuringSchedulingIgnoredDuringExecution" (append (default list $anti.preferredDuringSchedulingIgnoredDuringExecution) (dict "weight" 100 "podAffinityTerm" $term)) -}}
{{- end -}}
{{- $_ := set $a "podAntiAffinity" $anti -}}
{{- end -}}
{{- $together := .root.Values.placement.workersTogether -}}
{{- if and $together (has .component (list "prefill" "decode")) -}}
{{- $release := dict "app.kubernetes.io/name" (include "xpyd.name" .root) "app.kubernetes.io/instance" .root.Release.Name -}}
{{- $workers := list (dict "key" "app.kubernetes.io/component" "operator" "In" "values" (list "prefill" "decode")) -}}
{{- $term := dict "labelSelector" (dict "matchLabels" $release "matchExpressions" $workers) "topologyKey" .root.Values.placement.topologyKey -}}
{{- $pa := deepCopy (default dict $a.podAffinity) -}}
{{- if eq $together "required" -}}
{{- $_ := set $pa "requiredDuringSchedulingIgnoredDuringExecution" (append (default list $pa.requiredDuringSchedulingIgnoredDuringExecution) $term) -}}
{{- else -}}
{{- $_ := set $pa "preferredDuringSchedulingIgnoredDuringExecution" (append (default list $pa.preferredDuringSchedulingIgnoredDuringExecution) (dict "weight" 100 "podAffinityTerm" $term)) -}}
{{- end -}}
{{- $_ := set $a "podAffinity" $pa -}}
{{- end -}}
{{- if $a }}{{ toYaml $a }}{{ end -}}
{{- end -}}

{{/* Scheduling fields shared by every pod template. Call with the component's values. */}}
{{- define "xpyd.scheduling" -}}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with include "xpyd.affinity" . | fromYaml }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- include "xpyd.topologySpread" (dict "root" $.root "component" $.component "constraints" .) | nindent 2 }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/*
A pod's initContainers: wait-for-etcd, then the chart's own steps (yaml list items in .steps, e.g. the
model download), then the component's initContainers value. Call with
(dict "root" $ "steps" "" "extra" .Values.prefill.initContainers); nothing when there are none.
*/}}
{{- define "xpyd.initContainers" -}}
{{- $items := trim (include "xpyd.waitForEtcd" .root) -}}
{{- with trim (default "" .steps) }}{{ $items = printf "%s\n%s" $items . | trim }}{{ end -}}
{{- with .extra }}{{ $items = printf "%s\n%s" $items (toYaml .) | trim }}{{ end -}}
{{- with $items }}
initContainers:
{{ . }}
{{- end }}
{{- end -}}

{{/* The init container that waits for etcd (uses the xpyd image's Python): a list item. */}}
{{- define "xpyd.waitForEtcd" -}}
{{- if .Values.waitForEtcd.enabled }}
- name: wait-for-etcd
  image: {{ include "xpyd.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import socket, sys, time
      endpoint, limit = sys.argv[1], float(sys.argv[2])
      host, _, port = endpoint.rpartition(":")
      deadline = time.monotonic() + limit
      while True:
          try:
              socket.create_connection((host, int(port)), timeout=2).close()
              print(f"etcd {endpoint} is reachable", flush=True)
              break
          except OSError as e:
              if time.monotonic() > deadline:
                  sys.exit(f"etcd {endpoint} unreachable for {limit:g}s: {e}")
              print(f"waiting for etcd {endpoint}: {e}", flush=True)
              time.sleep(2)
    - "$(XPYD_ETCD)"
    - {{ .Values.waitForEtcd.timeoutSeconds | quote }}
  envFrom:
    - configMapRef:
        name: {{ include "xpyd.configMapName" . }}
  resources:
    {{- toYaml .Values.waitForEtcd.resources | nindent 6 }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 6 }}
{{- end }}
{{- end -}}

{{/*
Pod annotations that roll a component's pods when something they read changes, and only then:
  checksum/config        workers: the whole ConfigMap (model, dtype, lengths, etcd, config.env);
                         proxy and planner: the part they read (etcd endpoint, config.env), so a model
                         setting rolls the workers and leaves the proxy alone
  checksum/api-key       proxy and planner (the planner reads the proxy's /metrics with it)
  checksum/cluster-token proxy, prefill and decode (one change rolls the three in the same upgrade)
  checksum/cluster-token-accept  prefill and decode (the proxy only signs: it never checks a token)
A secret the chart makes is hashed from the values; an existingSecret from its data in the cluster
(`lookup`, on install and upgrade), so `helm upgrade` after rotating it rolls the pods that read it.
`helm template` cannot look up: there the hash is of nothing, stable.
Call with (dict "root" $ "component" "proxy").
*/}}
{{- define "xpyd.configChecksum" -}}
{{- $v := .root.Values -}}
{{- $worker := has .component (list "prefill" "decode") -}}
{{- if $worker }}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- else }}
checksum/config: {{ list (include "xpyd.etcdEndpoint" .root) $v.config.env | toJson | sha256sum }}
{{- end }}
{{- if and (has .component (list "proxy" "planner")) (include "xpyd.apiKeySecretName" .root) }}
checksum/api-key: {{ include "xpyd.secretChecksum" (dict "root" .root "secret" $v.apiKey "name" (include "xpyd.apiKeySecretName" .root)) }}
{{- end }}
{{- if and (ne .component "planner") (include "xpyd.clusterTokenSecretName" .root) }}
checksum/cluster-token: {{ include "xpyd.secretChecksum" (dict "root" .root "secret" $v.clusterToken "name" (include "xpyd.clusterTokenSecretName" .root)) }}
{{- end }}
{{- if and $worker (include "xpyd.acceptedTokenSecretName" .root) }}
checksum/cluster-token-accept: {{ include "xpyd.secretChecksum" (dict "root" .root "secret" $v.clusterToken.accept "name" (include "xpyd.acceptedTokenSecretName" .root)) }}
{{- end }}
{{- end -}}

{{/* sha256 of one secret value: from the values, or from the existing Secret's data (lookup). */}}
{{- define "xpyd.secretChecksum" -}}
{{- if .secret.existingSecret -}}
{{- $found := lookup "v1" "Secret" .root.Release.Namespace .name | default dict -}}
{{- dig "data" .secret.secretKey "" $found | sha256sum -}}
{{- else if eq .name (include "xpyd.clusterTokenSecretName" .root) -}}
{{- include "xpyd.clusterTokenValue" .root | sha256sum -}}
{{- else -}}
{{- .secret.value | sha256sum -}}
{{- end -}}
{{- end -}}

{{/* The online planner's name (its Deployment, Service, ServiceAccount, Role). */}}
{{- define "xpyd.plannerName" -}}
{{- printf "%s-planner" (include "xpyd.fullname" .) -}}
{{- end -}}

{{/* What acts on the planner's desired replicas in metrics mode: "hpa", "keda" or "" (nothing in the chart). */}}
{{- define "xpyd.plannerScaler" -}}
{{- $p := .Values.planner -}}
{{- if and $p.enabled (eq $p.mode "metrics") -}}
{{- if $p.metrics.hpa.enabled }}hpa{{ else if $p.metrics.keda.enabled }}keda{{ end -}}
{{- end -}}
{{- end -}}

{{/*
"true" when something else sets a worker Deployment's replicas (its HPA, the planner in scale mode, or an
HPA/KEDA on the planner's metrics): the Deployment then leaves replicas out, so an upgrade never resets them.
Call with (dict "root" $ "role" "prefill").
*/}}
{{- define "xpyd.replicasOwnedElsewhere" -}}
{{- $p := .root.Values.planner -}}
{{- $w := index .root.Values .role -}}
{{- if or $w.autoscaling.enabled $w.keda.enabled (and $p.enabled (eq $p.mode "scale")) (include "xpyd.plannerScaler" .root) -}}
true
{{- end -}}
{{- end -}}

{{/* The model download's folder under model.mountPath (download.dir, else from the repo or the URI). */}}
{{- define "xpyd.modelDownloadDir" -}}
{{- $d := .Values.model.download -}}
{{- if $d.dir -}}
{{- $d.dir -}}
{{- else if eq $d.source "hf" -}}
{{- $d.hf.repo | replace "/" "--" -}}
{{- else -}}
{{- $d.s3.uri | trimSuffix "/" | base -}}
{{- end -}}
{{- end -}}

{{/*
XPYD_MODEL with model.download: the downloaded folder, or the folder its .gguf (download.file) is converted
into once, next to it; else model.path.
*/}}
{{- define "xpyd.modelPath" -}}
{{- $d := .Values.model.download -}}
{{- if $d.source -}}
{{- $dir := printf "%s/%s" (.Values.model.mountPath | trimSuffix "/") (include "xpyd.modelDownloadDir" .) -}}
{{- if $d.file -}}
{{- printf "%s/%s" $dir (trimSuffix ".gguf" (base $d.file)) -}}
{{- else -}}
{{- $dir -}}
{{- end -}}
{{- else -}}
{{- .Values.model.path -}}
{{- end -}}
{{- end -}}

{{- define "xpyd.modelClaimName" -}}
{{- default (printf "%s-models" (include "xpyd.fullname" .)) .Values.model.download.claim.existingClaim -}}
{{- end -}}

{{/*
The model download's init containers (list items; "" without model.download.source). Each worker pod runs
them; the first pod does the work under a file lock on the shared claim, the others find it done:
  model-download  hf: huggingface_hub into <mountPath>/<dir> (HF_TOKEN from hf.tokenSecret);
                  s3: `aws s3 sync` in the AWS CLI image (credentials from s3.credentialsSecret or the
                  service account, e.g. IRSA)
  model-convert   with download.file (a .gguf): converted once into <dir>/<file's stem>, a safetensors
                  folder the workers load without converting
Call with (dict "root" $).
*/}}
{{- define "xpyd.modelDownload" -}}
{{- $root := .root -}}
{{- $d := $root.Values.model.download -}}
{{- if $d.source -}}
{{- $dir := printf "%s/%s" ($root.Values.model.mountPath | trimSuffix "/") (include "xpyd.modelDownloadDir" $root) -}}
{{- $mounts := list (dict "name" "model" "mountPath" $root.Values.model.mountPath) (dict "name" "tmp" "mountPath" "/tmp") -}}
- name: model-download
  {{- if eq $d.source "hf" }}
  image: {{ include "xpyd.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import fcntl, sys
      from pathlib import Path
      repo, revision, dest, file = sys.argv[1:5]
      dest = Path(dest)
      dest.parent.mkdir(parents=True, exist_ok=True)
      with open(dest.parent / f".{dest.name}.lock", "a+") as lock:
          fcntl.flock(lock, fcntl.LOCK_EX)
          if (dest / ".xpyd-downloaded").is_file():
              print(f"{repo}@{revision} already in {dest}", flush=True)
              sys.exit(0)
          from huggingface_hub import snapshot_download
          snapshot_download(repo, revision=revision, local_dir=dest, allow_patterns=[file] if file else None)
          (dest / ".xpyd-downloaded").write_text(f"{repo}@{revision}\n")
          print(f"downloaded {repo}@{revision} into {dest}", flush=True)
    - {{ $d.hf.repo | quote }}
    - {{ $d.hf.revision | quote }}
    - {{ $dir | quote }}
    - {{ $d.file | quote }}
  env:
    - name: HOME
      value: /tmp
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- with $d.hf.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $d.hf.tokenSecret.key }}
    {{- end }}
  {{- else }}
  image: "{{ $d.s3.image.repository }}:{{ $d.s3.image.tag }}"
  imagePullPolicy: {{ $d.s3.image.pullPolicy }}
  command: [sh, -c]
  args:
    - |
      set -e
      if [ -f "$DEST/.xpyd-downloaded" ]; then echo "$URI already in $DEST"; exit 0; fi
      aws s3 sync --no-progress "$URI" "$DEST"
      echo "$URI" > "$DEST/.xpyd-downloaded"
  env:
    - name: URI
      value: {{ $d.s3.uri | quote }}
    - name: DEST
      value: {{ $dir | quote }}
    - name: HOME
      value: /tmp
  {{- with $d.s3.credentialsSecret }}
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  {{- end }}
  resources:
    {{- toYaml $d.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    {{- toYaml $mounts | nindent 4 }}
{{- if $d.file }}
- name: model-convert
  image: {{ include "xpyd.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import fcntl, os, sys
      from pathlib import Path
      gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
      os.environ["XPYD_CACHE_DIR"] = str(out.parent / ".xpyd-cache")  # same volume: the result is renamed
      os.environ["HF_HOME"] = "/tmp/huggingface"
      with open(out.parent / f".{out.name}.convert.lock", "a+") as lock:
          fcntl.flock(lock, fcntl.LOCK_EX)
          if (out / "config.json").is_file():
              print(f"{gguf} already converted into {out}", flush=True)
              sys.exit(0)
          from xpyd.model.loader import ensure_converted
          os.replace(ensure_converted(str(gguf), progress=False).path, out)
          print(f"converted {gguf} into {out}", flush=True)
    - {{ printf "%s/%s" $dir $d.file | quote }}
    - {{ include "xpyd.modelPath" $root | quote }}
  envFrom:
    - configMapRef:
        name: {{ include "xpyd.configMapName" $root }}
  resources:
    {{- toYaml $d.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    {{- toYaml $mounts | nindent 4 }}
{{- end }}
{{- end -}}
{{- end -}}

{{/*
How many pods of a component always run: its replicas, an HPA's minReplicas; 1 where the planner or an
autoscaler on its metrics owns a worker Deployment's replicas (it may go down to one).
Call with (dict "root" $ "component" "prefill").
*/}}
{{- define "xpyd.guaranteedPods" -}}
{{- $c := index .root.Values .component -}}
{{- if not (has .component (list "prefill" "decode")) -}}
{{- int $c.replicas -}}
{{- else if $c.autoscaling.enabled -}}
{{- int $c.autoscaling.minReplicas -}}
{{- else if include "xpyd.replicasOwnedElsewhere" (dict "root" .root "role" .component) -}}
1
{{- else -}}
{{- int $c.replicas -}}
{{- end -}}
{{- end -}}

{{/* A worker role's size for NOTES.txt: "2", "1-6 (HPA)" or "1-6 (KEDA)". Call with the role's values. */}}
{{- define "xpyd.roleCount" -}}
{{- if .autoscaling.enabled -}}
{{ .autoscaling.minReplicas }}-{{ .autoscaling.maxReplicas }} (HPA)
{{- else if .keda.enabled -}}
{{ .keda.minReplicaCount }}-{{ .keda.maxReplicaCount }} (KEDA)
{{- else -}}
{{ .replicas }}
{{- end -}}
{{- end -}}
