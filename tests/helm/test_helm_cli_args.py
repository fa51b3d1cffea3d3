"""The command lines the chart gives its pods are ones xpyd accepts: each rendered container's
args, with $(VAR) expanded the way the kubelet does (ConfigMap + downward API), go through
xpyd's own argument parser and config validation. A renamed or removed flag fails here, not in
somebody's cluster."""

from __future__ import annotations

import re

import pytest

from helmchart import VALUE_SETS, Helm

FULLNAME = "demo-xpyd"
POD_IP = "10.1.2.3"


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    def one(arg: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)

    expanded = [one(a) for a in args]
    leftover = [a for a in expanded if "$(" in a]
    assert not leftover, f"unexpanded variables: {leftover}"
    return expanded


def _pod_argv(docs: list[dict], name: str) -> list[str]:
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["xpyd"]
    return _expand(c["args"], {**config, "POD_IP": POD_IP})


@pytest.fixture(scope="module")
def parser():
    from xpyd.cli import build_parser

    return build_parser()


@pytest.mark.parametrize("value_set", ["default", "2p3d", "gpu", "gpu-efa", "external-etcd"])
def test_worker_args_make_a_valid_worker_config(helm: Helm, parser, value_set: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from xpyd.worker import config as worker_config
    from xpyd.worker.config import config_from_args

    # no CUDA here: accept the device name (the pattern check is the parser's); everything else is validated
    monkeypatch.setattr(worker_config, "check_device", lambda device: device)
    docs = helm.template(VALUE_SETS[value_set])
    endpoint = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["XPYD_ETCD"]
    for role in ("prefill", "decode"):
        args = parser.parse_args(_pod_argv(docs, f"{FULLNAME}-{role}"))
        config = config_from_args(args, args.command)  # raises ValueError on anything invalid
        assert (config.role, config.etcd, config.host, config.public_host) == (role, endpoint, "0.0.0.0", POD_IP)
        assert config.drain_timeout > 0 and config.port > 0 and config.kv_port > 0
        gpus = "nvidia.com/gpu" in str(docs)
        assert (config.device, config.kv_backend) == ("cuda" if gpus else "cpu", "nixl" if value_set == "gpu-efa" else "tcp")
        if role == "prefill":
            assert config.signal_port > 0


@pytest.mark.parametrize("value_set", ["default", "autoscaling"])
def test_proxy_args_make_a_valid_proxy_config(helm: Helm, parser, value_set: str) -> None:
    from xpyd.proxy.main import config_from_args

    docs = helm.template(VALUE_SETS[value_set], sets=("model.servedModelName=smol", "proxy.pairCooldown=12"))
    args = parser.parse_args(_pod_argv(docs, f"{FULLNAME}-proxy"))
    config = config_from_args(args)
    endpoint = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["XPYD_ETCD"]
    assert (config.etcd, config.host, config.model_name, config.pair_cooldown) == (endpoint, "0.0.0.0", "smol", 12)


def test_worker_flag_values_follow_values(helm: Helm, parser) -> None:
    from xpyd.worker.config import config_from_args

    docs = helm.template(sets=("prefill.batchSize=4", "prefill.threads=3", "prefill.kvTTL=12",
                               "decode.prefillWaitTimeout=9", "decode.leaseTTL=7", "decode.signalTimeout=3",
                               "model.dtype=float32",
                               "model.maxModelLen=4096", "decode.extraArgs={--nice=5}"))
    prefill = config_from_args(parser.parse_args(_pod_argv(docs, f"{FULLNAME}-prefill")), "prefill")
    decode = config_from_args(parser.parse_args(_pod_argv(docs, f"{FULLNAME}-decode")), "decode")
    assert (prefill.batch_size, prefill.threads, prefill.kv_ttl) == (4, 3, 12)
    assert (decode.prefill_wait_timeout, decode.lease_ttl, decode.nice, decode.signal_timeout) == (9, 7, 5, 3)
    assert prefill.dtype == decode.dtype == "float32"
    assert prefill.max_model_len == decode.max_model_len == 4096
