# syntax=docker/dockerfile:1
# The GTM image: both tiers (`gtm` and `regional-lb`) in one virtualenv, run as a non-root user,
# happy on a read-only root filesystem. Build: docker build -t gtm:0.1.0 .
#
# Runtime layout (mount these; nothing else is written):
#   /etc/gtm                 read-only: topology.yaml, policies/, keys/ (document public keys;
#                            on admin nodes document-signing.key, mode 0600, owned by 10001)
#   /usr/share/GeoIP         read-only: GeoLite2-City.mmdb / GeoIP2-City.mmdb (hot-reloaded)
#   /var/lib/gtm             writable volume: audit spool, chain keys, checkpoint sink
#   /tmp                     a small tmpfs
# Secrets (GTM_DATABASE_URL, GTM_REPORT_SECRET, REGIONAL_LB_REPORT_SECRET) come from the
# orchestrator's secret store as environment variables, never from this file.

# Pin the base by digest in your registry mirror (ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# The same steps tests/deploy/test_image.py runs in a fresh virtualenv: a wheel of the project,
# then the wheel (with its dependencies) into the runtime's virtualenv.
COPY pyproject.toml README.md ./
COPY gtm ./gtm
COPY regional_lb ./regional_lb
COPY migrations ./migrations
COPY policies ./policies
COPY examples ./examples
RUN python -m venv /opt/gtm \
    && /opt/gtm/bin/pip install --upgrade pip \
    && /opt/gtm/bin/pip wheel --no-deps --wheel-dir /wheels . \
    && /opt/gtm/bin/pip install /wheels/gtm-*.whl \
    && /opt/gtm/bin/python -m compileall -q /opt/gtm/lib \
    && /opt/gtm/bin/gtm --help >/dev/null \
    && /opt/gtm/bin/regional-lb --help >/dev/null

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="gtm" \
      org.opencontainers.image.description="Global traffic manager for AI inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 gtm \
    && useradd --system --uid 10001 --gid gtm --home-dir /var/lib/gtm --no-create-home \
       --shell /usr/sbin/nologin gtm \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/gtm \
    && install -d -m 0755 /etc/gtm /usr/share/GeoIP
COPY --from=build /opt/gtm /opt/gtm
ENV PATH=/opt/gtm/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GTM_LOG_FORMAT=json \
    GTM_CONFIG=/etc/gtm/topology.yaml \
    GTM_POLICIES='["/etc/gtm/policies"]' \
    GTM_GEOIP_PATH=/usr/share/GeoIP/GeoLite2-City.mmdb \
    GTM_SPOOL_DIR=/var/lib/gtm/spool \
    GTM_AUDIT_CHECKPOINT_DIR=/var/lib/gtm/checkpoints \
    GTM_DATABASE_URL=sqlite:////var/lib/gtm/gtm.sqlite3
WORKDIR /var/lib/gtm
VOLUME ["/var/lib/gtm"]
USER 10001:10001
# DNS (UDP and TCP), HTTP front, admin API, metrics; regional-lb listens on 8600.
EXPOSE 5353/udp 5353/tcp 8080/tcp 9000/tcp 9100/tcp 8600/tcp
# No HEALTHCHECK: one image serves two commands; orchestrators probe /livez and /readyz
# (the front on 8080, the balancer on 8600).
ENTRYPOINT ["gtm"]
CMD ["serve", "--dns", "0.0.0.0:5353", "--http", "0.0.0.0:8080", "--metrics", "0.0.0.0:9100"]
