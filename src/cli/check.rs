//! `outboxd check`: everything that must hold before `run` can work,
//! checked one by one, each with the fix when it fails.

use std::fmt;

use crate::config::columns::Role;
use crate::config::{Config, Validated};
use crate::kafka::sink::{KafkaSink, Retention};
use crate::postgres::{admin, failover};
use crate::source::outbox::OutboxColumns;

/// The result of one check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckLine {
    pub name: &'static str,
    pub ok: bool,
    /// Works, but not as safely as it could (printed as `warn`).
    pub warning: bool,
    pub detail: String,
}

impl fmt::Display for CheckLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mark = match (self.ok, self.warning) {
            (false, _) => "FAIL",
            (true, true) => "warn",
            (true, false) => "ok  ",
        };
        write!(f, "{mark} {:<12} {}", self.name, self.detail)
    }
}

fn line(name: &'static str, ok: bool, detail: impl Into<String>) -> CheckLine {
    CheckLine {
        name,
        ok,
        warning: false,
        detail: detail.into(),
    }
}

/// Runs every check; PostgreSQL checks stop at the first that makes the
/// rest meaningless (no connection), Kafka is checked regardless.
pub async fn run_checks(config: &Config, v: &Validated) -> Vec<CheckLine> {
    let mut out = vec![line("config", true, "parsed and valid")];
    if let Some(w) = fencing_warning(config) {
        out.push(w);
    }
    out.extend(postgres_checks(config, v).await);
    let sink = KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0);
    out.push(match &sink {
        Err(e) => line("kafka", false, e.to_string()),
        Ok(sink) => match sink.check_brokers().await {
            Ok(n) => line(
                "kafka",
                true,
                format!("{} reachable, {n} broker(s) in the cluster", config.kafka.brokers),
            ),
            Err(e) => line("kafka", false, e.to_string()),
        },
    });
    let kafka_ok = out.last().is_some_and(|l| l.ok);
    if config.kafka.keeps_slot_register() && kafka_ok && config.mode == crate::config::Mode::Cdc {
        out.push(register_check(config, v).await);
        if let Ok(sink) = &sink {
            if let Some(l) = retention_check(sink, config.kafka.progress_topic()).await {
                out.push(l);
            }
        }
    }
    if v.transactional_id.is_some() && kafka_ok {
        out.push(progress_check(config, v).await);
    }
    out.extend(registry_checks(config, v).await);
    out
}

/// The Schema Registry answers and takes the credentials; each rule of
/// `[routing.schemas]` that names its subject resolves; and so does the
/// subject of each (aggregate type, event type) the outbox table holds
/// now (read from up to 10,000 of its rows).
async fn registry_checks(config: &Config, v: &Validated) -> Vec<CheckLine> {
    let registry = match crate::schema::Registry::from_config(config, None) {
        Ok(Some(r)) => r,
        Ok(None) => return Vec::new(),
        Err(e) => return vec![line("registry", false, e)],
    };
    let mut out = vec![match registry.reachable().await {
        Ok(n) => line(
            "registry",
            true,
            format!("{} answers, {n} subject(s)", registry.url()),
        ),
        Err(e) => {
            return vec![line("registry", false, e.to_string())];
        }
    }];
    for (what, r) in registry.check_configured().await {
        out.push(match r {
            Ok(found) => line("schema", true, format!("{what}: {found}")),
            Err(e) => line("schema", false, format!("{what}: {e}")),
        });
    }
    let seen = match admin::connect(&v.pg).await {
        Ok(client) => match columns_check(&client, v).await.1 {
            Some(resolved) => seen_topics(&client, v, &resolved).await,
            None => return out,
        },
        Err(_) => return out,
    };
    match seen {
        Ok(pairs) => {
            for (event_type, topic) in pairs {
                out.push(match registry.check_event(&event_type, &topic).await {
                    Ok(found) => line("schema", true, format!("{event_type} on {topic} → {found}")),
                    Err(e) => line("schema", false, format!("{event_type} on {topic}: {e}")),
                });
            }
        }
        Err(e) => out.push(line(
            "schema",
            false,
            format!("cannot read the event types in {}: {e}", v.table),
        )),
    }
    out
}

