"""The chart's online planner (planner.enabled): its Deployment runs a `xpyd planner` command line xpyd accepts; in
scale mode a Role allows exactly get and patch on the two worker Deployments' scale subresource, bound to the
planner's own service account alone; in metrics mode no RBAC, and HPAs (External metric) or KEDA ScaledObjects
(a CRD: no schema bundled, its fields checked here) make the Deployments follow xpyd_planner_desired_replicas;
whatever sets a Deployment's replicas, the Deployment itself renders none. No cluster runs here."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from helmchart import KUBE_VERSIONS, NAMESPACE, VALUE_SETS, Helm

FULLNAME = "demo-xpyd"
PLANNER = f"{FULLNAME}-planner"
ROLES = ("prefill", "decode")
WORKERS = {f"{FULLNAME}-{r}" for r in ROLES}


def _objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _planner_pod(docs: list[dict]) -> dict:
    return _objects(docs, "Deployment")[PLANNER]["spec"]["template"]["spec"]


def _container(docs: list[dict]) -> dict:
    (c,) = _planner_pod(docs)["containers"]
    return c


def _argv(docs: list[dict]) -> list[str]:
    """The planner's command line as the kubelet runs it ($(VAR) from its ConfigMap)."""
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    c = _container(docs)
    assert c["command"] == ["xpyd"]
    argv = [re.sub(r"\$\(([A-Za-z_]+)\)", lambda m: config[m.group(1)], a) for a in c["args"]]
    assert not [a for a in argv if "$(" in a]
    return argv


def _planner_kinds(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs
            if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "planner"
            or d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject", "Role", "RoleBinding")}


@pytest.fixture(scope="module")
def parser():
    from xpyd.cli import build_parser

    return build_parser()


def test_no_planner_by_default(helm: Helm) -> None:
    docs = helm.template()
    assert _planner_kinds(docs) == set()
    assert all(_objects(docs, "Deployment")[n]["spec"]["replicas"] == 1 for n in WORKERS)


# --- scale mode ------------------------------------------------------------------------------------------------


def test_scale_mode_renders_exactly_the_planner_and_its_rbac(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner"])
    assert _planner_kinds(docs) == {("ServiceAccount", PLANNER), ("Service", PLANNER), ("Deployment", PLANNER),
                                    ("Role", PLANNER), ("RoleBinding", PLANNER), ("NetworkPolicy", PLANNER)}


def test_the_role_allows_get_and_patch_on_the_two_deployments_scale_and_nothing_else(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner"])
    role = _objects(docs, "Role")[PLANNER]
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": sorted(WORKERS, reverse=True), "verbs": ["get", "patch"]}]
    assert set(role["rules"][0]["resourceNames"]) <= set(_objects(docs, "Deployment"))
    binding = _objects(docs, "RoleBinding")[PLANNER]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": PLANNER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": PLANNER, "namespace": NAMESPACE}]
    assert len(_objects(docs, "RoleBinding")) == 1 and not _objects(docs, "ClusterRole")


def test_pod_deletion_costs_add_list_and_patch_on_pods_and_the_flag(helm: Helm, parser) -> None:
    from xpyd.launcher.planner_service import config_from_args

    assert not config_from_args(parser.parse_args(_argv(helm.template(VALUE_SETS["planner"])))).pod_deletion_cost
    docs = helm.template(VALUE_SETS["planner"], sets=("planner.podDeletionCost=true",))
    role = _objects(docs, "Role")[PLANNER]
    assert role["rules"][1:] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}]
    assert role["rules"][0]["resources"] == ["deployments/scale"]
    assert config_from_args(parser.parse_args(_argv(docs))).pod_deletion_cost
    metrics = helm.template(sets=("planner.enabled=true", "planner.mode=metrics", "planner.podDeletionCost=true"))
    assert not _objects(metrics, "Role") and "--pod-deletion-cost" not in _container(metrics)["args"]


