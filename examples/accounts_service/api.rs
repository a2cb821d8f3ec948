//! The HTTP API (axum). Commands go through the SDK's event store
//! (`AccountStore::update`, optimistic concurrency retried); reads come from
//! the three views, and time travel from the event store itself. JSON is
//! camelCase, as in the seed; every error is `{"message": …}` (plus `rule`
//! for a broken business rule). Request validation is axum's own: its
//! rejections keep their status and text, in the same JSON shape.

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use chrono::{DateTime, Utc};
use outbox_sdk::accounts::{Account, AccountCommandError, AccountError, AccountState, AccountStore};
use outbox_sdk::event_store::EventStoreError;
use outbox_sdk::outbox::Headers;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::pool::{Pool, PoolError};
use crate::projection::Projection;

/// Attempts of a command that keeps meeting concurrent writers.
const MAX_ATTEMPTS: u32 = 20;
const CORRELATION_HEADER: &str = "x-correlation-id";

#[derive(Debug)]
pub struct AppState {
    pub pool: Pool,
    pub store: AccountStore,
    pub projections: Vec<Arc<Projection>>,
}

type Shared = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/accounts", post(open))
        .route("/accounts/{id}", get(balance))
        .route("/accounts/{id}/deposits", post(deposit))
        .route("/accounts/{id}/withdrawals", post(withdraw))
        .route("/accounts/{id}/transactions", get(transactions))
        .route("/accounts/{id}/audit", get(audit))
        .route("/accounts/{id}/state", get(state_at))
        .route("/healthz", get(healthz))
        .route("/projections", get(projections))
        .with_state(state)
}

// ---- errors --------------------------------------------------------------

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    rule: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            rule: None,
        }
    }

    fn internal(e: impl std::fmt::Display) -> Self {
        tracing::error!("request failed: {e}");
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("internal error: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"message": self.message});
        if let Some(rule) = self.rule {
            body["rule"] = json!(rule);
        }
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        ApiError::new(r.status(), r.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::new(r.status(), r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        ApiError::new(r.status(), r.body_text())
    }
}

impl From<PoolError> for ApiError {
    fn from(e: PoolError) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database unavailable: {e}"),
        )
    }
}

impl From<tokio_postgres::Error> for ApiError {
    fn from(e: tokio_postgres::Error) -> Self {
        ApiError::internal(e)
    }
}

impl From<EventStoreError> for ApiError {
    fn from(e: EventStoreError) -> Self {
        ApiError::internal(e)
    }
}

impl From<AccountCommandError> for ApiError {
    fn from(e: AccountCommandError) -> Self {
        match e {
            AccountCommandError::Domain(rule) => ApiError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                message: rule.to_string(),
                rule: Some(match rule {
                    AccountError::NegativeInitialBalance(_) => "negativeInitialBalance",
                    AccountError::NonPositiveAmount(_) => "nonPositiveAmount",
                    AccountError::NotActive(_) => "accountNotActive",
                    AccountError::InsufficientFunds { .. } => "insufficientFunds",
                    AccountError::Overflow => "balanceOverflow",
                }),
            },
            AccountCommandError::NotFound(id) => {
                ApiError::new(StatusCode::NOT_FOUND, format!("account {id} does not exist"))
            }
            e @ AccountCommandError::RetriesExhausted { .. } => {
                ApiError::new(StatusCode::CONFLICT, e.to_string())
            }
            AccountCommandError::Store(e) => e.into(),
        }
    }
}

/// axum's extractors, their rejections answered as [`ApiError`]s.
#[derive(Debug, FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
struct Json<T>(T);

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
struct Query<T>(T);

#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
struct Path<T>(T);

// ---- commands -------------------------------------------------------------

/// The request's correlation id (`X-Correlation-Id`, or a new one), kept in
/// the events' metadata and echoed in the response.
fn correlation(headers: &HeaderMap) -> (Headers, String) {
    let id = headers
        .get(CORRELATION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 200)
        .map_or_else(|| Uuid::now_v7().to_string(), str::to_owned);
    let mut h = Headers::new();
    h.set_correlation_id(id.clone());
    (h, id)
}