/// The (event type, topic) pairs of up to 10,000 of the table's rows,
/// at most 100.
async fn seen_topics(
    client: &tokio_postgres::Client,
    v: &Validated,
    resolved: &OutboxColumns,
) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
    let quote = |n: &str| format!("(\"{}\")::text", n.replace('"', "\"\""));
    let role = |r: Role| resolved.role_column(r).map_or_else(|| "''".to_owned(), quote);
    let mut list = vec![role(Role::Route), role(Role::Type)];
    list.extend(v.columns.extra.iter().map(|c| quote(c.as_str())));
    let sql = format!(
        "SELECT DISTINCT * FROM (SELECT {} FROM {} LIMIT 10000) s LIMIT 1000",
        list.join(", "),
        v.table.quoted()
    );
    let rows = client.query(&sql, &[]).await?;
    let mut seen = std::collections::BTreeSet::new();
    for r in &rows {
        let values = SeenRow {
            route: r.get::<_, Option<String>>(0).unwrap_or_default(),
            event_type: r.get::<_, Option<String>>(1).unwrap_or_default(),
            extra: (2..r.len()).map(|i| r.get::<_, Option<String>>(i)).collect(),
        };
        if let Ok(topic) = v.topic.render(&values) {
            seen.insert((values.event_type, topic));
        }
        if seen.len() >= 100 {
            break;
        }
    }
    Ok(seen.into_iter().collect())
}

/// A row's topic-deciding columns, as [`seen_topics`] reads them.
struct SeenRow {
    route: String,
    event_type: String,
    extra: Vec<Option<String>>,
}

impl crate::kafka::records::TopicValues for SeenRow {
    fn route(&self) -> &str {
        &self.route
    }
    fn event_type(&self) -> &str {
        &self.event_type
    }
    fn column(&self, extra: usize) -> Option<&str> {
        self.extra.get(extra).and_then(Option::as_deref)
    }
}

/// The progress topic keeps its records for good (`None`: it does not
/// exist yet; outboxd creates it compacted).
async fn retention_check(sink: &KafkaSink, topic: &str) -> Option<CheckLine> {
    match sink.progress_topic_retention(topic).await {
        Ok(Retention::Kept) => Some(line("retention", true, format!("{topic} keeps each slot's latest record (cleanup.policy)"))),
        Ok(Retention::Deletes(problem)) => Some(line("retention", false, problem)),
        Ok(Retention::Missing) => None,
        Err(e) => Some(CheckLine {
            name: "retention",
            ok: true,
            warning: true,
            detail: format!("cannot read {topic}'s cleanup.policy ({e}): it must be compact, or the slot register of an idle slot may be deleted"),
        }),
    }
}

/// A `message.timeout.ms` longer than the leader lease: a leader stopped
/// with records queued could still send them after a standby took over.
fn fencing_warning(config: &Config) -> Option<CheckLine> {
    if config.kafka.delivery == crate::config::Delivery::ExactlyOnce {
        return None;
    }
    let timeout: u64 = config.kafka.options.get("message.timeout.ms")?.parse().ok()?;
    let lease = config.postgres.leader_timeout.0;
    (u128::from(timeout) > lease.as_millis()).then(|| CheckLine {
        name: "fencing",
        ok: true,
        warning: true,
        detail: format!(
            "kafka.options.message.timeout.ms ({timeout} ms) is longer than postgres.leader_timeout ({lease:?}): a leader that was stopped with records queued may still send them after a standby took over (out of order with the new leader's first copies). Leave it unset, or at most the lease"
        ),
    })
}

