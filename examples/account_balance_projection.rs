//! Read side (seed 004): keeps `account_balance_view` up to date from the
//! `account.events` topic that outboxd fills from the SDK's event store.
//!
//! ```sh
//! cargo run --example account_balance_projection -- \
//!     --brokers localhost:9092 --database-url postgres://app@localhost/app
//! ```
//!
//! * **Idempotent**: an event applies only when its version is the view's
//!   version + 1. A duplicate or a replay (version ≤ the view's) changes
//!   nothing; a gap (version > view + 1) is reported and not applied.
//! * **Offsets after commit**: a record's offset is committed to Kafka only
//!   after the view's transaction for it has committed, so a crash between
//!   the two replays the record, which the version check then ignores.
//! * **Dead letters**: an event that breaks a business rule (a withdrawal
//!   larger than the balance, a non-positive amount, an unknown type, an
//!   unreadable payload) goes to `account.events.dlq` with the reason in the
//!   `dlq.reason` header, and the projection moves on.
//!
//! `--from-beginning` re-reads the topic from offset 0 (a replay);
//! `--exit-when-idle N` stops after N seconds without records.

use std::time::Duration;

use clap::Parser;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset};
use serde_json::Value;

/// Keep account_balance_view in step with account.events.
#[derive(Debug, Parser)]
struct Args {
    #[arg(long, default_value = "localhost:9092")]
    brokers: String,
    /// postgres:// URL of the database holding the view.
    #[arg(long)]
    database_url: String,
    #[arg(long, default_value = "account.events")]
    topic: String,
    #[arg(long, default_value = "account.events.dlq")]
    dlq_topic: String,
    #[arg(long, default_value = "account-balance-projection")]
    group: String,
    /// How outboxd builds values: "envelope" (data under "data") or "payload".
    #[arg(long, default_value = "envelope")]
    value: String,
    /// Re-read the topic from the beginning.
    #[arg(long)]
    from_beginning: bool,
    /// Exit after this many seconds without a record.
    #[arg(long)]
    exit_when_idle: Option<u64>,
    /// Replication factor when the DLQ topic must be created; -1 uses the broker default.
    #[arg(long, default_value_t = -1, allow_hyphen_values = true)]
    dlq_replication_factor: i32,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const VIEW_DDL: &str = "
CREATE TABLE IF NOT EXISTS account_balance_view (
    account_id    text        PRIMARY KEY,
    owner_id      text        NOT NULL,
    balance       bigint      NOT NULL,
    status        text        NOT NULL,
    version       bigint      NOT NULL,
    last_event_id uuid        NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
)";

/// What one record did to the view.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Applied,
    Duplicate,
    Gap { view_version: i64, event_version: i64 },
    Rejected(String),
}

#[derive(Debug, Default)]
struct Counts {
    applied: u64,
    duplicates: u64,
    gaps: u64,
    dead_letters: u64,
}

fn header<'a>(m: &'a BorrowedMessage<'a>, name: &str) -> Option<&'a str> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| std::str::from_utf8(h.value?).ok())
}

/// The event's data, from an envelope or a bare payload.
fn event_data(m: &BorrowedMessage<'_>, envelope: bool) -> Result<Value, String> {
    let body: Value = serde_json::from_slice(m.payload().unwrap_or_default())
        .map_err(|e| format!("value is not JSON: {e}"))?;
    if envelope {
        body.get("data")
            .cloned()
            .ok_or_else(|| "envelope has no data".to_owned())
    } else {
        Ok(body)
    }
}

fn amount(data: &Value) -> Result<i64, String> {
    let a = data["amount"]
        .as_i64()
        .ok_or("amount is missing or not an integer")?;
    if a <= 0 {
        return Err(format!("amount must be positive, got {a}"));
    }
    Ok(a)
}

async fn apply(
    client: &mut tokio_postgres::Client,
    m: &BorrowedMessage<'_>,
    envelope: bool,
) -> Result<Outcome, BoxError> {
    let reject = |why: String| Ok(Outcome::Rejected(why));
    let (Some(account), Some(kind), Some(version), Some(id)) = (
        header(m, "aggregateId"),
        header(m, "type"),
        header(m, "version"),
        header(m, "id"),
    ) else {
        return reject("missing aggregateId, type, version or id header".into());
    };
    let Ok(version) = version.parse::<i64>() else {
        return reject(format!("version header {version:?} is not a number"));
    };
    let Ok(event_id) = id.parse::<uuid::Uuid>() else {
        return reject(format!("id header {id:?} is not a UUID"));
    };
    let data = match event_data(m, envelope) {
        Ok(d) => d,
        Err(why) => return reject(why),
    };
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            "SELECT version, balance FROM account_balance_view WHERE account_id = $1 FOR UPDATE",
            &[&account],
        )
        .await?;
    let (view_version, balance) = row
        .map(|r| (r.get::<_, i64>(0), r.get::<_, i64>(1)))
        .unwrap_or((0, 0));
    if version <= view_version {
        return Ok(Outcome::Duplicate);
    }
    if version != view_version + 1 {
        return Ok(Outcome::Gap {
            view_version,
            event_version: version,
        });
    }
    match kind {
        "AccountOpened" => {
            let Some(owner) = data["ownerId"].as_str() else {
                return reject("ownerId is missing".into());
            };
            let Some(initial) = data["initialBalance"].as_i64().filter(|b| *b >= 0) else {
                return reject("initialBalance must be a non-negative integer".into());
            };
            tx.execute(
                "INSERT INTO account_balance_view (account_id, owner_id, balance, status, version, last_event_id)
                 VALUES ($1, $2, $3, 'ACTIVE', $4, $5)",
                &[&account, &owner, &initial, &version, &event_id],
            )
            .await?;
        }
        "DepositMade" | "WithdrawalMade" => {
            let amount = match amount(&data) {
                Ok(a) => a,
                Err(why) => return reject(why),
            };
            let delta = if kind == "DepositMade" { amount } else { -amount };
            if balance + delta < 0 {
                return reject(format!("withdrawal of {amount} exceeds the balance {balance}"));
            }
            tx.execute(
                "UPDATE account_balance_view
                    SET balance = balance + $2, version = $3, last_event_id = $4, updated_at = now()
                  WHERE account_id = $1",
                &[&account, &delta, &version, &event_id],
            )
            .await?;
        }
        other => return reject(format!("unknown event type {other:?}")),
    }
    tx.commit().await?;
    Ok(Outcome::Applied)
}

