"""Render the xpyd chart with a real helm binary (fetched once by scripts/fetch_helm.py)."""

from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes_validate.utils import all_versions

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "xpyd"
EXAMPLES = ROOT / "helm" / "examples"
RELEASE = "demo"
NAMESPACE = "serving"
HELM_TIMEOUT = 60  # seconds for one helm command
# What rendered objects are validated against: the two newest Kubernetes minors kubernetes-validate knows, and
# the oldest the chart supports (Chart.yaml's kubeVersion).
NEWEST_MINORS = sorted(set(all_versions()), key=lambda v: tuple(map(int, v.split("."))))[-2:]
KUBE_VERSIONS = (*NEWEST_MINORS, "1.29.0")

# The value sets CI renders and validates: name -> values files under helm/examples/.
VALUE_SETS: dict[str, tuple[str, ...]] = {
    "default": (),
    "external-etcd": ("external-etcd.yaml",),
    "autoscaling": ("autoscaling.yaml",),
    "gpu-efa": ("gpu-efa.yaml",),
    "model-download": ("model-download.yaml",),
    "keda": ("keda.yaml",),
    "inference-gateway": ("inference-gateway.yaml",),
    "2p3d": ("2p3d.yaml",),
    "gpu": ("gpu.yaml",),
    "network-policy": ("network-policy.yaml",),
    "planner": ("planner.yaml",),
    "planner-metrics": ("planner-metrics.yaml",),
    "planner-keda": ("planner-keda.yaml",),
}


def load_fetch_helm():
    """scripts/fetch_helm.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("fetch_helm", ROOT / "scripts" / "fetch_helm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RenderError(Exception):
    """helm refused the values; the message is helm's stderr."""


@dataclass
class Helm:
    path: Path
    env: dict[str, str] = field(repr=False)
    _renders: dict[tuple, list[dict]] = field(default_factory=dict, repr=False)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.path), *args], capture_output=True, text=True, env=self.env,
                              timeout=HELM_TIMEOUT)

    def template(self, values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (),
                 set_strings: tuple[str, ...] = ()) -> list[dict]:
        """The rendered objects (cached per arguments); RenderError if helm refuses."""
        key = (values_files, sets, set_strings)
        if key not in self._renders:
            args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
            for name in values_files:
                args += ["-f", str(EXAMPLES / name)]
            for item in sets:
                args += ["--set", item]
            for item in set_strings:
                args += ["--set-string", item]
            done = self.run(*args)
            if done.returncode != 0:
                raise RenderError(done.stderr.strip())
            self._renders[key] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
        return self._renders[key]
