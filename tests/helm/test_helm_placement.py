"""Placement and disruption: prefill and decode kept in one topology domain, anti-affinity within a component,
maxSurge 0, and PodDisruptionBudgets that keep a minimum available where there is a minimum to keep."""

from __future__ import annotations

import pytest

from helmchart import VALUE_SETS, Helm

FULLNAME = "demo-xpyd"


def _kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"].removeprefix(f"{FULLNAME}-"): d for d in docs if d["kind"] == kind}


def _workload(docs: list[dict], component: str) -> dict:
    (found,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                and d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component]
    return found


def _affinity(docs: list[dict], component: str) -> dict:
    return _workload(docs, component)["spec"]["template"]["spec"].get("affinity", {})


def _labels(docs: list[dict], component: str) -> dict[str, str]:
    return _workload(docs, component)["spec"]["template"]["metadata"]["labels"]


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


@pytest.mark.parametrize("mode", ["preferred", "required"])
def test_workers_together_is_one_term_that_matches_both_roles(helm: Helm, mode: str) -> None:
    docs = helm.template(sets=(f"placement.workersTogether={mode}",))
    terms = []
    for role in ("prefill", "decode"):
        pa = _affinity(docs, role)["podAffinity"]
        if mode == "required":
            (term,) = pa["requiredDuringSchedulingIgnoredDuringExecution"]
        else:
            (weighted,) = pa["preferredDuringSchedulingIgnoredDuringExecution"]
            term = weighted["podAffinityTerm"]
        assert term["topologyKey"] == "topology.kubernetes.io/zone"
        terms.append(term)
    assert terms[0] == terms[1]
    # the term selects every worker of the release (so the first pod can schedule: it matches itself), and
    # neither the proxy nor etcd
    for name, expected in (("prefill", True), ("decode", True), ("proxy", False), ("etcd", False)):
        assert _matches(terms[0]["labelSelector"], _labels(docs, name)) is expected, name
    assert "podAffinity" not in _affinity(docs, "proxy")


def test_placement_keeps_the_users_affinity(helm: Helm) -> None:
    docs = helm.template(sets=(
        "placement.workersTogether=required", "placement.topologyKey=example.com/placement-group",
        "decode.antiAffinity=hard",
        "decode.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
        ".matchExpressions[0].key=gpu",
        "decode.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
        ".matchExpressions[0].operator=Exists"))
    a = _affinity(docs, "decode")
    assert a["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (term,) = a["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "example.com/placement-group"
    (anti,) = a["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"


def test_etcd_members_prefer_different_nodes_by_default(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["2p3d"])
    (weighted,) = _affinity(docs, "etcd")["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert weighted["podAffinityTerm"]["labelSelector"]["matchLabels"] == {
        k: v for k, v in _labels(docs, "etcd").items()
        if k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")}
    hard = helm.template(VALUE_SETS["2p3d"], sets=("etcd.antiAffinity=hard",))
    assert _affinity(hard, "etcd")["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_max_surge_zero_for_accelerator_examples(helm: Helm) -> None:
    for name in ("gpu", "gpu-efa"):
        docs = helm.template(VALUE_SETS[name])
        for role in ("prefill", "decode"):
            strategy = _kind(docs, "Deployment")[role]["spec"]["strategy"]
            assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_budgets_keep_a_minimum_where_there_is_one(helm: Helm) -> None:
    assert not _kind(helm.template(), "PodDisruptionBudget")  # one pod each: a budget would block drains
    docs = helm.template(VALUE_SETS["2p3d"])
    pdbs = {n: d["spec"] for n, d in _kind(docs, "PodDisruptionBudget").items()}
    assert pdbs.keys() == {"etcd", "proxy", "prefill", "decode"}
    assert pdbs["etcd"]["minAvailable"] == 2  # a quorum of 3
    assert all(pdbs[c]["minAvailable"] == 1 and "maxUnavailable" not in pdbs[c] for c in ("proxy", "prefill", "decode"))
    hpa = _kind(helm.template(sets=("decode.autoscaling.enabled=true", "decode.autoscaling.minReplicas=2")),
                "PodDisruptionBudget")
    assert set(hpa) == {"decode"}
    five = helm.template(sets=("etcd.replicas=5", "etcd.persistence.enabled=true"))
    assert _kind(five, "PodDisruptionBudget")["etcd"]["spec"]["minAvailable"] == 3
