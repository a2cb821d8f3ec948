//! `outboxd import debezium FILE`: a Debezium PostgreSQL connector's
//! configuration, with its Outbox Event Router, as outboxd's TOML.
//!
//! The file is what Kafka Connect holds: the REST API's JSON (`GET
//! /connectors/{name}`, `GET /connectors/{name}/config`, or what is POSTed:
//! `{"name": …, "config": {…}}`) or a standalone `.properties` file. The
//! worker's file (`--worker`) supplies what the connector leaves to it:
//! the converters and `bootstrap.servers`.
//!
//! Every option of the connector and of the Event Router is either
//! carried over (the slot, the publication, the table, the column roles,
//! the placements, the topic route, tombstones, the converters as value
//! and key formats, the Java client's partitioner) or named in a comment
//! at the end with why it has no equivalent. Secrets are never copied: the
//! password becomes `${PGPASSWORD}`.
//!
//! Moving a Debezium deployment is then: import, `outboxd check`, stop the
//! connector (a clean stop confirms the slot), start outboxd on the same
//! slot (docs/migrating-from-debezium.md).

pub mod properties;

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Why a connector configuration could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{0} is neither Kafka Connect's JSON nor a .properties file: {1}")]
    Unreadable(String, String),
    #[error("connector.class is {0:?}, not Debezium's PostgreSQL connector (io.debezium.connector.postgresql.PostgresConnector)")]
    NotPostgres(String),
    #[error("the connector has no Outbox Event Router transform (a transforms.<name>.type of io.debezium.transforms.outbox.EventRouter): outboxd relays outbox tables, not every change of a database")]
    NoEventRouter,
    #[error("{option} = {value:?}: {reason}")]
    Invalid {
        option: String,
        value: String,
        reason: String,
    },
}

/// The Event Router's class.
pub const EVENT_ROUTER: &str = "io.debezium.transforms.outbox.EventRouter";

/// An option that is not carried over, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub option: String,
    pub value: String,
    pub why: String,
}

/// The result: outboxd's TOML (the notes are comments at its end).
#[derive(Clone, Debug)]
pub struct Imported {
    pub toml: String,
    pub notes: Vec<Note>,
}

/// A connector's (or worker's) configuration as flat string pairs.
pub fn read_config(
    name: &str,
    text: &str,
) -> Result<(Option<String>, BTreeMap<String, String>), ImportError> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ImportError::Unreadable(name.into(), e.to_string()))?;
        let serde_json::Value::Object(top) = value else {
            return Err(ImportError::Unreadable(name.into(), "not a JSON object".into()));
        };
        // {"name", "config": {...}} (POST, GET /connectors/{name}) or the
        // flat map (GET /connectors/{name}/config).
        let (connector, map) = match top.get("config") {
            Some(serde_json::Value::Object(config)) => (
                top.get("name").and_then(|n| n.as_str()).map(str::to_owned),
                config.clone(),
            ),
            _ => (None, top),
        };
        let mut out = BTreeMap::new();
        for (k, v) in map {
            let text = match v {
                serde_json::Value::String(s) => s,
                serde_json::Value::Null => continue,
                other => other.to_string(),
            };
            out.insert(k, text);
        }
        let connector = connector.or_else(|| out.get("name").cloned());
        return Ok((connector, out));
    }
    let map = properties::parse(text).map_err(|e| ImportError::Unreadable(name.into(), e))?;
    Ok((map.get("name").cloned(), map))
}

/// What the importer reads: the connector's options, then the worker's.
struct Options<'a> {
    connector: &'a BTreeMap<String, String>,
    worker: Option<&'a BTreeMap<String, String>>,
    /// Options carried over or noted, so that the rest can be named.
    seen: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