async fn dead_letter(
    producer: &FutureProducer,
    dlq: &str,
    m: &BorrowedMessage<'_>,
    reason: &str,
) -> Result<(), BoxError> {
    let mut headers = OwnedHeaders::new();
    if let Some(h) = m.headers() {
        for h in h.iter() {
            headers = headers.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
    }
    let offset = m.offset().to_string();
    let partition = m.partition().to_string();
    headers = headers
        .insert(Header {
            key: "dlq.reason",
            value: Some(reason),
        })
        .insert(Header {
            key: "dlq.source.topic",
            value: Some(m.topic()),
        })
        .insert(Header {
            key: "dlq.source.partition",
            value: Some(&partition),
        })
        .insert(Header {
            key: "dlq.source.offset",
            value: Some(&offset),
        });
    let mut record = FutureRecord::to(dlq)
        .payload(m.payload().unwrap_or_default())
        .headers(headers);
    if let Some(k) = m.key() {
        record = record.key(k);
    }
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| format!("cannot write to {dlq}: {e}"))?;
    Ok(())
}

/// Creates the DLQ topic when it is missing, with the source topic's partition count.
async fn ensure_dlq(args: &Args) -> Result<(), BoxError> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::types::RDKafkaErrorCode;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .create()?;
    let md = admin
        .inner()
        .fetch_metadata(Some(&args.topic), Duration::from_secs(10))?;
    let partitions = md.topics().first().map_or(1, |t| t.partitions().len().max(1)) as i32;
    let topic = NewTopic::new(
        &args.dlq_topic,
        partitions,
        TopicReplication::Fixed(args.dlq_replication_factor),
    );
    for result in admin.create_topics([&topic], &AdminOptions::new()).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                return Err(format!("cannot create the dead-letter topic {name}: {code}").into())
            }
        }
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let envelope = match args.value.as_str() {
        "envelope" => true,
        "payload" => false,
        other => return Err(format!("--value must be envelope or payload, not {other:?}").into()),
    };
    let pg: outboxd::pg::conninfo::PgConnectConfig = args.database_url.parse()?;
    let mut client = outboxd::pg::admin::connect(&pg).await?;
    client.batch_execute(VIEW_DDL).await?;
    ensure_dlq(&args).await?;

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("group.id", &args.group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&args.topic])?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("enable.idempotence", "true")
        .create()?;

    let mut rewind = args.from_beginning;
    let mut counts = Counts::default();
    let idle = args.exit_when_idle.map(Duration::from_secs);
    let mut last = tokio::time::Instant::now();
    loop {
        if rewind {
            let assigned = consumer.assignment()?;
            if assigned.count() > 0 {
                for p in assigned.elements() {
                    consumer.seek(
                        p.topic(),
                        p.partition(),
                        Offset::Beginning,
                        Duration::from_secs(10),
                    )?;
                }
                rewind = false;
            }
        }
        let m = match tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await {
            Ok(m) => m?,
            Err(_) => {
                if idle.is_some_and(|i| last.elapsed() >= i) && !rewind {
                    break;
                }
                continue;
            }
        };
        last = tokio::time::Instant::now();
        match apply(&mut client, &m, envelope).await? {
            Outcome::Applied => counts.applied += 1,
            Outcome::Duplicate => counts.duplicates += 1,
            Outcome::Gap {
                view_version,
                event_version,
            } => {
                counts.gaps += 1;
                eprintln!(
                    "gap: account {} is at version {view_version} but the next record has version {event_version}; rebuild the view with --from-beginning after fixing the source",
                    header(&m, "aggregateId").unwrap_or("?")
                );
            }
            Outcome::Rejected(reason) => {
                dead_letter(&producer, &args.dlq_topic, &m, &reason).await?;
                counts.dead_letters += 1;
                eprintln!("dead letter: {} at offset {}: {reason}", m.topic(), m.offset());
            }
        }
        // Only now, with the view's transaction committed (or the record
        // dead-lettered), is the record done.
        consumer.commit_message(&m, CommitMode::Sync)?;
    }
    println!(
        "applied {} duplicates {} gaps {} dead letters {}",
        counts.applied, counts.duplicates, counts.gaps, counts.dead_letters
    );
    Ok(())
}
