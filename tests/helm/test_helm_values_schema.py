"""Wrong values stop `helm template` with a message that names them: type and unknown-key errors
come from values.schema.json, cross-value errors from templates/_validate.tpl."""

from __future__ import annotations

import json

import pytest

from helmchart import CHART, Helm, RenderError

# (--set or --set-string items, a fragment of helm's error message)
SCHEMA_ERRORS = [
    pytest.param((), ("prefill.replicas=2",), "/prefill/replicas", id="replicas-as-string"),
    pytest.param(("decode.replicas=-1",), (), "/decode/replicas", id="negative-replicas"),
    pytest.param(("replicas=2",), (), "'replicas' not allowed", id="unknown-top-level-key"),
    pytest.param(("prefill.replica=2",), (), "'replica' not allowed", id="typo-in-worker-key"),
    pytest.param(("decode.kvTTL=5",), (), "'kvTTL' not allowed", id="prefill-only-key-on-decode"),
    pytest.param(("etcd.persistence.sise=1Gi",), (), "'sise' not allowed", id="unknown-nested-key"),
    pytest.param((), ("model.dtype=float16",), "/model/dtype", id="unknown-dtype"),
    pytest.param(("model.maxModelLen=8",), (), "/model/maxModelLen", id="context-too-short"),
    pytest.param(("etcd.replicas=2",), (), "/etcd/replicas", id="even-etcd-members"),
    pytest.param((), ("etcd.external.endpoint=etcd.infra",), "/etcd/external/endpoint", id="endpoint-without-port"),
    pytest.param((), ("proxy.service.type=Ingress",), "/proxy/service/type", id="unknown-service-type"),
    pytest.param((), ("proxy.policy=random",), "/proxy/policy", id="unknown-policy"),
    pytest.param(("prefill.devices.neuron=-1",), (), "/prefill/devices/neuron", id="negative-devices"),
    pytest.param(("prefill.devices.tpu=1",), (), "'tpu' not allowed", id="unknown-device"),
    pytest.param(("decode.leaseTTL=1",), (), "/decode/leaseTTL", id="lease-below-etcd-minimum"),
    pytest.param((), ("prefill.resources.requests.cpu=two",), "/prefill/resources/requests/cpu",
                 id="bad-quantity"),
    pytest.param(("prefill.resources.request.cpu=1",), (), "'request' not allowed", id="typo-in-resources"),
    pytest.param(("decode.probes.liveness.path=/x",), (), "'path' not allowed", id="probe-path-is-fixed"),
    pytest.param(("decode.extraArgs={batch}",), (), "/decode/extraArgs", id="extra-arg-not-a-flag"),
    pytest.param(("image.tag=15",), (), "/image/tag", id="numeric-image-tag"),
    pytest.param((), ("serviceMonitor.enabled=yes",), "/serviceMonitor/enabled", id="bool-as-string"),
    pytest.param(("networkPolicy.enable=true",), (), "'enable' not allowed", id="typo-in-network-policy"),
    pytest.param((), ("networkPolicy.metricsFrom=monitoring",), "/networkPolicy/metricsFrom",
                 id="peers-not-a-list"),
    pytest.param((), ("networkPolicy.proxyFrom[0]=10.0.0.0/8",), "/networkPolicy/proxyFrom/0",
                 id="peer-not-an-object"),
    pytest.param((), ("networkPolicy.proxyFrom[0].namespaceSelecter.matchLabels.a=b",),
                 "'namespaceSelecter' not allowed", id="typo-in-peer"),
    pytest.param((), ("planner.mode=auto",), "/planner/mode", id="unknown-planner-mode"),
    pytest.param((), ("prefill.extraVolumes[0].emptyDir.medium=Memory",), "/prefill/extraVolumes/0",
                 id="volume-without-name"),
    pytest.param((), ("decode.initContainers[0].name=fetch",), "/decode/initContainers/0", id="init-without-image"),
    pytest.param((), ("proxy.extraVolumeMounts[0].name=x", "proxy.extraVolumeMounts[0].mountPath=relative"),
                 "/proxy/extraVolumeMounts/0/mountPath", id="relative-mount-path"),
    pytest.param((), ("prefill.env[0].name=A",), "'env' not allowed", id="env-is-now-extraEnv"),
    pytest.param((), ("model.download.source=git",), "/model/download/source", id="unknown-download-source"),
    pytest.param((), ("model.download.s3.uri=https://bucket/x",), "/model/download/s3/uri", id="s3-uri-scheme"),
    pytest.param((), ("model.download.file=model.bin",), "/model/download/file", id="download-file-not-gguf"),
    pytest.param((), ("planner.slo=fast",), "/planner/slo", id="slo-not-key-value"),
    pytest.param((), ("planner.slo=ttft=2s\\,latency=1s",), "/planner/slo", id="unknown-slo-key"),
    pytest.param(("planner.maxWorkers=1",), (), "/planner/maxWorkers", id="planner-one-worker"),
    pytest.param(("planner.intervalSeconds=0",), (), "/planner/intervalSeconds", id="planner-zero-interval"),
    pytest.param(("planner.metrics.hpa.enable=true",), (), "'enable' not allowed", id="typo-in-planner-hpa"),
    pytest.param((), ("planner.metrics.keda.serverAddress=prometheus:9090",), "/planner/metrics/keda/serverAddress",
                 id="keda-address-without-scheme"),
]