impl Options<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.seen.borrow_mut().insert(key.to_owned());
        self.connector.get(key).map(String::as_str)
    }

    fn or(&self, key: &str, default: &'static str) -> String {
        self.get(key).unwrap_or(default).to_owned()
    }

    /// A converter (`key.converter` or `value.converter`): the
    /// connector's, else the worker's; and where it came from.
    fn converter(&self, key: &str) -> (Option<String>, &'static str) {
        if let Some(v) = self.get(key) {
            return (Some(v.to_owned()), "connector");
        }
        match self.worker.and_then(|w| w.get(key)) {
            Some(v) => (Some(v.clone()), "worker"),
            None => (None, "default"),
        }
    }

    /// A converter's own setting (`value.converter.schemas.enable`), read
    /// where the converter is configured: Connect configures a converter
    /// the connector sets from the connector's keys alone.
    fn converter_setting(&self, key: &str, from: &str) -> Option<String> {
        match from {
            "connector" => self.get(key).map(str::to_owned),
            _ => self.worker.and_then(|w| w.get(key)).cloned(),
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, ImportError> {
        match self.get(key).map(str::trim) {
            None => Ok(default),
            Some(v) if v.eq_ignore_ascii_case("true") => Ok(true),
            Some(v) if v.eq_ignore_ascii_case("false") => Ok(false),
            Some(v) => Err(ImportError::Invalid {
                option: key.into(),
                value: v.into(),
                reason: "is neither true nor false".into(),
            }),
        }
    }
}

/// TOML text, one key at a time.
#[derive(Default)]
struct Toml {
    text: String,
}

impl Toml {
    fn section(&mut self, name: &str) {
        let _ = write!(self.text, "\n[{name}]\n");
    }

    fn comment(&mut self, line: &str) {
        for l in line.lines() {
            let _ = writeln!(self.text, "# {l}");
        }
    }

    /// A string value, taken literally: a `$` is written `$$`, so that
    /// outboxd's `${VAR}` interpolation leaves it alone.
    fn string(&mut self, key: &str, value: &str, comment: Option<&str>) {
        let quoted = toml::Value::String(value.replace('$', "$$")).to_string();
        self.line(key, &quoted, comment);
    }

    /// `${var}`: a value outboxd reads from the environment.
    fn env(&mut self, key: &str, var: &str, comment: Option<&str>) {
        self.line(key, &format!("\"${{{var}}}\""), comment);
    }

    fn raw(&mut self, key: &str, value: impl std::fmt::Display, comment: Option<&str>) {
        self.line(key, &value.to_string(), comment);
    }

    fn line(&mut self, key: &str, value: &str, comment: Option<&str>) {
        let key = if key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            key.to_owned()
        } else {
            toml::Value::String(key.to_owned()).to_string()
        };
        match comment {
            Some(c) => {
                let _ = writeln!(self.text, "{key} = {value}  # {c}");
            }
            None => {
                let _ = writeln!(self.text, "{key} = {value}");
            }
        }
    }
}

/// Debezium's default `route.topic.regex`.
const DEFAULT_REGEX: &str = "(?<routedByValue>.*)";
/// Debezium's default `route.topic.replacement`.
const DEFAULT_REPLACEMENT: &str = "outbox.event.${routedByValue}";

/// A `route.topic.replacement` (Java's `Matcher.replaceFirst` syntax:
/// `$n`, `${name}`, `\x`) as an outboxd topic template over the regex's
/// groups (`{$n}`, `{$name}`). `$n` takes as many digits as still name a
/// group, as Java does.
pub fn replacement_to_template(replacement: &str, groups: usize) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = replacement.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(x) => out.push(x),
                None => return Err("ends in a lone backslash".into()),
            },
            '$' => match chars.peek() {
                Some('{') => {
                    chars.next();
                    let name: String = chars.by_ref().take_while(|&c| c != '}').collect();
                    if name.is_empty() {
                        return Err("has an empty ${} group reference".into());
                    }
                    let _ = write!(out, "{{${name}}}");
                }
                Some(d) if d.is_ascii_digit() => {
                    let mut n: usize = 0;
                    let mut first = true;
                    while let Some(&d) = chars.peek() {
                        let Some(v) = d.to_digit(10) else { break };
                        let next = n * 10 + v as usize;
                        if !first && next >= groups {
                            break;
                        }
                        n = next;
                        first = false;
                        chars.next();
                    }
                    let _ = write!(out, "{{${n}}}");
                }
                _ => return Err("has a $ that names no group (write \\$ for a dollar sign)".into()),
            },
            '{' | '}' => return Err(format!("holds {c:?}, which no topic name can")),
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Splits Debezium's comma-separated lists (`\,` escapes a comma).
fn list(text: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&',') => {
                chars.next();
                if let Some(last) = out.last_mut() {
                    last.push(',');
                }
            }
            ',' => out.push(String::new()),
            c => {
                if let Some(last) = out.last_mut() {
                    last.push(c);
                }
            }
        }
    }
    out.into_iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// A `table.include.list` entry that names one table (`public.outbox`,