/// The slot register ([`crate::relay::slot_register`]): a missing slot that
/// outboxd streamed before was lost, and `run` will refuse to recreate it.
async fn register_check(config: &Config, v: &Validated) -> CheckLine {
    let kafka = &config.kafka;
    let slot = v.slot.as_str();
    let system = match crate::postgres::connection::ReplicationConnection::identify(&v.pg).await {
        Ok(s) => s,
        Err(e) => {
            return line(
                "register",
                false,
                format!("cannot identify the PostgreSQL system: {e}"),
            )
        }
    };
    let (info, wal_end) = match admin::connect(&v.pg).await {
        Ok(c) => (
            admin::slot_info(&c, &v.slot).await,
            admin::wal_insert_lsn(&c).await.ok(),
        ),
        Err(e) => (Err(e), None),
    };
    let record =
        crate::relay::slot_register::read(kafka, &system.system_id, slot, kafka.admin_timeout.0).await;
    if let (Ok(Some(info)), Ok(r)) = (&info, &record) {
        if let Some(problem) = resumption_problem(config, v, &system, info, r.as_ref()).await {
            return line("register", false, problem);
        }
    }
    match (info, record) {
        (Err(e), _) => line("register", false, e.to_string()),
        (_, Err(e)) => line("register", false, e.to_string()),
        // A missing slot: lost, or never in the backup a rewound server
        // was restored from.
        (Ok(None), Ok(Some(r))) => line(
            "register",
            false,
            crate::relay::slot_missing(
                &r,
                system.timeline,
                wal_end.unwrap_or(crate::Lsn(u64::MAX)),
                kafka.progress_topic(),
                &v.config_args(),
            )
            .to_string(),
        ),
        (Ok(Some(info)), Ok(r)) if info.invalidated().is_some() => line(
            "register",
            false,
            format!(
                "slot {slot} was invalidated: after recreating it, re-publish the gap with `{}`",
                crate::relay::slot_register::replay_command(&v.config_args(), r.as_ref())
            ),
        ),
        (Ok(_), Ok(Some(r))) => line(
            "register",
            true,
            format!(
                "{}: outboxd streamed slot {slot} up to at least {} (seen at {})",
                kafka.progress_topic(),
                r.confirmed_lsn,
                r.seen_at
            ),
        ),
        (Ok(_), Ok(None)) => line(
            "register",
            true,
            format!(
                "{}: slot {slot} not streamed yet on this system",
                kafka.progress_topic()
            ),
        ),
    }
}

/// What a session starting now would refuse about where the slot
/// resumes (see `pipeline::resume`): a register past the server's WAL (a
/// rewound history), or a publication that may have changed since.
async fn resumption_problem(
    config: &Config,
    v: &Validated,
    system: &crate::postgres::connection::SystemIdentity,
    info: &admin::SlotInfo,
    record: Option<&crate::relay::slot_register::SlotRecord>,
) -> Option<String> {
    use crate::relay::resume::{publication_proof, register_beyond_wal, PublicationProof};
    let client = admin::connect(&v.pg).await.ok()?;
    let wal_end = admin::wal_insert_lsn(&client).await.ok()?;
    if let Some(detail) = register_beyond_wal(record, system.timeline, wal_end) {
        return Some(format!(
            "{detail}: the WAL history went back (a restored snapshot or backup); `run` refuses to stream. If this server is the one to publish from now on, run `outboxd progress --reset`"
        ));
    }
    let version = crate::postgres::publication::server_version(&client).await.ok()?;
    let mut subject = crate::postgres::publication::Subject::new(config, v, version);
    subject.receiving.read_before = record.is_some_and(|r| r.messages.is_some());
    let verified = crate::postgres::publication::inspect(&client, &subject)
        .await
        .ok()?;
    match publication_proof(&verified, info.catalog_xmin, record) {
        PublicationProof::Unproven(why) if config.kafka.keeps_slot_register() && record.is_some() => Some(format!(
            "the publication cannot be shown unchanged since the slot's position {}: {}. `run` refuses to stream. Re-publish the window with `{}`, then run `outboxd progress --accept-publication`",
            info.confirmed_flush_lsn.map(|l| l.to_string()).unwrap_or_else(|| "-".into()),
            why.because(),
            crate::relay::slot_register::replay_command(&v.config_args(), record)
        )),
        _ => None,
    }
}

