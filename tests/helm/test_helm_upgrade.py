"""`helm upgrade` from any value set to any other must not change a field Kubernetes keeps immutable (the
API server would refuse the upgrade). No API server runs here: both renders are diffed field by field, for
every ordered pair of the example value sets and of etcd's member count and persistence."""

from __future__ import annotations

import itertools

import pytest

from helmchart import VALUE_SETS, Helm

# What Kubernetes lets an update change in a StatefulSet's spec (apps/v1 validation); the rest is immutable.
STATEFULSET_MUTABLE = {"replicas", "ordinals", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy",
                       "minReadySeconds"}

# etcd's shapes, each a set of --set values: an upgrade may go from any to any
ETCD_STATES = {
    "etcd-1": (),
    "etcd-1-persistent": ("etcd.persistence.enabled=true",),
    "etcd-3": ("etcd.replicas=3", "etcd.persistence.enabled=true"),
    "etcd-3-10Gi": ("etcd.replicas=3", "etcd.persistence.enabled=true", "etcd.persistence.size=10Gi"),
    "etcd-5": ("etcd.replicas=5", "etcd.persistence.enabled=true"),
}


def _immutable(doc: dict) -> object:
    """The part of an object an update may not change (None: nothing checked for this kind)."""
    spec = doc.get("spec", {})
    match doc["kind"]:
        case "StatefulSet":
            return {k: v for k, v in spec.items() if k not in STATEFULSET_MUTABLE}
        case "Deployment" | "DaemonSet":
            return spec["selector"]
        case "Service":
            return (spec.get("clusterIP") == "None", spec.get("type", "ClusterIP") == "ExternalName")
        case "PersistentVolumeClaim":
            return {k: v for k, v in spec.items() if k != "resources"}
        case "Job":
            return spec["template"]
    return None


def _by_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _check(before: list[dict], after: list[dict]) -> list[str]:
    old, new = _by_name(before), _by_name(after)
    problems = []
    for key in old.keys() & new.keys():
        if _immutable(old[key]) != _immutable(new[key]):
            problems.append(f"{key[0]} {key[1]}: an immutable field changes")
        if key[0] == "PersistentVolumeClaim":
            size = lambda d: d["spec"]["resources"]["requests"]["storage"]  # noqa: E731
            if size(old[key]) != size(new[key]):
                problems.append(f"PVC {key[1]}: size changes ({size(old[key])} -> {size(new[key])})")
    return problems


@pytest.mark.parametrize(("before", "after"), list(itertools.permutations(sorted(VALUE_SETS), 2)))
def test_upgrades_between_example_value_sets_change_no_immutable_field(helm: Helm, before: str, after: str) -> None:
    assert not _check(helm.template(VALUE_SETS[before]), helm.template(VALUE_SETS[after]))


@pytest.mark.parametrize(("before", "after"), list(itertools.permutations(sorted(ETCD_STATES), 2)))
def test_etcd_member_count_and_persistence_changes_upgrade(helm: Helm, before: str, after: str) -> None:
    """Member count and persistence are fixed when an etcd cluster is made (--initial-cluster,
    volumeClaimTemplates): a change is a new StatefulSet (another generation), never an edit of the old one;
    the client Service follows the new generation. A PVC size change is the one thing that stays an edit of
    the same StatefulSet, and is refused by the check: Kubernetes cannot resize through a StatefulSet."""
    old, new = helm.template(sets=ETCD_STATES[before]), helm.template(sets=ETCD_STATES[after])
    problems = _check(old, new)
    sizes = {"etcd-3", "etcd-3-10Gi"}
    if {before, after} == sizes:
        assert problems == [f"StatefulSet {'demo-xpyd-etcd-m3p'}: an immutable field changes"]
        return
    assert not problems
    (sts_old,), (sts_new,) = ([d for d in docs if d["kind"] == "StatefulSet"] for docs in (old, new))
    assert sts_old["metadata"]["name"] != sts_new["metadata"]["name"]
    client = next(d for d in new if d["kind"] == "Service" and d["metadata"]["name"] == "demo-xpyd-etcd")
    assert client["spec"]["selector"].items() <= sts_new["spec"]["template"]["metadata"]["labels"].items()
    assert not client["spec"]["selector"].items() <= sts_old["spec"]["template"]["metadata"]["labels"].items()
