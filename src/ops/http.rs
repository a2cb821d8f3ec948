//! `/metrics`, `/healthz`, `/readyz` and `/status` on `http.listen`, and
//! with `http.admin_token` set, Kafka Connect's verbs for sources:
//!
//! * `GET /sources`: every source's status (state, slot, lag, last error);
//! * `GET /sources/{name}`: one source's;
//! * `POST /sources/{name}/pause`, `/resume`, `/restart` (`PUT` too for
//!   pause and resume, as Connect has them): change the running state only;
//!   the file is the truth again at the next start or reload.
//!
//! The verbs need `Authorization: Bearer <http.admin_token>` (compared in
//! constant time); without a configured token the routes do not exist.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use subtle::ConstantTimeEq;

use crate::config::Secret;
use crate::ops::board::{Board, ControlError, Verb};

#[derive(Clone, Debug)]
struct AppState {
    board: Arc<Board>,
    token: Option<Secret>,
}

/// The HTTP server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} (http.listen): {source}; is another process using the port?")]
pub struct BindError {
    addr: SocketAddr,
    source: std::io::Error,
}

async fn metrics_page(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.board.metrics_text(),
    )
        .into_response()
}

async fn healthz(State(s): State<AppState>) -> Response {
    match s.board.live() {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not live: {why}\n")).into_response(),
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    match s.board.readiness() {
        Ok(notes) if notes.is_empty() => (StatusCode::OK, "ready\n").into_response(),
        Ok(notes) => (StatusCode::OK, format!("ready, degraded: {}\n", notes.join("; "))).into_response(),
        Err(reasons) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", reasons.join("; ")),
        )
            .into_response(),
    }
}

/// `{"sources": {name: status}}`; with one source, its status is at the
/// top level too, as it was before sources existed.
async fn status(State(s): State<AppState>) -> Response {
    let sources = s.board.sources();
    let mut by_name = serde_json::Map::new();
    for source in &sources {
        by_name.insert(
            source.name.clone(),
            serde_json::to_value(source.status()).unwrap_or_default(),
        );
    }
    let mut top = match sources.as_slice() {
        [one] => serde_json::to_value(one.status()).unwrap_or_default(),
        _ => serde_json::json!({ "ready": s.board.readiness().is_ok() }),
    };
    if let Some(t) = top.as_object_mut() {
        t.insert("sources".into(), serde_json::Value::Object(by_name));
        if let Some(c) = s.board.coordination() {
            t.insert("coordination".into(), serde_json::to_value(c).unwrap_or_default());
        }
    }
    Json(top).into_response()
}

/// Whether the request carries the token.
fn authorized(s: &AppState, headers: &HeaderMap) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let ok = match (&s.token, given) {
        (Some(want), Some(given)) => bool::from(want.0.as_bytes().ct_eq(given.as_bytes())),
        _ => false,
    };
    ok
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        "the source verbs need Authorization: Bearer <http.admin_token>\n",
    )
        .into_response()
}

async fn list_sources(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if !authorized(&s, &headers) {
        return unauthorized();
    }
    let all: Vec<_> = s.board.sources().iter().map(|s| s.status()).collect();
    Json(all).into_response()
}

async fn one_source(State(s): State<AppState>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    if !authorized(&s, &headers) {
        return unauthorized();
    }
    match s.board.get(&name) {
        Some(source) => Json(source.status()).into_response(),
        None => refused(ControlError::NoSuchSource(name)),
    }
}

fn refused(e: ControlError) -> Response {
    let code = match e {
        ControlError::NoSuchSource(_) => StatusCode::NOT_FOUND,
        ControlError::Conflict(..) => StatusCode::CONFLICT,
        ControlError::Stopping => StatusCode::SERVICE_UNAVAILABLE,
    };
    (code, format!("{e}\n")).into_response()
}

async fn verb(s: AppState, headers: HeaderMap, name: String, verb: Verb) -> Response {
    if !authorized(&s, &headers) {
        return unauthorized();
    }
    tracing::info!(source = %name, ?verb, "operator request over HTTP");
    match s.board.control(&name, verb).await {
        Ok(()) => match s.board.get(&name) {
            Some(source) => Json(source.status()).into_response(),
            None => refused(ControlError::NoSuchSource(name)),
        },
        Err(e) => refused(e),
    }
}

async fn pause(State(s): State<AppState>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    verb(s, headers, name, Verb::Pause).await
}

async fn resume(State(s): State<AppState>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    verb(s, headers, name, Verb::Resume).await
}

async fn restart(State(s): State<AppState>, headers: HeaderMap, Path(name): Path<String>) -> Response {
    verb(s, headers, name, Verb::Restart).await
}

/// Binds `addr` and serves in the background; returns the bound address
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    board: Arc<Board>,
    token: Option<Secret>,
) -> Result<SocketAddr, BindError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| BindError { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| BindError { addr, source })?;
    let mut app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status));
    if token.is_some() {
        app = app
            .route("/sources", get(list_sources))
            .route("/sources/{name}", get(one_source))
            .route("/sources/{name}/pause", post(pause).put(pause))
            .route("/sources/{name}/resume", post(resume).put(resume))
            .route("/sources/{name}/restart", post(restart));
    }
    let app = app.with_state(AppState { board, token });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the HTTP server stopped");
        }
    });
    Ok(bound)
}
