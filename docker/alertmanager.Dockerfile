# Alertmanager from Debian bookworm's package (0.25), standing in for prom/alertmanager in docker-compose.cpu.yml:
# the same entrypoint contract (the binary is the entrypoint, compose gives the flags), user (nobody, 65534) and
# paths (/etc/alertmanager, data in /alertmanager), port 9093.
ARG DAS_DEBIAN_IMAGE=das-local/debian:bookworm
FROM ${DAS_DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus-alertmanager \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /alertmanager /etc/alertmanager \
 && chown -R 65534:65534 /alertmanager /etc/alertmanager
USER 65534:65534
WORKDIR /alertmanager
EXPOSE 9093
VOLUME ["/alertmanager"]
ENTRYPOINT ["/usr/bin/prometheus-alertmanager"]
CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]
