# Apache Kafka 4.1.1 on Debian bookworm's JRE 17, standing in for apache/kafka:4.1.1 in docker-compose.cpu.yml. The
# jars are the ones scripts/kafka/pom.xml resolves from Maven Central (the local brokers of scripts/kafka.sh run
# the same), copied in by scripts/docker_images.sh (build/docker/kafka). It keeps apache/kafka's contract, which
# docker-compose.yml relies on:
# - configured by environment: every KAFKA_* variable is a broker property (KAFKA_FOO_BAR -> foo.bar, __ -> _,
#   ___ -> -), CLUSTER_ID formats the storage once (static quorum: controller.quorum.voters);
# - /opt/kafka/bin/kafka-broker-api-versions.sh (the health check), data in /var/lib/kafka/data, user appuser
#   (uid 1000), KAFKA_OPTS and KAFKA_HEAP_OPTS on the JVM's command line;
# - the Prometheus JMX exporter agent in /opt/kafka/jmx-agent, which the CPU override's kafka-jmx-agent service
#   copies into the brokers' agent volume (no Maven Central at run time).
ARG DAS_DEBIAN_IMAGE=das-local/debian:bookworm
FROM ${DAS_DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 1000 --user-group --home-dir /home/appuser --create-home --shell /bin/bash appuser \
 && mkdir -p /opt/kafka/config /var/lib/kafka/data \
 && chown -R appuser:appuser /opt/kafka/config /var/lib/kafka
COPY build/docker/kafka/libs /opt/kafka/libs
COPY build/docker/kafka/jmx-agent /opt/kafka/jmx-agent
COPY scripts/kafka/log4j2.properties /opt/kafka/config/log4j2.properties
COPY docker/kafka/bin /opt/kafka/bin
RUN chmod 0755 /opt/kafka/bin/*
ENV PATH=/opt/kafka/bin:$PATH \
    KAFKA_LOG4J_OPTS="-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties -Dkafka.log.file=/dev/stdout"
USER appuser
WORKDIR /home/appuser
EXPOSE 9092
VOLUME ["/var/lib/kafka/data"]
ENTRYPOINT ["/opt/kafka/bin/run-broker.sh"]
