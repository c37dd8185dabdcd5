# The ampwatch server image: `docker compose up` runs it next to Postgres (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric uid, so orchestrators that insist on non-root can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 ampwatch \
    && useradd --system --uid 10001 --gid ampwatch --home-dir /data --create-home ampwatch

# A regular (not editable) install: only `ampwatch` and its subpackages end up importable.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent/ agent/
COPY server/ server/
COPY web/ web/
COPY migrations/ migrations/
RUN pip install ".[server]" && rm -rf /src

# The working directory is writable, so the SQLite default (sqlite:///ampwatch.db) also works without Postgres.
WORKDIR /data
USER 10001:10001

EXPOSE 8600
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8600/healthz', timeout=4)"]
CMD ["ampwatch", "server", "--host", "0.0.0.0", "--port", "8600"]
