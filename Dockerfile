# One image for every role: the command picks it (`relax worker rollout ...`, `relax init ...`).
#
#   docker build -t relax-bus:local .                                           # CPU (the default)
#   docker build -t relax-bus:local --build-arg TORCH_WHEELHOUSE=.wheelhouse .   # CPU, torch from a local wheel
#   docker build -t relax-bus:cuda --build-arg VARIANT=cuda .                    # NVIDIA GPUs: CUDA torch + vLLM
#
# VARIANT picks what goes in, from pyproject.toml's pins (deploy/image/requirements.py writes the lists in the
# `requirements` stage; `--target requirements` builds only that, in seconds):
#   cpu   torch 2.13's CPU build (PyTorch's CPU index), extras workers + models: the torch engine, the trainer,
#         `type: hf` tasks (datasets), the `math` reward (math-verify), GGUF imports. ~1.8 GB.
#   cuda  the same extras plus vllm-cuda (vLLM 0.32's CUDA build), torch 2.13 from PyPI (its default wheels are
#         the CUDA build, ~5 GB with the NVIDIA libraries), and gcc for the kernels Triton compiles at run time.
#         The host needs the NVIDIA driver and container toolkit; the image carries no driver.
# TORCH_INDEX_URL overrides where torch comes from (another CUDA version: https://download.pytorch.org/whl/cu128).
# TORCH_WHEELHOUSE names a directory inside the build context holding the torch wheel (`.wheelhouse/` is the one
# .dockerignore lets in); torch is installed from there with --no-index, its small pure-Python dependencies
# from PyPI. Only the build stages see the wheelhouse.
#
# Layers, most stable first: torch, the pinned dependencies, then the project as a wheel, so a source
# change rebuilds only the last small layer.

# ---------------------------------------------------------------- requirements: what the variant installs
FROM python:3.11-slim AS requirements
# Every stage carries the label, so the images a rebuild leaves untagged can be pruned by it.
LABEL org.relax-bus.image=relax-bus

ARG VARIANT=cpu
ARG TORCH_INDEX_URL=
COPY pyproject.toml deploy/image/requirements.py /src/
RUN python /src/requirements.py write /requirements --pyproject /src/pyproject.toml \
        --variant "$VARIANT" --torch-index-url "$TORCH_INDEX_URL" \
 && cp /src/requirements.py /requirements/ \
 && cat /requirements/variant /requirements/torch.txt /requirements/torch-index

# ---------------------------------------------------------------- deps: a venv with torch + the pins
FROM python:3.11-slim AS deps
LABEL org.relax-bus.image=relax-bus

ARG TORCH_WHEELHOUSE=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m venv /opt/relax
ENV PATH=/opt/relax/bin:$PATH

COPY --from=requirements /requirements /requirements
# `.wheelhouse/` always exists in the context (it holds a README), so this COPY works with or
# without a wheel in it.
COPY ${TORCH_WHEELHOUSE:-.wheelhouse} /tmp/wheelhouse/
RUN torch="$(cat /requirements/torch.txt)" \
 && if [ -n "$TORCH_WHEELHOUSE" ]; then \
        pip install --no-index --no-deps --find-links /tmp/wheelhouse "$torch" \
        && pip install "$torch"; \
    else \
        pip install --index-url "$(cat /requirements/torch-index)" "$torch"; \
    fi \
 && python /requirements/requirements.py check-torch "$(cat /requirements/variant)" \
 && rm -rf /tmp/wheelhouse

# The runtime pins and the variant's extras, read from pyproject.toml (torch already satisfies its pin).
RUN pip install -r /requirements/project.txt \
 && python /requirements/requirements.py check-torch "$(cat /requirements/variant)"

# ---------------------------------------------------------------- wheel: the project, nothing else
FROM deps AS wheel
COPY pyproject.toml README.md /src/
COPY schemas /src/schemas
COPY relax_bus /src/relax_bus
COPY workers /src/workers
# setuptools is in the venv already (torch requires it): no isolated build environment to download.
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src

# ---------------------------------------------------------------- runtime: the venv and a plain user
FROM python:3.11-slim
LABEL org.relax-bus.image=relax-bus

# Triton (under vLLM and torch.compile) compiles a small C launcher for its kernels at run time.
ARG VARIANT=cpu
RUN if [ "$VARIANT" = cuda ]; then \
        apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN groupadd --gid 10001 relax \
 && useradd --uid 10001 --gid relax --create-home --shell /usr/sbin/nologin relax \
 && mkdir -p /var/lib/relax \
 && chown relax:relax /var/lib/relax

ENV PATH=/opt/relax/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

COPY --from=deps /opt/relax /opt/relax
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels \
 && relax --help > /dev/null \
 && python -c "import datasets, math_verify, transformers, gguf, accelerate"

USER relax
# The roles' working dir: model files they build or download go under --work-dir (./.relax/work);
# docker-compose.yml mounts a volume here.
WORKDIR /var/lib/relax
ENTRYPOINT ["relax"]
CMD ["--help"]
