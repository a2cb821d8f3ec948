//! The `outboxd` command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use outboxd::config::Config;
use tokio::sync::watch;

/// Relay transactional-outbox rows from PostgreSQL logical replication to Kafka.
#[derive(Debug, Parser)]
#[command(name = "outboxd", version, about, long_about = None)]
struct Cli {
    /// With `[[sources]]`: the source a command acts on (`run`: run only
    /// this one; `check` and `status`: every source when left out).
    #[arg(long, global = true, env = "OUTBOXD_SOURCE")]
    source: Option<String>,
    #[command(subcommand)]
    command: Command,
}

/// `--source`, set once in `main` before any command runs.
static SOURCE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

fn chosen_source() -> Option<&'static str> {
    SOURCE.get().and_then(|s| s.as_deref())
}

/// The sources a command covers: the one `--source` names, else all.
fn chosen_sources(path: &std::path::Path) -> Result<Vec<outboxd::config::sources::SourceConfig>, ExitCode> {
    let all = Config::load_sources(path).map_err(|e| {
        eprintln!("outboxd: {e}");
        ExitCode::from(2)
    })?;
    match chosen_source() {
        None => Ok(all),
        Some(name) => {
            let known: Vec<String> = all.iter().map(|s| s.name.clone()).collect();
            let one: Vec<_> = all.into_iter().filter(|s| s.name == name).collect();
            if one.is_empty() {
                eprintln!(
                    "outboxd: {}",
                    outboxd::config::ConfigError::NoSuchSource {
                        name: name.to_owned(),
                        known
                    }
                );
                return Err(ExitCode::from(2));
            }
            Ok(one)
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the relay until SIGTERM or SIGINT.
    Run {
        /// The TOML configuration file.
        #[arg(short, long, env = "OUTBOXD_CONFIG")]
        config: PathBuf,
    },
    /// Validate the configuration and check PostgreSQL and Kafka; exits non-zero on any problem.
    Check {
        /// The TOML configuration file.
        #[arg(short, long, env = "OUTBOXD_CONFIG")]
        config: PathBuf,
        /// Only validate the configuration file; connect to nothing.
        #[arg(long)]
        config_only: bool,
    },
    /// Show the slot, LSNs, lag, retained WAL, the oldest waiting event and whether Kafka is reachable.
    Status {
        /// The TOML configuration file.
        #[arg(short, long, env = "OUTBOXD_CONFIG")]
        config: PathBuf,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Show what Kafka remembers of the slot (the slot register; with exactly-once, the progress record), or reset it.
    Progress {
        /// The TOML configuration file.
        #[arg(short, long, env = "OUTBOXD_CONFIG")]
        config: PathBuf,
        /// Write tombstones for the slot: the next start publishes from the
        /// slot's confirmed LSN, or creates a lost slot anew (acknowledging
        /// the gap). Refused while the slot is active.
        #[arg(long)]
        reset: bool,
        /// With --reset: create the slot now (if it is missing), so that
        /// `outboxd replay` can close a gap before the relay resumes, and
        /// no aggregate's newer events reach Kafka before its replayed ones.
        #[arg(long, requires = "reset")]
        create_slot: bool,
        /// Record the publication as it is now as the one outboxd streams
        /// with, after re-publishing what it may have missed while it
        /// changed (the start refuses otherwise; see the error).
        #[arg(long, conflicts_with = "reset")]
        accept_publication: bool,
    },
    /// Apply the shipped migrations (outbox, event store, orders) once each, in order.
    Migrate {
        /// The TOML configuration file.
        #[arg(short, long, env = "OUTBOXD_CONFIG")]
        config: PathBuf,
    },
    /// Delete outbox rows older than a retention period, in small batches.
    Retention {
        /// The TOML configuration file.
        #[arg(short, long, env = "OUTBOXD_CONFIG")]
        config: PathBuf,
        /// Delete rows created longer ago than this, e.g. "7d" or "12h".
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: std::time::Duration,
        /// Rows per DELETE statement (each statement is short and skips locked rows).
        #[arg(long, default_value_t = 5_000)]
        batch: i64,
        /// Keep rows whose published_at is NULL (for a table that a polling
        /// relay also reads). Always on when the configuration's mode is
        /// "polling": retention never deletes what that relay has not published.
        #[arg(long)]
        published_only: bool,
        /// Delete even when the slot is missing or invalidated (CDC mode),
        /// when the rows may be what `outboxd replay` needs to close the gap.
        #[arg(long)]
        force: bool,
        /// A partitioned outbox: how long to wait, per old partition, for
        /// the slot to confirm past its rows before keeping it for now.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
        wait: std::time::Duration,
    },
    /// Re-publish outbox rows from the table (after a lost slot, lost Kafka data, or for a new consumer).
    Replay(ReplayArgs),
    /// Parked events (routing.on_poison = "park"): list, show, redrive, skip, discard.
    Parked(ParkedArgs),
    /// Turn another relay's configuration into outboxd's TOML.
    #[command(subcommand)]
    Import(ImportCommand),
}

/// `outboxd import`
#[derive(Debug, Subcommand)]
enum ImportCommand {
    /// Print the outboxd configuration equivalent to a Debezium PostgreSQL
    /// connector with the Outbox Event Router (Kafka Connect's REST JSON or
    /// a .properties file), naming each option that has no equivalent.
    Debezium {
        /// The connector's configuration: `GET /connectors/NAME` or
        /// `/config` output, the JSON POSTed to create it, or a
        /// standalone .properties file.
        file: PathBuf,
        /// The Connect worker's .properties (its converters and
        /// bootstrap.servers, where the connector sets none).
        #[arg(long)]
        worker: Option<PathBuf>,
    },
}

/// `outboxd parked`: see README.md, "Bad rows".
#[derive(Debug, clap::Args)]
struct ParkedArgs {
    /// The TOML configuration file.
    #[arg(short, long, env = "OUTBOXD_CONFIG", global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: ParkedCommand,
}

/// Which sequences: --key (with --topic), --reason or --all.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
struct SequenceArgs {
    /// The sequences of this key (aggregate id).
    #[arg(long)]
    key: Option<String>,
    /// The sequences whose head was parked for this reason (a dlq.reason).
    #[arg(long)]
    reason: Option<String>,
    /// Every parked sequence.
    #[arg(long)]
    all: bool,
}

#[derive(Debug, clap::Subcommand)]
enum ParkedCommand {
    /// Per parked sequence: the head's reason, the count and since when.
    List {
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// The parked events of the selected sequences, in order (JSON lines).
    Show {
        #[command(flatten)]
        which: SequenceArgs,
        /// With --key: only this topic.
        #[arg(long)]
        topic: Option<String>,
    },
    /// Re-publish the selected sequences in order under today's configuration, deleting each event once Kafka acknowledged it.
    Redrive {
        #[command(flatten)]
        which: SequenceArgs,
        /// With --key: only this topic.
        #[arg(long)]
        topic: Option<String>,
        /// Show what would be redriven; publish nothing.
        #[arg(long)]
        dry_run: bool,
        /// How long to wait for the slot to confirm past parked events (a running outboxd confirms within seconds).
        #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
        wait: std::time::Duration,
    },
    /// Send the head of a sequence to the dead-letter topic, then redrive the rest.
    Skip {
        /// The head event's id.
        #[arg(long)]
        id: String,
        #[arg(long)]
        dry_run: bool,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
        wait: std::time::Duration,
    },
    /// Delete the selected sequences' parked events for good.
    Discard {
        #[command(flatten)]
        which: SequenceArgs,
        #[arg(long)]
        topic: Option<String>,
        /// Required: the events are gone afterwards.
        #[arg(long)]
        confirm: bool,
        /// How long to wait for the slot to confirm past the events.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
        wait: std::time::Duration,
    },
}

fn selection(which: &SequenceArgs, topic: Option<String>) -> outboxd::cli::parked::Selection {
    use outboxd::cli::parked::Selection;
    match (&which.key, &which.reason) {
        (Some(key), _) => Selection::Key {
            key: key.clone(),
            topic,
        },
        (None, Some(reason)) => Selection::Reason(reason.clone()),
        (None, None) => Selection::All,
    }
}

async fn parked(args: ParkedArgs) -> ExitCode {
    use outboxd::cli::parked::{self as p, RedriveOptions};
    let Some(path) = args.config else {
        eprintln!("outboxd: give the configuration file with --config (or OUTBOXD_CONFIG)");
        return ExitCode::FAILURE;
    };
    let (config, validated) = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    outboxd::ops::telemetry::init(&config.log);
    let result = match args.command {
        ParkedCommand::List { json } => p::list(&validated).await.map(|l| {
            if json {
                println!("{}", serde_json::to_string_pretty(&l).unwrap_or_default());
            } else if l.is_empty() {
                println!("no parked sequences");
            } else {
                println!("{:<32} {:<24} {:>7} {:<28} {:<25} HEAD", "TOPIC", "KEY", "EVENTS", "REASON", "PARKED AT");
                for s in &l {
                    let back = if s.handed_back { " (handed back: outboxd publishes the rest)" } else { "" };
                    println!("{:<32} {:<24} {:>7} {:<28} {:<25} {}{back}", s.topic, s.key, s.events, s.head_reason, s.parked_at, s.head_id);
                }
            }
        }),
        ParkedCommand::Show { which, topic } => p::show(&validated, &selection(&which, topic)).await.map(|events| {
            for e in events {
                let line = serde_json::json!({
                    "topic": e.topic, "key": e.key, "id": e.id(), "commit_lsn": e.pos.commit_lsn.to_string(),
                    "position": e.pos.index, "reason": e.reason, "error": e.error, "attempts": e.attempts,
                });
                println!("{line}");
            }
        }),
        ParkedCommand::Redrive {
            which,
            topic,
            dry_run,
            wait,
        } => {
            let options = RedriveOptions { dry_run, wait };
            match p::redrive(&config, &validated, &selection(&which, topic), &options).await {
                Ok(r) if r.left > 0 => Err(p::ParkedError::Incomplete(r.left)),
                Ok(r) => {
                    println!("redriven: {} event(s) published, {} sequence(s) released{}", r.published, r.released, handed_back(&r));
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        ParkedCommand::Skip { id, dry_run, wait } => {
            let options = RedriveOptions { dry_run, wait };
            match p::skip(&config, &validated, &id, &options).await {
                Ok(r) if r.left > 0 => Err(p::ParkedError::Incomplete(r.left)),
                Ok(r) => {
                    println!("skipped {id}; redriven: {} event(s) published, {} sequence(s) released{}", r.published, r.released, handed_back(&r));
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        ParkedCommand::Discard {
            which,
            topic,
            confirm,
            wait,
        } => {
            p::discard(&validated, &selection(&which, topic), confirm, wait).await.map(|n| println!("discarded {n} parked event(s)"))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outboxd: parked: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `outboxd replay`: see docs/recovery.md, "Replay and backfill".
#[derive(Debug, clap::Args)]
struct ReplayArgs {
    /// The TOML configuration file.
    #[arg(short, long, env = "OUTBOXD_CONFIG")]
    config: PathBuf,
    /// Rows committed at or after this time: RFC 3339 (2026-12-01T10:00:00Z) or a duration ago (2h).
    #[arg(long, value_parser = parse_time)]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Rows committed before this time: RFC 3339 or a duration ago.
    #[arg(long, value_parser = parse_time)]
    until: Option<chrono::DateTime<chrono::Utc>>,
    /// Where commit times are unknown (track_commit_timestamp off), select by created_at from this long before --since: a transaction that committed after --since may have begun before it.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    slack: std::time::Duration,
    /// Only rows of this aggregate type: the route column's value (repeatable).
    #[arg(long = "aggregate-type")]
    aggregate_types: Vec<String>,
    /// Only rows of this aggregate id: the key column's value (repeatable).
    #[arg(long = "aggregate-id")]
    aggregate_ids: Vec<String>,
    /// Only the row with this id: the id column's value (repeatable).
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Replay the whole table (needed when nothing else selects rows).
    #[arg(long)]
    all: bool,
    /// Count the rows that would be replayed; publish nothing.
    #[arg(long)]
    dry_run: bool,
    /// At most this many records a second.
    #[arg(long)]
    rate: Option<f64>,
    /// Rows read and acknowledged per batch.
    #[arg(long, default_value_t = 1_000)]
    batch: usize,
    /// The state file: what was selected and how far Kafka acknowledged it.
    #[arg(long, default_value = "outboxd-replay.json")]
    state: PathBuf,
    /// Continue the replay in --state where it stopped.
    #[arg(long)]
    resume: bool,
}

/// RFC 3339, or a duration before now.
fn parse_time(s: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.to_utc());
    }
    let ago = humantime::parse_duration(s).map_err(|_| {
        format!("{s:?} is neither an RFC 3339 time (2026-12-01T10:00:00Z) nor a duration (2h)")
    })?;
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|d| chrono::Utc::now().checked_sub_signed(d))
        .ok_or_else(|| format!("{s:?} reaches before the earliest time outboxd can write"))
}

async fn replay(args: ReplayArgs) -> ExitCode {
    use outboxd::cli::replay::{Options, Outcome, Replay, ReplayError};
    use std::sync::atomic::{AtomicBool, Ordering};
    let (config, validated) = match load(&args.config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    outboxd::ops::telemetry::init(&config.log);
    let options = Options {
        selection: outboxd::cli::replay::select::Selection {
            since: args.since,
            until: args.until,
            slack: args.slack,
            aggregate_types: args.aggregate_types,
            aggregate_ids: args.aggregate_ids,
            ids: args.ids,
        },
        all: args.all,
        dry_run: args.dry_run,
        rate: args.rate,
        batch: args.batch,
        state: args.state,
        resume: args.resume,
    };
    let replay = Replay::new(config, validated, options);
    let stop = Arc::new(AtomicBool::new(false));
    tokio::spawn({
        let stop = stop.clone();
        async move {
            wait_for_signal().await;
            eprintln!("outboxd: stopping the replay after the records in flight");
            stop.store(true, Ordering::Relaxed);
        }
    });
    match replay.run(stop).await {
        Ok(Outcome::DryRun { counts, order }) => {
            let total: i64 = counts.iter().map(|c| c.rows).sum();
            println!("dry run: {total} rows would be replayed, ordered by {order}");
            for c in counts {
                println!(
                    "  {:<24} {:>10}  {} .. {}",
                    c.aggregate_type, c.rows, c.first, c.last
                );
            }
            ExitCode::SUCCESS
        }
        Ok(Outcome::Finished(summary)) => {
            println!("replay finished\n{summary}");
            ExitCode::SUCCESS
        }
        Ok(Outcome::Interrupted(summary)) => {
            println!(
                "replay interrupted\n{summary}\nresume with: {}",
                replay.resume_command()
            );
            ExitCode::from(130)
        }
        Err(e @ (ReplayError::NothingSelected | ReplayError::State(_))) => {
            eprintln!("outboxd: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("outboxd: {e}");
            if let Some(resume) = replay.resumable() {
                eprintln!("resume with: {resume}");
            }
            ExitCode::FAILURE
        }
    }
}

fn load(path: &std::path::Path) -> Result<(Config, outboxd::config::Validated), ExitCode> {
    Config::load_source(path, chosen_source()).map_err(|e| {
        eprintln!("outboxd: {e}");
        ExitCode::from(2)
    })
}

async fn run(path: PathBuf) -> ExitCode {
    let sources = match chosen_sources(&path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let Some(first) = sources.first() else {
        eprintln!("outboxd: the config file lists no source");
        return ExitCode::from(2);
    };
    let (shared, listen, token) = (
        first.config.clone(),
        first.validated.listen,
        first.config.http.admin_token.clone(),
    );
    outboxd::ops::telemetry::init(&shared.log);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        sources = ?sources.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        brokers = shared.kafka.brokers.as_str(),
        "starting outboxd"
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown requested; draining in-flight events");
        let _ = stop_tx.send(true);
        // A second signal is not needed: the drain is bounded by shutdown.drain_timeout.
        std::future::pending::<()>().await;
    });
    let only = chosen_source().map(str::to_owned);
    let (supervisor, board) = match outboxd::daemon::Supervisor::new(Some(path), only, sources) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot set up the sources");
            return ExitCode::FAILURE;
        }
    };
    match outboxd::ops::http::serve(listen, board, token.clone()).await {
        Ok(addr) if token.is_some() => tracing::info!(
            %addr,
            "serving /metrics, /healthz, /readyz, /status and the source verbs under /sources"
        ),
        Ok(addr) => tracing::info!(%addr, "serving /metrics, /healthz, /readyz and /status"),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the HTTP server");
            return ExitCode::FAILURE;
        }
    }
    match supervisor.run(stop_rx).await {
        outboxd::daemon::Ending::Stopped => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        outboxd::daemon::Ending::Failed => {
            tracing::error!("every source stopped on an error that a restart will not fix");
            ExitCode::FAILURE
        }
    }
}

async fn wait_for_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn check(path: PathBuf, config_only: bool) -> ExitCode {
    let sources = match chosen_sources(&path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    if config_only {
        println!("ok   config       parsed and valid");
        return ExitCode::SUCCESS;
    }
    let mut ok = true;
    for source in &sources {
        if sources.len() > 1 {
            println!("source {}", source.name);
        }
        let lines = outboxd::cli::check::run_checks(&source.config, &source.validated).await;
        for l in &lines {
            println!("{l}");
        }
        ok &= lines.iter().all(|l| l.ok);
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn sql_client(
    path: &std::path::Path,
) -> Result<(tokio_postgres::Client, Config, outboxd::config::Validated), ExitCode> {
    let (config, validated) = load(path)?;
    match outboxd::postgres::admin::connect(&validated.pg).await {
        Ok(c) => Ok((c, config, validated)),
        Err(e) => {
            eprintln!("outboxd: {e}");
            Err(ExitCode::FAILURE)
        }
    }
}

async fn progress(path: PathBuf, reset: bool, create_slot: bool, accept_publication: bool) -> ExitCode {
    let (config, validated) = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let kafka = &config.kafka;
    let slot = validated.slot.as_str();
    let timeout = kafka.admin_timeout.0;
    match outboxd::relay::exactly_once::read_progress(kafka, kafka.progress_topic(), slot, timeout).await {
        Ok(Some(record)) => match serde_json::to_string_pretty(&record) {
            Ok(text) => println!("{text}"),
            Err(e) => eprintln!("outboxd: {e}"),
        },
        Ok(None) => println!(
            "no progress record for slot {slot:?} in {:?}",
            kafka.progress_topic()
        ),
        Err(e) => {
            eprintln!("outboxd: {e}");
            return ExitCode::FAILURE;
        }
    }
    // The slot register is keyed by the PostgreSQL system identifier.
    let system = match outboxd::postgres::connection::ReplicationConnection::identify(&validated.pg).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "outboxd: cannot identify the PostgreSQL system, so the slot register cannot be read: {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    match outboxd::relay::slot_register::read(kafka, &system.system_id, slot, timeout).await {
        Ok(Some(record)) => match serde_json::to_string_pretty(&record) {
            Ok(text) => println!("slot register:\n{text}"),
            Err(e) => eprintln!("outboxd: {e}"),
        },
        Ok(None) => println!(
            "no slot register record for slot {slot:?} of system {} in {:?}",
            system.system_id,
            kafka.progress_topic()
        ),
        Err(e) => {
            eprintln!("outboxd: {e}");
            return ExitCode::FAILURE;
        }
    }
    if accept_publication {
        return match outboxd::cli::progress::accept_publication(&config, &validated, &system).await {
            Ok(text) => {
                println!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("outboxd: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if !reset {
        return ExitCode::SUCCESS;
    }
    // Only with outboxd stopped: a running one would go on from its own
    // position and write a new record at its next commit anyway.
    let active = match outboxd::postgres::admin::connect(&validated.pg).await {
        Ok(client) => client
            .query_opt(
                "SELECT active FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .map(|row| row.is_some_and(|r| r.get::<_, bool>(0))),
        Err(e) => {
            eprintln!("outboxd: cannot check that the slot is idle, so the progress is left as it is: {e}");
            return ExitCode::FAILURE;
        }
    };
    match active {
        Ok(false) => {}
        Ok(true) => {
            eprintln!("outboxd: slot {slot:?} is active: stop outboxd before resetting its progress");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("outboxd: cannot read the slot: {e}");
            return ExitCode::FAILURE;
        }
    }
    let reset = match outboxd::relay::exactly_once::reset_progress(
        kafka,
        kafka.progress_topic(),
        slot,
        timeout,
    )
    .await
    {
        Ok(()) => outboxd::relay::slot_register::forget(kafka, &system.system_id, slot, timeout)
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match reset {
        Ok(()) if create_slot => match outboxd::cli::progress::create_slot(&config, &validated).await {
            Ok(text) => {
                println!("reset; {text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("outboxd: reset, but the slot could not be created: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(()) => {
            println!("reset: the next start publishes from the slot's confirmed LSN, or creates the slot if it is missing");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("outboxd: the reset failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn status(path: PathBuf, json: bool) -> ExitCode {
    let sources = match chosen_sources(&path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    // Every source is reported; one that cannot be read is named, and the
    // exit code says so at the end.
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for s in &sources {
        match outboxd::cli::status::gather(&s.config, &s.validated, &s.name).await {
            Ok(report) => reports.push(report),
            Err(e) => {
                eprintln!("outboxd: source {}: {e}", s.name);
                failed.push(serde_json::json!({"source": s.name, "error": e.to_string()}));
            }
        }
    }
    let single_shape = sources.len() == 1 && sources[0].validated.source_name.is_none();
    if json {
        // A file without [[sources]] prints its report as before; a file
        // with them, an array (also of one, under --source).
        // A source that could not be read is an entry with its error.
        let text = match reports.as_slice() {
            [one] if single_shape => serde_json::to_string_pretty(one),
            _ if single_shape => return ExitCode::FAILURE,
            all => {
                let mut entries: Vec<serde_json::Value> =
                    all.iter().filter_map(|r| serde_json::to_value(r).ok()).collect();
                entries.extend(failed.iter().cloned());
                serde_json::to_string_pretty(&entries)
            }
        };
        match text {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("outboxd: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        let texts: Vec<String> = reports.iter().map(|r| r.render()).collect();
        print!("{}", texts.join("\n"));
    }
    if !failed.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The tail of a redrive's summary: the sequences handed back to the relay.
fn handed_back(r: &outboxd::cli::parked::Redriven) -> String {
    match r.handed_back {
        0 => String::new(),
        n => format!(", {n} handed back to outboxd (still written to: it publishes the rest in order and releases them)"),
    }
}

async fn migrate(path: PathBuf) -> ExitCode {
    let (mut client, _, _) = match sql_client(&path).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    match outbox_sdk::migrate::migrate(&mut client).await {
        Ok(applied) if applied.is_empty() => {
            println!("schema is up to date");
            ExitCode::SUCCESS
        }
        Ok(applied) => {
            for name in applied {
                println!("applied {name}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("outboxd: migration failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn retention(
    path: PathBuf,
    older_than: std::time::Duration,
    batch: i64,
    published_only: bool,
    force: bool,
    wait: std::time::Duration,
) -> ExitCode {
    let (mut client, config, validated) = match sql_client(&path).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    // Retention deletes by migration 0001's columns; a table of another
    // shape keeps its own clean-up.
    {
        use outboxd::config::columns::Role;
        let named = |r: Role, want: &str| validated.columns.column(r).is_some_and(|c| c.as_str() == want);
        let published = config.polling.published_column == "published_at";
        if !(named(Role::Id, "id") && named(Role::Timestamp, "created_at") && published) {
            eprintln!(
                "outboxd: retention deletes by the columns id, created_at and published_at of migrations/0001_outbox.sql, and [columns] names others for {}: nothing was deleted. Delete old rows with a job of your own, after the slot has confirmed past them",
                validated.table
            );
            return ExitCode::FAILURE;
        }
    }
    // With the slot lost, the table is the only copy of the gap: keep it
    // until `outboxd replay` has re-published it.
    if config.mode == outboxd::config::Mode::Cdc && !force {
        let slot = &validated.slot;
        let problem = match outboxd::postgres::admin::slot_info(&client, slot).await {
            Ok(None) => Some("does not exist".to_owned()),
            Ok(Some(info)) => info
                .invalidated()
                .map(|reason| format!("was invalidated ({reason})")),
            Err(e) => {
                eprintln!("outboxd: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Some(problem) = problem {
            eprintln!(
                "outboxd: replication slot {} {problem}: the outbox rows may be the only copy of events it did not deliver, which `outboxd replay` re-publishes. Nothing was deleted. Close the gap first (see `outboxd check`), or pass --force (for example before outboxd first ran)",
                slot.as_str()
            );
            return ExitCode::FAILURE;
        }
    }
    // In polling mode published_at is the relay's progress: a row without
    // it has not been published yet, whatever its age.
    let retain = if published_only || config.mode == outboxd::config::Mode::Polling {
        outbox_sdk::retention::Retain::PublishedOnly
    } else {
        outbox_sdk::retention::Retain::Cdc
    };
    // A partitioned outbox: whole partitions first (see outboxd::cli::retention).
    let passed = match retain {
        outbox_sdk::retention::Retain::PublishedOnly => outboxd::cli::retention::Passed::Published,
        outbox_sdk::retention::Retain::Cdc => outboxd::cli::retention::Passed::Slot {
            slot: &validated.slot,
            wait,
        },
    };
    match outboxd::cli::retention::drop_old_partitions(&mut client, &validated.table, older_than, passed)
        .await
    {
        Ok(outcomes) => {
            for o in outcomes {
                println!("{o}");
            }
        }
        Err(e) => {
            eprintln!("outboxd: retention failed: {e}");
            return ExitCode::FAILURE;
        }
    }
    match outbox_sdk::retention::delete_older_than(&client, &validated.table, older_than, batch, retain).await
    {
        Ok(n) => {
            println!(
                "deleted {n} outbox row(s) older than {}",
                humantime::format_duration(older_than)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("outboxd: retention failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn import_debezium(file: &std::path::Path, worker: Option<&std::path::Path>) -> ExitCode {
    use outboxd::cli::import;
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))
    };
    let imported = (|| -> Result<import::Imported, String> {
        let (name, connector) =
            import::read_config(&file.display().to_string(), &read(file)?).map_err(|e| e.to_string())?;
        let worker = match worker {
            Some(w) => Some(
                import::read_config(&w.display().to_string(), &read(w)?)
                    .map_err(|e| e.to_string())?
                    .1,
            ),
            None => None,
        };
        import::debezium(name.as_deref(), &connector, worker.as_ref()).map_err(|e| e.to_string())
    })();
    match imported {
        Ok(i) => {
            print!("{}", i.toml);
            eprintln!(
                "outboxd: imported; {} option(s) have no equivalent (listed at the end). Next: outboxd check --config <this file>",
                i.notes.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("outboxd: {e}");
            ExitCode::from(2)
        }
    }
}

/// One malloc arena for the whole process, unless the environment sets
/// `MALLOC_ARENA_MAX` (or `glibc.malloc.arena_max` in `GLIBC_TUNABLES`). glibc gives each thread
/// that allocates an arena of its own, up to eight per core. outboxd's
/// records are allocated on the runtime's workers and freed on librdkafka's
/// threads, and each arena keeps its own high-water mark of what such
/// frees leave: a drain to 150 partitions peaked 8–12 MiB higher with the
/// default arenas, at no less CPU per event (BENCHMARKS.md, "One malloc
/// arena, and warm topics"). glibc's fastbins stay on: turning them off
/// saved no memory at the default budget and cost CPU (BENCHMARKS.md, "A
/// larger budget for many partitions").
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn one_malloc_arena() {
    // Read as bytes: a value that is not UTF-8 may still set the arenas.
    let tuned = std::env::var_os("GLIBC_TUNABLES")
        .is_some_and(|t| t.to_string_lossy().contains("glibc.malloc.arena_max"));
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() && !tuned {
        // SAFETY: mallopt only sets a tunable of glibc's allocator, which
        // takes its own lock; it runs before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn one_malloc_arena() {}

fn main() -> ExitCode {
    one_malloc_arena();
    let cli = Cli::parse();
    let _ = SOURCE.set(cli.source.clone());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("outboxd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The command runs as a task on the runtime's workers, not on this
    // thread: a worker that wakes from the I/O driver (the replication
    // socket) then runs the relay itself, where a future blocked on here
    // would be woken across threads at every message.
    let command = runtime.spawn(async move {
        match cli.command {
            Command::Run { config } => run(config).await,
            Command::Check { config, config_only } => check(config, config_only).await,
            Command::Status { config, json } => status(config, json).await,
            Command::Migrate { config } => migrate(config).await,
            Command::Progress {
                config,
                reset,
                create_slot,
                accept_publication,
            } => progress(config, reset, create_slot, accept_publication).await,
            Command::Retention {
                config,
                older_than,
                batch,
                published_only,
                force,
                wait,
            } => retention(config, older_than, batch, published_only, force, wait).await,
            Command::Replay(args) => replay(args).await,
            Command::Parked(args) => parked(args).await,
            Command::Import(ImportCommand::Debezium { file, worker }) => {
                import_debezium(&file, worker.as_deref())
            }
        }
    });
    runtime.block_on(command).unwrap_or_else(|e| {
        eprintln!("outboxd: the command's task failed: {e}");
        ExitCode::FAILURE
    })
}