def test_only_the_planner_pod_gets_a_token_and_the_bound_account(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner"])
    pod = _planner_pod(docs)
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == (PLANNER, True)
    for name, d in _objects(docs, "Deployment").items():
        if name != PLANNER:
            spec = d["spec"]["template"]["spec"]
            assert spec["serviceAccountName"] != PLANNER and spec["automountServiceAccountToken"] is False, name
    for name, sts in _objects(docs, "StatefulSet").items():
        assert sts["spec"]["template"]["spec"].get("serviceAccountName") != PLANNER, name


def test_the_planner_owns_the_worker_replicas_in_scale_mode(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner"], sets=("prefill.replicas=3",))
    for name in WORKERS:
        assert "replicas" not in _objects(docs, "Deployment")[name]["spec"], name
    assert _objects(docs, "Deployment")[PLANNER]["spec"]["replicas"] == 1
    assert _objects(docs, "Deployment")[PLANNER]["spec"]["strategy"] == {"type": "Recreate"}
    assert not _objects(docs, "HorizontalPodAutoscaler")


def test_the_planners_command_line_is_one_xpyd_accepts(helm: Helm, parser) -> None:
    from xpyd.discovery.planner_state import PlannerMode
    from xpyd.launcher.planner_service import config_from_args, parts_from_args
    from xpyd.planner.controller import Role

    docs = helm.template(VALUE_SETS["planner"], sets=("decode.batchSize=16",),
                         set_strings=("planner.simProfile=llama3-8b-h100-estimate",))
    args = parser.parse_args(_argv(docs))
    config = config_from_args(args)
    parts = parts_from_args(args, config.mode)
    proxy = _objects(docs, "Service")[f"{FULLNAME}-proxy"]
    assert config.mode is PlannerMode.SCALE and config.namespace == NAMESPACE
    assert config.deployments == {Role.PREFILL: f"{FULLNAME}-prefill", Role.DECODE: f"{FULLNAME}-decode"}
    assert config.proxy_url == f"http://{FULLNAME}-proxy.{NAMESPACE}.svc:{proxy['spec']['ports'][0]['port']}"
    assert config.etcd == next(d for d in docs if d["kind"] == "ConfigMap")["data"]["XPYD_ETCD"]
    assert (config.host, config.port) == ("0.0.0.0", _container(docs)["ports"][0]["containerPort"])
    assert (parts.controller.config.max_workers, parts.controller.config.dwell_s, parts.loop.interval_s) == (
        10, 120, 15)
    assert parts.controller.config.slo.ttft_s == 2 and args.batch_size == 16
    assert args.sim_profile == "llama3-8b-h100-estimate"


@pytest.mark.parametrize("value_set", ["planner-metrics", "planner-keda"])
def test_the_metrics_mode_command_line_is_one_xpyd_accepts(helm: Helm, parser, value_set: str) -> None:
    from xpyd.discovery.planner_state import PlannerMode
    from xpyd.launcher.planner_service import config_from_args, parts_from_args

    args = parser.parse_args(_argv(helm.template(VALUE_SETS[value_set])))
    config = config_from_args(args)
    parts = parts_from_args(args, config.mode)
    assert (config.mode, config.deployments, parts.controller.config.max_workers) == (PlannerMode.METRICS, {}, 12)
    assert parts.controller.config.slo.itl_s == 0.1


def test_the_planner_has_the_api_key_for_the_proxys_metrics(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner"], set_strings=("apiKey.existingSecret=keys",))
    env = {e["name"]: e for e in _container(docs)["env"]}
    assert env["XPYD_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    assert "env" not in _container(helm.template(VALUE_SETS["planner"]))


# --- metrics mode ----------------------------------------------------------------------------------------------


def test_metrics_mode_has_no_rbac_and_no_token(helm: Helm) -> None:
    for name in ("planner-metrics", "planner-keda"):
        docs = helm.template(VALUE_SETS[name])
        assert not _objects(docs, "Role") and not _objects(docs, "RoleBinding"), name
        assert _planner_pod(docs)["automountServiceAccountToken"] is False
        assert "--mode=metrics" in _container(docs)["args"]
        assert not [a for a in _container(docs)["args"] if "deployment" in a]


def test_hpas_follow_the_desired_replicas_as_an_external_metric(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner-metrics"])
    hpas = _objects(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == WORKERS
    for role in ROLES:
        spec = hpas[f"{FULLNAME}-{role}"]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULLNAME}-{role}"}
        assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 11)
        assert spec["metrics"] == [{"type": "External", "external": {
            "metric": {"name": "xpyd_planner_desired_replicas",
                       "selector": {"matchLabels": {"role": role, "service": PLANNER}}},
            "target": {"type": "AverageValue", "averageValue": "1"}}}]
        assert spec["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 60}}
        assert "replicas" not in _objects(docs, "Deployment")[f"{FULLNAME}-{role}"]["spec"]
    assert PLANNER in _objects(docs, "Service")  # (the metric's service label: the Service Prometheus scraped)


def test_keda_scaled_objects_query_the_desired_replicas(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner-keda"])
    assert not _objects(docs, "HorizontalPodAutoscaler")  # (KEDA makes its own)
    scaled = _objects(docs, "ScaledObject")
    assert set(scaled) == WORKERS
    for role in ROLES:
        so = scaled[f"{FULLNAME}-{role}"]
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULLNAME}-{role}"}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 11)
        assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 300)
        assert spec["triggers"] == [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
            "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
            "query": f'max(xpyd_planner_desired_replicas{{namespace="{NAMESPACE}",service="{PLANNER}",'
                     f'role="{role}"}})',
            "threshold": "1"}}]
        assert set(so) == {"apiVersion", "kind", "metadata", "spec"}
        assert "replicas" not in _objects(docs, "Deployment")[f"{FULLNAME}-{role}"]["spec"]


def test_metrics_mode_without_a_scaler_leaves_the_replicas_to_the_values(helm: Helm) -> None:
    docs = helm.template(sets=("planner.enabled=true", "planner.mode=metrics", "decode.replicas=2"))
    assert not _objects(docs, "HorizontalPodAutoscaler") and not _objects(docs, "ScaledObject")
    assert _objects(docs, "Deployment")[f"{FULLNAME}-decode"]["spec"]["replicas"] == 2


def test_the_service_monitor_scrapes_the_planner_too(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["planner-metrics"])
    (sm,) = _objects(docs, "ServiceMonitor").values()
    (expr,) = sm["spec"]["selector"]["matchExpressions"]
    assert expr["values"] == ["proxy", "prefill", "decode", "planner"]
    service = _objects(docs, "Service")[PLANNER]
    assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "planner"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8300, "targetPort": "http", "protocol": "TCP"}]
    assert _container(docs)["ports"] == [{"name": "http", "containerPort": 8300, "protocol": "TCP"}]


