#!/usr/bin/env bash
# The independent Schema Registry clients the tests decode outboxd's
# records with, as a consumer would: Confluent's Python client
# (`confluent-kafka` with its Avro, JSON Schema and Protobuf
# deserializers, which resolve each record's schema id at the registry)
# and grpcio-tools' protoc, which compiles a registry's .proto text into
# the message class the Protobuf deserializer needs. In a virtual
# environment of its own under $OUTBOXD_TOOLS (default
# ~/.cache/outboxd/tools). Prints its python. Idempotent.
set -euo pipefail
confluent=2.16.1
grpc=1.85.1
tools="${OUTBOXD_TOOLS:-$HOME/.cache/outboxd/tools}"
venv="$tools/registry-clients-$confluent-$grpc"
python="$venv/bin/python"
check='import confluent_kafka.schema_registry.avro, confluent_kafka.schema_registry.json_schema, confluent_kafka.schema_registry.protobuf, grpc_tools.protoc, fastavro'
if ! "$python" -c "$check" >/dev/null 2>&1; then
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "confluent-kafka[avro,json,protobuf,schemaregistry]==$confluent" "grpcio-tools==$grpc" >&2
  "$python" -c "$check"
fi
echo "$python"
