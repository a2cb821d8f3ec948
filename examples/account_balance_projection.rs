//! Read side (seed 004): keeps `account_balance_view` up to date from the
//! `account.events` topic that outboxd fills from the SDK's event store.
//!
//! ```sh
//! cargo run --example account_balance_projection -- \
//!     --brokers localhost:9092 --database-url postgres://app@localhost/app
//! ```
//!
//! * **Idempotent**: the view's `version` is the last version of the
//!   account it has *handled*, applied or rejected. An event is handled
//!   only when its version is the view's version + 1. A duplicate or a
//!   replay (version ≤ the view's) changes nothing.
//! * **Offsets after commit**: a record's offset is committed to Kafka only
//!   after the view's transaction for it has committed, so a crash between
//!   the two replays the record, which the version check then ignores.
//! * **Dead letters**: an event that breaks a business rule (a withdrawal
//!   larger than the balance, a non-positive amount, an unknown type, an
//!   unreadable payload) goes to `account.events.dlq` with the reason in the
//!   `dlq.reason` header. Then, in one transaction, the view's version moves
//!   past it, its `rejected_events` count goes up and the reason is kept in
//!   `account_balance_rejections`, so the account's later events still
//!   apply. (Moving the version first and dead-lettering after would lose
//!   the dead letter to a crash in between; this order can only repeat it.)
//!   Movements on an account whose opening was rejected are rejected too:
//!   the view has no balance to move.
//! * **Gaps**: an event whose version is past the view's version + 1 means
//!   the records between are missing from the topic. It cannot be applied,
//!   so it is dead-lettered with the reason `gap: …` (nothing is dropped)
//!   and the view waits for the missing version; rebuild with
//!   `--from-beginning` once the source is fixed.
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
);
ALTER TABLE account_balance_view ADD COLUMN IF NOT EXISTS rejected_events bigint NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS account_balance_rejections (
    account_id  text        NOT NULL,
    version     bigint      NOT NULL,
    event_id    uuid        NOT NULL,
    reason      text        NOT NULL,
    rejected_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, version)
)";

/// A record the view handles at its next version.
#[derive(Debug, PartialEq, Eq)]
struct Next {
    account: String,
    version: i64,
    event_id: uuid::Uuid,
}

/// What one record did to the view.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Applied,
    Duplicate,
    /// Dead-letter it; with `next`, the view then moves past its version.
    Rejected {
        reason: String,
        next: Option<Next>,
    },
}

#[derive(Debug, Default)]
struct Counts {
    applied: u64,
    duplicates: u64,
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
    let reject = |reason: String| Ok(Outcome::Rejected { reason, next: None });
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
            "SELECT version, balance, status FROM account_balance_view WHERE account_id = $1 FOR UPDATE",
            &[&account],
        )
        .await?;
    let (view_version, balance, status) = row
        .map(|r| (r.get::<_, i64>(0), r.get::<_, i64>(1), r.get::<_, String>(2)))
        .unwrap_or((0, 0, String::new()));
    if version <= view_version {
        return Ok(Outcome::Duplicate);
    }
    if version != view_version + 1 {
        return reject(format!(
            "gap: account {account} is at version {view_version} in the view, this event has version {event_version}; the versions between are missing from the topic",
            event_version = version
        ));
    }
    // From here on a rejection still moves the view past this version.
    let reject = |reason: String| {
        Ok(Outcome::Rejected {
            reason,
            next: Some(Next {
                account: account.to_owned(),
                version,
                event_id,
            }),
        })
    };
    if status == REJECTED && kind != "AccountOpened" {
        return reject(format!(
            "account {account} has no balance in the view: its opening was rejected"
        ));
    }
    match kind {
        "AccountOpened" => {
            if view_version > 0 {
                return reject(format!("account {account} is already open in the view"));
            }
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
            match balance.checked_add(delta) {
                Some(b) if b >= 0 => {}
                Some(_) => return reject(format!("withdrawal of {amount} exceeds the balance {balance}")),
                None => return reject(format!("deposit of {amount} overflows the balance {balance}")),
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

/// Status of a view row whose AccountOpened was rejected.
const REJECTED: &str = "REJECTED";

/// Moves the view past a rejected event and keeps the reason.
async fn record_rejection(
    client: &mut tokio_postgres::Client,
    next: &Next,
    reason: &str,
) -> Result<(), BoxError> {
    let tx = client.transaction().await?;
    tx.execute(
        "INSERT INTO account_balance_view
                (account_id, owner_id, balance, status, version, last_event_id, rejected_events)
         VALUES ($1, '', 0, $4, $2, $3, 1)
         ON CONFLICT (account_id) DO UPDATE
            SET version = $2, last_event_id = $3, updated_at = now(),
                rejected_events = account_balance_view.rejected_events + 1
          WHERE account_balance_view.version = $2 - 1",
        &[&next.account, &next.version, &next.event_id, &REJECTED],
    )
    .await?;
    tx.execute(
        "INSERT INTO account_balance_rejections (account_id, version, event_id, reason)
         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        &[&next.account, &next.version, &next.event_id, &reason],
    )
    .await?;
    tx.commit().await?;
    Ok(())
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
            Outcome::Rejected { reason, next } => {
                dead_letter(&producer, &args.dlq_topic, &m, &reason).await?;
                if let Some(next) = &next {
                    record_rejection(&mut client, next, &reason).await?;
                }
                counts.dead_letters += 1;
                eprintln!("dead letter: {} at offset {}: {reason}", m.topic(), m.offset());
            }
        }
        // Only now, with the view's transaction committed (or the record
        // dead-lettered), is the record done.
        consumer.commit_message(&m, CommitMode::Sync)?;
    }
    println!(
        "applied {} duplicates {} dead letters {}",
        counts.applied, counts.duplicates, counts.dead_letters
    );
    Ok(())
}