fn with_correlation(status: StatusCode, state: AccountState, id: &str) -> Response {
    let mut r = (status, axum::Json(state)).into_response();
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert(CORRELATION_HEADER, v);
    }
    r
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct OpenAccount {
    account_id: Option<String>,
    owner_id: String,
    initial_balance: i64,
}

async fn open(
    State(app): Shared,
    headers: HeaderMap,
    Json(body): Json<OpenAccount>,
) -> Result<Response, ApiError> {
    let id = body
        .account_id
        .unwrap_or_else(|| format!("acc-{}", Uuid::now_v7()));
    if id.is_empty() || id.len() > 200 {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "accountId must have 1 to 200 characters",
        ));
    }
    if body.owner_id.is_empty() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "ownerId must not be empty",
        ));
    }
    let (meta, correlation_id) = correlation(&headers);
    let mut account =
        Account::open(&id, body.owner_id, body.initial_balance).map_err(AccountCommandError::Domain)?;
    let mut client = app.pool.get().await?;
    let tx = client.transaction().await?;
    match app.store.save(&tx, &mut account, &meta).await {
        Ok(_) => {}
        Err(EventStoreError::ConcurrencyConflict { .. }) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("account {id} already exists"),
            ))
        }
        Err(e) => return Err(e.into()),
    }
    tx.commit().await?;
    Ok(with_correlation(
        StatusCode::CREATED,
        account.state().clone(),
        &correlation_id,
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Movement {
    amount: i64,
    #[serde(default)]
    description: String,
}

async fn deposit(
    state: Shared,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Movement>,
) -> Result<Response, ApiError> {
    command(state, id, headers, move |a| {
        a.deposit(body.amount, body.description.clone())
    })
    .await
}

async fn withdraw(
    state: Shared,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Movement>,
) -> Result<Response, ApiError> {
    command(state, id, headers, move |a| {
        a.withdraw(body.amount, body.description.clone())
    })
    .await
}

async fn command<F>(State(app): Shared, id: String, headers: HeaderMap, f: F) -> Result<Response, ApiError>
where
    F: FnMut(&mut Account) -> Result<(), AccountError>,
{
    let (meta, correlation_id) = correlation(&headers);
    let mut client = app.pool.get().await?;
    let state = app.store.update(&mut client, &id, MAX_ATTEMPTS, &meta, f).await?;
    Ok(with_correlation(StatusCode::OK, state, &correlation_id))
}

// ---- queries --------------------------------------------------------------

async fn balance(State(app): Shared, Path(id): Path<String>) -> Result<Response, ApiError> {
    let client = app.pool.get().await?;
    let row = client
        .query_opt(
            "SELECT owner_id, balance, status, projection_version, updated_at
               FROM account_balance_view WHERE account_id = $1",
            &[&id],
        )
        .await?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("account {id} is not in the balance view"),
            )
        })?;
    Ok(Json(json!({
        "accountId": id,
        "ownerId": row.get::<_, String>(0),
        "balance": row.get::<_, i64>(1),
        "status": row.get::<_, String>(2),
        "projectionVersion": row.get::<_, i64>(3),
        "updatedAt": row.get::<_, DateTime<Utc>>(4),
    }))
    .into_response())
}

/// `?limit=&before=`: at most `limit` rows (1 to 500, default 50) with a
/// version below `before`, newest first; `nextBefore` pages on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Page {
    limit: Option<i64>,
    before: Option<i64>,
}

impl Page {
    fn limit(&self) -> Result<i64, ApiError> {
        match self.limit.unwrap_or(50) {
            l @ 1..=500 => Ok(l),
            l => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("limit must be between 1 and 500, got {l}"),
            )),
        }
    }
}

