//! Running outboxd: the HTTP endpoints ([`http`]) over the sources'
//! [`board`], liveness and readiness ([`health`]), logs ([`telemetry`]) and OpenTelemetry spans of published
//! events ([`otel`]).

pub mod board;
pub mod health;
pub mod http;
pub mod otel;
pub mod telemetry;
