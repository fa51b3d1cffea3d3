{{/*
Checks that span several values (values.schema.json checks each value on its own).
Rendering stops with a message that names the values to change.
*/}}
{{- define "xpyd.validate" -}}
{{- $v := .Values -}}
{{- if and (not $v.etcd.enabled) (not $v.etcd.external.endpoint) -}}
{{- fail "etcd.enabled is false: set etcd.external.endpoint to HOST:PORT of your etcd" -}}
{{- end -}}
{{- if and $v.etcd.enabled $v.etcd.external.endpoint -}}
{{- fail "set either etcd.enabled (etcd in this release) or etcd.external.endpoint, not both" -}}
{{- end -}}
{{- if and $v.etcd.enabled (gt (int $v.etcd.replicas) 1) (not $v.etcd.persistence.enabled) -}}
{{- fail "etcd.replicas > 1 needs etcd.persistence.enabled=true (a member restarted with an empty data dir cannot rejoin)" -}}
{{- end -}}
{{- range $what := list "clientTLS" "auth" -}}
{{- if index $v.etcd.security $what -}}
{{- fail (printf "etcd.security.%s: xpyd's discovery (xpyd/discovery/etcd*.py) connects to etcd over plain HTTP with no certificate or user, so the proxy and the workers could not register or watch; keep it false and let networkPolicy (on by default) limit etcd's client port to this release's pods (docs/kubernetes.md, \"etcd\")" $what) -}}
{{- end -}}
{{- end -}}
{{- if has $v.kvBackend (list "shm" "cuda_ipc" "neuron") -}}
{{- fail (printf "kvBackend=%s cannot work between pods: shm needs prefill and decode in one /dev/shm and network namespace (two pods never share them), cuda_ipc needs them on one GPU (a pod holds whole GPUs), and neuron refuses to start (the workers keep the KV pool in host or CUDA memory; docs/transfer.md). Use auto (TCP between pods), tcp or nixl" $v.kvBackend) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $w := index $v $role -}}
{{- if gt (int $w.devices.neuron) 0 -}}
{{- fail (printf "%s.devices.neuron: xpyd's workers compute on the CPU or one CUDA device (--device cpu|cuda) and have no Neuron device path, so a pod holding a Neuron device would leave it idle; set %s.devices.neuron=0" $role $role) -}}
{{- end -}}
{{- if gt (int $w.devices.gpu) 1 -}}
{{- fail (printf "%s.devices.gpu=%v: a worker computes on one device (--device cuda); run more replicas instead" $role $w.devices.gpu) -}}
{{- end -}}
{{- if and (gt (int $w.devices.efa) 0) (ne $v.kvBackend "nixl") -}}
{{- fail (printf "%s.devices.efa: only kvBackend=nixl can move KV over an EFA interface (with kvBackend=%s it moves over TCP/shared memory); set kvBackend=nixl or %s.devices.efa=0" $role $v.kvBackend $role) -}}
{{- end -}}
{{- if $w.autoscaling.enabled -}}
{{- if gt (int $w.autoscaling.minReplicas) (int $w.autoscaling.maxReplicas) -}}
{{- fail (printf "%s.autoscaling.minReplicas (%v) is above maxReplicas (%v)" $role $w.autoscaling.minReplicas $w.autoscaling.maxReplicas) -}}
{{- end -}}
{{- if and (kindIs "invalid" $w.autoscaling.targetCPUUtilizationPercentage) (not $w.autoscaling.metrics) -}}
{{- fail (printf "%s.autoscaling is enabled with no metric: set targetCPUUtilizationPercentage or metrics" $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- include "xpyd.validatePlanner" . -}}
{{- include "xpyd.validateExtensions" . -}}
{{- include "xpyd.validateEtcdUpgrade" . -}}
{{- include "xpyd.validateKeda" . -}}
{{- $ip := $v.inferencePool -}}
{{- if and $ip.enabled (not $ip.endpointPicker.name) -}}
{{- fail "inferencePool.enabled needs inferencePool.endpointPicker.name: the Service of the endpoint picker (EPP) you run" -}}
{{- end -}}
{{- if and $ip.enabled $ip.httpRoute.enabled (not $ip.httpRoute.parentRefs) -}}
{{- fail "inferencePool.httpRoute needs parentRefs: the Gateway it attaches to, e.g. [{name: inference-gateway}]" -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled $v.serviceMonitor.enabled (not $v.networkPolicy.metricsFrom) -}}
{{- fail "serviceMonitor.enabled: the NetworkPolicies (networkPolicy.enabled) let nobody scrape the workers, etcd or the planner; set networkPolicy.metricsFrom to your Prometheus (e.g. [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}])" -}}
{{- end -}}
{{- range $component := list "etcd" "proxy" "prefill" "decode" -}}
{{- $pdb := (index $v $component).podDisruptionBudget -}}
{{- if and $pdb.enabled (not (kindIs "invalid" $pdb.minAvailable)) (not (kindIs "invalid" $pdb.maxUnavailable)) -}}
{{- fail (printf "%s.podDisruptionBudget: set minAvailable or maxUnavailable, not both (set the other to null)" $component) -}}
{{- end -}}
{{- end -}}
{{- if and $v.apiKey.value $v.apiKey.existingSecret -}}
{{- fail "set apiKey.existingSecret or apiKey.value, not both" -}}
{{- end -}}
{{- if and $v.clusterToken.value $v.clusterToken.existingSecret -}}
{{- fail "set clusterToken.existingSecret or clusterToken.value, not both" -}}
{{- end -}}
{{- if and $v.apiKey.value (or (lt (len $v.apiKey.value) 8) (gt (len $v.apiKey.value) 512) (contains " " $v.apiKey.value)) -}}
{{- fail "apiKey.value must be 8-512 printable characters without spaces" -}}
{{- end -}}
{{- if and $v.clusterToken.value (or (lt (len $v.clusterToken.value) 8) (gt (len $v.clusterToken.value) 256)) -}}
{{- fail "clusterToken.value must be 8-256 characters" -}}
{{- end -}}
{{- $accept := $v.clusterToken.accept -}}
{{- if and $accept.value $accept.existingSecret -}}
{{- fail "set clusterToken.accept.existingSecret or clusterToken.accept.value, not both" -}}
{{- end -}}
{{- if and (or $accept.value $accept.existingSecret) (not (include "xpyd.clusterTokenSecretName" .)) -}}
{{- fail "clusterToken.accept is the other token of a rotation: it needs a cluster token (clusterToken.existingSecret, value or generate)" -}}
{{- end -}}
{{- if and $accept.value (or (lt (len $accept.value) 8) (gt (len $accept.value) 256)) -}}
{{- fail "clusterToken.accept.value must be 8-256 characters" -}}
{{- end -}}
{{- if and $accept.value (eq $accept.value $v.clusterToken.value) -}}
{{- fail "clusterToken.accept.value is the same as clusterToken.value: give the other token of the rotation" -}}
{{- end -}}
{{- end -}}


{{/* The planner's settings against each other and against the rest. */}}
{{- define "xpyd.validatePlanner" -}}
{{- $v := .Values -}}
{{- $p := $v.planner -}}
{{- if and $p.metrics.hpa.enabled $p.metrics.keda.enabled -}}
{{- fail "planner.metrics.hpa and planner.metrics.keda both act on the planner's desired replicas: enable one" -}}
{{- end -}}
{{- if $p.enabled -}}
{{- if and (ne $p.mode "metrics") (or $p.metrics.hpa.enabled $p.metrics.keda.enabled) -}}
{{- fail (printf "planner.metrics.hpa/keda act on the desired replicas of planner.mode=metrics; with planner.mode=%s the planner sets the replicas itself: turn them off or set planner.mode=metrics" $p.mode) -}}
{{- end -}}
{{- if and $p.metrics.keda.enabled (not $p.metrics.keda.serverAddress) -}}
{{- fail "planner.metrics.keda needs planner.metrics.keda.serverAddress: the Prometheus that scrapes the planner" -}}
{{- end -}}
{{- $scaling := or (eq $p.mode "scale") $p.metrics.hpa.enabled $p.metrics.keda.enabled -}}
{{- range $role := list "prefill" "decode" -}}
{{- if and $scaling (index $v $role).autoscaling.enabled -}}
{{- fail (printf "the planner (planner.mode=%s%s) sets the %s Deployment's replicas and %s.autoscaling.enabled makes an HPA set them too: turn one off" $p.mode (ternary "" (printf ", planner.metrics.%s" (include "xpyd.plannerScaler" $)) (eq $p.mode "scale")) $role $role) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $v.proxy.replicas) 1 -}}
{{- fail (printf "the planner reads one proxy's /metrics through the proxy Service: with proxy.replicas %v it would see each proxy's counters in turn (a share of the traffic, counters that jump); keep proxy.replicas 1 with planner.enabled" $v.proxy.replicas) -}}
{{- end -}}
{{- if and (not $scaling) (gt (add (int $v.prefill.replicas) (int $v.decode.replicas)) (int $p.maxWorkers)) -}}
{{- fail (printf "prefill.replicas + decode.replicas (%d) is more than planner.maxWorkers (%v)" (add (int $v.prefill.replicas) (int $v.decode.replicas)) $p.maxWorkers) -}}
{{- end -}}
{{- end -}}
{{- end -}}


