# One image for every driftline service; docker-compose.yml picks the subcommand.
FROM python:3.11-slim
WORKDIR /app
# torch is pinned to 2.13.0. Pass a CPU-only index here to skip the multi-GB CUDA build, e.g.
# `docker compose build --build-arg TORCH_INDEX_URL=<your CPU wheel index>`.
ARG TORCH_INDEX_URL=
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX_URL"; fi
COPY pyproject.toml README.md ./
COPY driftline driftline
COPY services services
COPY joiner joiner
COPY trainer trainer
COPY serving serving
COPY proto proto
COPY ps ps
COPY producers producers
COPY movielens movielens
COPY status status
COPY evaluation evaluation
# the demo's project file (docker-compose.yml: DRIFTLINE_PROJECT), as `make up` runs it
COPY examples examples
RUN pip install --no-cache-dir .
ENV DRIFTLINE_VAR_DIR=/var/lib/driftline DRIFTLINE_DATA_DIR=/var/lib/driftline/data OMP_WAIT_POLICY=PASSIVE
VOLUME /var/lib/driftline
ENTRYPOINT ["driftline"]
