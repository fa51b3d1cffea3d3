"""Rollouts and secrets: one drain time for every role, checksum annotations that roll only the pods that read
what changed, and the cluster token the chart generates (helm template: no cluster, so `lookup` finds nothing
and each render generates; the upgrade path that reads the Secret back cannot run here)."""

from __future__ import annotations

import base64
import hashlib

import pytest

from helmchart import Helm, RenderError

FULLNAME = "demo-xpyd"
ROLES = ("prefill", "decode")
COMPONENTS = ("proxy", *ROLES)


def _deployments(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"].removeprefix(f"{FULLNAME}-"): d for d in docs if d["kind"] == "Deployment"}


def _annotations(docs: list[dict]) -> dict[str, dict[str, str]]:
    return {n: d["spec"]["template"]["metadata"].get("annotations", {}) for n, d in _deployments(docs).items()}


def _rolled(before: list[dict], after: list[dict]) -> set[str]:
    """The Deployments whose pod template changed."""
    a, b = _deployments(before), _deployments(after)
    return {n for n in a if a[n]["spec"]["template"] != b[n]["spec"]["template"]}


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def test_one_value_sets_every_roles_drain_and_grace(helm: Helm) -> None:
    docs = helm.template(sets=("drain.seconds=900", "drain.marginSeconds=20", "proxy.preStopSleepSeconds=7"))
    for name, d in _deployments(docs).items():
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert _flag(c["args"], "drain-timeout") == "900", name
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == (900 + 20 + 7 if name == "proxy" else 900 + 20), name
        # a worker leaves etcd as the first step of its SIGTERM: no preStop delays that
        assert ("lifecycle" in c) == (name == "proxy"), name


def test_rolling_one_role_restarts_no_other(helm: Helm) -> None:
    # a fixed token: helm template cannot look the generated one up, so each render would make another
    token = ("clusterToken.value=token-for-tests",)
    base = helm.template(set_strings=token)
    for role, sets in (("prefill", ("prefill.batchSize=4",)), ("decode", ("decode.shmSize=2Gi",)),
                       ("proxy", ("proxy.pairCooldown=9",))):
        assert _rolled(base, helm.template(sets=sets, set_strings=token)) == {role}, sets


def test_the_api_key_rolls_the_proxy_only(helm: Helm) -> None:
    token = ("clusterToken.value=token-for-tests",)
    before = helm.template(set_strings=(*token, "apiKey.value=key-one-for-tests"))
    after = helm.template(set_strings=(*token, "apiKey.value=key-two-for-tests"))
    assert _rolled(before, after) == {"proxy"}
    assert "checksum/api-key" in _annotations(before)["proxy"]
    assert not any("checksum/api-key" in _annotations(before)[r] for r in ROLES)


def test_a_new_cluster_token_rolls_the_three_in_one_upgrade(helm: Helm) -> None:
    before = helm.template(set_strings=("clusterToken.value=token-one-for-tests",))
    after = helm.template(set_strings=("clusterToken.value=token-two-for-tests",))
    assert _rolled(before, after) == set(COMPONENTS)
    for name, annotations in _annotations(before).items():
        assert annotations["checksum/cluster-token"] != _annotations(after)[name]["checksum/cluster-token"]
    # an existing Secret is hashed from the cluster (lookup); helm template sees none: the same empty hash
    existing = helm.template(set_strings=("clusterToken.existingSecret=mine",))
    assert len({a["checksum/cluster-token"] for a in _annotations(existing).values()}) == 1


def test_a_cluster_token_is_generated_by_default(helm: Helm) -> None:
    docs = helm.template()
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == f"{FULLNAME}-cluster-token"
    token = base64.b64decode(secret["data"]["cluster-token"]).decode()
    assert len(token) == 48 and token.isalnum()
    for name, d in _deployments(docs).items():
        (c,) = d["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["XPYD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{FULLNAME}-cluster-token", "key": "cluster-token"}, name
    # the Secret and the pods' checksum were made from the same token (one per render)
    sums = {a["checksum/cluster-token"] for a in _annotations(docs).values()}
    assert sums == {hashlib.sha256(token.encode()).hexdigest()}


@pytest.mark.parametrize("sets", [("clusterToken.value=token-for-tests",), ("clusterToken.existingSecret=mine",)])
def test_a_given_token_is_not_replaced_by_a_generated_one(helm: Helm, sets: tuple[str, ...]) -> None:
    docs = helm.template(set_strings=sets)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    if "existingSecret" in sets[0]:
        assert not secrets
    else:
        assert base64.b64decode(secrets[f"{FULLNAME}-cluster-token"]["data"]["cluster-token"]) == b"token-for-tests"


def test_the_lookup_keeps_the_token_across_upgrades() -> None:
    """What cannot run without an API server is at least written the way it must be: the Secret's token is
    read back from the release's own Secret before a new one is generated."""
    from helmchart import CHART

    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    start = helpers.index('define "xpyd.clusterTokenValue"')
    body = helpers[start:helpers.index("{{- end -}}\n", helpers.index("randAlphaNum", start))]
    assert body.index('lookup "v1" "Secret" .Release.Namespace') < body.index("randAlphaNum 48")


def _env(d: dict) -> dict[str, dict]:
    (c,) = d["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in c.get("env", [])}


def test_a_rotations_three_upgrades_roll_only_what_reads_the_tokens(helm: Helm) -> None:
    """docs/kubernetes.md's rotation: 1. accept the new token (the workers roll: the proxy checks no token),
    2. the new token becomes the token and the old one is accepted (all three roll), 3. the old one is dropped
    (the workers roll). Between the steps old and new pods each hold the token the other proves and signs
    with (tests/integration/test_token_rotation.py runs such a pair)."""
    old, new = "clusterToken.value=token-one-for-tests", "clusterToken.value=token-two-for-tests"
    steps = [helm.template(set_strings=(old,)),
             helm.template(set_strings=(old, "clusterToken.accept.value=token-two-for-tests")),
             helm.template(set_strings=(new, "clusterToken.accept.value=token-one-for-tests")),
             helm.template(set_strings=(new,))]
    assert [_rolled(a, b) for a, b in zip(steps, steps[1:])] == [set(ROLES), set(COMPONENTS), set(ROLES)]
    secrets = {d["metadata"]["name"]: d for d in steps[1] if d["kind"] == "Secret"}
    accept = secrets[f"{FULLNAME}-cluster-token-accept"]
    assert base64.b64decode(accept["data"]["cluster-token"]) == b"token-two-for-tests"
    for name, d in _deployments(steps[1]).items():
        env = _env(d)
        if name == "proxy":
            assert "XPYD_CLUSTER_TOKEN_ACCEPT" not in env
            continue
        assert env["XPYD_CLUSTER_TOKEN_ACCEPT"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{FULLNAME}-cluster-token-accept", "key": "cluster-token"}, name
        assert "checksum/cluster-token-accept" in _annotations(steps[1])[name]
    assert not any("XPYD_CLUSTER_TOKEN_ACCEPT" in _env(d) for d in _deployments(steps[3]).values())
    mine = helm.template(set_strings=(old, "clusterToken.accept.existingSecret=next-token",
                                      "clusterToken.accept.secretKey=token"))
    assert f"{FULLNAME}-cluster-token-accept" not in {d["metadata"]["name"] for d in mine if d["kind"] == "Secret"}
    assert _env(_deployments(mine)["decode"])["XPYD_CLUSTER_TOKEN_ACCEPT"]["valueFrom"]["secretKeyRef"] == {
        "name": "next-token", "key": "token"}


@pytest.mark.parametrize("sets,strings,message", [
    ((), ("clusterToken.value=token-one-for-tests", "clusterToken.accept.value=token-one-for-tests"), "the same as"),
    (("clusterToken.generate=false",), ("clusterToken.accept.value=token-two-for-tests",), "needs a cluster token"),
    ((), ("clusterToken.value=token-one-for-tests", "clusterToken.accept.value=short"), "8-256"),
    ((), ("clusterToken.accept.existingSecret=mine", "clusterToken.accept.value=token-two-for-tests"), "not both"),
])
def test_an_accepted_token_that_could_not_work_is_refused(helm: Helm, sets: tuple[str, ...], strings: tuple[str, ...],
                                                         message: str) -> None:
    with pytest.raises(RenderError, match=message):
        helm.template(sets=sets, set_strings=strings)
