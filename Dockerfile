# syntax=docker/dockerfile:1.7
# pdserve images. Two build targets, one runtime contract:
#
#   docker build --target cpu  -t pdserve:cpu  .     # the default target (the last stage): CPU torch
#   docker build --target cuda -t pdserve:cuda .     # CUDA 12.8 runtime + torch from the cu128 index
#
# Both: ENTRYPOINT ["pdserve"] (CMD is the role and its flags; settings also come from PDSERVE_* variables),
# user 10001:10001 (no login shell, no sudo), the model read from the volume /models (PDSERVE_MODEL points at
# /models/default: mount a Hugging Face directory there or pass --model), a HEALTHCHECK that GETs /healthz on the
# HTTP port of the role being run (deploy/docker/healthcheck.py: the router's --http-port, a worker's
# --metrics-port; defaults 8000 and 9100), listening on 0.0.0.0. Nothing secret is baked in: API keys, JWT keys,
# TLS files and Redis passwords come from mounted files or the environment at run time (docs/operations.md).
# Base images are pinned by tag (stage 0); pin them by digest in a registry you control for reproducible builds.

ARG TORCH_VERSION=2.13.0

# -- 0. the two base images, each named once -------------------------------------------------------------------
FROM python:3.11.13-slim-bookworm AS python-base

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS cuda-base
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# -- 1. the pdserve wheel (pure Python; shared by both targets) ------------------------------------------------
FROM python-base AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY pdserve ./pdserve
COPY services ./services
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- 2a. CPU: a virtual environment with CPU-only torch, then pdserve and its dependencies ---------------------
FROM python-base AS cpu-venv
ARG TORCH_VERSION
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /wheels /wheels
RUN /opt/venv/bin/pip install --no-cache-dir /wheels/*.whl
# The engine's CPU kernels, one library per instruction-set level (x86-64-v4 + AVX512-BF16 with and without AMX, v3,
# baseline): the runtime images carry no compiler, so the workers load the best variant their CPU runs
# (PDSERVE_CPU_KERNELS_DIR).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && /opt/venv/bin/python -m common.engine.cpu_kernels --prebuild /opt/venv/share/pdserve-cpu-kernels

# -- 2b. CUDA: the same on the CUDA runtime image (Ubuntu's python3), torch from the cu128 index ---------------
FROM cuda-base AS cuda-venv
ARG TORCH_VERSION
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url https://download.pytorch.org/whl/cu128
COPY --from=wheel /wheels /wheels
# extras: gpu (nvidia-ml-py: the pdserve:gpu_* gauges), quant (torchao: --quantization int8-weight-only, int8-dynamic) and nixl
# (nixl-cu12, CUDA 12 like this torch: --kv-transport nixl / --kv-nixl between pools on different hosts)
RUN /opt/venv/bin/pip install --no-cache-dir --find-links /wheels "pdserve[gpu,quant,nixl]"
# the CPU kernels as in cpu-venv (used when a CUDA image serves on the CPU)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && /opt/venv/bin/python -m common.engine.cpu_kernels --prebuild /opt/venv/share/pdserve-cpu-kernels

# -- 3. runtime targets: keep these two blocks identical below their FROM/COPY lines --------------------------
# (tests/deploy/test_dockerfile.py checks that they are).
FROM cuda-base AS cuda
COPY --from=cuda-venv /opt/venv /opt/venv
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/pdserve-healthcheck
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/pdserve --create-home --shell /usr/sbin/nologin pdserve \
    && mkdir -p /models \
    && chown 10001:10001 /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_METRICS_PORT=9100 \
    PDSERVE_MODEL=/models/default \
    PDSERVE_CPU_KERNELS_DIR=/opt/venv/share/pdserve-cpu-kernels
VOLUME ["/models"]
WORKDIR /home/pdserve
USER 10001:10001
EXPOSE 50051 8000 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 CMD ["pdserve-healthcheck", "healthz"]
ENTRYPOINT ["pdserve"]
CMD ["router"]

FROM python-base AS cpu
COPY --from=cpu-venv /opt/venv /opt/venv
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/pdserve-healthcheck
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/pdserve --create-home --shell /usr/sbin/nologin pdserve \
    && mkdir -p /models \
    && chown 10001:10001 /models
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PDSERVE_HOST=0.0.0.0 \
    PDSERVE_METRICS_PORT=9100 \
    PDSERVE_MODEL=/models/default \
    PDSERVE_CPU_KERNELS_DIR=/opt/venv/share/pdserve-cpu-kernels
VOLUME ["/models"]
WORKDIR /home/pdserve
USER 10001:10001
EXPOSE 50051 8000 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 CMD ["pdserve-healthcheck", "healthz"]
ENTRYPOINT ["pdserve"]
CMD ["router"]
