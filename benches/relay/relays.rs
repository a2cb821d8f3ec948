//! The relays under test behind one face: outboxd (CDC or polling mode)
//! and Debezium (Kafka Connect standalone with the PostgreSQL connector and
//! its Outbox Event Router). Each is started on a slot and writes every
//! event to one named topic; the benchmark then reads the same figures
//! from both: the slot's confirmed LSN, the topic's records, and the
//! process's RSS and CPU.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::harness::debezium::{Debezium, Source};
use crate::harness::postgres::free_port;

/// The Debezium connector settings the benchmark adds to
/// `scripts/debezium.sh connector`'s: the documented throughput settings
/// (a batch and a queue four times the defaults of 2,048 and 8,192) and a
/// short poll interval, so that neither drain nor latency is held back by
/// a default a tuned deployment would change.
pub const DEBEZIUM_TUNING: &[&str] = &[
    "max.batch.size=8192",
    "max.queue.size=32768",
    "poll.interval.ms=50",
];

/// What every relay needs to know: the database, the broker, and where to
/// keep its files.
#[derive(Clone, Debug)]
pub struct Setting {
    pub pg_port: u16,
    pub brokers: String,
    /// The brokers' JVMs, whose CPU a drain reports beside the relay's.
    pub broker_pids: Vec<u32>,
    pub dir: PathBuf,
    pub publication: String,
    /// Extra lines for outboxd's `[kafka]` table (`--outboxd-kafka`).
    pub outboxd_kafka: Vec<String>,
    /// Extra lines for `[kafka.exactly_once]` of the exactly-once run
    /// (`--exactly-once-setting`).
    pub exactly_once_settings: Vec<String>,
    /// The OTLP/HTTP endpoint of the traced run's span receiver.
    pub otlp_endpoint: String,
    /// The Schema Registry of the Avro run (`None`: no Avro run).
    pub registry_url: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Outboxd,
    /// outboxd with `kafka.delivery = "exactly-once"`.
    OutboxdExactlyOnce,
    /// outboxd with `[opentelemetry] enabled = true`: a span per event.
    OutboxdTraced,
    /// outboxd with `routing.value = "avro"` against a registered schema.
    OutboxdAvro,
    /// outboxd on `mapped_outbox` through `[columns]`: renamed columns and
    /// two header placements ([`crate::mapping`]).
    OutboxdMapped,
    /// Another outboxd binary (`OUTBOXD_BENCH_REFERENCE`, for example an
    /// earlier release) with the plain run's configuration: a before/after
    /// comparison on the same backlog, in the same run.
    Reference,
    Polling,
    Debezium,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Outboxd => "outboxd",
            Kind::OutboxdExactlyOnce => "outboxd_eo",
            Kind::OutboxdTraced => "outboxd_otel",
            Kind::OutboxdAvro => "outboxd_avro",
            Kind::OutboxdMapped => "outboxd_mapped",
            Kind::Reference => "reference",
            Kind::Polling => "polling",
            Kind::Debezium => "debezium",
        }
    }

    /// Starts the relay on `slot`, writing to `topic` (3 partitions, made
    /// beforehand). Debezium returns once its task streams (seconds);
    /// outboxd returns at once.
    pub fn start(self, s: &Setting, slot: &str, topic: &str) -> Running {
        match self {
            Kind::Outboxd
            | Kind::OutboxdExactlyOnce
            | Kind::OutboxdTraced
            | Kind::OutboxdAvro
            | Kind::OutboxdMapped
            | Kind::Reference
            | Kind::Polling => {
                let http_port = free_port();
                let mode = if self == Kind::Polling {
                    "mode = \"polling\""
                } else {
                    ""
                };
                let text = format!(
                    r#"{mode}
[postgres]
url = "postgres://postgres@127.0.0.1:{pg}/postgres?sslmode=disable"
slot = "{slot}"
publication = "{publication}"
{table}
[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
{kafka_extra}
[routing]
topic = "{topic}"
{avro}
{columns}
[http]
listen = "127.0.0.1:{http_port}"
[log]
level = "{level}"
{otel}
"#,
                    otel = if self == Kind::OutboxdTraced {
                        format!(
                            "[opentelemetry]\nenabled = true\nendpoint = \"{}\"",
                            s.otlp_endpoint
                        )
                    } else {
                        String::new()
                    },
                    avro = match (self, &s.registry_url) {
                        (Kind::OutboxdAvro, Some(url)) =>
                            format!("value = \"avro\"\n[schema_registry]\nurl = \"{url}\""),
                        _ => String::new(),
                    },
                    level = std::env::var("OUTBOXD_BENCH_LOG").unwrap_or_else(|_| "info".into()),
                    pg = s.pg_port,
                    publication = if self == Kind::OutboxdMapped {
                        crate::mapping::PUBLICATION
                    } else {
                        &s.publication
                    },
                    table = if self == Kind::OutboxdMapped {
                        format!("table = \"public.{}\"", crate::mapping::TABLE)
                    } else {
                        String::new()
                    },
                    columns = if self == Kind::OutboxdMapped {
                        crate::mapping::COLUMNS
                    } else {
                        ""
                    },
                    brokers = s.brokers,
                    kafka_extra = if self == Kind::OutboxdExactlyOnce {
                        format!(
                            "{}\ndelivery = \"exactly-once\"\n[kafka.exactly_once]\nprogress_topic = \"progress-{topic}\"\n{}",
                            s.outboxd_kafka.join("\n"),
                            s.exactly_once_settings.join("\n")
                        )
                    } else {
                        s.outboxd_kafka.join("\n")
                    },
                );
                let config = s.dir.join(format!("{topic}.toml"));
                std::fs::write(&config, text).expect("write outboxd's config");
                let log = s.dir.join(format!("{topic}.log"));
                let mut running = Running::Outboxd {
                    binary: if self == Kind::Reference {
                        reference_binary().expect("OUTBOXD_BENCH_REFERENCE names the reference binary")
                    } else {
                        PathBuf::from(env!("CARGO_BIN_EXE_outboxd"))
                    },
                    child: None,
                    config,
                    log,
                    http_port,
                };
                running.restart();
                running
            }
            Kind::Debezium => {
                let source = Source {
                    pg_port: s.pg_port,
                    dbname: "postgres",
                    slot,
                    publication: &s.publication,
                };
                Running::Debezium(Debezium::start(&s.brokers, &source, topic, DEBEZIUM_TUNING))
            }
        }
    }
}

