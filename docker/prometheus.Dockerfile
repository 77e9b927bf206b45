# Prometheus from Debian bookworm's package (2.42), standing in for prom/prometheus in docker-compose.cpu.yml: the
# same entrypoint contract (the binary is the entrypoint, compose gives the flags), user (nobody, 65534) and
# paths (/etc/prometheus, data in /prometheus), port 9090.
ARG DAS_DEBIAN_IMAGE=das-local/debian:bookworm
FROM ${DAS_DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus /etc/prometheus \
 && chown -R 65534:65534 /prometheus /etc/prometheus
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
VOLUME ["/prometheus"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
