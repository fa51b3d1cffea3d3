"""The chart lints, renders valid Kubernetes objects for every example value set, and wires
xpyd the way it needs: selectors, probes, resources, etcd endpoint, roles, replicas, secrets."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from helmchart import CHART, EXAMPLES, KUBE_VERSIONS, NAMESPACE, RELEASE, VALUE_SETS, Helm, RenderError

FULLNAME = f"{RELEASE}-xpyd"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
ROLES = ("prefill", "decode")
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject"),
             ("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = objects(docs, kind)
    assert name in found, f"no {kind} {name}; have {sorted(found)}"
    return found[name]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args: list[str], name: str) -> str | None:
    """The value of --name=value in args (None if absent)."""
    prefix = f"--{name}="
    values = [a[len(prefix):] for a in args if a.startswith(prefix)]
    assert len(values) <= 1, f"{name} given {len(values)} times"
    return values[0] if values else None


def config_data(docs: list[dict]) -> dict[str, str]:
    return one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- lint and schema validity --------------------------------------------------------------


def test_lint_strict(helm: Helm, value_set: str) -> None:
    args = ["lint", "--strict", str(CHART)]
    for name in VALUE_SETS[value_set]:
        args += ["-f", str(EXAMPLES / name)]
    done = helm.run(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_rendered_objects_pass_kubernetes_validate_strict(rendered: list[dict], kube_version: str) -> None:
    checked = 0
    for doc in rendered:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # no schema bundled; test_service_monitor_* and test_helm_planner check them
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} (Kubernetes {kube_version}): {e.message} "
                        f"at {'/'.join(map(str, e.path))}")
        checked += 1
    assert checked >= 10


def test_every_example_file_is_a_tested_value_set() -> None:
    tested = {name for files in VALUE_SETS.values() for name in files}
    assert {p.name for p in EXAMPLES.glob("*.yaml")} == tested


# --- structure ------------------------------------------------------------------------------


def test_selectors_match_pod_labels(rendered: list[dict]) -> None:
    workloads = [d for d in rendered if d["kind"] in WORKLOAD_KINDS]
    pod_labels = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads}
    for w in workloads:
        selector = w["spec"]["selector"]["matchLabels"]
        assert selects(selector, pod_labels[w["metadata"]["name"]]), w["metadata"]["name"]
        others = [n for n, labels in pod_labels.items() if n != w["metadata"]["name"] and selects(selector, labels)]
        assert not others, f"{w['metadata']['name']} also selects the pods of {others}"
    for kind, get_selector in (("Service", lambda o: o["spec"]["selector"]),
                               ("PodDisruptionBudget", lambda o: o["spec"]["selector"]["matchLabels"]),
                               ("NetworkPolicy", lambda o: o["spec"]["podSelector"]["matchLabels"])):
        for name, obj in objects(rendered, kind).items():
            matched = [n for n, labels in pod_labels.items() if selects(get_selector(obj), labels)]
            assert len(matched) == 1, f"{kind} {name} selects the pods of {matched}"
    for name, sts in objects(rendered, "StatefulSet").items():
        assert sts["spec"]["serviceName"] in objects(rendered, "Service"), name


def test_every_container_has_probes_and_resource_requests(rendered: list[dict]) -> None:
    for w in (d for d in rendered if d["kind"] in WORKLOAD_KINDS):
        spec = pod_spec(w)
        for c in spec["containers"]:
            where = f"{w['metadata']['name']}/{c['name']}"
            assert "readinessProbe" in c and "livenessProbe" in c, where
            named_ports = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c and "httpGet" in c[probe]:
                    assert c[probe]["httpGet"]["port"] in named_ports, f"{where} {probe}"
            requests = c["resources"]["requests"]
            assert {"cpu", "memory"} <= requests.keys(), where
            assert "memory" in c["resources"]["limits"], where
        for c in spec.get("initContainers", []):
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), c["name"]


def test_probes_use_the_real_health_endpoints(rendered: list[dict]) -> None:
    for role in ROLES:
        c = container(one(rendered, "Deployment", f"{FULLNAME}-{role}"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health"
    proxy = container(one(rendered, "Deployment", f"{FULLNAME}-proxy"))
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 until both roles have a worker
    assert '"/health"' in proxy["livenessProbe"]["exec"]["command"][-1]  # 200 or 503 = alive


def test_workers_get_their_role_the_etcd_endpoint_and_their_pod_ip(rendered: list[dict]) -> None:
    endpoint = config_data(rendered)["XPYD_ETCD"]
    assert re.fullmatch(r"[^\s:]+:\d+", endpoint)
    for role in ROLES:
        c = container(one(rendered, "Deployment", f"{FULLNAME}-{role}"))
        assert c["command"] == ["xpyd"] and c["args"][0] == role
        assert flag(c["args"], "etcd") == "$(XPYD_ETCD)"
        assert flag(c["args"], "host") == "0.0.0.0"
        assert flag(c["args"], "advertise-host") == "$(POD_IP)"
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert c["envFrom"] == [{"configMapRef": {"name": f"{FULLNAME}-config"}}]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert str(ports["http"]) == flag(c["args"], "port")
        assert str(ports["kv"]) == flag(c["args"], "kv-port")
        if role == "prefill":
            assert str(ports["signal"]) == flag(c["args"], "signal-port")
    proxy = container(one(rendered, "Deployment", f"{FULLNAME}-proxy"))
    assert proxy["args"][0] == "proxy" and flag(proxy["args"], "etcd") == "$(XPYD_ETCD)"


def test_termination_grace_covers_the_drain(rendered: list[dict]) -> None:
    """One drain time everywhere: the proxy and the workers drain for as long, and each pod's grace period
    covers its preStop sleep, that drain and a margin to exit."""
    drains = set()
    for role in ("proxy", *ROLES):
        w = one(rendered, "Deployment", f"{FULLNAME}-{role}")
        c = container(w)
        drain = int(flag(c["args"], "drain-timeout"))
        drains.add(drain)
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
        assert pod_spec(w)["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain + 1, role
    assert len(drains) == 1 and drains.pop() > 30


def test_every_pod_waits_for_etcd(rendered: list[dict]) -> None:
    for name in (f"{FULLNAME}-proxy", *(f"{FULLNAME}-{r}" for r in ROLES)):
        init = pod_spec(one(rendered, "Deployment", name))["initContainers"]
        assert init[0]["name"] == "wait-for-etcd", name  # first: the chart's other steps and the user's follow
        assert "$(XPYD_ETCD)" in init[0]["command"]


def test_config_changes_roll_the_pods(helm: Helm) -> None:
    def checksum(docs):
        return {n: d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for n, d in objects(docs, "Deployment").items()}

    before, after = checksum(helm.template()), checksum(helm.template(sets=("model.maxModelLen=4096",)))
    assert before.keys() == after.keys()
    # the workers read the model settings and roll; the proxy does not, and stays
    assert {n for n in before if before[n] != after[n]} == {f"{FULLNAME}-{r}" for r in ROLES}
    env = checksum(helm.template(sets=("config.env.LOG_LEVEL=debug",)))
    assert all(env[n] != before[n] for n in before)


# --- value sets -----------------------------------------------------------------------------


def test_default_is_1p1d_with_etcd_in_the_release(helm: Helm) -> None:
    docs = helm.template()
    for role in ROLES:
        assert one(docs, "Deployment", f"{FULLNAME}-{role}")["spec"]["replicas"] == 1
    assert config_data(docs)["XPYD_ETCD"] == f"{FULLNAME}-etcd.{NAMESPACE}.svc.cluster.local:2379"
    etcd = one(docs, "StatefulSet", f"{FULLNAME}-etcd-m1")
    assert etcd["spec"]["replicas"] == 1 and "volumeClaimTemplates" not in etcd["spec"]
    assert one(docs, "Service", f"{FULLNAME}-etcd-headless")["spec"]["clusterIP"] == "None"
    assert not objects(docs, "HorizontalPodAutoscaler") and not objects(docs, "ServiceMonitor")
    assert set(objects(docs, "Secret")) == {f"{FULLNAME}-cluster-token"}  # generated (test_helm_rollout)
    assert not objects(docs, "PodDisruptionBudget")  # one pod each: test_helm_placement


def test_2p3d_replicas_and_etcd_members(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["2p3d"])
    assert one(docs, "Deployment", f"{FULLNAME}-prefill")["spec"]["replicas"] == 2
    assert one(docs, "Deployment", f"{FULLNAME}-decode")["spec"]["replicas"] == 3
    etcd = one(docs, "StatefulSet", f"{FULLNAME}-etcd-m3p")
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["podManagementPolicy"] == "Parallel"
    members = flag(container(etcd)["args"], "initial-cluster").split(",")
    assert [m.split("=")[0] for m in members] == [f"{FULLNAME}-etcd-m3p-{i}" for i in range(3)]
    assert etcd["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (3, 1), (0, 5)])
def test_replicas_follow_values(helm: Helm, prefill: int, decode: int) -> None:
    docs = helm.template(sets=(f"prefill.replicas={prefill}", f"decode.replicas={decode}"))
    assert one(docs, "Deployment", f"{FULLNAME}-prefill")["spec"]["replicas"] == prefill
    assert one(docs, "Deployment", f"{FULLNAME}-decode")["spec"]["replicas"] == decode


def test_autoscaling_hands_replicas_to_the_hpa(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["autoscaling"])
    hpas = objects(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"{FULLNAME}-prefill", f"{FULLNAME}-decode"}
    for role in ROLES:
        hpa = hpas[f"{FULLNAME}-{role}"]
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": f"{FULLNAME}-{role}"}
        assert "replicas" not in one(docs, "Deployment", f"{FULLNAME}-{role}")["spec"]
    decode = hpas[f"{FULLNAME}-decode"]["spec"]
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 8)
    assert [m["type"] for m in decode["metrics"]] == ["External", "Pods"]  # no CPU target (null)
    assert decode["metrics"][1]["pods"]["metric"]["name"] == "xpyd_requests_in_flight"
    prefill = hpas[f"{FULLNAME}-prefill"]["spec"]
    assert [m["type"] for m in prefill["metrics"]] == ["Resource", "External"]


def test_service_monitor_scrapes_proxy_and_workers(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["autoscaling"])
    (sm,) = objects(docs, "ServiceMonitor").values()
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s",
                                        "scrapeTimeout": "10s"}]
    selector = sm["spec"]["selector"]
    (expr,) = selector["matchExpressions"]
    scraped = {n for n, s in objects(docs, "Service").items()
               if selects(selector["matchLabels"], s["metadata"]["labels"])
               and s["metadata"]["labels"]["app.kubernetes.io/component"] in expr["values"]}
    assert scraped == {f"{FULLNAME}-{c}" for c in ("proxy", *ROLES)}
    for name in scraped:
        assert "http" in {p["name"] for p in objects(docs, "Service")[name]["spec"]["ports"]}


def test_service_monitor_sends_the_api_key(helm: Helm) -> None:
    """With an API key the proxy's /metrics needs it too."""
    docs = helm.template(VALUE_SETS["autoscaling"], set_strings=("apiKey.existingSecret=keys",))
    (sm,) = objects(docs, "ServiceMonitor").values()
    assert sm["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "keys", "key": "api-key"}}


def test_external_etcd_replaces_the_statefulset(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["external-etcd"])
    assert not objects(docs, "StatefulSet")
    assert f"{FULLNAME}-etcd" not in objects(docs, "PodDisruptionBudget")
    assert not [n for n in objects(docs, "Service") if "etcd" in n]
    assert config_data(docs)["XPYD_ETCD"] == "etcd-client.infra.svc.cluster.local:2379"


@pytest.mark.parametrize(("value_set", "resource", "count"), [
    ("gpu-efa", "vpc.amazonaws.com/efa", 1),
    ("gpu-efa", "nvidia.com/gpu", 1),
    ("gpu", "nvidia.com/gpu", 1),
])
def test_devices_are_requested_and_limited(helm: Helm, value_set: str, resource: str, count: int) -> None:
    docs = helm.template(VALUE_SETS[value_set])
    for role in ROLES:
        w = one(docs, "Deployment", f"{FULLNAME}-{role}")
        res = container(w)["resources"]
        assert res["requests"][resource] == count and res["limits"][resource] == count
        assert pod_spec(w)["tolerations"]
    proxy = container(one(docs, "Deployment", f"{FULLNAME}-proxy"))["resources"]
    assert resource not in proxy["requests"] and resource not in proxy.get("limits", {})


def test_workers_use_the_devices_they_hold(rendered: list[dict]) -> None:
    """Every example: a pod that holds a GPU computes on it, one without computes on the CPU; a pod that
    holds an EFA interface moves KV with nixl, may lock memory and has the libfabric environment; no pod
    holds a Neuron device (no worker could use it); /dev/shm is a sized memory volume; both roles agree on
    the KV backend."""
    backends = set()
    for role in ROLES:
        w = one(rendered, "Deployment", f"{FULLNAME}-{role}")
        c, spec = container(w), pod_spec(w)
        limits = c["resources"].get("limits", {})
        gpus, efas = limits.get("nvidia.com/gpu", 0), limits.get("vpc.amazonaws.com/efa", 0)
        assert flag(c["args"], "device") == ("cuda" if gpus else "cpu"), role
        assert gpus <= 1 and "aws.amazon.com/neuron" not in limits
        backend = flag(c["args"], "kv-backend")
        backends.add(backend)
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        caps = c["securityContext"].get("capabilities", {}).get("add", [])
        if efas:
            assert backend == "nixl" and "IPC_LOCK" in caps and env["FI_PROVIDER"] == "efa", role
            assert env.get("FI_EFA_USE_DEVICE_RDMA") == ("1" if gpus else None)
        else:
            assert "IPC_LOCK" not in caps and "FI_PROVIDER" not in env, role
        if backend == "nixl":
            assert efas or gpus, f"{role}: nixl without a device it could use"
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        if gpus and "runtimeClassName" in spec:
            assert spec["runtimeClassName"] == "nvidia"
    assert len(backends) == 1, f"prefill and decode disagree on --kv-backend: {backends}"


@pytest.mark.parametrize(("sets", "message"), [
    (("prefill.devices.neuron=1",), "no Neuron device path"),
    (("decode.devices.gpu=2",), "one device"),
    (("decode.devices.efa=1",), "only kvBackend=nixl"),
    (("kvBackend=cuda_ipc",), "one GPU"),
    (("kvBackend=neuron",), "refuses to start"),
    (("kvBackend=shm",), "never share them"),
])
def test_devices_nothing_would_use_are_refused(helm: Helm, sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        helm.template(sets=sets)


def test_shm_size_and_runtime_class_follow_values(helm: Helm) -> None:
    docs = helm.template(sets=("decode.shmSize=", "prefill.shmSize=20Gi", "prefill.runtimeClassName=nvidia"))
    prefill, decode = (one(docs, "Deployment", f"{FULLNAME}-{r}") for r in ROLES)
    (shm,) = [v for v in pod_spec(prefill)["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "20Gi" and pod_spec(prefill)["runtimeClassName"] == "nvidia"
    assert not [v for v in pod_spec(decode)["volumes"] if v["name"] == "dshm"]
    assert "runtimeClassName" not in pod_spec(decode)


def test_topology_spread_defaults_to_the_roles_own_pods(helm: Helm) -> None:
    docs = helm.template()
    for role in ROLES:
        w = one(docs, "Deployment", f"{FULLNAME}-{role}")
        (constraint,) = pod_spec(w)["topologySpreadConstraints"]
        assert constraint["labelSelector"]["matchLabels"] == w["spec"]["selector"]["matchLabels"]


# --- secrets --------------------------------------------------------------------------------


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def test_existing_secrets_reach_proxy_and_workers(helm: Helm) -> None:
    docs = helm.template(VALUE_SETS["2p3d"])
    assert not objects(docs, "Secret")
    proxy = _env(container(one(docs, "Deployment", f"{FULLNAME}-proxy")))
    assert proxy["XPYD_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "xpyd-api-key", "key": "api-key"}
    # the proxy signs request ids with the cluster token and presents it to the workers' HTTP APIs
    assert proxy["XPYD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "xpyd-cluster-token", "key": "cluster-token"}
    for role in ROLES:
        env = _env(container(one(docs, "Deployment", f"{FULLNAME}-{role}")))
        assert env["XPYD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "xpyd-cluster-token", "key": "cluster-token"}
        assert "XPYD_API_KEY" not in env


def test_secret_values_become_secrets_the_pods_reference(helm: Helm) -> None:
    docs = helm.template(set_strings=("apiKey.value=sk-test-only", "clusterToken.value=token-for-tests"))
    secrets = objects(docs, "Secret")
    assert set(secrets) == {f"{FULLNAME}-api-key", f"{FULLNAME}-cluster-token"}
    assert set(secrets[f"{FULLNAME}-api-key"]["data"]) == {"api-key"}
    proxy = _env(container(one(docs, "Deployment", f"{FULLNAME}-proxy")))
    assert proxy["XPYD_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULLNAME}-api-key"
    assert proxy["XPYD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULLNAME}-cluster-token"
    for role in ROLES:
        env = _env(container(one(docs, "Deployment", f"{FULLNAME}-{role}")))
        assert env["XPYD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == f"{FULLNAME}-cluster-token"


def test_cluster_token_reaches_every_pod_in_its_environment_only(helm: Helm) -> None:
    """The proxy signs request ids with the token and the workers' HTTP APIs require it: every xpyd pod has it,
    from the Secret, never on a command line (visible in the process list); the probes hit /health, which
    needs no token."""
    docs = helm.template(set_strings=("clusterToken.value=token-for-tests",))
    deployments = objects(docs, "Deployment")
    assert set(deployments) == {f"{FULLNAME}-proxy", *(f"{FULLNAME}-{role}" for role in ROLES)}
    for name, workload in deployments.items():
        c = container(workload)
        assert _env(c)["XPYD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{FULLNAME}-cluster-token", "key": "cluster-token"}, name
        assert not any("token-for-tests" in str(word) for word in [*c.get("command", []), *c.get("args", [])])
        probes = [c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if "httpGet" in c.get(p, {})]
        assert probes and all(p["httpGet"]["path"] == "/health" for p in probes), name


def test_no_secret_env_without_secrets(helm: Helm) -> None:
    docs = helm.template(sets=("clusterToken.generate=false",))
    for name, w in objects(docs, "Deployment").items():
        env = _env(container(w))
        assert "XPYD_API_KEY" not in env and "XPYD_CLUSTER_TOKEN" not in env, name


# --- model ----------------------------------------------------------------------------------


def test_model_volume_and_path(helm: Helm) -> None:
    docs = helm.template(sets=("model.path=/models/llama", "model.volume.persistentVolumeClaim.claimName=models",
                               "model.servedModelName=llama"))
    assert config_data(docs)["XPYD_MODEL"] == "/models/llama"
    for role in ROLES:
        w = one(docs, "Deployment", f"{FULLNAME}-{role}")
        c = container(w)
        assert flag(c["args"], "model") == "$(XPYD_MODEL)"
        assert flag(c["args"], "served-model-name") == "llama"
        mount = {m["name"]: m for m in c["volumeMounts"]}["model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        volume = {v["name"]: v for v in pod_spec(w)["volumes"]}["model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models"}
    proxy = container(one(docs, "Deployment", f"{FULLNAME}-proxy"))
    assert flag(proxy["args"], "model-name") == "llama"


def test_empty_model_path_means_the_wheels_default_model(helm: Helm) -> None:
    docs = helm.template(sets=("model.path=",))
    assert "XPYD_MODEL" not in config_data(docs)
    for role in ROLES:
        assert flag(container(one(docs, "Deployment", f"{FULLNAME}-{role}"))["args"], "model") is None


def test_notes_tell_how_to_reach_the_api(helm: Helm) -> None:
    done = helm.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                    "--set-string", "apiKey.existingSecret=keys")
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert f"port-forward service/{FULLNAME}-proxy 8000:8000" in notes
    assert "/v1/chat/completions" in notes and "Authorization: Bearer" in notes
    assert "--set prefill.replicas=" in notes