/// The reference binary of the before/after run, if one is named.
pub fn reference_binary() -> Option<PathBuf> {
    std::env::var_os("OUTBOXD_BENCH_REFERENCE").map(PathBuf::from)
}

/// A started relay.
pub enum Running {
    Outboxd {
        binary: PathBuf,
        child: Option<Child>,
        config: PathBuf,
        log: PathBuf,
        http_port: u16,
    },
    Debezium(Debezium),
}

impl Running {
    /// The process whose RSS and CPU count: outboxd, or Connect's JVM.
    pub fn pid(&self) -> u32 {
        match self {
            Running::Outboxd { child, .. } => child.as_ref().map_or(0, Child::id),
            Running::Debezium(d) => d.pid,
        }
    }

    /// outboxd's metrics port.
    pub fn http_port(&self) -> Option<u16> {
        match self {
            Running::Outboxd { http_port, .. } => Some(*http_port),
            Running::Debezium(_) => None,
        }
    }

    /// SIGTERM, and waits for the exit: outboxd drains and confirms,
    /// Connect commits its offsets and Debezium confirms the slot.
    pub fn stop(&mut self) {
        match self {
            Running::Outboxd { child, .. } => {
                if let Some(mut c) = child.take() {
                    let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
                    let _ = c.wait();
                }
            }
            Running::Debezium(d) => d.stop(),
        }
    }

    /// Starts the stopped relay again with the same configuration (and,
    /// for Connect, the offsets it stored).
    pub fn restart(&mut self) {
        match self {
            Running::Outboxd {
                binary,
                child,
                config,
                log,
                ..
            } => {
                let log = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&*log)
                    .expect("outboxd's log file");
                *child = Some(
                    Command::new(&*binary)
                        .args(["run", "--config"])
                        .arg(&*config)
                        .env_remove("RUST_LOG")
                        .stdin(Stdio::null())
                        .stdout(log.try_clone().expect("log file"))
                        .stderr(log)
                        .spawn()
                        .expect("start outboxd"),
                );
            }
            Running::Debezium(d) => d.restart(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}
