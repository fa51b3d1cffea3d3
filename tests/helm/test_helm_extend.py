"""Extending the pods (extraEnv, extraVolumes, extraVolumeMounts, initContainers, extraContainers per role) and
the model download into a shared claim (init containers; rendered here, never run against a registry)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from helmchart import KUBE_VERSIONS, VALUE_SETS, Helm

FULLNAME = "demo-xpyd"
COMPONENTS = ("proxy", "prefill", "decode")

EXTENDED = tuple(
    item for c in COMPONENTS for item in (
        f"{c}.extraEnv[0].name=EXTRA", f"{c}.extraEnv[0].value=1",
        f"{c}.extraVolumes[0].name=neuron-cache", f"{c}.extraVolumes[0].emptyDir.sizeLimit=10Gi",
        f"{c}.extraVolumeMounts[0].name=neuron-cache", f"{c}.extraVolumeMounts[0].mountPath=/var/cache/neuron",
        f"{c}.initContainers[0].name=prepare", f"{c}.initContainers[0].image=busybox:1.36",
        f"{c}.extraContainers[0].name=log-shipper", f"{c}.extraContainers[0].image=fluent/fluent-bit:3.0",
    ))


def _deployment(docs: list[dict], component: str) -> dict:
    (d,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{FULLNAME}-{component}"]
    return d


@pytest.fixture(scope="module")
def extended(helm: Helm) -> list[dict]:
    return helm.template(set_strings=EXTENDED)


def test_extensions_land_in_every_role(extended: list[dict]) -> None:
    for component in COMPONENTS:
        spec = _deployment(extended, component)["spec"]["template"]["spec"]
        main, sidecar = spec["containers"]
        assert main["name"] == component and sidecar["name"] == "log-shipper"
        assert {"name": "EXTRA", "value": "1"} in main["env"]
        assert {"name": "neuron-cache", "mountPath": "/var/cache/neuron"} in main["volumeMounts"]
        assert {"name": "neuron-cache", "emptyDir": {"sizeLimit": "10Gi"}} in spec["volumes"]
        # the chart's own init containers first: etcd is reachable before the user's run
        assert [c["name"] for c in spec["initContainers"]] == ["wait-for-etcd", "prepare"]


def test_extensions_without_wait_for_etcd(helm: Helm) -> None:
    docs = helm.template(sets=("waitForEtcd.enabled=false",), set_strings=EXTENDED)
    assert [c["name"] for c in _deployment(docs, "decode")["spec"]["template"]["spec"]["initContainers"]] == [
        "prepare"]
    assert "initContainers" not in helm.template(sets=("waitForEtcd.enabled=false",))[0].get("spec", {})


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_extended_and_download_renders_pass_kubernetes_validate_strict(helm: Helm, extended: list[dict],
                                                                      kube_version: str) -> None:
    s3 = helm.template(sets=("model.download.source=s3", "model.download.s3.uri=s3://models/llama-3.2-1b/",
                             "model.download.s3.credentialsSecret=aws-keys",
                             "model.download.claim.existingClaim=models"))
    for doc in [*extended, *s3, *helm.template(VALUE_SETS["model-download"])]:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {e.message} at {'/'.join(map(str, e.path))}")


def test_hf_download_and_conversion_into_the_shared_claim(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["model-download"])
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == f"{FULLNAME}-models"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "efs-sc"
    folder = "/models/bartowski--SmolLM2-1.7B-Instruct-GGUF"
    converted = f"{folder}/SmolLM2-1.7B-Instruct-Q8_0"
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert config["XPYD_MODEL"] == converted
    for role in ("prefill", "decode"):
        spec = _deployment(docs, role)["spec"]["template"]["spec"]
        download, convert = spec["initContainers"][1:]
        assert (download["name"], convert["name"]) == ("model-download", "model-convert")
        assert download["command"][-4:] == ["bartowski/SmolLM2-1.7B-Instruct-GGUF", "main", folder,
                                            "SmolLM2-1.7B-Instruct-Q8_0.gguf"]
        token = {e["name"]: e for e in download["env"]}["HF_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert convert["command"][-2:] == [f"{folder}/SmolLM2-1.7B-Instruct-Q8_0.gguf", converted]
        for init in (download, convert):
            assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]  # writable here
        (main,) = spec["containers"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": f"{FULLNAME}-models"}} in spec["volumes"]
        assert "--model=$(XPYD_MODEL)" in main["args"]
    proxy = _deployment(docs, "proxy")["spec"]["template"]["spec"]
    assert [c["name"] for c in proxy["initContainers"]] == ["wait-for-etcd"]


def test_s3_download_into_an_existing_claim_without_conversion(helm: Helm) -> None:
    docs = helm.template(sets=("model.download.source=s3", "model.download.s3.uri=s3://models/llama-3.2-1b/",
                               "model.download.claim.existingClaim=models"))
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert config["XPYD_MODEL"] == "/models/llama-3.2-1b"
    spec = _deployment(docs, "prefill")["spec"]["template"]["spec"]
    (download,) = spec["initContainers"][1:]
    assert download["image"].startswith("amazon/aws-cli:") and "aws s3 sync" in download["args"][0]
    env = {e["name"]: e["value"] for e in download["env"]}
    assert (env["URI"], env["DEST"]) == ("s3://models/llama-3.2-1b/", "/models/llama-3.2-1b")
    assert "envFrom" not in download  # the service account's credentials (IRSA)
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in spec["volumes"]


def test_the_conversion_script_uses_xpyds_loader(helm: Helm) -> None:
    """The init container's script imports what it names from the xpyd package (no network, no model)."""
    from xpyd.model import loader

    docs = helm.template(VALUE_SETS["model-download"])
    convert = _deployment(docs, "decode")["spec"]["template"]["spec"]["initContainers"][2]
    script = convert["command"][2]
    assert "from xpyd.model.loader import ensure_converted" in script and hasattr(loader, "ensure_converted")
    compile(script, "model-convert", "exec")
    download = _deployment(docs, "decode")["spec"]["template"]["spec"]["initContainers"][1]
    compile(download["command"][2], "model-download", "exec")
