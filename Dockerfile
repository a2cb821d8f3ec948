# syntax=docker/dockerfile:1
# outboxd image: a Rust build stage, then a slim, non-root runtime.
#   docker build -t outboxd .
#   docker run -v $PWD/outboxd.toml:/etc/outboxd/outboxd.toml:ro -e PGPASSWORD=… outboxd

FROM rust:1.95-slim-bookworm AS build
# librdkafka is compiled from source by the rdkafka crate: it needs a C
# toolchain, make, pkg-config and OpenSSL headers (for Kafka TLS and SASL).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make pkg-config libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin outboxd \
 && strip target/release/outboxd

FROM debian:bookworm-slim AS runtime
# ca-certificates: TLS to PostgreSQL (sslrootcert=system) and Kafka.
# libssl3: librdkafka's TLS.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin outboxd
COPY --from=build /src/target/release/outboxd /usr/local/bin/outboxd
USER 10001:10001
# /metrics, /healthz, /readyz and /status (http.listen must be 0.0.0.0:9187).
EXPOSE 9187
ENTRYPOINT ["/usr/local/bin/outboxd"]
CMD ["run", "--config", "/etc/outboxd/outboxd.toml"]
