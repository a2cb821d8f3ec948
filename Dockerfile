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
# The dependencies first, in a layer of their own, built against
# placeholder sources: a change to outboxd's own code rebuilds only its
# crates, not librdkafka and the rest.
COPY Cargo.toml Cargo.lock ./
COPY sdk/Cargo.toml sdk/
# librdkafka with outboxd's patch (vendor/rdkafka-sys/PATCHES.md).
COPY vendor/ vendor/
RUN mkdir -p src sdk/src \
 && echo 'fn main() {}' >src/main.rs && touch src/lib.rs sdk/src/lib.rs \
 && cargo build --release --locked --bin outboxd \
 && rm -rf src sdk/src
COPY . .
# Newer than the placeholders whatever their own times, so cargo rebuilds
# outboxd's crates from them.
RUN find src sdk/src migrations -type f -exec touch {} + \
 && cargo build --release --locked --bin outboxd \
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