/// Exactly-once: the progress topic reads with `read_committed`. It never
/// registers the transactional id: that would fence a running outboxd.
async fn progress_check(config: &Config, v: &Validated) -> CheckLine {
    let kafka = &config.kafka;
    let slot = v.slot.as_str();
    let wal_end = match admin::connect(&v.pg).await {
        Ok(c) => admin::wal_insert_lsn(&c).await.ok(),
        Err(_) => None,
    };
    let system = crate::postgres::connection::ReplicationConnection::identify(&v.pg)
        .await
        .ok();
    match crate::relay::exactly_once::read_progress(kafka, kafka.progress_topic(), slot, kafka.admin_timeout.0).await
    {
        Ok(Some(r))
            if system.as_ref().is_some_and(|s| s.system_id == r.system_id && s.timeline == r.timeline)
                && r.end_lsn().ok().zip(wal_end).is_some_and(|(end, wal)| end > wal) =>
        {
            line(
                "progress",
                false,
                format!(
                    "{}: the progress record says commit {} of slot {slot} is in Kafka, but this server's WAL ends before it ({}): the WAL history went back (a restored snapshot or backup), and `run` refuses to skip anything by it. If this server is the one to publish from now on, run `outboxd progress --reset`",
                    kafka.progress_topic(),
                    r.commit_lsn,
                    wal_end.map(|l| l.to_string()).unwrap_or_default()
                ),
            )
        }
        Ok(Some(r)) => line(
            "progress",
            true,
            format!(
                "{}: slot {slot} is in Kafka up to commit {} (written by {} at {})",
                kafka.progress_topic(),
                r.commit_lsn,
                r.writer,
                r.written_at
            ),
        ),
        Ok(None) => line(
            "progress",
            true,
            format!(
                "{}: no record for slot {slot} yet; the first start publishes from the slot",
                kafka.progress_topic()
            ),
        ),
        Err(e) => line(
            "progress",
            false,
            format!(
                "{e}; outboxd needs READ on {} (and WRITE, and CREATE unless it exists)",
                kafka.progress_topic()
            ),
        ),
    }
}

/// The column map against the live table: every mapped column exists,
/// with a type its role can be read from. The line names each role's
/// column; a FAIL names the column and the setting to change.
async fn columns_check(client: &tokio_postgres::Client, v: &Validated) -> (CheckLine, Option<OutboxColumns>) {
    let catalog = match crate::source::outbox::read_table(client, &v.table).await {
        Ok(c) => c,
        Err(e) => return (line("columns", false, e.to_string()), None),
    };
    match OutboxColumns::from_catalog(&v.table.to_string(), &catalog, &v.columns) {
        Ok(resolved) => {
            let mut l = line("columns", true, describe_columns(&resolved, v));
            if let Some(zone) = local_time_zone(client, &resolved).await {
                l.warning = true;
                l.detail.push_str(&format!(
                    "; the timestamp column is a timestamp without time zone, which outboxd reads as UTC, but this database's sessions default to TimeZone {zone:?}: a writer's now() is stored as local time (and polling mode would wait for it). Set the writers' TimeZone to UTC (ALTER DATABASE … SET TimeZone = 'UTC'), or use timestamptz"
                ));
            }
            (l, Some(resolved))
        }
        Err(e) => (line("columns", false, e.to_string()), None),
    }
}

/// The session time zone a writer gets by default, when the timestamp
/// column has no zone and that time zone is not UTC.
async fn local_time_zone(client: &tokio_postgres::Client, resolved: &OutboxColumns) -> Option<String> {
    if resolved.timestamp_kind() != Some(crate::source::outbox::Kind::Timestamp) {
        return None;
    }
    let zone: String = client
        .query_one("SELECT current_setting('TimeZone')", &[])
        .await
        .ok()?
        .get(0);
    let utc = [
        "UTC",
        "Etc/UTC",
        "GMT",
        "Etc/GMT",
        "UCT",
        "Zulu",
        "Universal",
        "Etc/Universal",
    ];
    (!utc.iter().any(|u| u.eq_ignore_ascii_case(&zone))).then_some(zone)
}

/// `id=id key=aggregateid route=aggregatetype type=- payload=payload …`.
fn describe_columns(resolved: &OutboxColumns, v: &Validated) -> String {
    let mut parts: Vec<String> = Role::ALL
        .into_iter()
        .map(|r| {
            let name = match r {
                Role::Id => "id",
                Role::Key => "key",
                Role::Route => "route",
                Role::Type => "type",
                Role::Payload => "payload",
                Role::Headers => "headers",
                Role::Timestamp => "timestamp",
            };
            let column = resolved.role_column(r).map_or_else(
                || match r {
                    Role::Timestamp => "(commit time)".to_owned(),
                    _ => "(none)".to_owned(),
                },
                |c| format!("{c:?}"),
            );
            format!("{name}={column}")
        })
        .collect();
    for p in &v.columns.placements {
        let column = &v.columns.extra[p.extra];
        parts.push(match p.placement {
            crate::config::columns::Placement::Partition => format!("{:?}→partition", column.as_str()),
            other => format!(
                "{:?}→{} {:?}",
                column.as_str(),
                format!("{other:?}").to_lowercase(),
                p.name
            ),
        });
    }
    parts.join(" ")
}

