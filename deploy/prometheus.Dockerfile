# Prometheus from Debian's package, for `docker compose --profile monitoring up`: built on the
# nodes' base image (a Debian bookworm image with python3: python:3.11-slim or a debootstrap base), so the
# monitoring profile pulls no image of its own. docker-compose.yml mounts deploy/prometheus.yml.
#
#   docker build -f deploy/prometheus.Dockerfile -t neuronode-prometheus:local deploy
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# policy-rc.d: the package's maintainer scripts must not start a daemon inside the build.
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /usr/sbin/policy-rc.d \
    && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
# Debian's promtool (2.42) has no `check healthy`; the base has python3 (the nodes need it).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:9090/-/healthy', timeout=4)"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=:9090", "--web.console.libraries=/usr/share/prometheus/console_libraries", \
     "--web.console.templates=/usr/share/prometheus/consoles"]
