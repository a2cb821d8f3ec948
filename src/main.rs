//! The `outboxd` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outboxd::config::Config;
use outboxd::pipeline::Relay;
use tokio::sync::watch;

/// Relay transactional-outbox rows from PostgreSQL logical replication to Kafka.
#[derive(Debug, Parser)]
#[command(name = "outboxd", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    },
}

fn load(path: &std::path::Path) -> Result<(Config, outboxd::config::Validated), ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("outboxd: {e}");
        ExitCode::from(2)
    })
}

async fn run(path: PathBuf) -> ExitCode {
    let (config, validated) = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    outboxd::telemetry::init(&config.log);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        postgres = %validated.pg.target(),
        table = %validated.table,
        slot = validated.slot.as_str(),
        publication = validated.publication.as_str(),
        brokers = config.kafka.brokers.as_str(),
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
    let mut relay = match Relay::new(config, validated) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    match relay.run(stop_rx).await {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "stopped on an error that a restart will not fix");
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

async fn check(path: PathBuf) -> ExitCode {
    let (config, validated) = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let lines = outboxd::check::run_checks(&config, &validated).await;
    for l in &lines {
        println!("{l}");
    }
    if lines.iter().all(|l| l.ok) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
    runtime.block_on(async {
        match cli.command {
            Command::Run { config } => run(config).await,
            Command::Check { config } => check(config).await,
        }
    })
}
