//! Running outboxd: the HTTP endpoints ([`http`]), liveness and readiness
//! ([`health`]), logs ([`telemetry`]) and OpenTelemetry spans of published
//! events ([`otel`]).

pub mod health;
pub mod http;
pub mod otel;
pub mod telemetry;