/// Runs a page query (`$1` account, `$2` before, `$3` limit + 1) and shapes
/// `{"accountId", <key>: [...], "nextBefore"}`.
async fn paged(
    app: &AppState,
    id: &str,
    page: &Page,
    sql: &str,
    key: &str,
    row: fn(&tokio_postgres::Row) -> Value,
) -> Result<Response, ApiError> {
    let limit = page.limit()?;
    let before = page.before.unwrap_or(i64::MAX);
    let client = app.pool.get().await?;
    let exists = client
        .query_opt(
            "SELECT 1 FROM projection_positions WHERE account_id = $1 LIMIT 1",
            &[&id],
        )
        .await?
        .is_some();
    if !exists {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("account {id} is not in the views"),
        ));
    }
    let rows = client.query(sql, &[&id, &before, &(limit + 1)]).await?;
    let more = rows.len() as i64 > limit;
    let items: Vec<Value> = rows.iter().take(limit as usize).map(row).collect();
    let next = more.then(|| items.last().map(|i| i["version"].clone())).flatten();
    Ok(Json(json!({"accountId": id, key: items, "nextBefore": next})).into_response())
}

async fn transactions(
    State(app): Shared,
    Path(id): Path<String>,
    Query(page): Query<Page>,
) -> Result<Response, ApiError> {
    paged(
        &app,
        &id,
        &page,
        "SELECT version, event_id, kind, amount, balance_after, description, occurred_at
           FROM account_transaction_history
          WHERE account_id = $1 AND version < $2 ORDER BY version DESC LIMIT $3",
        "transactions",
        |r| {
            json!({
                "version": r.get::<_, i64>(0),
                "eventId": r.get::<_, Uuid>(1),
                "kind": r.get::<_, String>(2),
                "amount": r.get::<_, i64>(3),
                "balanceAfter": r.get::<_, i64>(4),
                "description": r.get::<_, String>(5),
                "occurredAt": r.get::<_, DateTime<Utc>>(6),
            })
        },
    )
    .await
}

async fn audit(
    State(app): Shared,
    Path(id): Path<String>,
    Query(page): Query<Page>,
) -> Result<Response, ApiError> {
    paged(
        &app,
        &id,
        &page,
        "SELECT version, event_id, event_type, correlation_id, occurred_at, payload, metadata
           FROM account_audit_log
          WHERE account_id = $1 AND version < $2 ORDER BY version DESC LIMIT $3",
        "events",
        |r| {
            json!({
                "version": r.get::<_, i64>(0),
                "eventId": r.get::<_, Uuid>(1),
                "type": r.get::<_, String>(2),
                "correlationId": r.get::<_, Option<String>>(3),
                "occurredAt": r.get::<_, DateTime<Utc>>(4),
                "payload": r.get::<_, Value>(5),
                "metadata": r.get::<_, Value>(6),
            })
        },
    )
    .await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct At {
    /// RFC 3339.
    at: DateTime<Utc>,
}

/// The seed's time travel: the account as it was at `at`, replayed from the
/// event store (latest snapshot at or before it, then the events after).
async fn state_at(
    State(app): Shared,
    Path(id): Path<String>,
    Query(q): Query<At>,
) -> Result<Response, ApiError> {
    let client = app.pool.get().await?;
    let state = app.store.state_at(&*client, &id, q.at).await?.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!("account {id} did not exist at {}", q.at.to_rfc3339()),
        )
    })?;
    let mut body = serde_json::to_value(&state).map_err(ApiError::internal)?;
    body["at"] = json!(q.at);
    Ok(Json(body).into_response())
}

// ---- operations -----------------------------------------------------------

async fn healthz(State(app): Shared) -> Result<Response, ApiError> {
    let client = app.pool.get().await?;
    client.query_one("SELECT 1", &[]).await?;
    Ok(Json(json!({"status": "ok"})).into_response())
}

async fn projections(State(app): Shared) -> Result<Response, ApiError> {
    let mut reports = Vec::new();
    for p in &app.projections {
        let p = p.clone();
        let lag = tokio::task::spawn_blocking(move || {
            let lag = p.lag();
            if let Err(e) = &lag {
                tracing::warn!(projection = p.view.name(), "cannot read the lag: {e}");
            }
            p.report(lag.ok())
        })
        .await
        .map_err(ApiError::internal)?;
        reports.push(lag);
    }
    Ok(Json(json!({"projections": reports})).into_response())
}
