//! The accounts service: seed 004's write and read sides in one process,
//! the reference application of outbox-sdk and outboxd.
//!
//! ```text
//!  POST /accounts, …/deposits, …/withdrawals
//!        │ AccountStore::update (optimistic concurrency, retried)
//!        ▼
//!  PostgreSQL: events + snapshots + outbox ──WAL──▶ outboxd ──▶ Kafka account.events
//!        ▲                                                          │
//!        │ GET …/state?at= (time travel, from the event store)      │ three consumer groups
//!        │                                                          ▼
//!  GET /accounts/{id}, …/transactions, …/audit ◀── balance, history and audit views
//! ```
//!
//! ```sh
//! cargo run --example accounts_service -- \
//!     --database-url postgres://app@localhost/app --brokers localhost:9092 --listen 127.0.0.1:8080
//! ```
//!
//! `--rebuild balance|history|audit` (repeatable) projects that view again
//! from the start of the topic before serving. Modules: `api` (HTTP),
//! `projection` (the consumer loop, its idempotency and dead letters),
//! `views` (the three read models), `event` (one record), `pool`.

mod api;
mod event;
mod pool;
mod projection;
mod views;

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;
use outbox_sdk::accounts::AccountStore;
use outbox_sdk::event_store::EventStore;
use rdkafka::producer::FutureProducer;
use rdkafka::ClientConfig;

use crate::api::AppState;
use crate::projection::{BoxError, Projection, Source};
use crate::views::View;

/// Seed 004's accounts: commands, three projections and time travel over HTTP.
#[derive(Debug, Parser)]
struct Args {
    /// postgres:// URL of the database with the event store and the views.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    #[arg(long, default_value = "localhost:9092")]
    brokers: String,
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    #[arg(long, default_value = "account.events")]
    topic: String,
    #[arg(long, default_value = "account.events.dlq")]
    dlq_topic: String,
    /// The views' consumer groups are <prefix>.balance, .history and .audit.
    #[arg(long, default_value = "accounts-service")]
    group_prefix: String,
    /// How outboxd builds values: "envelope" (data under "data") or "payload".
    #[arg(long, default_value = "envelope")]
    value: String,
    /// A snapshot of an account every this many versions.
    #[arg(long, default_value_t = 100)]
    snapshot_every: i64,
    /// Database connections (commands, queries and the three views).
    #[arg(long, default_value_t = 16)]
    pool_size: usize,
    /// Project this view again from the start of the topic (repeatable).
    #[arg(long, value_enum)]
    rebuild: Vec<View>,
    /// Replication factor when the DLQ topic must be created; -1 uses the broker default.
    #[arg(long, default_value_t = -1, allow_hyphen_values = true)]
    dlq_replication_factor: i32,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if let Err(e) = serve(Args::parse()).await {
        eprintln!("accounts_service: {e}");
        std::process::exit(1);
    }
}

async fn serve(args: Args) -> Result<(), BoxError> {
    let envelope = match args.value.as_str() {
        "envelope" => true,
        "payload" => false,
        other => return Err(format!("--value must be envelope or payload, not {other:?}").into()),
    };
    if args.snapshot_every < 1 {
        return Err("--snapshot-every must be at least 1".into());
    }
    let pg: outboxd::config::conninfo::PgConnectConfig = args.database_url.parse()?;
    let pool = pool::new(pg, args.pool_size.max(4))?;
    {
        let mut client = pool.get().await?;
        let applied = outbox_sdk::migrate::migrate(&mut client).await?;
        if !applied.is_empty() {
            tracing::info!("applied migrations {applied:?}");
        }
        client.batch_execute(views::DDL).await?;
    }
    let source = Arc::new(Source {
        brokers: args.brokers.clone(),
        topic: args.topic.clone(),
        dlq_topic: args.dlq_topic.clone(),
        group_prefix: args.group_prefix.clone(),
        envelope,
    });
    projection::ensure_dlq(&source, args.dlq_replication_factor).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("enable.idempotence", "true")
        .create()?;

    let mut projections = Vec::new();
    for view in View::ALL {
        let p = Arc::new(Projection::new(view, &source)?);
        if args.rebuild.contains(&view) {
            tracing::info!(
                view = view.name(),
                group = p.group,
                "rebuilding from the start of {}",
                args.topic
            );
            p.reset(&pool).await?;
        }
        tokio::spawn(projection::run(
            p.clone(),
            source.clone(),
            pool.clone(),
            producer.clone(),
        ));
        projections.push(p);
    }

    let state = Arc::new(AppState {
        pool,
        store: AccountStore::new(EventStore::with_snapshot_every(args.snapshot_every)),
        projections,
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    // The bound address (with --listen …:0, the port chosen).
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, api::router(state))
        .with_graceful_shutdown(shutdown())
        .await?;
    Ok(())
}

async fn shutdown() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
