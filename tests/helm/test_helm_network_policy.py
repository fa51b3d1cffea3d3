"""The opt-in NetworkPolicies (networkPolicy.enabled): one per component, each selecting exactly
that component's pods of the release and allowing exactly the traffic xpyd needs, checked as
whole structures against the rendered workloads."""

from __future__ import annotations

import kubernetes_validate
import pytest

from helmchart import KUBE_VERSIONS, VALUE_SETS, Helm

FULLNAME = "demo-xpyd"
WORKLOADS = {"proxy": "Deployment", "prefill": "Deployment", "decode": "Deployment", "etcd": "StatefulSet"}
TCP = "TCP"
# What the network-policy example gives (helm/examples/network-policy.yaml).
EXAMPLE_PROXY_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
EXAMPLE_METRICS_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
ENABLED = ("networkPolicy.enabled=true",)
MONITORING = ("networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",)


def _objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _policies(docs: list[dict]) -> dict[str, dict]:
    """NetworkPolicies by component (the part of the name after the release's full name)."""
    found = _objects(docs, "NetworkPolicy")
    assert all(n.startswith(f"{FULLNAME}-") for n in found), sorted(found)
    return {n.removeprefix(f"{FULLNAME}-"): p for n, p in found.items()}


def _workload(docs: list[dict], component: str) -> dict:
    (found,) = [w for w in _objects(docs, WORKLOADS[component]).values()
                if w["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component]
    return found


def _selector(docs: list[dict], component: str) -> dict[str, str]:
    """The component's selector labels (etcd's policy covers every generation of its StatefulSet)."""
    labels = _workload(docs, component)["spec"]["selector"]["matchLabels"]
    return {k: v for k, v in labels.items() if k != "xpyd.io/etcd-generation"}


def _container_ports(docs: list[dict], component: str) -> dict[str, int]:
    (c,) = _workload(docs, component)["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def _pods(docs: list[dict], component: str) -> dict:
    """A peer: this release's pods of one component."""
    return {"podSelector": {"matchLabels": _selector(docs, component)}}


def _port(name: str) -> dict:
    return {"port": name, "protocol": TCP}


def _expected(docs: list[dict], proxy_from: list[dict], metrics_from: list[dict],
              etcd: bool = True) -> dict[str, dict]:
    """The whole spec of every policy for these peers."""
    http = [_port("http")]
    proxy_rule = {"ports": http, **({"from": proxy_from} if proxy_from else {})}
    metrics_rules = [{"from": metrics_from, "ports": http}] if metrics_from else []
    specs = {"proxy": [proxy_rule, *(metrics_rules if proxy_from else [])]}
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        specs[role] = [{"from": [_pods(docs, "proxy")], "ports": http},
                       {"from": [_pods(docs, peer)]},  # no ports: every port
                       *metrics_rules]
    if etcd:
        specs["etcd"] = [
            {"from": [_pods(docs, c) for c in ("proxy", "prefill", "decode")], "ports": [_port("client")]},
            {"from": [_pods(docs, "etcd")], "ports": [_port("client"), _port("peer")]},
            *([{"from": metrics_from, "ports": [_port("metrics")]}] if metrics_from else []),
        ]
    return {c: {"podSelector": {"matchLabels": _selector(docs, c)}, "policyTypes": ["Ingress"], "ingress": rules}
            for c, rules in specs.items()}


# --- on by default -------------------------------------------------------------------------


def test_network_policies_are_on_by_default(helm: Helm) -> None:
    names = set(_objects(helm.template(), "NetworkPolicy"))
    assert names == {f"{FULLNAME}-{c}" for c in ("proxy", "prefill", "decode", "etcd")}
    assert not _objects(helm.template(sets=("networkPolicy.enabled=false",)), "NetworkPolicy")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_value_set_keeps_the_workers_closed(helm: Helm, name: str) -> None:
    """Every example: the other role's pods are the only peers on every port; whoever else is let in (the
    proxy, the planner, metricsFrom) reaches the HTTP port only."""
    docs = helm.template(VALUE_SETS[name])
    policies = _objects(docs, "NetworkPolicy")
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        for rule in policies[f"{FULLNAME}-{role}"]["spec"]["ingress"]:
            if "ports" in rule:
                assert rule["ports"] == [{"port": "http", "protocol": "TCP"}], (name, role, rule)
            else:
                (only,) = rule["from"]
                assert only["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == peer, (name, role)


# --- the example value set -----------------------------------------------------------------


def test_example_renders_exactly_the_expected_policies(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["network-policy"])
    policies = _policies(docs)
    assert set(policies) == {"proxy", "prefill", "decode", "etcd"}
    expected = _expected(docs, EXAMPLE_PROXY_FROM, EXAMPLE_METRICS_FROM)
    for component, policy in policies.items():
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["metadata"]["labels"]["app.kubernetes.io/component"] == component
        assert policy["spec"] == expected[component], component


def test_pod_selectors_are_the_components_selector_labels(helm: Helm) -> None:
    """Each policy selects its component's pods through the workload's own selector (a subset of
    the pod template's labels), and no other workload's pods."""
    docs = helm.template(VALUE_SETS["network-policy"])
    pod_labels = {c: _workload(docs, c)["spec"]["template"]["metadata"]["labels"] for c in WORKLOADS}
    for component, policy in _policies(docs).items():
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selector == _selector(docs, component)
        assert selector == {"app.kubernetes.io/name": "xpyd", "app.kubernetes.io/instance": "demo",
                            "app.kubernetes.io/component": component}
        matched = [c for c, labels in pod_labels.items() if selector.items() <= labels.items()]
        assert matched == [component]


def test_workers_take_every_port_from_the_other_role_and_only_http_from_the_proxy(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["network-policy"])
    policies = _policies(docs)
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        rules = policies[role]["spec"]["ingress"]
        from_proxy = [r for r in rules if _pods(docs, "proxy") in r.get("from", [])]
        from_peer = [r for r in rules if _pods(docs, peer) in r.get("from", [])]
        assert from_proxy == [{"from": [_pods(docs, "proxy")], "ports": [_port("http")]}], role
        assert from_peer == [{"from": [_pods(docs, peer)]}], role  # no "ports": all of them
        # The named port is the worker's HTTP container port (the one --port gets).
        assert _container_ports(docs, role)["http"] == {"prefill": 8100, "decode": 8200}[role]
        # Nobody else gets an all-ports rule.
        assert [r for r in rules if "ports" not in r] == from_peer


def test_proxy_policy_port_is_the_proxy_container_port(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["network-policy"], sets=("proxy.port=9000",))
    (container,) = _workload(docs, "proxy")["spec"]["template"]["spec"]["containers"]
    assert {"name": "http", "containerPort": 9000, "protocol": TCP} in container["ports"]
    rules = _policies(docs)["proxy"]["spec"]["ingress"]
    assert rules == [{"ports": [_port("http")], "from": EXAMPLE_PROXY_FROM},
                     {"from": EXAMPLE_METRICS_FROM, "ports": [_port("http")]}]


def test_named_ports_exist_on_the_selected_pods(helm: Helm) -> None:
    """Every port a policy names is a containerPort name of the pods it selects, with the
    number the values give."""
    docs = helm.template(VALUE_SETS["network-policy"])
    numbers = {"proxy": {"http": 8000}, "prefill": {"http": 8100},
               "decode": {"http": 8200}, "etcd": {"client": 2379, "peer": 2380, "metrics": 2381}}
    for component, policy in _policies(docs).items():
        ports = _container_ports(docs, component)
        named = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
        assert {n: ports[n] for n in named} == numbers[component], component


def test_metrics_peers_only_reach_the_metrics_ports(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["network-policy"])
    metrics_port = {"proxy": "http", "prefill": "http", "decode": "http", "etcd": "metrics"}
    for component, policy in _policies(docs).items():
        rules = [r for r in policy["spec"]["ingress"]
                 if any(peer in r.get("from", []) for peer in EXAMPLE_METRICS_FROM)]
        assert rules == [{"from": EXAMPLE_METRICS_FROM, "ports": [_port(metrics_port[component])]}], component


# --- other values --------------------------------------------------------------------------


def test_empty_peer_lists_mean_proxy_from_anywhere_and_no_metrics_rules(helm: Helm) -> None:
    docs = helm.template(sets=ENABLED)
    policies = _policies(docs)
    assert {c: p["spec"] for c, p in policies.items()} == _expected(docs, [], [])
    assert policies["proxy"]["spec"]["ingress"] == [{"ports": [_port("http")]}]  # no "from": anyone


def test_metrics_from_without_proxy_from_adds_no_proxy_rule(helm: Helm) -> None:
    """The proxy port is open to anyone already; the workers and etcd get the metrics rule."""
    docs = helm.template(sets=ENABLED + MONITORING)
    peers = [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
    assert {c: p["spec"] for c, p in _policies(docs).items()} == _expected(docs, [], peers)


def test_external_etcd_gets_no_etcd_policy(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["external-etcd"] + VALUE_SETS["network-policy"])
    policies = _policies(docs)
    assert set(policies) == {"proxy", "prefill", "decode"}
    expected = _expected(docs, EXAMPLE_PROXY_FROM, EXAMPLE_METRICS_FROM, etcd=False)
    assert {c: p["spec"] for c, p in policies.items()} == expected


def test_policies_follow_name_overrides(helm: Helm) -> None:
    """Selectors come from the chart's helper, so they follow nameOverride like the pods do."""
    docs = helm.template(sets=ENABLED + ("nameOverride=llm", "fullnameOverride=demo-xpyd"))
    policies = _policies(docs)
    for component, policy in policies.items():
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "llm"
    assert {c: p["spec"] for c, p in policies.items()} == _expected(docs, [], [])


@pytest.mark.parametrize("sets", [ENABLED, ENABLED + MONITORING, ENABLED + ("proxy.service.type=LoadBalancer",)])
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_variants_pass_kubernetes_validate_strict(helm: Helm, sets: tuple[str, ...], kube_version: str) -> None:
    policies = _objects(helm.template(sets=sets), "NetworkPolicy")
    assert len(policies) == 4
    for name, policy in policies.items():
        try:
            kubernetes_validate.validate(policy, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"NetworkPolicy {name} (Kubernetes {kube_version}): {e.message}")
