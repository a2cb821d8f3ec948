//! `[[sources]]`: several outboxes in one file, each a source of its own.
//!
//! A file either has the single-source shape (`[postgres]`, `[routing]`
//! and so on at the top), which is one source named `default`, or a list
//! of `[[sources]]`:
//!
//! ```toml
//! [kafka]                # shared: one broker connection setting for all
//! brokers = "kafka:9092"
//!
//! [[sources]]
//! name = "orders"
//! [sources.postgres]
//! url = "postgres://outboxd@orders-db/orders"
//! slot = "outboxd_orders"
//! ```
//!
//! Per source: `name`, `required`, `mode`, `polling`, `postgres`,
//! `columns`, `routing`, and `kafka.delivery` / `kafka.exactly_once` (the top-level
//! values are the default). Everything else (`kafka`, `http`, `health`,
//! `shutdown`, `log`, `opentelemetry`, `schema_registry`) is shared and
//! stays at the top. Each source is merged with the shared sections into
//! one [`Config`] table and deserialized and validated as the single-source
//! file is, so every key means the same in both shapes; an error names the
//! key as `sources[N].postgres.url`.
//!
//! Across sources the file is refused when two sources share a name, a
//! replication slot on one server (slots are per server, not per
//! database), an outbox table or a publication of one database, or, in
//! exactly-once delivery, a transactional id or a progress key.

use std::collections::HashSet;

use super::coordination::MAX_WEIGHT;
use super::{interpolate_value, invalid, Config, ConfigError, Delivery, Validated};

/// The sections a source owns; with `[[sources]]` they may not be at the top.
const PER_SOURCE: &[&str] = &["mode", "polling", "postgres", "columns", "routing"];
/// The keys of `[kafka]` a source may set for itself.
const PER_SOURCE_KAFKA: &[&str] = &["delivery", "exactly_once"];

/// The name of the source of a file without `[[sources]]`.
pub const DEFAULT_SOURCE: &str = "default";

/// One source: its name, whether readiness waits for it, and its
/// configuration as the relay reads it (shared sections included).
#[derive(Clone, Debug)]
pub struct SourceConfig {
    pub name: String,
    /// `/readyz` is ready only when every required source is (default true).
    pub required: bool,
    pub config: Config,
    pub validated: Validated,
    /// A digest of the source's own table and the shared sections: a reload
    /// restarts the source when it changes.
    pub fingerprint: u64,
    /// Its weight among the sources `[coordination]` spreads over replicas
    /// (1 to 3, default 1; see [`crate::config::coordination`]).
    pub weight: u32,
}

/// Checks a source name: it goes into metric labels, URLs and log fields.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a source name: use 1 to 32 of a-z, 0-9, _ and -, starting with a letter or digit"
        ))
    }
}

