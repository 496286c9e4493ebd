# One image for every pagedserve process: `serve`, or `scheduler`, `worker` and `frontend` one by
# one (see compose.yaml). The torch wheel from PyPI carries CUDA; workers given a GPU use NCCL,
# workers on CPU use gloo.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE=/cache

WORKDIR /opt/pagedserve
# a C compiler for the worker's native CPU kernels (built once per host into PAGEDSERVE_CACHE)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY pagedserve pagedserve
COPY frontend frontend
COPY scheduler scheduler
COPY worker worker
COPY kernels kernels
RUN pip install .

ENTRYPOINT ["pagedserve"]
CMD ["serve", "--model", "demo", "--host", "0.0.0.0"]