async fn postgres_checks(config: &Config, v: &Validated) -> Vec<CheckLine> {
    let mut out = Vec::new();
    let client = match admin::connect(&v.pg).await {
        Ok(c) => c,
        Err(e) => {
            out.push(line("postgres", false, e.to_string()));
            return out;
        }
    };
    out.push(line("postgres", true, format!("connected to {}", v.pg.target())));
    if config.mode == crate::config::Mode::Polling {
        let columns = columns_check(&client, v).await;
        let timestamp = columns
            .1
            .as_ref()
            .and_then(|c| c.role_column(Role::Timestamp).map(str::to_owned));
        out.push(columns.0);
        let Some(timestamp) = timestamp else {
            return out;
        };
        let published = &config.polling.published_column;
        out.push(match admin::polling_table_problem(&client, &v.table, &timestamp, published).await {
            Ok(()) => line(
                "table",
                true,
                format!(
                    "{} has {published}, and {timestamp} is never NULL and defaults to clock_timestamp() (polling mode publishes in its order)",
                    v.table
                ),
            ),
            Err(e) => line("table", false, e.to_string()),
        });
        return out;
    }

    match client.query_one("SHOW wal_level", &[]).await {
        Ok(r) => {
            let level: String = r.get(0);
            out.push(if level == "logical" {
                line("wal_level", true, "logical")
            } else {
                line(
                    "wal_level",
                    false,
                    format!("is {level}, must be logical: ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL"),
                )
            });
        }
        Err(e) => out.push(line("wal_level", false, e.to_string())),
    }

    let table_ok = match admin::table_exists(&client, &v.table).await {
        Ok(true) => {
            out.push(line("table", true, format!("{} exists", v.table)));
            out.push(columns_check(&client, v).await.0);
            true
        }
        Ok(false) => {
            out.push(line(
                "table",
                false,
                format!(
                    "{} does not exist: run `outboxd migrate` or apply migrations/0001_outbox.sql",
                    v.table
                ),
            ));
            false
        }
        Err(e) => {
            out.push(line("table", false, e.to_string()));
            false
        }
    };

    let role = client
        .query_one(
            "SELECT r.rolname::text, r.rolreplication OR r.rolsuper,
                    has_database_privilege(current_database(), 'CREATE')
               FROM pg_catalog.pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await;
    match role {
        Ok(r) => {
            let name: String = r.get(0);
            let replication: bool = r.get(1);
            out.push(if replication {
                line("privileges", true, format!("role {name} may replicate"))
            } else {
                line(
                    "privileges",
                    false,
                    format!("role {name} lacks REPLICATION: ALTER ROLE {name} WITH REPLICATION;"),
                )
            });
            if table_ok {
                let select = client
                    .query_one(
                        "SELECT has_table_privilege(format('%I.%I', $1::text, $2::text), 'SELECT')",
                        &[&v.table.schema, &v.table.name],
                    )
                    .await
                    .map(|r| r.get::<_, bool>(0));
                if let Ok(false) = select {
                    out.push(line(
                        "privileges",
                        false,
                        format!(
                            "role {name} cannot SELECT {}: GRANT SELECT ON {} TO {name};",
                            v.table,
                            v.table.quoted()
                        ),
                    ));
                }
            }
        }
        Err(e) => out.push(line("privileges", false, e.to_string())),
    }

    // The same proof the relay makes at start and keeps making.
    let version = crate::postgres::publication::server_version(&client)
        .await
        .unwrap_or(0);
    let subject = crate::postgres::publication::Subject::new(config, v, version);
    out.push(
        match crate::postgres::publication::inspect(&client, &subject).await {
            Ok(_) => line(
                "publication",
                true,
                format!(
                    "{} delivers every INSERT on {} with every column",
                    v.publication.as_str(),
                    v.table
                ),
            ),
            // Checked last, once the publication delivers: the line below.
            Err(
                admin::AdminError::EmitNotReceived { .. }
                | admin::AdminError::EmitPrefix { .. }
                | admin::AdminError::EmitOpen { .. },
            ) => line(
                "publication",
                true,
                format!(
                    "{} delivers every INSERT on {} with every column",
                    v.publication.as_str(),
                    v.table
                ),
            ),
            Err(admin::AdminError::NoPublication { .. }) if config.postgres.create_publication => line(
                "publication",
                true,
                format!(
                    "{} is missing and will be created at start",
                    v.publication.as_str()
                ),
            ),
            Err(e) => line("publication", false, e.to_string()),
        },
    );

    out.push(
        match crate::postgres::publication::messages(&client, &subject).await {
            Ok(Some(prefix)) => line(
                "messages",
                true,
                format!("reads logical decoding messages with prefix {prefix:?} (the table-less outbox); PUBLIC may not write them"),
            ),
            Ok(None) => line(
                "messages",
                true,
                "reads no logical decoding messages (no outbox_emit in this database, or postgres.messages = false)",
            ),
            Err(e) => line("messages", false, e.to_string()),
        },
    );
    out.push(match admin::slot_info(&client, &v.slot).await {
        Ok(None) => line("slot", true, format!("{} is missing and will be created at start", v.slot.as_str())),
        Ok(Some(info)) if info.plugin.as_deref() != Some("pgoutput") || info.database.as_deref() != Some(v.pg.dbname.as_str()) => line(
            "slot",
            false,
            format!(
                "{} exists with plugin {:?} on database {:?}; drop it with SELECT pg_drop_replication_slot('{}') or choose another postgres.slot",
                v.slot.as_str(),
                info.plugin.unwrap_or_default(),
                info.database.unwrap_or_default(),
                v.slot.as_str()
            ),
        ),
        Ok(Some(info)) if info.invalidated().is_some() => line(
            "slot",
            false,
            format!(
                "{} was invalidated ({}: {}): drop and recreate it; events written meanwhile must be re-published from the outbox table",
                v.slot.as_str(),
                info.invalidated().unwrap_or_default(),
                admin::explain_invalidation(&info.invalidated().unwrap_or_default())
            ),
        ),
        Ok(Some(info)) => line(
            "slot",
            true,
            format!(
                "{} confirmed at {}{}",
                v.slot.as_str(),
                info.confirmed_flush_lsn.map(|l| l.to_string()).unwrap_or_else(|| "-".into()),
                match info.active_pid {
                    Some(pid) => format!(", active for PID {pid}"),
                    None => String::new(),
                }
            ),
        ),
        Err(e) => line("slot", false, e.to_string()),
    });
    out.push(failover_check(config, v, &client).await);
    out.extend(left_parked_check(config, v, &client).await);
    out
}

/// Without `park`: sequences parked under it earlier, which the relay
/// keeps parking behind until they are redriven (see `crate::relay`'s
/// parking).
async fn left_parked_check(
    config: &Config,
    v: &Validated,
    client: &tokio_postgres::Client,
) -> Option<CheckLine> {
    if config.routing.on_poison == crate::config::OnPoison::Park {
        return None;
    }
    match crate::park::ParkStore::waiting(client, &v.table, v.slot.as_str()).await {
        Ok(Some(sequences)) if sequences > 0 => Some(line(
            "parked",
            true,
            format!(
                "{sequences} sequence(s) parked under routing.on_poison = \"park\" are left: the relay parks their later events behind them until `outboxd parked redrive` (new bad rows follow \"{}\")",
                config.routing.on_poison.name()
            ),
        )),
        Ok(_) => None,
        Err(e) => Some(line("parked", false, e.to_string())),
    }
}

/// Whether the slot would survive a promotion ([`failover::inspect`]): a
/// warning when not, a failure only with
/// `health.require_failover_protection`.
async fn failover_check(config: &Config, v: &Validated, client: &tokio_postgres::Client) -> CheckLine {
    match failover::inspect(client, &v.pg, &v.slot).await {
        Ok(p) => {
            let protected = p.gauge() == 1;
            let required = config.health.require_failover_protection;
            CheckLine {
                name: "failover",
                ok: protected || !required,
                warning: !protected,
                detail: p.describe(),
            }
        }
        Err(e) => line("failover", false, e.to_string()),
    }
}
