//! `/metrics`, `/healthz`, `/readyz` and `/status` on `http.listen`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::metrics::Metrics;
use crate::ops::health::Health;

#[derive(Clone, Debug)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

/// The HTTP server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} (http.listen): {source}; is another process using the port?")]
pub struct BindError {
    addr: SocketAddr,
    source: std::io::Error,
}

async fn metrics_page(State(s): State<AppState>) -> Response {
    s.metrics
        .ready
        .set(i64::from(s.health.not_ready_reasons().is_empty()));
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.encode(),
    )
        .into_response()
}

async fn healthz(State(s): State<AppState>) -> Response {
    match s.health.live() {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not live: {why}\n")).into_response(),
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    let reasons = s.health.not_ready_reasons();
    s.metrics.ready.set(i64::from(reasons.is_empty()));
    if reasons.is_empty() {
        let degraded = s.health.degraded_reasons();
        if degraded.is_empty() {
            (StatusCode::OK, "ready\n").into_response()
        } else {
            (
                StatusCode::OK,
                format!("ready, degraded: {}\n", degraded.join("; ")),
            )
                .into_response()
        }
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", reasons.join("; ")),
        )
            .into_response()
    }
}

async fn status(State(s): State<AppState>) -> Response {
    Json(s.health.snapshot()).into_response()
}

/// Binds `addr` and serves in the background; returns the bound address
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) -> Result<SocketAddr, BindError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| BindError { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| BindError { addr, source })?;
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .with_state(AppState { metrics, health });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the HTTP server stopped");
        }
    });
    Ok(bound)
}