/// `public\.outbox`), as `schema.table`.
fn literal_table(entry: &str) -> Option<String> {
    let plain = entry.replace("\\.", ".");
    let (schema, table) = plain.split_once('.')?;
    let ident = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    (ident(schema) && ident(table)).then(|| format!("{schema}.{table}"))
}

/// The value format a value converter writes, the key format a key
/// converter writes.
enum Converter {
    String,
    Json { schemas: bool },
    Bytes,
    Avro,
    Protobuf,
    JsonSchema,
    Other(String),
}

fn converter(class: &str, schemas: bool) -> Converter {
    match class {
        "org.apache.kafka.connect.storage.StringConverter" => Converter::String,
        "org.apache.kafka.connect.json.JsonConverter" => Converter::Json { schemas },
        "org.apache.kafka.connect.converters.ByteArrayConverter"
        | "io.debezium.converters.BinaryDataConverter"
        | "io.debezium.converters.ByteArrayConverter" => Converter::Bytes,
        "io.confluent.connect.avro.AvroConverter" | "io.apicurio.registry.utils.converter.AvroConverter" => {
            Converter::Avro
        }
        "io.confluent.connect.protobuf.ProtobufConverter" => Converter::Protobuf,
        "io.confluent.connect.json.JsonSchemaConverter"
        | "io.apicurio.registry.utils.converter.ExtJsonConverter" => Converter::JsonSchema,
        other => Converter::Other(other.to_owned()),
    }
}

