"""Scaling and the gateway: per-role KEDA ScaledObjects and HPAs on the queue and TTFT metrics, and the
Gateway API Inference Extension's InferencePool and HTTPRoute. No schema is bundled for these CRDs, so their
fields are checked here, against the metric names xpyd exports."""

from __future__ import annotations

import re

import pytest

from helmchart import NAMESPACE, VALUE_SETS, Helm, RenderError

FULLNAME = "demo-xpyd"


def _kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _exported_metric_names() -> set[str]:
    """The metric names the proxy and the workers register (from their source)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "xpyd"
    text = (root / "proxy" / "metrics.py").read_text() + (root / "worker" / "metrics.py").read_text()
    return set(re.findall(r'(?:Gauge|Counter|Histogram)\("([a-z_]+)"', text))


def test_keda_example_scales_each_role_on_the_queue_and_ttft(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["keda"])
    scaled = _kind(docs, "ScaledObject")
    assert set(scaled) == {f"{FULLNAME}-prefill", f"{FULLNAME}-decode"}
    exported = _exported_metric_names()
    for role in ("prefill", "decode"):
        spec = scaled[f"{FULLNAME}-{role}"]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULLNAME}-{role}"}
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
            meta = trigger["metadata"]
            assert meta["serverAddress"].startswith("http") and float(meta["threshold"]) > 0
            assert f'namespace="{NAMESPACE}"' in meta["query"] and "{{" not in meta["query"]
            names = {n.removesuffix("_bucket") for n in re.findall(r"\b(xpyd_[a-z_]+)\b", meta["query"])}
            assert names and names <= exported, names - exported
        # KEDA owns the replicas: the Deployment leaves them out, no chart HPA competes
        deployment = _kind(docs, "Deployment")[f"{FULLNAME}-{role}"]
        assert "replicas" not in deployment["spec"]
    assert not _kind(docs, "HorizontalPodAutoscaler")
    queries = " ".join(t["metadata"]["query"] for s in scaled.values() for t in s["spec"]["triggers"])
    assert "xpyd_proxy_time_to_first_token_seconds_bucket" in queries and "xpyd_proxy_queue_waiting" in queries


def test_hpa_example_uses_the_queue_and_ttft(helm: Helm) -> None:
    hpas = _kind(helm.template(VALUE_SETS["autoscaling"]), "HorizontalPodAutoscaler")
    names = {m.get("external", m.get("pods", {})).get("metric", {}).get("name")
             for h in hpas.values() for m in h["spec"]["metrics"]}
    assert {"xpyd_proxy_ttft_p90_seconds", "xpyd_proxy_queue_waiting", "xpyd_requests_in_flight"} <= names


@pytest.mark.parametrize(("sets", "message"), [
    (("decode.keda.enabled=true",), "serverAddress"),
    (("decode.keda.enabled=true", "decode.keda.serverAddress=http://p:9090"), "at least one trigger"),
    (("prefill.keda.enabled=true", "prefill.autoscaling.enabled=true"), "enable one"),
    (("prefill.keda.enabled=true", "planner.enabled=true"), "the planner already sets"),
    (("inferencePool.enabled=true",), "endpointPicker.name"),
    (("inferencePool.enabled=true", "inferencePool.endpointPicker.name=epp", "inferencePool.httpRoute.enabled=true"),
     "parentRefs"),
    (("serviceMonitor.enabled=true",), "networkPolicy.metricsFrom"),
])
def test_scaling_and_gateway_misconfigurations_are_refused(helm: Helm, sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        helm.template(sets=sets)


def test_inference_pool_selects_the_proxy_pods_on_their_port(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["inference-gateway"])
    (pool,) = _kind(docs, "InferencePool").values()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    proxy = _kind(docs, "Deployment")[f"{FULLNAME}-proxy"]
    assert spec["selector"]["matchLabels"] == proxy["spec"]["selector"]["matchLabels"]
    (port,) = proxy["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert spec["targetPorts"] == [{"number": port["containerPort"]}]
    assert spec["endpointPickerRef"] == {"name": "xpyd-epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    (route,) = _kind(docs, "HTTPRoute").values()
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    assert re.fullmatch(r"([0-9]+(h|m|s|ms))+", rule["timeouts"]["request"])
    assert not _kind(helm.template(), "InferencePool")