/// Every source of a file's text, interpolated, merged and validated.
pub fn from_toml(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Vec<SourceConfig>, ConfigError> {
    let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
    let mut value = toml::Value::Table(table);
    interpolate_value(&mut value, "", &env)?;
    let toml::Value::Table(table) = value else {
        return Err(ConfigError::Syntax("the file is not a TOML table".into()));
    };
    let sources = split(table)?;
    let mut out = Vec::with_capacity(sources.len());
    for s in sources {
        let fingerprint = fingerprint(&s.table);
        let (name, index, weight) = (s.name, s.index, s.weight);
        let (config, mut validated) = Config::from_table(s.table).map_err(|e| locate(&name, index, e))?;
        validated.source_name = index.map(|_| name.clone());
        out.push(SourceConfig {
            name,
            required: s.required,
            config,
            validated,
            fingerprint,
            weight,
        });
    }
    check_apart(&out)?;
    Ok(out)
}

/// One source's merged table, before deserializing.
struct Split {
    name: String,
    required: bool,
    weight: u32,
    /// `None` for the single-source shape, else its index in `[[sources]]`.
    index: Option<usize>,
    table: toml::Table,
}

/// Names a per-source key of an error by its source's index.
fn locate(name: &str, index: Option<usize>, e: ConfigError) -> ConfigError {
    let Some(i) = index else { return e };
    match e {
        ConfigError::Invalid { path, reason } if is_per_source(&path) => ConfigError::Invalid {
            path: format!("sources[{i}].{path}"),
            reason: format!("{reason} (source {name:?})"),
        },
        other => other,
    }
}

fn is_per_source(path: &str) -> bool {
    let head = path.split(['.', '[']).next().unwrap_or("");
    PER_SOURCE.contains(&head)
        || PER_SOURCE_KAFKA.iter().any(|k| {
            path.strip_prefix("kafka.")
                .is_some_and(|rest| rest.starts_with(k))
        })
}

/// The sources of a parsed file, each merged with the shared sections.
fn split(mut top: toml::Table) -> Result<Vec<Split>, ConfigError> {
    let Some(list) = top.remove("sources") else {
        return Ok(vec![Split {
            name: DEFAULT_SOURCE.to_owned(),
            required: true,
            weight: 1,
            index: None,
            table: top,
        }]);
    };
    let toml::Value::Array(list) = list else {
        return Err(invalid(
            "sources",
            "must be a list of tables: write each source as [[sources]]",
        ));
    };
    if list.is_empty() {
        return Err(invalid("sources", "lists no source"));
    }
    if let Some(key) = PER_SOURCE.iter().find(|k| top.contains_key(**k)) {
        return Err(invalid(
            key,
            format!("with [[sources]], {key} belongs in each source: move it into [sources.{key}]"),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, item) in list.into_iter().enumerate() {
        let toml::Value::Table(mut own) = item else {
            return Err(invalid(&format!("sources[{i}]"), "must be a table"));
        };
        let name = match own.remove("name") {
            Some(toml::Value::String(n)) => n,
            Some(_) => return Err(invalid(&format!("sources[{i}].name"), "must be a string")),
            None => {
                return Err(invalid(
                    &format!("sources[{i}].name"),
                    "is missing: every source needs a name",
                ))
            }
        };
        check_name(&name).map_err(|r| invalid(&format!("sources[{i}].name"), r))?;
        let required = match own.remove("required") {
            None => true,
            Some(toml::Value::Boolean(b)) => b,
            Some(_) => {
                return Err(invalid(
                    &format!("sources[{i}].required"),
                    "must be true or false",
                ))
            }
        };
        let weight = match own.remove("weight") {
            None => 1,
            Some(toml::Value::Integer(w)) if (1..=i64::from(MAX_WEIGHT)).contains(&w) => w as u32,
            Some(_) => {
                return Err(invalid(
                    &format!("sources[{i}].weight"),
                    format!("must be a whole number from 1 to {MAX_WEIGHT}: [coordination] spreads the sources of each weight over the replicas apart"),
                ))
            }
        };
        let mut table = top.clone();
        for (key, value) in own {
            if key == "kafka" {
                merge_kafka(&mut table, value, i)?;
            } else if PER_SOURCE.contains(&key.as_str()) {
                table.insert(key, value);
            } else {
                return Err(invalid(
                    &format!("sources[{i}].{key}"),
                    format!(
                        "is not a per-source key ({}, kafka.delivery, kafka.exactly_once); shared settings such as [{key}] go at the top of the file",
                        PER_SOURCE.join(", ")
                    ),
                ));
            }
        }
        out.push(Split {
            name,
            required,
            weight,
            index: Some(i),
            table,
        });
    }
    Ok(out)
}

/// Lays a source's `[sources.kafka]` over the shared `[kafka]`.
fn merge_kafka(table: &mut toml::Table, own: toml::Value, i: usize) -> Result<(), ConfigError> {
    let toml::Value::Table(own) = own else {
        return Err(invalid(&format!("sources[{i}].kafka"), "must be a table"));
    };
    let shared = table
        .entry("kafka")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(shared) = shared else {
        return Err(invalid("kafka", "must be a table"));
    };
    for (key, value) in own {
        if !PER_SOURCE_KAFKA.contains(&key.as_str()) {
            return Err(invalid(
                &format!("sources[{i}].kafka.{key}"),
                format!("is shared by every source: set kafka.{key} at the top of the file"),
            ));
        }
        // A table (`exactly_once`) is laid key by key over the shared one,
        // so the keys the source leaves out keep the shared values.
        match (shared.get_mut(&key), value) {
            (Some(toml::Value::Table(base)), toml::Value::Table(over)) => base.extend(over),
            (_, value) => {
                shared.insert(key, value);
            }
        }
    }
    Ok(())
}

/// A stable digest of a merged table (TOML tables are ordered maps),
/// without `[http]`, `[log]` and `[coordination]`: those belong to the
/// process, not to a relay, so they restart no relay.
fn fingerprint(table: &toml::Table) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut relayed = table.clone();
    relayed.remove("http");
    relayed.remove("log");
    relayed.remove("coordination");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    relayed.to_string().hash(&mut h);
    h.finish()
}

/// Refuses sources that would fight over one slot, table, publication or
/// Kafka transaction.
fn check_apart(sources: &[SourceConfig]) -> Result<(), ConfigError> {
    let mut names = HashSet::new();
    for (i, s) in sources.iter().enumerate() {
        if !names.insert(s.name.as_str()) {
            return Err(invalid(
                &format!("sources[{i}].name"),
                format!("{:?} names two sources; names must be unique", s.name),
            ));
        }
    }
    for (j, b) in sources.iter().enumerate() {
        for a in &sources[..j] {
            if let Some(why) = clash(a, b) {
                return Err(invalid(
                    &format!("sources[{j}]"),
                    format!("sources {:?} and {:?} {why}", a.name, b.name),
                ));
            }
        }
    }
    Ok(())
}

fn clash(a: &SourceConfig, b: &SourceConfig) -> Option<String> {
    let (va, vb) = (&a.validated, &b.validated);
    let one_server = va.pg.hosts.iter().any(|h| vb.pg.hosts.contains(h));
    let one_database = one_server && va.pg.dbname == vb.pg.dbname;
    // Polling sources use no slot and no publication.
    let cdc = a.config.mode == super::Mode::Cdc && b.config.mode == super::Mode::Cdc;
    if cdc && one_server && va.slot == vb.slot {
        return Some(format!(
            "use one replication slot ({:?}) on one server; give each source its own postgres.slot",
            va.slot.as_str()
        ));
    }
    if one_database && va.table == vb.table {
        return Some(format!(
            "read one outbox table ({}) of one database, so every event would be published twice; remove one of them",
            va.table
        ));
    }
    if cdc && one_database && va.publication == vb.publication {
        return Some(format!(
            "use one publication ({:?}) in one database for different tables; give each source its own postgres.publication",
            va.publication.as_str()
        ));
    }
    let exactly_once = |s: &SourceConfig| s.config.kafka.delivery == Delivery::ExactlyOnce;
    if exactly_once(a) && exactly_once(b) {
        if va.transactional_id == vb.transactional_id {
            return Some(format!(
                "share the Kafka transactional id {:?}, so each would fence the other; set kafka.exactly_once.transactional_id in one of them",
                va.transactional_id.as_deref().unwrap_or("")
            ));
        }
        if a.config.kafka.progress_topic() == b.config.kafka.progress_topic() && va.slot == vb.slot {
            return Some(format!(
                "write the same progress key ({:?}) to {}; give each source its own postgres.slot",
                va.slot.as_str(),
                a.config.kafka.progress_topic()
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHARED: &str = r#"
[kafka]
brokers = "k:9092"
[http]
listen = "127.0.0.1:0"
"#;

    fn source(name: &str, url: &str, slot: &str, table: &str) -> String {
        format!(
            r#"
[[sources]]
name = "{name}"
[sources.postgres]
url = "{url}"
slot = "{slot}"
publication = "{slot}"
table = "{table}"
"#
        )
    }

    fn load(text: &str) -> Result<Vec<SourceConfig>, String> {
        from_toml(text, |_| None).map_err(|e| e.to_string())
    }

    #[test]
    fn coordination_and_weights_are_read_and_checked() {
        // `weight` sits beside `name`; the postgres table follows it.
        let text = |extra: &str, weight: &str| {
            format!(
                "{SHARED}{extra}\n[[sources]]\nname = \"a\"\nweight = {weight}\n[sources.postgres]\nurl = \"postgres://u@h/d\"\nslot = \"sa\"\npublication = \"sa\"\ntable = \"o1\"\n{}",
                source("b", "postgres://u@h/d", "sb", "o2"),
            )
        };
        let group = "[coordination]\ngroup = \"g\"\nreplica = \"r1\"\n";
        let all = load(&text(group, "3")).unwrap();
        assert_eq!(all[0].weight, 3);
        assert_eq!(all[1].weight, 1);
        let c = all[0].config.coordination.clone().unwrap();
        assert_eq!(c.group, "g");
        assert_eq!(c.replica_name(), "r1");
        assert_eq!(c.session_timeout.0, std::time::Duration::from_secs(10));
        // [coordination] is the process's: changing it restarts no relay.
        let other = load(&text("[coordination]\ngroup = \"h\"\n", "3")).unwrap();
        assert_eq!(all[0].fingerprint, other[0].fingerprint);
        for (extra, weight, key) in [
            (group, "0", "sources[0].weight"),
            (group, "4", "sources[0].weight"),
            (group, "\"heavy\"", "sources[0].weight"),
            ("[coordination]\ngroup = \"a b\"\n", "1", "coordination.group"),
            (
                "[coordination]\ngroup = \"g\"\nreplica = \"\"\n",
                "1",
                "coordination.replica",
            ),
            (
                "[coordination]\ngroup = \"g\"\nsession_timeout = \"6s\"\nheartbeat_interval = \"3s\"\n",
                "1",
                "coordination.heartbeat_interval",
            ),
            (
                "[coordination]\ngroup = \"g\"\nsession_timeout = \"500ms\"\n",
                "1",
                "coordination.session_timeout",
            ),
            ("[coordination]\ngroup = \"g\"\ngroups = 2\n", "1", "coordination"),
        ] {
            let e = load(&text(extra, weight)).unwrap_err();
            assert!(e.contains(key), "{extra} weight {weight}: {e}");
        }
    }

    #[test]
    fn a_single_source_file_is_the_default_source() {
        let text = format!("{SHARED}\n[postgres]\nurl = \"postgres://u@h/db\"\n");
        let s = load(&text).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].name, DEFAULT_SOURCE);
        assert!(s[0].required);
    }

    #[test]
    fn sources_merge_with_the_shared_sections() {
        let text = format!(
            "{SHARED}{}{}\n[sources.kafka]\ndelivery = \"exactly-once\"\n",
            source("orders", "postgres://u@h1/orders", "o", "outbox"),
            source("billing", "postgres://u@h2/billing", "b", "outbox"),
        );
        let s = load(&text).unwrap();
        assert_eq!(
            s.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["orders", "billing"]
        );
        assert_eq!(s[0].config.kafka.brokers, "k:9092");
        assert_eq!(s[1].config.kafka.brokers, "k:9092");
        assert_eq!(s[0].config.kafka.delivery, Delivery::AtLeastOnce);
        assert_eq!(s[1].config.kafka.delivery, Delivery::ExactlyOnce);
        assert_eq!(s[1].validated.transactional_id.as_deref(), Some("outboxd.b"));
        assert_ne!(s[0].fingerprint, s[1].fingerprint);
        // The same text twice gives the same fingerprints.
        let again = load(&text).unwrap();
        assert_eq!(s[1].fingerprint, again[1].fingerprint);
    }

    #[test]
    fn fighting_sources_are_refused() {
        let cases = [
            (
                source("a", "postgres://u@h:5432/x", "s", "outbox")
                    + &source("b", "postgres://u@h:5432/y", "s", "outbox"),
                "one replication slot",
            ),
            (
                source("a", "postgres://u@h/x", "s1", "outbox")
                    + &source("b", "postgres://u@h/x", "s2", "outbox"),
                "twice",
            ),
            (
                source("a", "postgres://u@h/x", "s1", "outbox")
                    + &source("b", "postgres://u@h/x", "s2", "outbox2")
                        .replace("\"s2\"\ntable", "\"s1\"\ntable"),
                "publication",
            ),
            (
                source("a", "postgres://u@h/x", "s1", "outbox")
                    + &source("a", "postgres://u@h/y", "s2", "outbox"),
                "unique",
            ),
        ];
        for (sources, want) in cases {
            let err = load(&format!("{SHARED}{sources}")).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
        // Exactly-once on two servers with one slot name: one transactional id.
        let eo = format!(
            "{SHARED}{}\n[sources.kafka]\ndelivery = \"exactly-once\"\n{}\n[sources.kafka]\ndelivery = \"exactly-once\"\n",
            source("a", "postgres://u@h1/x", "s", "outbox"),
            source("b", "postgres://u@h2/x", "s", "outbox"),
        );
        let err = load(&eo).unwrap_err();
        assert!(err.contains("transactional id"), "{err}");
    }

    #[test]
    fn misplaced_keys_name_where_they_go() {
        let top = format!(
            "{SHARED}\n[routing]\ntopic = \"x\"\n{}",
            source("a", "postgres://u@h/x", "s", "outbox")
        );
        assert!(load(&top).unwrap_err().contains("move it into [sources.routing]"));
        let shared_in_source = format!(
            "{SHARED}{}\n[sources.kafka]\nbrokers = \"other:9092\"\n",
            source("a", "postgres://u@h/x", "s", "outbox")
        );
        let err = load(&shared_in_source).unwrap_err();
        assert!(
            err.contains("sources[0].kafka.brokers") && err.contains("shared"),
            "{err}"
        );
        let http_in_source = format!(
            "{SHARED}{}\n[sources.http]\nlisten = \"0.0.0.0:1\"\n",
            source("a", "postgres://u@h/x", "s", "outbox")
        );
        assert!(load(&http_in_source).unwrap_err().contains("sources[0].http"));
        for bad in ["", "Orders", "-x", "a b", &"x".repeat(33)] {
            let text = format!("{SHARED}{}", source(bad, "postgres://u@h/x", "s", "outbox"));
            assert!(load(&text).unwrap_err().contains("sources[0].name"), "{bad:?}");
        }
        let no_name = format!("{SHARED}\n[[sources]]\n[sources.postgres]\nurl = \"postgres://u@h/x\"\n");
        assert!(load(&no_name).unwrap_err().contains("every source needs a name"));
        assert!(load(&format!("{SHARED}\nsources = []\n")).is_err());
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let text = include_str!("../../config/sources.toml");
        let s = from_toml(text, |v| v.ends_with("PGPASSWORD").then(|| "p".to_owned())).unwrap();
        assert_eq!(s.len(), 2);
        assert!(!s[1].required);
        assert_eq!(s[1].validated.source_name.as_deref(), Some("billing"));
        assert_eq!(s[0].validated.pg.password.as_deref(), Some("p"));
        // An unset variable is named by its source's key.
        let err = from_toml(text, |_| None).unwrap_err().to_string();
        assert!(err.contains("sources[0].postgres.url"), "{err}");
    }

    #[test]
    fn a_source_exactly_once_table_keeps_the_shared_keys() {
        let text = format!(
            "{SHARED}\n[kafka.exactly_once]\nprogress_topic = \"p\"\nmax_events = 77\n{}\n[sources.kafka]\ndelivery = \"exactly-once\"\n[sources.kafka.exactly_once]\ntransactional_id = \"t1\"\n",
            source("a", "postgres://u@h1/x", "s", "outbox"),
        );
        let s = load(&text).unwrap();
        let k = &s[0].config.kafka;
        assert_eq!(k.progress_topic(), "p");
        assert_eq!(k.exactly_once.transactional_id.as_deref(), Some("t1"));
        assert!(
            format!("{:?}", k.exactly_once).contains("77"),
            "{:?}",
            k.exactly_once
        );
    }

    #[test]
    fn polling_sources_share_no_slot() {
        let one = |name: &str, db: &str| {
            format!("\n[[sources]]\nname = \"{name}\"\nmode = \"polling\"\n[sources.postgres]\nurl = \"postgres://u@h/{db}\"\n")
        };
        let text = format!("{SHARED}{}{}", one("a", "x"), one("b", "y"));
        assert!(load(&text).is_ok(), "{:?}", load(&text).err());
        let cdc = text.replace("mode = \"polling\"\n", "");
        assert!(load(&cdc).unwrap_err().contains("one replication slot"));
    }

    #[test]
    fn a_secret_of_the_wrong_type_is_not_quoted() {
        let text = format!(
            "{}{}",
            SHARED.replace(
                "listen = \"127.0.0.1:0\"",
                "listen = \"127.0.0.1:0\"\nadmin_token = 987654321987654321"
            ),
            source("a", "postgres://u@h/x", "s", "outbox")
        );
        let err = load(&text).unwrap_err();
        assert!(
            err.contains("http.admin_token") && err.contains("must be a string"),
            "{err}"
        );
        assert!(!err.contains("987654321"), "{err}");
    }

    #[test]
    fn http_and_log_restart_no_relay() {
        let base = format!("{SHARED}{}", source("a", "postgres://u@h/x", "s", "outbox"));
        let other = base.replace(
            "listen = \"127.0.0.1:0\"",
            "listen = \"127.0.0.1:1\"\nadmin_token = \"0123456789abcdef0\"",
        );
        let (a, b) = (load(&base).unwrap(), load(&other).unwrap());
        assert_eq!(a[0].fingerprint, b[0].fingerprint);
        let routed = base.replace("table = \"outbox\"", "table = \"outbox2\"");
        assert_ne!(a[0].fingerprint, load(&routed).unwrap()[0].fingerprint);
    }

    #[test]
    fn one_progress_key_in_one_topic_is_refused() {
        let text = format!(
            "{SHARED}{}\n[sources.kafka]\ndelivery = \"exactly-once\"\n[sources.kafka.exactly_once]\ntransactional_id = \"t1\"\n{}\n[sources.kafka]\ndelivery = \"exactly-once\"\n[sources.kafka.exactly_once]\ntransactional_id = \"t2\"\n",
            source("a", "postgres://u@h1/x", "s", "outbox"),
            source("b", "postgres://u@h2/x", "s", "outbox"),
        );
        let err = load(&text).unwrap_err();
        assert!(err.contains("progress key"), "{err}");
    }

    #[test]
    fn a_per_source_error_names_its_source() {
        let text = format!(
            "{SHARED}{}{}",
            source("a", "postgres://u@h/x", "s1", "outbox"),
            source("b", "postgres://u@h/x", "BAD SLOT", "outbox2"),
        );
        let err = load(&text).unwrap_err();
        assert!(
            err.contains("sources[1].postgres.slot") && err.contains("\"b\""),
            "{err}"
        );
        // A shared key is named without a source.
        let text = format!(
            "[kafka]\nbrokers = \"\"\n{}",
            source("a", "postgres://u@h/x", "s1", "outbox")
        );
        let err = load(&text).unwrap_err();
        assert!(err.starts_with("config key kafka.brokers"), "{err}");
    }
}