/// Imports a Debezium PostgreSQL connector's configuration.
pub fn debezium(
    connector_name: Option<&str>,
    connector: &BTreeMap<String, String>,
    worker: Option<&BTreeMap<String, String>>,
) -> Result<Imported, ImportError> {
    let o = Options {
        connector,
        worker,
        seen: Default::default(),
    };
    let mut notes: Vec<Note> = Vec::new();
    let mut note = |option: &str, value: &str, why: &str| {
        notes.push(Note {
            option: option.to_owned(),
            value: value.to_owned(),
            why: why.to_owned(),
        })
    };
    let class = o.or("connector.class", "");
    if !class.ends_with("PostgresConnector") {
        return Err(ImportError::NotPostgres(class));
    }
    o.get("name");
    // The Event Router among the transforms.
    let transforms = list(&o.or("transforms", ""));
    let router = transforms
        .iter()
        .find(|t| o.get(&format!("transforms.{t}.type")) == Some(EVENT_ROUTER))
        .cloned()
        .ok_or(ImportError::NoEventRouter)?;
    for t in transforms.iter().filter(|t| **t != router) {
        let class = o.or(&format!("transforms.{t}.type"), "");
        note(
            &format!("transforms.{t}"),
            &class,
            "a transform besides the Event Router: outboxd runs no Kafka Connect transforms; what it did to the records is not done",
        );
    }
    let er = |key: &str| format!("transforms.{router}.{key}");
    if let Some(p) = o.get(&er("predicate")) {
        let negate = o.flag(&er("negate"), false)?;
        let pattern = o
            .get(&format!("predicates.{p}.pattern"))
            .unwrap_or_default()
            .to_owned();
        o.get(&format!("predicates.{p}.type"));
        note(
            &er("predicate"),
            &format!("{p}{} {pattern}", if negate { " (negated)" } else { "" }),
            "outboxd reads only postgres.table, so the predicate that picked the outbox table's records is not needed",
        );
    }

    let mut t = Toml::default();
    let title = connector_name.map_or_else(String::new, |n| format!(" {n:?}"));
    t.comment(&format!(
        "outboxd configuration imported from the Debezium connector{title} by `outboxd import debezium`.\n\
         Check it (`outboxd check --config FILE`), stop the connector (a clean stop confirms the slot),\n\
         then start outboxd: it resumes at the slot's confirmed position. docs/migrating-from-debezium.md"
    ));

    // [postgres]
    t.section("postgres");
    let host = o.or("database.hostname", "localhost");
    let port = o.or("database.port", "5432");
    let user = o.or("database.user", "postgres");
    let dbname = o
        .get("database.dbname")
        .map(str::to_owned)
        .ok_or_else(|| ImportError::Invalid {
            option: "database.dbname".into(),
            value: String::new(),
            reason: "is required: the database that holds the outbox table".into(),
        })?;
    let mut url = url::Url::parse("postgres://localhost").map_err(|e| ImportError::Invalid {
        option: "database.hostname".into(),
        value: host.clone(),
        reason: e.to_string(),
    })?;
    let invalid = |option: &str, value: &str| ImportError::Invalid {
        option: option.into(),
        value: value.into(),
        reason: "cannot be written into a connection URL".into(),
    };
    url.set_host(Some(&host))
        .map_err(|_| invalid("database.hostname", &host))?;
    url.set_port(Some(port.parse().map_err(|_| invalid("database.port", &port))?))
        .map_err(|()| invalid("database.port", &port))?;
    url.set_username(&user)
        .map_err(|()| invalid("database.user", &user))?;
    url.set_path(&dbname);
    let sslmode = o.or("database.sslmode", "prefer");
    url.query_pairs_mut().append_pair("sslmode", &sslmode);
    for key in ["database.sslrootcert", "database.sslcert", "database.sslkey"] {
        if let Some(v) = o.get(key) {
            let param = key.trim_start_matches("database.");
            url.query_pairs_mut().append_pair(param, v);
        }
    }
    t.string("url", url.as_str(), None);
    let password = o.get("database.password").unwrap_or_default();
    t.env(
        "password",
        "PGPASSWORD",
        Some(if password.starts_with("${") {
            "Debezium read it from a config provider: give outboxd the same secret in PGPASSWORD"
        } else {
            "not copied: set PGPASSWORD to Debezium's database.password"
        }),
    );
    let include = o.get("table.include.list").map(list).unwrap_or_default();
    let table = match include.as_slice() {
        [one] => match literal_table(one) {
            Some(t) => t,
            None => {
                note(
                    "table.include.list",
                    one,
                    "a pattern, not one table: set postgres.table to the outbox table it matches",
                );
                "public.outbox".to_owned()
            }
        },
        [] => {
            note(
                "table.include.list",
                "",
                "not set (Debezium captured every table): postgres.table is taken as public.outbox; set the outbox table",
            );
            "public.outbox".to_owned()
        }
        many => {
            let tables: Vec<String> = many.iter().filter_map(|e| literal_table(e)).collect();
            note(
                "table.include.list",
                &many.join(","),
                "several tables: an outboxd source reads one outbox table; add a [[sources]] entry (with its own slot) for each other one",
            );
            tables
                .first()
                .cloned()
                .unwrap_or_else(|| "public.outbox".to_owned())
        }
    };
    t.string("table", &table, None);
    let plugin = o.or("plugin.name", "decoderbufs");
    let slot = o.or("slot.name", "debezium");
    if plugin == "pgoutput" {
        t.string(
            "slot",
            &slot,
            Some("Debezium's slot: outboxd takes it over where Debezium confirmed"),
        );
    } else {
        t.string(
            "slot",
            "outboxd",
            Some("a slot of outboxd's own (see the note on plugin.name)"),
        );
        note(
            "plugin.name",
            &plugin,
            "Debezium's slot decodes with this plugin, which outboxd cannot read: outboxd creates a pgoutput slot of its own. Start outboxd before stopping Debezium and expect duplicates for what lies between the two slots",
        );
    }
    if o.flag("slot.drop.on.stop", false)? {
        note(
            "slot.drop.on.stop",
            "true",
            "stopping the connector drops its slot, and with it everything not yet confirmed: set it to false before the switch",
        );
    }
    let autocreate = o.or("publication.autocreate.mode", "all_tables");
    if plugin == "pgoutput" {
        t.string("publication", &o.or("publication.name", "dbz_publication"), None);
        t.raw(
            "create_publication",
            false,
            Some(&format!(
                "Debezium's publication (publication.autocreate.mode = {autocreate}); outboxd proves it publishes the table's INSERTs"
            )),
        );
    } else {
        // A decoderbufs deployment has no publication.
        t.string(
            "publication",
            "outboxd",
            Some("made by outboxd for the table (a decoderbufs slot reads none)"),
        );
        t.raw("create_publication", true, None);
    }

    // [columns]
    t.section("columns");
    t.string("id", &o.or(&er("table.field.event.id"), "id"), None);
    t.string("key", &o.or(&er("table.field.event.key"), "aggregateid"), None);
    t.string("route", &o.or(&er("route.by.field"), "aggregatetype"), None);
    match o.get(&er("table.field.event.type")) {
        Some(v) => t.string(
            "type",
            v,
            Some("Debezium never reads it; outboxd uses it for CloudEvents and registry rules only"),
        ),
        None => t.raw(
            "type",
            false,
            Some("Debezium's Event Router reads no type column (place it as a header to send it)"),
        ),
    }
    t.string(
        "payload",
        &o.or(&er("table.field.event.payload"), "payload"),
        None,
    );
    t.raw(
        "headers",
        false,
        Some("the Event Router turns no column into headers but the placements"),
    );
    match o.get(&er("table.field.event.timestamp")) {
        Some(v) => t.string(
            "timestamp",
            v,
            Some("a timestamp (read as UTC) or bigint epoch milliseconds; outboxd also reads timestamptz"),
        ),
        None => t.raw(
            "timestamp",
            false,
            Some("Debezium stamps its processing time; outboxd the transaction's commit time"),
        ),
    }
    let missing = o.or(&er("table.field.additional.missing"), "error");
    match missing.as_str() {
        "error" | "ignore" => t.string("additional_missing", &missing, None),
        other => {
            return Err(ImportError::Invalid {
                option: er("table.field.additional.missing"),
                value: other.into(),
                reason: "is neither error nor ignore".into(),
            })
        }
    }
    let mut envelope_placements = false;
    if let Some(placements) = o.get(&er("table.fields.additional.placement")) {
        for entry in list(placements) {
            let parts: Vec<&str> = entry.split(':').map(str::trim).collect();
            let (column, placement, alias) = match parts.as_slice() {
                [c, p] => (*c, *p, None),
                [c, p, a] => (*c, *p, Some(*a)),
                _ => {
                    return Err(ImportError::Invalid {
                        option: er("table.fields.additional.placement"),
                        value: entry.clone(),
                        reason: "is not column:placement[:alias]".into(),
                    })
                }
            };
            if !matches!(placement, "header" | "envelope" | "partition") {
                return Err(ImportError::Invalid {
                    option: er("table.fields.additional.placement"),
                    value: entry.clone(),
                    reason: "the placement must be header, envelope or partition".into(),
                });
            }
            if placement == "header" && alias.unwrap_or(column) == "id" {
                note(
                    &er("table.fields.additional.placement"),
                    &entry,
                    "a second `id` header beside the event id's: outboxd sets one `id` header, the event id",
                );
                continue;
            }
            envelope_placements |= placement == "envelope";
            t.text.push_str("\n[[columns.additional]]\n");
            t.string("column", column, None);
            t.string("placement", placement, None);
            if let (Some(a), false) = (alias, placement == "partition") {
                t.string("name", a, None);
            }
        }
    }
    if let Some(v) = o.get(&er("table.field.event.schema.version")) {
        note(
            &er("table.field.event.schema.version"),
            v,
            "outboxd writes no Connect schema version into the value struct",
        );
    }

    // [routing]
    t.section("routing");
    let regex = o.or(&er("route.topic.regex"), DEFAULT_REGEX);
    let replacement = o.or(&er("route.topic.replacement"), DEFAULT_REPLACEMENT);
    if regex == DEFAULT_REGEX {
        let template = replacement_to_template(&replacement, 2)
            .map_err(|reason| ImportError::Invalid {
                option: er("route.topic.replacement"),
                value: replacement.clone(),
                reason,
            })?
            .replace("{$routedByValue}", "{aggregate_type}")
            .replace("{$1}", "{aggregate_type}")
            .replace("{$0}", "{aggregate_type}");
        t.string("topic", &template, None);
    } else {
        let groups = crate::config::routing::TopicRegex::parse(&regex)
            .map_err(|reason| ImportError::Invalid {
                option: er("route.topic.regex"),
                value: regex.clone(),
                reason,
            })?
            .group_count();
        let template =
            replacement_to_template(&replacement, groups).map_err(|reason| ImportError::Invalid {
                option: er("route.topic.replacement"),
                value: replacement.clone(),
                reason,
            })?;
        t.string("topic_regex", &regex, None);
        t.string(
            "topic",
            &template,
            Some("a route value the regex does not match is the topic as it is, as with Debezium"),
        );
    }
    t.raw("lowercase_aggregate_type", false, Some("Debezium keeps the case"));
    t.raw(
        "standard_headers",
        false,
        Some("the `id` header and the placements, as the Event Router writes"),
    );
    if o.flag(&er("route.tombstone.on.empty.payload"), false)? {
        t.raw("tombstone_on_empty_payload", true, None);
    }
    // The converters decide the value's and the key's bytes.
    let expand = o.flag(&er("table.expand.json.payload"), false)?;
    for key in [
        er("table.json.payload.null.behavior"),
        er("table.json.payload.empty.array.behavior"),
    ] {
        if let Some(v) = o.get(&key) {
            note(
                &key,
                v,
                "applies to table.expand.json.payload, which outboxd does not reshape (see its note)",
            );
        }
    }
    let (value_class, value_from) = o.converter("value.converter");
    let value_schemas = o
        .converter_setting("value.converter.schemas.enable", value_from)
        .is_none_or(|v| v.trim().eq_ignore_ascii_case("true"));
    let (key_class, key_from) = o.converter("key.converter");
    let key_schemas = o
        .converter_setting("key.converter.schemas.enable", key_from)
        .is_none_or(|v| v.trim().eq_ignore_ascii_case("true"));
    const JSON: &str = "org.apache.kafka.connect.json.JsonConverter";
    if value_from == "default" || key_from == "default" {
        note(
            "key.converter, value.converter",
            "",
            "set by neither the connector nor a worker file (--worker): taken as Connect's sample worker's, JsonConverter with schemas.enable=true. Check what your worker sets",
        );
    }
    let value_class = value_class.unwrap_or_else(|| JSON.to_owned());
    let key_class = key_class.unwrap_or_else(|| JSON.to_owned());
    let mut registry_url: Option<String> = None;
    match converter(&value_class, value_schemas) {
        Converter::String | Converter::Bytes => {
            t.string(
                "value",
                "payload",
                Some(&format!("{value_class}: the payload's bytes")),
            );
            if expand {
                note(
                    &er("table.expand.json.payload"),
                    "true",
                    "with a string or bytes converter the payload is not expanded either: nothing changes",
                );
            }
            if envelope_placements {
                note(
                    &er("table.fields.additional.placement"),
                    "envelope",
                    "an envelope placement needs a converter that writes structs: set routing.value = \"connect-json\" or place the column as a header",
                );
            }
        }
        Converter::Json { schemas } => {
            if expand {
                t.string(
                    "value",
                    "payload",
                    Some("closest to an expanded JSON payload; see the note"),
                );
                note(
                    &er("table.expand.json.payload"),
                    "true",
                    "Debezium re-serialises the payload through an inferred Connect schema (compact, nulls and empty arrays dropped, 2.50 as 2.5); outboxd forwards the payload's JSON text as PostgreSQL holds it (value = \"payload\"), which consumers reading JSON values read alike",
                );
            } else {
                t.string("value", "connect-json", Some("Kafka Connect's JsonConverter"));
                t.raw("connect_schemas", schemas, Some("value.converter.schemas.enable"));
                if envelope_placements {
                    t.string(
                        "connect_topic_prefix",
                        &o.or("topic.prefix", "outboxd"),
                        Some("names the value struct, as Debezium's topic.prefix"),
                    );
                }
            }
        }
        Converter::Avro | Converter::Protobuf | Converter::JsonSchema => {
            let format = match converter(&value_class, value_schemas) {
                Converter::Avro => "avro",
                Converter::Protobuf => "protobuf",
                _ => "json-schema",
            };
            t.string("value", format, Some(&value_class));
            if expand {
                t.string(
                    "schema",
                    "inferred",
                    Some("a schema derived from each payload, as table.expand.json.payload does"),
                );
            }
            registry_url = o
                .converter("value.converter.schema.registry.url")
                .0
                .or_else(|| o.converter("value.converter.apicurio.registry.url").0);
            if let Some(strategy) = o
                .converter("value.subject.name.strategy")
                .0
                .or_else(|| o.converter("value.converter.value.subject.name.strategy").0)
            {
                let ours = if strategy.ends_with("TopicRecordNameStrategy") {
                    "topic-record"
                } else if strategy.ends_with("RecordNameStrategy") {
                    "record"
                } else {
                    "topic"
                };
                t.string("subject_strategy", ours, Some(&strategy));
            }
        }
        Converter::Other(class) => {
            t.string("value", "payload", Some("see the note on value.converter"));
            note(
                "value.converter",
                &class,
                "a converter outboxd does not know: the payload's bytes are written as they are",
            );
        }
    }
    match converter(&key_class, key_schemas) {
        Converter::String | Converter::Bytes => {}
        Converter::Json { schemas } => {
            t.string(
                "key_format",
                "connect-json",
                Some("Kafka Connect's JsonConverter"),
            );
            t.raw(
                "connect_key_schemas",
                schemas,
                Some("key.converter.schemas.enable"),
            );
        }
        Converter::Avro => t.string("key_format", "avro", Some(&key_class)),
        Converter::JsonSchema => t.string("key_format", "json-schema", Some(&key_class)),
        Converter::Protobuf | Converter::Other(_) => note(
            "key.converter",
            &key_class,
            "outboxd writes keys as strings, Connect JSON, Avro or JSON Schema: the key is its UTF-8 here",
        ),
    }
    let tolerance = o.or("errors.tolerance", "none");
    t.string(
        "on_poison",
        if tolerance == "all" { "dead-letter" } else { "stop" },
        Some(&format!("errors.tolerance = {tolerance}")),
    );
    if let Some(url) = registry_url {
        t.section("schema_registry");
        t.string(
            "url",
            &url,
            Some("Apicurio: its Confluent-compatible /apis/ccompat/v7"),
        );
    }

    // [kafka]
    t.section("kafka");
    match worker.and_then(|w| w.get("bootstrap.servers")) {
        Some(b) => t.string("brokers", b, Some("the worker's bootstrap.servers")),
        None => t.env(
            "brokers",
            "KAFKA_BROKERS",
            Some("the Connect worker's bootstrap.servers (pass --worker to read it)"),
        ),
    }
    if let Some(p) = o.get("topic.creation.default.partitions") {
        if let Ok(n) = p.trim().parse::<i32>() {
            t.raw("topic_partitions", n, Some("topic.creation.default.partitions"));
        }
    }
    if let Some(r) = o.get("topic.creation.default.replication.factor") {
        if let Ok(n) = r.trim().parse::<i32>() {
            t.raw(
                "topic_replication_factor",
                n,
                Some("topic.creation.default.replication.factor"),
            );
        }
    }
    t.section("kafka.options");
    t.string(
        "partitioner",
        "murmur2_random",
        Some("the Java client's partitioner: each key stays on its partition across the switch"),
    );

    // Options of note that have no equivalent.
    if o.flag("extended.headers.enabled", true)? {
        note(
            "extended.headers.enabled",
            "true",
            "outboxd writes no __debezium.context.* headers (connector name, task id, run id)",
        );
    }
    let snapshot = o.or("snapshot.mode", "initial");
    if snapshot != "no_data" && snapshot != "never" {
        note(
            "snapshot.mode",
            &snapshot,
            "outboxd takes no snapshot: rows written before its slot existed are published with `outboxd replay`",
        );
    }
    for (key, why) in [
        (
            "heartbeat.interval.ms",
            "outboxd confirms an idle slot from keepalives: no heartbeat topic or table",
        ),
        ("heartbeat.action.query", "outboxd needs no heartbeat writes"),
        (
            "offset.flush.interval.ms",
            "outboxd confirms about 100 ms after Kafka's acknowledgement",
        ),
        (
            "lsn.flush.mode",
            "outboxd confirms the slot itself, once Kafka acknowledged",
        ),
        ("tombstones.on.delete", "outboxd publishes INSERTs only"),
        ("skipped.operations", "outboxd publishes INSERTs only"),
        (
            &er("table.op.invalid.behavior"),
            "outboxd ignores UPDATEs and DELETEs of the outbox table without a warning",
        ),
        (
            "header.converter",
            "outboxd writes header values as their text, as SimpleHeaderConverter does",
        ),
        (
            "errors.deadletterqueue.topic.name",
            "set routing.dead_letter_topic (a dead letter carries the row and dlq.* headers)",
        ),
        (
            &er("tracing.span.context.field"),
            "outboxd's tracing is [opentelemetry]; place the column as a header to pass it on",
        ),
        (
            &er("tracing.operation.name"),
            "outboxd's tracing is [opentelemetry]",
        ),
        (
            &er("tracing.with.context.field.only"),
            "outboxd's tracing is [opentelemetry]",
        ),
        (
            "tasks.max",
            "one outboxd leads a slot; run a second one as a hot standby",
        ),
        (
            "value.converter.replace.null.with.default",
            "outboxd writes no column defaults into values",
        ),
        (
            "provide.transaction.metadata",
            "outboxd publishes no transaction topic (exactly-once delivery keeps transactions whole)",
        ),
    ] {
        if let Some(v) = o.get(key) {
            note(key, v, why);
        }
    }
    // Everything else the connector set, named.
    let seen = o.seen.borrow().clone();
    let ignorable = |k: &str| {
        k == "name"
            || k.starts_with("database.")
            || k == "topic.prefix"
            || k.starts_with("key.converter")
            || k.starts_with("value.converter")
            || k.starts_with("predicates.")
            || k.starts_with("transforms.") && !k.starts_with(&format!("transforms.{router}."))
    };
    for (k, v) in connector {
        if !seen.contains(k) && !ignorable(k) {
            note(
                k,
                v,
                "no outboxd equivalent: check whether your deployment relies on it",
            );
        }
    }
    if !notes.is_empty() {
        t.text.push('\n');
        t.comment("Not carried over (option = value: why):");
        for n in &notes {
            let value = if n.option.contains("password") {
                "***"
            } else {
                &n.value
            };
            t.comment(&format!("  {} = {value}: {}", n.option, n.why));
        }
    }
    Ok(Imported { toml: t.text, notes })
}

#[cfg(test)]
mod tests;
