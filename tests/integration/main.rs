//! The single integration-test binary: end-to-end tests against a real
//! PostgreSQL and a real Apache Kafka broker that the harness starts (see
//! `harness`).

#![allow(clippy::unwrap_used)]

mod accounts_service;
mod cloudevents;
mod cluster;
mod debezium;
mod docs;
mod every_version;
mod exactly_once;
mod existing_tables;
mod fuzz;
mod hardening;
mod harness;
mod kafka_rules;
mod librdkafka;
mod many_topics;
mod operations;
mod otel;
mod park;
mod relay;
mod reliability;
mod replay;
mod replicas;
mod schema_registry;
mod sdk;
mod shared_producer;
mod sources;