{{/* The model download and the pods' extensions. */}}
{{- define "xpyd.validateExtensions" -}}
{{- $v := .Values -}}
{{- $d := $v.model.download -}}
{{- if and (eq $d.source "hf") (not $d.hf.repo) -}}
{{- fail "model.download.source=hf needs model.download.hf.repo (e.g. HuggingFaceTB/SmolLM2-1.7B-Instruct)" -}}
{{- end -}}
{{- if and (eq $d.source "s3") (not $d.s3.uri) -}}
{{- fail "model.download.source=s3 needs model.download.s3.uri (s3://bucket/prefix/)" -}}
{{- end -}}
{{- if and $d.source $v.model.volume -}}
{{- fail "model.download fills its own claim (model.download.claim) and mounts it as the model volume: leave model.volume empty, or set model.download.claim.existingClaim to your PVC" -}}
{{- end -}}
{{- range $component := list "proxy" "prefill" "decode" -}}
{{- $c := index $v $component -}}
{{- range $kind, $reserved := dict "extraVolumes" (list "cache" "tmp" "dshm" "model") "initContainers" (list "wait-for-etcd" "model-download" "model-convert") "extraContainers" (list $component) -}}
{{- range (index $c $kind) -}}
{{- if has .name $reserved -}}
{{- fail (printf "%s.%s: the name %s is the chart's own (%s): pick another" $component $kind .name (join ", " $reserved)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A change of etcd.persistence (size, storageClass, accessModes) at the same member count would edit the
StatefulSet's volumeClaimTemplates, which Kubernetes refuses; said here, on install and upgrade (lookup; not
with helm template, which sees no cluster).
*/}}
{{- define "xpyd.validateEtcdUpgrade" -}}
{{- $e := .Values.etcd -}}
{{- if and $e.enabled $e.persistence.enabled -}}
{{- $name := printf "%s-%s" (include "xpyd.etcdName" .) (include "xpyd.etcdGeneration" .) -}}
{{- $found := lookup "apps/v1" "StatefulSet" .Release.Namespace $name | default dict -}}
{{- range (dig "spec" "volumeClaimTemplates" list $found) -}}
{{- $size := dig "spec" "resources" "requests" "storage" "" . -}}
{{- if and $size (ne (toString $size) (toString $e.persistence.size)) -}}
{{- fail (printf "etcd.persistence.size: the running StatefulSet %s has %s claims and Kubernetes cannot change a StatefulSet's volumeClaimTemplates; keep %s, or change etcd.replicas in the same upgrade (a new etcd generation with new claims; docs/kubernetes.md, \"etcd\")" $name $size $size) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Per-role KEDA against the other owners of a worker Deployment's replicas. */}}
{{- define "xpyd.validateKeda" -}}
{{- $v := .Values -}}
{{- range $role := list "prefill" "decode" -}}
{{- $k := (index $v $role).keda -}}
{{- if $k.enabled -}}
{{- if (index $v $role).autoscaling.enabled -}}
{{- fail (printf "%s.keda and %s.autoscaling both make an HPA for the %s Deployment: enable one" $role $role $role) -}}
{{- end -}}
{{- if and $v.planner.enabled (or (eq $v.planner.mode "scale") (include "xpyd.plannerScaler" $)) -}}
{{- fail (printf "%s.keda: the planner already sets the %s Deployment's replicas (planner.mode=%s): turn one off" $role $role $v.planner.mode) -}}
{{- end -}}
{{- if not $k.serverAddress -}}
{{- fail (printf "%s.keda needs serverAddress: the Prometheus that scrapes the pods" $role) -}}
{{- end -}}
{{- if not $k.triggers -}}
{{- fail (printf "%s.keda needs at least one trigger ({query, threshold})" $role) -}}
{{- end -}}
{{- if gt (int $k.minReplicaCount) (int $k.maxReplicaCount) -}}
{{- fail (printf "%s.keda.minReplicaCount (%v) is above maxReplicaCount (%v)" $role $k.minReplicaCount $k.maxReplicaCount) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
