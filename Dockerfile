# One image for every role: the command picks it (`relax worker rollout ...`, `relax init ...`).
#
#   docker build -t relax-bus:local .                                          # torch: PyTorch CPU index
#   docker build -t relax-bus:local --build-arg TORCH_WHEELHOUSE=.wheelhouse .  # torch: a local wheel
#
# torch is always the CPU build (2.13.*, the pin of pyproject.toml): the CUDA wheels on PyPI are ~5 GB.
# TORCH_WHEELHOUSE names a directory inside the build context holding a torch-2.13.*+cpu wheel
# (`.wheelhouse/` is the one .dockerignore lets in); torch is installed from there with --no-index,
# its small pure-Python dependencies from PyPI. Only the build stages see the wheelhouse.
#
# Layers, most stable first: torch, the pinned dependencies, then the project as a wheel, so a source
# change rebuilds only the last small layer.

# ---------------------------------------------------------------- deps: a venv with torch + the pins
FROM python:3.11-slim AS deps
# Every stage carries the label, so the images a rebuild leaves untagged can be pruned by it.
LABEL org.relax-bus.image=relax-bus

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELHOUSE=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m venv /opt/relax
ENV PATH=/opt/relax/bin:$PATH

# `.wheelhouse/` always exists in the context (it holds a README), so this COPY works with or
# without a wheel in it.
COPY ${TORCH_WHEELHOUSE:-.wheelhouse} /tmp/wheelhouse/
RUN if [ -n "$TORCH_WHEELHOUSE" ]; then \
        pip install --no-index --no-deps --find-links /tmp/wheelhouse "torch==2.13.*" \
        && pip install "torch==2.13.*"; \
    else \
        pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.*"; \
    fi \
 && python -c "import torch; assert torch.__version__.startswith('2.13.') and not torch.version.cuda, torch.__version__" \
 && rm -rf /tmp/wheelhouse

# The runtime pins and the `workers` extra, read from pyproject.toml (torch already satisfies its pin).
COPY pyproject.toml /src/
RUN python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['workers']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# ---------------------------------------------------------------- wheel: the project, nothing else
FROM deps AS wheel
COPY README.md /src/
COPY schemas /src/schemas
COPY relax_bus /src/relax_bus
COPY workers /src/workers
# setuptools is in the venv already (torch requires it): no isolated build environment to download.
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src

# ---------------------------------------------------------------- runtime: the venv and a plain user
FROM python:3.11-slim
LABEL org.relax-bus.image=relax-bus

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
 && relax --help > /dev/null

USER relax
# The roles' working dir: model files they build or download go under --work-dir (./.relax/work);
# docker-compose.yml mounts a volume here.
WORKDIR /var/lib/relax
ENTRYPOINT ["relax"]
CMD ["--help"]