# --- with the network policies -----------------------------------------------------------------------------------


def test_network_policies_let_the_planner_reach_etcd_the_proxy_and_the_workers(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["network-policy"], sets=("planner.enabled=true",))
    policies = _objects(docs, "NetworkPolicy")
    planner_pods = {"podSelector": {"matchLabels": _objects(docs, "Deployment")[PLANNER]["spec"]["selector"]
                                    ["matchLabels"]}}
    etcd_clients = policies[f"{FULLNAME}-etcd"]["spec"]["ingress"][0]
    assert planner_pods in etcd_clients["from"] and etcd_clients["ports"] == [{"port": "client", "protocol": "TCP"}]
    for role in ROLES:
        http = policies[f"{FULLNAME}-{role}"]["spec"]["ingress"][0]
        assert planner_pods in http["from"] and http["ports"] == [{"port": "http", "protocol": "TCP"}]
    proxy_rules = policies[f"{FULLNAME}-proxy"]["spec"]["ingress"]
    assert {"from": [planner_pods], "ports": [{"port": "http", "protocol": "TCP"}]} in proxy_rules
    own = policies[PLANNER]["spec"]
    assert own["podSelector"] == planner_pods["podSelector"]
    assert own["ingress"] == [{"from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"port": "http", "protocol": "TCP"}]}]
    assert policies[PLANNER]["spec"]["policyTypes"] == ["Ingress"]
    no_metrics = helm.template(sets=("planner.enabled=true", "networkPolicy.enabled=true"))
    assert _objects(no_metrics, "NetworkPolicy")[PLANNER]["spec"]["ingress"] == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("sets", [
    ("planner.enabled=true", "networkPolicy.enabled=true",
     "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring"),
    ("planner.enabled=true", "planner.mode=metrics", "networkPolicy.enabled=true"),
    ("planner.enabled=true", "planner.podDeletionCost=true"),
    ("planner.enabled=true", "apiKey.existingSecret=keys", "planner.env[0].name=LOG_LEVEL",
     "planner.env[0].value=debug", "planner.extraArgs={--kube-timeout=10}"),
])
def test_planner_variants_pass_kubernetes_validate_strict(helm: Helm, sets: tuple[str, ...],
                                                          kube_version: str) -> None:
    for doc in helm.template(sets=sets):
        kubernetes_validate.validate(doc, kube_version, strict=True)
