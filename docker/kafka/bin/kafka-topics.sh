#!/usr/bin/env bash
# kafka-topics as Kafka's distribution runs it: the class on the broker's classpath, with KAFKA_OPTS and KAFKA_HEAP_OPTS
# (the compose health check clears KAFKA_OPTS, which would otherwise load the broker's JMX agent a second time).
# shellcheck disable=SC2086 - the *_OPTS variables are lists of JVM flags
exec java ${KAFKA_HEAP_OPTS:--Xmx256m} ${KAFKA_OPTS:-} -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -Dkafka.log.file=/dev/stderr -cp "/opt/kafka/libs/*" org.apache.kafka.tools.TopicCommand "$@"
