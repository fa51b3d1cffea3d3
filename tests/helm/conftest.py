"""Fixtures for the Helm chart tests: a real helm binary (fetched once) and rendered manifests.

No cluster runs here: the chart is checked with ``helm lint --strict``, rendered with
``helm template`` and the output validated against the Kubernetes OpenAPI schemas
(kubernetes-validate) and against what xpyd needs (tests in this folder).
"""

from __future__ import annotations

import os

import pytest

from helmchart import VALUE_SETS, Helm, load_fetch_helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    fetch = load_fetch_helm()
    try:
        path = fetch.fetch_helm()
    except fetch.FetchError as e:
        pytest.skip(f"no helm binary (scripts/fetch_helm.py could not get one): {e}")
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    env.update(HELM_CONFIG_HOME=str(home / "config"), HELM_CACHE_HOME=str(home / "cache"),
               HELM_DATA_HOME=str(home / "data"))
    env.pop("KUBECONFIG", None)
    return Helm(path, env)


@pytest.fixture(params=sorted(VALUE_SETS), scope="session")
def value_set(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def rendered(helm: Helm, value_set: str) -> list[dict]:
    return helm.template(VALUE_SETS[value_set])