TEMPLATE_ERRORS = [
    pytest.param(("etcd.enabled=false",), "etcd.external.endpoint", id="no-etcd-at-all"),
    pytest.param(("etcd.external.endpoint=etcd:2379",), "not both", id="two-etcds"),
    pytest.param(("etcd.replicas=3",), "etcd.persistence.enabled", id="members-without-persistence"),
    pytest.param(("prefill.autoscaling.enabled=true", "prefill.autoscaling.minReplicas=5"), "maxReplicas",
                 id="hpa-min-above-max"),
    pytest.param(("decode.autoscaling.enabled=true", "decode.autoscaling.targetCPUUtilizationPercentage=null"),
                 "no metric", id="hpa-without-metrics"),
    pytest.param(("proxy.podDisruptionBudget.maxUnavailable=1",), "not both", id="pdb-min-and-max"),
    pytest.param(("clusterToken.value=short",), "8-256", id="short-cluster-token"),
    pytest.param(("etcd.security.clientTLS=true",), "plain HTTP with no certificate", id="etcd-client-tls"),
    pytest.param(("etcd.security.auth=true",), "etcd.security.auth", id="etcd-auth"),
    pytest.param(("model.download.source=hf",), "model.download.hf.repo", id="hf-without-repo"),
    pytest.param(("model.download.source=s3",), "model.download.s3.uri", id="s3-without-uri"),
    pytest.param(("model.download.source=s3", "model.download.s3.uri=s3://b/m",
                  "model.volume.hostPath.path=/models"), "leave model.volume empty", id="download-and-volume"),
    pytest.param(("prefill.extraVolumes[0].name=tmp", "prefill.extraVolumes[0].emptyDir.medium=Memory"),
                 "the name tmp is the chart's own", id="volume-name-clash"),
    pytest.param(("apiKey.value=short",), "8-512", id="short-api-key"),
    pytest.param(("apiKey.value=has a space",), "without spaces", id="api-key-with-space"),
    pytest.param(("planner.enabled=true", "prefill.autoscaling.enabled=true"), "prefill.autoscaling.enabled makes an "
                 "HPA set them too", id="planner-scale-and-hpa"),
    pytest.param(("planner.enabled=true", "planner.mode=metrics", "planner.metrics.hpa.enabled=true",
                  "decode.autoscaling.enabled=true"), "decode.autoscaling.enabled", id="planner-hpa-and-hpa"),
    pytest.param(("planner.enabled=true", "planner.metrics.hpa.enabled=true"), "with planner.mode=scale the planner "
                 "sets the replicas itself", id="planner-scale-with-metrics-hpa"),
    pytest.param(("planner.metrics.hpa.enabled=true", "planner.metrics.keda.enabled=true"), "enable one",
                 id="planner-hpa-and-keda"),
    pytest.param(("planner.enabled=true", "planner.mode=metrics", "planner.metrics.keda.enabled=true"),
                 "planner.metrics.keda.serverAddress", id="keda-without-prometheus"),
    pytest.param(("planner.enabled=true", "proxy.replicas=2"), "keep proxy.replicas 1", id="planner-two-proxies"),
    pytest.param(("planner.enabled=true", "planner.mode=metrics", "prefill.replicas=5", "decode.replicas=4"),
                 "more than planner.maxWorkers", id="replicas-above-planner-max"),
]


@pytest.mark.parametrize(("sets", "set_strings", "message"), SCHEMA_ERRORS)
def test_schema_rejects(helm: Helm, sets: tuple[str, ...], set_strings: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError) as e:
        helm.template(sets=sets, set_strings=set_strings)
    assert message in str(e.value)


@pytest.mark.parametrize(("sets", "message"), TEMPLATE_ERRORS)
def test_template_checks_reject(helm: Helm, sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError) as e:
        helm.template(sets=sets)
    assert message in str(e.value)


def test_lint_strict_reports_schema_errors(helm: Helm) -> None:
    done = helm.run("lint", "--strict", str(CHART), "--set-string", "prefill.replicas=2")
    assert done.returncode != 0 and "/prefill/replicas" in done.stdout + done.stderr


@pytest.mark.parametrize("sets", [
    ("prefill.podDisruptionBudget.minAvailable=50%",),
    ("decode.podDisruptionBudget.minAvailable=null", "decode.podDisruptionBudget.maxUnavailable=50%"),
    ("etcd.replicas=3", "etcd.persistence.enabled=true"),
    ("proxy.service.type=NodePort", "proxy.service.nodePort=30080"),
    ("decode.autoscaling.enabled=true", "decode.autoscaling.targetCPUUtilizationPercentage=null",
     "decode.autoscaling.metrics[0].type=Pods", "decode.autoscaling.metrics[0].pods.metric.name=x",
     "decode.autoscaling.metrics[0].pods.target.type=AverageValue",
     "decode.autoscaling.metrics[0].pods.target.averageValue=4"),
    ("config.env.LOG_LEVEL=debug", "cache.medium=Memory"),
])
def test_valid_variations_render(helm: Helm, sets: tuple[str, ...]) -> None:
    assert helm.template(sets=sets)


def test_schema_is_strict_where_it_matters() -> None:
    """Every object in the schema that lists its properties rejects others, except the
    pass-through Kubernetes fields (affinity, securityContext, volume, ...)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
                open_objects.append(path)
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(schema, "")
    allowed_open = {"/definitions/env/items", "/definitions/topologySpreadConstraints/items",
                    "/definitions/autoscaling/properties/metrics/items",
                    # Kubernetes objects passed through (extraVolumes, extraVolumeMounts, initContainers,
                    # extraContainers): the schema requires their names, kubernetes-validate checks the rest
                    "/definitions/namedObjects/items", "/definitions/volumeMounts/items", "/definitions/containers/items"}
    assert set(open_objects) <= allowed_open
