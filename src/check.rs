//! `outboxd check`: everything that must hold before `run` can work,
//! checked one by one, each with the fix when it fails.

use std::fmt;

use crate::config::{Config, Validated};
use crate::kafka::KafkaSink;
use crate::pg::admin;

/// The result of one check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckLine {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

impl fmt::Display for CheckLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mark = if self.ok { "ok  " } else { "FAIL" };
        write!(f, "{mark} {:<12} {}", self.name, self.detail)
    }
}

fn line(name: &'static str, ok: bool, detail: impl Into<String>) -> CheckLine {
    CheckLine {
        name,
        ok,
        detail: detail.into(),
    }
}

/// Runs every check; PostgreSQL checks stop at the first that makes the
/// rest meaningless (no connection), Kafka is checked regardless.
pub async fn run_checks(config: &Config, v: &Validated) -> Vec<CheckLine> {
    let mut out = vec![line("config", true, "parsed and valid")];
    out.extend(postgres_checks(config, v).await);
    out.push(
        match KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0) {
            Err(e) => line("kafka", false, e.to_string()),
            Ok(sink) => match sink.check_brokers().await {
                Ok(n) => line(
                    "kafka",
                    true,
                    format!("{} reachable, {n} broker(s) in the cluster", config.kafka.brokers),
                ),
                Err(e) => line("kafka", false, e.to_string()),
            },
        },
    );
    if v.transactional_id.is_some() && out.last().is_some_and(|l| l.ok) {
        out.push(progress_check(config, v).await);
    }
    out
}

/// Exactly-once: the progress topic reads with `read_committed`. It never
/// registers the transactional id: that would fence a running outboxd.
async fn progress_check(config: &Config, v: &Validated) -> CheckLine {
    let (kafka, eo) = (&config.kafka, &config.kafka.exactly_once);
    let slot = v.slot.as_str();
    match crate::exactly_once::read_progress(kafka, &eo.progress_topic, slot, kafka.admin_timeout.0).await {
        Ok(Some(r)) => line(
            "progress",
            true,
            format!(
                "{}: slot {slot} is in Kafka up to commit {} (written by {} at {})",
                eo.progress_topic, r.commit_lsn, r.writer, r.written_at
            ),
        ),
        Ok(None) => line(
            "progress",
            true,
            format!(
                "{}: no record for slot {slot} yet; the first start publishes from the slot",
                eo.progress_topic
            ),
        ),
        Err(e) => line(
            "progress",
            false,
            format!(
                "{e}; outboxd needs READ on {} (and WRITE, and CREATE unless it exists)",
                eo.progress_topic
            ),
        ),
    }
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
        let has = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                                 WHERE table_schema = $1 AND table_name = $2 AND column_name = 'published_at')",
                &[&v.table.schema, &v.table.name],
            )
            .await
            .map(|r| r.get::<_, bool>(0));
        out.push(match has {
            Ok(true) => line(
                "table",
                true,
                format!("{} has published_at (polling mode)", v.table),
            ),
            Ok(false) => line(
                "table",
                false,
                format!(
                    "{} has no published_at column: polling mode needs migrations/0001_outbox.sql",
                    v.table
                ),
            ),
            Err(e) => line("table", false, admin::describe(&e)),
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
    out.push(
        match crate::pg::publication::inspect(&client, &v.publication, &v.table).await {
            Ok(_) => line(
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
        Ok(Some(info)) if info.wal_status.as_deref() == Some("lost") => line(
            "slot",
            false,
            format!("{} was invalidated (WAL removed): drop and recreate it; events written meanwhile must be re-published from the outbox table", v.slot.as_str()),
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
    out
}
