//! Outbox rows, read through the column map.
//!
//! [`crate::config::columns`] says which column plays which role (id,
//! key, route, type, payload, headers, timestamp) and which additional
//! columns the topic template and the placements read. This module is
//! the one place that reads a row through it, for every path: the
//! replication stream (a pgoutput `Relation` tells where each column sits
//! in a tuple), and the statements of polling mode, `outboxd replay` and
//! `outboxd check` ([`OutboxColumns::select`]).
//!
//! # Resolving
//!
//! [`OutboxColumns::resolve`] finds every mapped column among the table's
//! columns and checks its type ([`Kind`]): a missing column or one of a
//! type no row could be read from is a [`MappingError`] that names the
//! column and the setting, before any row is read. A role left at its
//! default may be missing when it is optional and nothing needs it.
//!
//! # Values
//!
//! Values arrive in text form (the replication connection and the
//! statements fix `DateStyle = ISO` and `TimeZone = UTC`). The payload is
//! kept as the column holds it: `jsonb` and `json` as their JSON text (a
//! `json` column keeps the writer's text), `text` as its characters, and
//! `bytea` as its bytes (its text form, `\x` hex or the escape format, is
//! decoded back), so that each value format can forward it byte for byte
//! or embed it without re-encoding ([`Payload`]). The timestamp is a
//! `timestamptz`, a `timestamp` read as UTC, or a `bigint` of milliseconds
//! since the Unix epoch.

use std::borrow::Cow;
use std::sync::Arc;

use chrono::{DateTime, NaiveDateTime, Utc};

use crate::config::columns::{ColumnMap, ColumnName, Role};
use crate::config::routing::TextPayload;
use crate::postgres::admin::CatalogColumn;
use crate::postgres::pgoutput::{Relation, Tuple, TupleValue};

pub use outbox_sdk::schema::column;

/// One row inserted into the outbox table, as its roles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRow {
    /// The event id's text (a uuid, text or an integer column).
    pub id: String,
    /// The route column's value (`{aggregate_type}`); empty when the
    /// table has none.
    pub aggregate_type: String,
    /// The key column's value; empty when it is NULL (a bad row).
    pub aggregate_id: String,
    /// The type column's value; empty when the table has none.
    pub event_type: String,
    pub payload: Payload,
    /// The headers object as JSON text (`{}` when the table has no headers
    /// column, or the row's is NULL).
    pub headers: String,
    pub created_at: CreatedAt,
    /// The additional columns' values, in [`ColumnMap::extra`] order.
    pub extra: Vec<Extra>,
    /// The kinds and nullability of the columns it was read from, when
    /// known (`None`: a message, a parked row read back).
    pub facts: Option<Arc<ColumnFacts>>,
}

/// The PostgreSQL type oid of `bytea`.
pub const BYTEA_OID: u32 = 17;

/// An event's payload, as its column holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload {
    /// JSON text, exactly as PostgreSQL rendered it (a `jsonb` or `json`
    /// column): always one valid JSON value.
    Json(String),
    /// A `text` or `varchar` column's characters: JSON or not.
    Text(String),
    /// A `bytea` column's bytes, forwarded unchanged.
    Bytes(Vec<u8>),
    /// SQL NULL.
    Null,
}

/// A payload as one JSON value, for the formats that embed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JsonPayload<'a> {
    /// Valid JSON text, embedded as it is.
    Json(Cow<'a, str>),
    /// Bytes, embedded as base64 under the bytes member's name.
    Bytes(&'a [u8]),
}

impl Payload {
    /// The bytes a record carries: the JSON or text's UTF-8, the bytea's
    /// bytes (nothing for NULL).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Payload::Json(s) | Payload::Text(s) => s.as_bytes(),
            Payload::Bytes(b) => b,
            Payload::Null => &[],
        }
    }

    /// The JSON text of a `jsonb` or `json` payload; `None` otherwise.
    pub fn json(&self) -> Option<&str> {
        match self {
            Payload::Json(s) => Some(s),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.as_bytes().is_empty()
    }

    /// NULL, or text of nothing but characters up to U+0020 (spaces and
    /// control characters): what `routing.tombstone_on_empty_payload`
    /// makes a tombstone, as Debezium's `route.tombstone.on.empty.payload`
    /// decides with Java's `toString().trim().isEmpty()` (which trims
    /// exactly those, and which bytes never are).
    pub fn is_blank(&self) -> bool {
        match self {
            Payload::Null => true,
            Payload::Text(s) => s.chars().all(|c| c <= '\u{20}'),
            Payload::Bytes(_) | Payload::Json(_) => false,
        }
    }

    /// The payload as one JSON value under `routing.text_payload`: JSON
    /// as stored; text as itself when it is JSON (`auto`, `json`) or as a
    /// JSON string (`string`, and `auto` when it is no JSON); `null` for
    /// NULL. `Err` names why a text payload is refused under `json`.
    pub fn json_value(&self, text: TextPayload) -> Result<JsonPayload<'_>, String> {
        Ok(match self {
            Payload::Json(s) => JsonPayload::Json(Cow::Borrowed(s)),
            Payload::Null => JsonPayload::Json(Cow::Borrowed("null")),
            Payload::Bytes(b) => JsonPayload::Bytes(b),
            Payload::Text(s) => match text {
                TextPayload::String => JsonPayload::Json(Cow::Owned(json_string(s))),
                TextPayload::Auto if is_json(s) => JsonPayload::Json(Cow::Borrowed(s)),
                TextPayload::Auto => JsonPayload::Json(Cow::Owned(json_string(s))),
                TextPayload::Json => match serde_json::from_str::<&serde_json::value::RawValue>(s) {
                    Ok(_) => JsonPayload::Json(Cow::Borrowed(s)),
                    Err(e) => {
                        return Err(format!(
                        "the text payload is not JSON ({e}), and routing.text_payload = \"json\" needs JSON"
                    ))
                    }
                },
            },
        })
    }

    /// Appends a JSON object member: `"<json_key>":<the payload as JSON>`,
    /// or `"<bytes_key>":"<base64>"` for bytes. A text payload follows
    /// `routing.text_payload`.
    pub fn push_member(
        &self,
        out: &mut Vec<u8>,
        json_key: &str,
        bytes_key: &str,
        text: TextPayload,
    ) -> Result<(), String> {
        use base64::Engine as _;
        // Writing a &str to a Vec cannot fail.
        match self.json_value(text)? {
            JsonPayload::Json(j) => {
                let _ = serde_json::to_writer(&mut *out, json_key);
                out.push(b':');
                out.extend_from_slice(j.as_bytes());
            }
            JsonPayload::Bytes(b) => {
                let _ = serde_json::to_writer(&mut *out, bytes_key);
                out.extend_from_slice(b":\"");
                out.extend_from_slice(base64::engine::general_purpose::STANDARD.encode(b).as_bytes());
                out.push(b'"');
            }
        }
        Ok(())
    }

    /// Reads a payload column's text: `bytea`'s as bytes, `jsonb`'s and
    /// `json`'s as JSON, any other as text.
    pub fn from_text(text: &str, kind: Kind) -> Result<Payload, String> {
        match kind {
            Kind::Bytea => decode_bytea(text).map(Payload::Bytes),
            Kind::Json | Kind::Jsonb => Ok(Payload::Json(text.to_owned())),
            _ => Ok(Payload::Text(text.to_owned())),
        }
    }
}

impl From<&str> for Payload {
    fn from(s: &str) -> Payload {
        Payload::Json(s.to_owned())
    }
}

/// Whether `s` is exactly one JSON value (whitespace around it allowed).
/// Numbers are checked for their syntax only: `1e400` is JSON.
pub fn is_json(s: &str) -> bool {
    serde_json::from_str::<&serde_json::value::RawValue>(s).is_ok()
}

fn json_string(s: &str) -> String {
    // A &str always serializes.
    serde_json::to_string(s).unwrap_or_default()
}

/// An additional column's value, kept with what it is, so that a
/// placement can write it as JSON.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Extra {
    /// The table has no such column (`columns.additional_missing =
    /// "ignore"`): its placements are left out.
    Missing,
    Null,
    /// Text, a uuid, a date, anything read as text.
    Text(String),
    /// An integer, numeric or float, as PostgreSQL prints it.
    Number(String),
    Bool(bool),
    /// A `json` or `jsonb` value's text.
    Json(String),
}

impl Extra {
    /// The value's text (`None` for NULL and missing): `true`/`false` for
    /// booleans.
    pub fn text(&self) -> Option<&str> {
        match self {
            Extra::Missing | Extra::Null => None,
            Extra::Text(s) | Extra::Number(s) | Extra::Json(s) => Some(s),
            Extra::Bool(true) => Some("true"),
            Extra::Bool(false) => Some("false"),
        }
    }

    /// Appends the value as JSON (a number that JSON cannot write, `NaN`
    /// or `Infinity`, as a string).
    pub fn push_json(&self, out: &mut Vec<u8>) {
        match self {
            Extra::Missing | Extra::Null => out.extend_from_slice(b"null"),
            Extra::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Extra::Json(s) => out.extend_from_slice(s.as_bytes()),
            Extra::Number(s) if is_json(s) => out.extend_from_slice(s.as_bytes()),
            Extra::Number(s) | Extra::Text(s) => {
                let _ = serde_json::to_writer(&mut *out, s.as_str());
            }
        }
    }
}

/// What a column's type is, as far as reading it goes (a domain counts as
/// its base type, an enum as text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// text, varchar, char, name, citext, an enum.
    Text,
    Uuid,
    /// smallint, integer, bigint; the bits.
    Int(u8),
    /// numeric, real, double precision.
    Decimal,
    Bool,
    Json,
    Jsonb,
    Bytea,
    Timestamptz,
    Timestamp,
    /// Anything else (date, inet, arrays, …): read as text.
    Other,
}

impl Kind {
    /// The kind of a built-in type oid (`None`: ask the catalog).
    pub fn of_oid(oid: u32) -> Option<Kind> {
        Some(match oid {
            16 => Kind::Bool,
            17 => Kind::Bytea,
            18 | 19 | 25 | 1042 | 1043 => Kind::Text,
            20 => Kind::Int(64),
            21 => Kind::Int(16),
            23 => Kind::Int(32),
            114 => Kind::Json,
            700 | 701 | 1700 => Kind::Decimal,
            1114 => Kind::Timestamp,
            1184 => Kind::Timestamptz,
            2950 => Kind::Uuid,
            3802 => Kind::Jsonb,
            _ if oid < 16384 => Kind::Other,
            _ => return None,
        })
    }

    /// The kind of a catalog column: its base type's oid, and `typtype`
    /// (`e` for an enum).
    pub fn of_catalog(base_oid: u32, typtype: i8, type_name: &str) -> Kind {
        if typtype == b'e' as i8 || type_name == "citext" {
            return Kind::Text;
        }
        Kind::of_oid(base_oid).unwrap_or(Kind::Other)
    }

    /// Whether a role may have a column of this kind, and what it takes.
    fn fits(self, role: Role) -> Result<(), &'static str> {
        let ok = match role {
            Role::Id | Role::Key | Role::Route | Role::Type => {
                matches!(self, Kind::Text | Kind::Uuid | Kind::Int(_) | Kind::Other)
            }
            // A type outboxd does not know (a domain or type created since
            // the session read the catalog) is read as text.
            Role::Payload => matches!(
                self,
                Kind::Json | Kind::Jsonb | Kind::Text | Kind::Bytea | Kind::Other
            ),
            Role::Headers => matches!(self, Kind::Json | Kind::Jsonb | Kind::Text),
            Role::Timestamp => matches!(self, Kind::Timestamptz | Kind::Timestamp | Kind::Int(64)),
        };
        if ok {
            return Ok(());
        }
        Err(match role {
            Role::Id | Role::Key | Role::Route | Role::Type => "text, varchar, uuid or an integer",
            Role::Payload => "jsonb, json, text, varchar or bytea",
            Role::Headers => "jsonb, json, or text holding a JSON object",
            Role::Timestamp => {
                "timestamptz, timestamp (read as UTC) or bigint (milliseconds since the Unix epoch)"
            }
        })
    }
}

/// One column of the outbox table, as the catalog describes it
/// ([`crate::postgres::admin::table_columns`]), with its kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableColumn {
    pub name: String,
    /// The declared type's oid (a domain's own, not its base type's).
    pub type_oid: u32,
    pub kind: Kind,
    /// `format_type`'s name, for messages.
    pub type_name: String,
    pub not_null: bool,
    /// The default expression, if any.
    pub default: Option<String>,
}

impl From<CatalogColumn> for TableColumn {
    fn from(c: CatalogColumn) -> Self {
        TableColumn {
            kind: Kind::of_catalog(c.base_type_oid, c.typtype, &c.type_name),
            type_oid: c.type_oid,
            name: c.name,
            type_name: c.type_name,
            not_null: c.not_null,
            default: c.default,
        }
    }
}

/// The outbox table's columns, read from the catalog.
pub async fn read_table(
    client: &impl tokio_postgres::GenericClient,
    table: &crate::config::ident::TableName,
) -> Result<Vec<TableColumn>, crate::postgres::error::AdminError> {
    let columns = crate::postgres::admin::table_columns(client, table).await?;
    if columns.is_empty() {
        return Err(crate::postgres::error::AdminError::NoTable {
            table: table.to_string(),
        });
    }
    Ok(columns.into_iter().map(TableColumn::from).collect())
}

/// The mapping does not fit the table: nothing can be read until the
/// setting or the table changes.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum MappingError {
    #[error("outbox table {table} has no column {column:?} ({setting}){hint}")]
    MissingColumn {
        table: String,
        column: String,
        setting: String,
        /// What to do: the column of another case, or the setting to change.
        hint: String,
    },
    #[error("outbox table {table}'s column {column:?} ({setting}) is {found}; it must be {wants}")]
    ColumnType {
        table: String,
        column: String,
        setting: String,
        found: String,
        wants: &'static str,
    },
}

/// A row could not be read as an outbox event.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum RowError {
    #[error(transparent)]
    Mapping(Box<MappingError>),
    #[error("outbox row has {got} columns but its relation announced {want}")]
    ColumnCount { got: usize, want: usize },
    #[error("outbox column {column:?} is NULL or not sent as text")]
    NotText { column: String },
    #[error("outbox column {column:?} has an invalid value {value:?}: {reason}")]
    Invalid {
        column: String,
        value: String,
        reason: String,
    },
    #[error(
        "outbox message is no outbox event: {reason} (see migrations/0007_outbox_emit.sql for the format)"
    )]
    Message { reason: String },
}

/// An inserted row that cannot be read as an event (a NULL where a value
/// must be, an empty id, text that is not UTF-8), with what can be read of
/// it, so that it can be dead-lettered or named in a stop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreadableRow {
    /// The id column's text, or empty when it is unreadable too.
    pub id: String,
    /// The key column's text, or empty.
    pub aggregate_id: String,
    pub error: RowError,
    /// Every column as a JSON object: its text, or null for NULL and
    /// non-text values.
    pub columns_json: String,
}

/// Where a role's column sits (a tuple position, or a select-list index),
/// its kind, and whether it may be NULL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    pos: usize,
    kind: Kind,
    optional: bool,
}

/// A column's kind and whether it may be NULL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fact {
    pub kind: Kind,
    pub optional: bool,
}

/// What the catalog says of the columns a record's schema describes
/// (see [`OutboxColumns::facts`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnFacts {
    pub key: Fact,
    pub payload: Fact,
    /// The additional columns, in [`ColumnMap::extra`] order.
    pub extra: Vec<Fact>,
    /// The table has a route column and a type column: their headers are
    /// written (even when a value is empty).
    pub has_route: bool,
    pub has_type: bool,
}

impl Default for ColumnFacts {
    /// Today's table: a text key and a jsonb payload, both NOT NULL.
    fn default() -> Self {
        ColumnFacts {
            key: Fact {
                kind: Kind::Text,
                optional: false,
            },
            payload: Fact {
                kind: Kind::Jsonb,
                optional: false,
            },
            extra: Vec::new(),
            has_route: true,
            has_type: true,
        }
    }
}

/// A value of a tuple or of a result row.
enum Cell<'a> {
    Null,
    Text(&'a str),
    /// Present but unreadable as text: why.
    Bad(&'static str),
}

/// Where values come from: a pgoutput tuple or a statement's row.
trait Cells {
    fn cell(&self, pos: usize) -> Cell<'_>;
}

impl Cells for Tuple {
    fn cell(&self, pos: usize) -> Cell<'_> {
        match self.get(pos) {
            None | Some(TupleValue::Null) => Cell::Null,
            Some(v @ TupleValue::Text(_)) => v.as_text().map_or(Cell::Bad("not UTF-8"), Cell::Text),
            Some(TupleValue::UnchangedToast) => Cell::Bad("not sent (an unchanged TOAST value)"),
            Some(TupleValue::Binary(_)) => Cell::Bad("sent in binary"),
        }
    }
}

impl Cells for tokio_postgres::Row {
    fn cell(&self, pos: usize) -> Cell<'_> {
        match self.try_get::<_, Option<&str>>(pos) {
            Ok(Some(t)) => Cell::Text(t),
            Ok(None) => Cell::Null,
            Err(_) => Cell::Bad("not text"),
        }
    }
}

/// The columns of the outbox table that outboxd reads, resolved: where
/// each sits and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxColumns {
    /// Every column's name, in tuple order (the stream) or select order.
    names: Vec<String>,
    width: usize,
    id: Slot,
    key: Slot,
    route: Option<Slot>,
    event_type: Option<Slot>,
    payload: Slot,
    headers: Option<Slot>,
    timestamp: Option<Slot>,
    /// `None`: the additional column is missing (and may be).
    extra: Vec<Option<Slot>>,
    /// The column names of the roles, for errors and dead letters.
    role_names: [Option<String>; 7],
    /// What rows read through these columns carry of them.
    facts: Arc<ColumnFacts>,
}

impl OutboxColumns {
    /// Finds the mapped columns among `table`'s `columns` (in tuple order)
    /// and checks their kinds.
    /// `columns` are the table's, in tuple order.
    pub fn resolve(table: &str, columns: &[TableColumn], map: &ColumnMap) -> Result<Self, MappingError> {
        let find = |name: &str| columns.iter().position(|c| c.name == name);
        let missing = |name: &ColumnName, setting: String| {
            let other_case = columns
                .iter()
                .find(|c| c.name.eq_ignore_ascii_case(name.as_str()))
                .map(|c| c.name.clone());
            MappingError::MissingColumn {
                table: table.to_owned(),
                column: name.to_string(),
                hint: match other_case {
                    Some(n) => format!(": it has {n:?}; names are matched exactly, so set {setting} = {n:?}"),
                    None => format!(": name the column that holds it with {setting}"),
                },
                setting,
            }
        };
        let role = |r: Role| -> Result<Option<Slot>, MappingError> {
            let rc = map.role(r);
            let Some(first) = &rc.name else { return Ok(None) };
            // The first of its names the table has (a rename rolled out
            // with both names reads whichever the rows have).
            let found = std::iter::once(first)
                .chain(&rc.aliases)
                .find_map(|n| find(n.as_str()).map(|pos| (n, pos)));
            let Some((name, pos)) = found else {
                if rc.explicit || rc.needed {
                    return Err(missing(first, r.setting().to_owned()));
                }
                return Ok(None);
            };
            let kind = columns[pos].kind;
            kind.fits(r).map_err(|wants| MappingError::ColumnType {
                table: table.to_owned(),
                column: name.to_string(),
                setting: r.setting().to_owned(),
                found: columns[pos].type_name.clone(),
                wants,
            })?;
            Ok(Some(Slot {
                pos,
                kind,
                optional: !columns[pos].not_null,
            }))
        };
        let required = |r: Role| -> Result<Slot, MappingError> {
            role(r)?.ok_or_else(|| {
                let name = ColumnName::new(r.default_column()).unwrap_or_else(|_| unreachable!());
                missing(&name, r.setting().to_owned())
            })
        };
        let mut extra = Vec::with_capacity(map.extra.len());
        for (i, name) in map.extra.iter().enumerate() {
            let placed = map.placements.iter().find(|p| p.extra == i);
            let setting = match placed {
                Some(_) => "columns.additional".to_owned(),
                None => "routing.topic".to_owned(),
            };
            let Some(pos) = find(name.as_str()) else {
                let in_template = map.placements.iter().all(|p| p.extra != i);
                if map.may_miss(i, in_template) {
                    extra.push(None);
                    continue;
                }
                return Err(missing(name, setting));
            };
            let kind = columns[pos].kind;
            let bad = |wants| MappingError::ColumnType {
                table: table.to_owned(),
                column: name.to_string(),
                setting: setting.clone(),
                found: columns[pos].type_name.clone(),
                wants,
            };
            if kind == Kind::Bytea {
                return Err(bad(
                    "any type but bytea (cast it in a view, or keep it in the payload)",
                ));
            }
            if map.partition().is_some_and(|p| p.extra == i) && !matches!(kind, Kind::Int(_)) {
                return Err(bad("an integer: it picks the partition"));
            }
            extra.push(Some(Slot {
                pos,
                kind,
                optional: !columns[pos].not_null,
            }));
        }
        // The names found (of a role's several, the one the table has).
        let mut role_names: [Option<String>; 7] = Default::default();
        for r in Role::ALL {
            let rc = map.role(r);
            role_names[r as usize] = rc
                .name
                .iter()
                .chain(&rc.aliases)
                .find(|n| find(n.as_str()).is_some())
                .or(rc.name.as_ref())
                .map(|c| c.to_string());
        }
        let mut resolved = OutboxColumns {
            names: columns.iter().map(|c| c.name.clone()).collect(),
            width: columns.len(),
            id: required(Role::Id)?,
            key: required(Role::Key)?,
            route: role(Role::Route)?,
            event_type: role(Role::Type)?,
            payload: required(Role::Payload)?,
            headers: role(Role::Headers)?,
            timestamp: role(Role::Timestamp)?,
            extra,
            role_names,
            facts: Arc::default(),
        };
        resolved.facts = Arc::new(resolved.facts());
        Ok(resolved)
    }

    /// Resolves against a `Relation` message: each column's kind is its
    /// built-in type's, else what the catalog said of it at start
    /// (`catalog`: domains, enums), else read as text; whether it may be
    /// NULL is the catalog's (a `Relation` does not say).
    pub fn from_relation(
        rel: &Relation,
        map: &ColumnMap,
        catalog: &[TableColumn],
    ) -> Result<Self, MappingError> {
        let columns: Vec<TableColumn> = rel
            .columns
            .iter()
            .map(|c| {
                // The catalog read at start describes a column only while
                // its type is still the one the relation names: a column
                // whose type changed since is read as text (no JSON is
                // ever built from text without checking it).
                let known = catalog
                    .iter()
                    .find(|t| t.name == c.name)
                    .filter(|t| t.type_oid == c.type_oid);
                TableColumn {
                    name: c.name.clone(),
                    type_oid: c.type_oid,
                    kind: Kind::of_oid(c.type_oid)
                        .or_else(|| known.map(|t| t.kind))
                        .unwrap_or(Kind::Other),
                    type_name: known
                        .map_or_else(|| format!("type oid {}", c.type_oid), |t| t.type_name.clone()),
                    not_null: known.is_some_and(|t| t.not_null),
                    default: None,
                }
            })
            .collect();
        Self::resolve(&format!("{}.{}", rel.namespace, rel.name), &columns, map)
    }

    /// Resolves against the catalog's columns (statements read the table).
    pub fn from_catalog(table: &str, catalog: &[TableColumn], map: &ColumnMap) -> Result<Self, MappingError> {
        Self::resolve(table, catalog, map)
    }

    /// The kinds and nullability of the key, the payload and the
    /// additional columns, for the formats that write a schema of each
    /// value (Kafka Connect's JSON).
    pub fn facts(&self) -> ColumnFacts {
        let fact = |s: Slot| Fact {
            kind: s.kind,
            optional: s.optional,
        };
        ColumnFacts {
            key: fact(self.key),
            payload: fact(self.payload),
            extra: self
                .extra
                .iter()
                .map(|e| {
                    e.map_or(
                        Fact {
                            kind: Kind::Text,
                            optional: true,
                        },
                        fact,
                    )
                })
                .collect(),
            has_route: self.route.is_some(),
            has_type: self.event_type.is_some(),
        }
    }

    /// The column name of a role, when the table has one.
    pub fn role_column(&self, r: Role) -> Option<&str> {
        let present = match r {
            Role::Id | Role::Key | Role::Payload => true,
            Role::Route => self.route.is_some(),
            Role::Type => self.event_type.is_some(),
            Role::Headers => self.headers.is_some(),
            Role::Timestamp => self.timestamp.is_some(),
        };
        present.then(|| self.role_names[r as usize].as_deref()).flatten()
    }

    /// The kind of the timestamp column, when the table has one.
    pub fn timestamp_kind(&self) -> Option<Kind> {
        self.timestamp.map(|s| s.kind)
    }

    /// The kind of the id column.
    pub fn id_kind(&self) -> Kind {
        self.id.kind
    }

    /// Every column this reads, each once, in slot order: the roles
    /// (id, key, route, type, payload, headers, timestamp), then the
    /// additional ones.
    fn slots(&self) -> Vec<Slot> {
        let mut out = vec![self.id, self.key];
        out.extend(self.route);
        out.extend(self.event_type);
        out.push(self.payload);
        out.extend(self.headers);
        out.extend(self.timestamp);
        out.extend(self.extra.iter().flatten().copied());
        out
    }

    /// The select list that reads a row over the table alias `o`, each
    /// value as text (run with `DateStyle = ISO`, `TimeZone = UTC`), and
    /// the columns to read its result rows with. A query's own columns
    /// start at [`OutboxColumns::width`] of the returned columns.
    pub fn select(&self) -> (String, OutboxColumns) {
        let slots = self.slots();
        let mut list = Vec::with_capacity(slots.len());
        let mut names = Vec::with_capacity(slots.len());
        for s in &slots {
            let name = &self.names[s.pos];
            let quoted = format!("\"{}\"", name.replace('"', "\"\""));
            list.push(format!("(o.{quoted})::text"));
            names.push(name.clone());
        }
        let at = |s: Slot| Slot {
            pos: slots.iter().position(|x| x.pos == s.pos).unwrap_or(0),
            ..s
        };
        let mut out = self.clone();
        out.names = names;
        out.width = slots.len();
        out.id = at(self.id);
        out.key = at(self.key);
        out.route = self.route.map(at);
        out.event_type = self.event_type.map(at);
        out.payload = at(self.payload);
        out.headers = self.headers.map(at);
        out.timestamp = self.timestamp.map(at);
        out.extra = self.extra.iter().map(|e| e.map(at)).collect();
        (list.join(", "), out)
    }

    /// How many values a row of [`OutboxColumns::select`] holds.
    pub fn width(&self) -> usize {
        self.width
    }

    /// What can be read of a tuple that [`OutboxColumns::row`] refused.
    pub fn unreadable(&self, tuple: &Tuple, error: RowError) -> UnreadableRow {
        let text = |s: Slot| match tuple.cell(s.pos) {
            Cell::Text(t) => t.to_owned(),
            _ => String::new(),
        };
        let columns: serde_json::Map<String, serde_json::Value> = self
            .names
            .iter()
            .zip(tuple.iter())
            .map(|(name, v)| {
                let value = v
                    .as_text()
                    .map_or(serde_json::Value::Null, |t| t.to_owned().into());
                (name.clone(), value)
            })
            .collect();
        UnreadableRow {
            id: text(self.id),
            aggregate_id: text(self.key),
            error,
            columns_json: serde_json::Value::Object(columns).to_string(),
        }
    }

    /// Reads an inserted tuple; `commit_time` stands in for a missing or
    /// NULL timestamp.
    pub fn row(&self, tuple: &Tuple, commit_time: DateTime<Utc>) -> Result<OutboxRow, RowError> {
        if tuple.len() != self.width {
            return Err(RowError::ColumnCount {
                got: tuple.len(),
                want: self.width,
            });
        }
        let mut row = self.read(tuple)?;
        if row.created_at == CreatedAt::Absent {
            row.created_at = CreatedAt::At(commit_time);
        }
        Ok(row)
    }

    /// Reads a result row of a statement that starts with
    /// [`OutboxColumns::select`]'s list (polling mode, `outboxd replay`).
    /// A missing or NULL timestamp is [`CreatedAt::Absent`].
    pub fn from_result(&self, r: &tokio_postgres::Row) -> Result<OutboxRow, RowError> {
        self.read(r)
    }

    fn name(&self, s: Slot) -> String {
        self.names.get(s.pos).cloned().unwrap_or_default()
    }

    fn read(&self, cells: &impl Cells) -> Result<OutboxRow, RowError> {
        // The text of a column that may be NULL (each cell is read, and
        // its UTF-8 checked, once).
        let nullable = |s: Slot| -> Result<Option<&str>, RowError> {
            match cells.cell(s.pos) {
                Cell::Text(t) => Ok(Some(t)),
                Cell::Null => Ok(None),
                Cell::Bad(reason) => Err(RowError::Invalid {
                    column: self.name(s),
                    value: String::new(),
                    reason: reason.into(),
                }),
            }
        };
        // The text of a column that must have a value.
        let text = |s: Slot| -> Result<&str, RowError> {
            nullable(s)?.ok_or_else(|| RowError::NotText { column: self.name(s) })
        };
        let id = text(self.id)?;
        if id.is_empty() {
            return Err(RowError::Invalid {
                column: self.name(self.id),
                value: String::new(),
                reason: "an event id must not be empty: consumers deduplicate by it".into(),
            });
        }
        let headers = match self.headers {
            Some(s) => nullable(s)?.unwrap_or("{}").to_owned(),
            None => "{}".to_owned(),
        };
        let created_at = match self.timestamp {
            Some(s) => match nullable(s)? {
                Some(t) => CreatedAt::read(t, s.kind),
                None => CreatedAt::Absent,
            },
            None => CreatedAt::Absent,
        };
        let payload = match nullable(self.payload)? {
            None => Payload::Null,
            Some(t) => Payload::from_text(t, self.payload.kind).map_err(|reason| RowError::Invalid {
                column: self.name(self.payload),
                value: t.chars().take(64).collect(),
                reason,
            })?,
        };
        let mut extra = Vec::with_capacity(self.extra.len());
        for e in &self.extra {
            extra.push(match e {
                None => Extra::Missing,
                Some(s) => match nullable(*s)? {
                    None => Extra::Null,
                    Some(t) => match s.kind {
                        Kind::Int(_) | Kind::Decimal => Extra::Number(t.to_owned()),
                        Kind::Bool => Extra::Bool(t == "t" || t == "true"),
                        Kind::Json | Kind::Jsonb => Extra::Json(t.to_owned()),
                        _ => Extra::Text(t.to_owned()),
                    },
                },
            });
        }
        Ok(OutboxRow {
            id: id.to_owned(),
            aggregate_type: self.route.map(text).transpose()?.unwrap_or_default().to_owned(),
            aggregate_id: nullable(self.key)?.unwrap_or_default().to_owned(),
            // The type is optional: a NULL one is empty (no CloudEvent is
            // made of it: a bad row there).
            event_type: match self.event_type {
                Some(s) => nullable(s)?.unwrap_or_default().to_owned(),
                None => String::new(),
            },
            payload,
            headers,
            created_at,
            extra,
            facts: Some(self.facts.clone()),
        })
    }
}

/// `bytea`'s text output back to its bytes: the hex format (`\x0a1b`,
/// PostgreSQL's default) or the escape format (`bytea_output = escape`:
/// `\\` for a backslash, `\ooo` for a byte in octal, other bytes as
/// themselves).
pub fn decode_bytea(text: &str) -> Result<Vec<u8>, String> {
    let b = text.as_bytes();
    if let Some(hex) = text.strip_prefix("\\x") {
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        };
        let h = hex.as_bytes();
        if h.len() % 2 != 0 {
            return Err("odd number of hex digits".into());
        }
        return h
            .chunks_exact(2)
            .map(|p| match (digit(p[0]), digit(p[1])) {
                (Some(hi), Some(lo)) => Ok(hi << 4 | lo),
                _ => Err(format!("{:?} is no hex byte", String::from_utf8_lossy(p))),
            })
            .collect();
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' {
            out.push(b[i]);
            i += 1;
        } else if b.get(i + 1) == Some(&b'\\') {
            out.push(b'\\');
            i += 2;
        } else {
            let oct = b
                .get(i + 1..i + 4)
                .filter(|o| o[0] <= b'3' && o.iter().all(|c| (b'0'..=b'7').contains(c)))
                .ok_or_else(|| format!("a backslash at byte {i} starts no escape"))?;
            out.push((oct[0] - b'0') << 6 | (oct[1] - b'0') << 3 | (oct[2] - b'0'));
            i += 4;
        }
    }
    Ok(out)
}

/// When the event happened, as the timestamp column held it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CreatedAt {
    /// A point in time.
    At(DateTime<Utc>),
    /// A value PostgreSQL accepts but that is no point outboxd can write
    /// (`infinity`, `-infinity`, a date BC, milliseconds beyond chrono's
    /// range), kept as PostgreSQL's text.
    Unrepresentable(String),
    /// No timestamp column, or a NULL one, read by a statement: the
    /// record takes its commit time (or the time of publishing, where
    /// that is not known).
    Absent,
}

impl CreatedAt {
    /// Reads a `timestamptz`'s text; what is no point in time is kept as
    /// text.
    pub fn parse(s: &str) -> CreatedAt {
        parse_timestamptz(s).map_or_else(|_| CreatedAt::Unrepresentable(s.to_owned()), CreatedAt::At)
    }

    /// Reads a timestamp column's text by its kind: `timestamp` without a
    /// zone is UTC, an integer is milliseconds since the Unix epoch.
    pub fn read(s: &str, kind: Kind) -> CreatedAt {
        match kind {
            Kind::Timestamp => match parse_timestamptz(&format!("{s}+00")) {
                Ok(t) => CreatedAt::At(t),
                Err(_) => CreatedAt::Unrepresentable(s.to_owned()),
            },
            Kind::Int(_) => s
                .parse::<i64>()
                .ok()
                .and_then(DateTime::from_timestamp_millis)
                .map_or_else(|| CreatedAt::Unrepresentable(s.to_owned()), CreatedAt::At),
            _ => CreatedAt::parse(s),
        }
    }

    /// The time, when RFC 3339 can write it (years 0001 to 9999).
    pub fn rfc3339(&self) -> Option<&DateTime<Utc>> {
        use chrono::Datelike;
        match self {
            CreatedAt::At(t) if (1..=9999).contains(&t.year()) => Some(t),
            _ => None,
        }
    }

    /// [`CreatedAt::Absent`] as the commit time `commit_ms`; the others as
    /// they are.
    pub fn or_commit(&self, commit_ms: i64) -> Cow<'_, CreatedAt> {
        match self {
            CreatedAt::Absent => Cow::Owned(DateTime::from_timestamp_millis(commit_ms).map_or_else(
                || CreatedAt::Unrepresentable(commit_ms.to_string()),
                CreatedAt::At,
            )),
            other => Cow::Borrowed(other),
        }
    }
}

impl std::fmt::Display for CreatedAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CreatedAt::At(t) => write!(f, "{}", t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
            CreatedAt::Unrepresentable(s) => f.write_str(s),
            CreatedAt::Absent => Ok(()),
        }
    }
}

/// Parses a `timestamptz` in ISO DateStyle, e.g. `2026-11-30 11:50:36.123456+00`.
/// The fixed layout PostgreSQL prints is read byte by byte (this runs once
/// per event); anything else goes through chrono.
pub fn parse_timestamptz(s: &str) -> Result<DateTime<Utc>, RowError> {
    // The rows of one transaction mostly share their time (`DEFAULT
    // now()`): the text read last, and what it gave, are kept per thread.
    thread_local! {
        static LAST: std::cell::Cell<Option<LastTimestamp>> = const { std::cell::Cell::new(None) };
    }
    let b = s.as_bytes();
    if let Some(last) = LAST.get().filter(|l| l.text.get(..usize::from(l.len)) == Some(b)) {
        return Ok(last.at);
    }
    let at = fast_timestamptz(b).map_or_else(|| slow_timestamptz(s), Ok)?;
    if b.len() <= LAST_TIMESTAMP_TEXT {
        let mut text = [0u8; LAST_TIMESTAMP_TEXT];
        text[..b.len()].copy_from_slice(b);
        LAST.set(Some(LastTimestamp {
            text,
            len: b.len() as u8,
            at,
        }));
    }
    Ok(at)
}

/// The longest `timestamptz` text [`parse_timestamptz`] remembers
/// (PostgreSQL's longest in ISO style is 35 bytes).
const LAST_TIMESTAMP_TEXT: usize = 40;

/// A `timestamptz` text and the time it reads as.
#[derive(Clone, Copy)]
struct LastTimestamp {
    text: [u8; LAST_TIMESTAMP_TEXT],
    len: u8,
    at: DateTime<Utc>,
}

fn fast_timestamptz(b: &[u8]) -> Option<DateTime<Utc>> {
    let num = |r: std::ops::Range<usize>| -> Option<u32> {
        let mut v = 0u32;
        for &c in b.get(r)? {
            if !c.is_ascii_digit() {
                return None;
            }
            v = v * 10 + u32::from(c - b'0');
        }
        Some(v)
    };
    if b.len() < 22 || b[4] != b'-' || b[7] != b'-' || b[10] != b' ' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let date = chrono::NaiveDate::from_ymd_opt(num(0..4)? as i32, num(5..7)?, num(8..10)?)?;
    let (h, m, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut i = 19;
    let mut micros = 0u32;
    if b.get(i) == Some(&b'.') {
        let start = i + 1;
        i = start;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let digits = i - start;
        if digits == 0 || digits > 6 {
            return None;
        }
        micros = num(start..i)? * 10u32.pow(6 - digits as u32);
    }
    let sign: i64 = match b.get(i)? {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let off_h = i64::from(num(i + 1..i + 3)?);
    let off_m = match b.len() - (i + 3) {
        0 => 0,
        3 if b[i + 3] == b':' => i64::from(num(i + 4..i + 6)?),
        _ => return None,
    };
    let naive = date.and_hms_micro_opt(h, m, sec, micros)?;
    let local = DateTime::<Utc>::from_naive_utc_and_offset(naive, Utc);
    Some(local - chrono::Duration::seconds(sign * (off_h * 3600 + off_m * 60)))
}

fn slow_timestamptz(s: &str) -> Result<DateTime<Utc>, RowError> {
    let invalid = |reason: String| RowError::Invalid {
        column: column::CREATED_AT.into(),
        value: s.to_owned(),
        reason,
    };
    // The offset is the trailing [+-]HH[:MM[:SS]]; find its sign after the time.
    let split = s
        .rfind(['+', '-'])
        .filter(|&i| i > 10)
        .ok_or_else(|| invalid("no UTC offset".into()))?;
    let (local, offset) = s.split_at(split);
    let naive =
        NaiveDateTime::parse_from_str(local, "%Y-%m-%d %H:%M:%S%.f").map_err(|e| invalid(e.to_string()))?;
    let sign: i64 = if offset.starts_with('-') { -1 } else { 1 };
    let mut parts = offset[1..].split(':');
    let mut secs = 0i64;
    for unit in [3600i64, 60, 1] {
        if let Some(p) = parts.next() {
            let v: i64 = p.parse().map_err(|_| invalid("bad UTC offset".into()))?;
            secs += v * unit;
        }
    }
    Ok(DateTime::<Utc>::from_naive_utc_and_offset(naive, Utc) - chrono::Duration::seconds(sign * secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::pgoutput::RelationColumn;
    use proptest::prelude::*;

    #[test]
    fn bytea_text_reads_back_in_both_output_formats() {
        assert_eq!(decode_bytea("\\x00010aFf").unwrap(), vec![0, 1, 10, 255]);
        assert_eq!(decode_bytea("\\x").unwrap(), Vec::<u8>::new());
        assert_eq!(decode_bytea("").unwrap(), Vec::<u8>::new());
        // bytea_output = escape: printable bytes as themselves, a backslash
        // doubled, the rest in octal.
        assert_eq!(
            decode_bytea("a\\\\b\\000\\377").unwrap(),
            b"a\\b\x00\xff".to_vec()
        );
        for bad in ["\\x0", "\\x0g", "\\x\u{e9}0", "\\", "a\\12", "\\400", "\\9aa"] {
            assert!(decode_bytea(bad).is_err(), "{bad:?} was read");
        }
        assert_eq!(
            Payload::from_text("\\x0102", Kind::Bytea).unwrap(),
            Payload::Bytes(vec![1, 2])
        );
        assert_eq!(
            Payload::from_text("\\x0102", Kind::Jsonb).unwrap(),
            Payload::Json("\\x0102".into())
        );
        assert_eq!(
            Payload::from_text("\\x0102", Kind::Text).unwrap(),
            Payload::Text("\\x0102".into())
        );
    }

    proptest! {
        /// Every byte string reads back from both of PostgreSQL's output
        /// formats.
        #[test]
        fn bytea_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            prop_assert_eq!(decode_bytea(&format!("\\x{hex}")).unwrap(), bytes.clone());
            let escaped: String = bytes
                .iter()
                .map(|&b| match b {
                    b'\\' => "\\\\".to_string(),
                    0x20..=0x7e => (b as char).to_string(),
                    _ => format!("\\{b:03o}"),
                })
                .collect();
            prop_assert_eq!(decode_bytea(&escaped).unwrap(), bytes);
        }
    }

    proptest! {
        /// The fast path agrees with chrono on everything PostgreSQL prints.
        #[test]
        fn fast_and_slow_paths_agree(secs in 0i64..4_102_444_800, micros in 0u32..1_000_000, digits in 0usize..7,
                                     off_q in -48i64..56) {
            let t = DateTime::from_timestamp(secs, micros).unwrap();
            let off = chrono::FixedOffset::east_opt((off_q * 900) as i32).unwrap();
            let local = t.with_timezone(&off);
            let frac = if digits == 0 { String::new() } else { format!(".{:06}", micros)[..=digits].to_owned() };
            let oh = off_q * 900 / 3600;
            let om = (off_q * 900).abs() % 3600 / 60;
            let sign = if off_q < 0 { '-' } else { '+' };
            let zone = if om == 0 { format!("{sign}{:02}", oh.abs()) } else { format!("{sign}{:02}:{om:02}", oh.abs()) };
            let text = format!("{}{frac}{zone}", local.format("%Y-%m-%d %H:%M:%S"));
            prop_assert_eq!(fast_timestamptz(text.as_bytes()), slow_timestamptz(&text).ok(), "{}", text);
            prop_assert!(fast_timestamptz(text.as_bytes()).is_some(), "{}", text);
        }
    }
    use bytes::Bytes;

    fn relation(names: &[&str]) -> Relation {
        Relation {
            xid: None,
            id: 1,
            namespace: "public".into(),
            name: "outbox".into(),
            replica_identity: b'd',
            columns: names
                .iter()
                .map(|n| RelationColumn {
                    flags: 0,
                    name: (*n).into(),
                    type_oid: 25,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    fn t(s: &str) -> TupleValue {
        TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    /// A relation of (name, type oid) columns.
    fn typed(columns: &[(&str, u32)]) -> Relation {
        let mut rel = relation(&[]);
        rel.columns = columns
            .iter()
            .map(|(n, oid)| RelationColumn {
                flags: 0,
                name: (*n).into(),
                type_oid: *oid,
                type_modifier: -1,
            })
            .collect();
        rel
    }

    fn map(text: &str) -> ColumnMap {
        let c: crate::config::columns::ColumnsConfig = toml::from_str(text).unwrap();
        ColumnMap::new(&c).unwrap()
    }

    fn commit() -> DateTime<Utc> {
        DateTime::from_timestamp(1_796_000_000, 0).unwrap()
    }

    const UUID: u32 = 2950;
    const TEXT: u32 = 25;
    const VARCHAR: u32 = 1043;
    const JSONB: u32 = 3802;
    const JSON: u32 = 114;
    const INT8: u32 = 20;
    const INT4: u32 = 23;
    const TS: u32 = 1114;
    const TSTZ: u32 = 1184;

    #[test]
    fn reads_a_row_in_any_column_order() {
        let rel = typed(&[
            ("payload", JSONB),
            ("extra", TEXT),
            ("id", UUID),
            ("type", TEXT),
            ("aggregate_id", TEXT),
            ("aggregate_type", TEXT),
            ("created_at", TSTZ),
            ("headers", JSONB),
        ]);
        let cols = OutboxColumns::from_relation(&rel, &ColumnMap::default(), &[]).unwrap();
        let row = cols
            .row(
                &vec![
                    t(r#"{"a": 1}"#),
                    TupleValue::Null,
                    t("0190a5a4-8c1e-7000-8000-000000000001"),
                    t("ordering.order-placed.v1"),
                    t("1001"),
                    t("Order"),
                    t("2026-11-30 11:50:36.123456+09"),
                    t(r#"{"correlationId": "c-1"}"#),
                ],
                commit(),
            )
            .unwrap();
        assert_eq!(row.aggregate_type, "Order");
        assert_eq!(row.event_type, "ordering.order-placed.v1");
        assert_eq!(row.payload.json(), Some(r#"{"a": 1}"#));
        assert_eq!(row.created_at.to_string(), "2026-11-30T02:50:36.123456Z");
    }

    #[test]
    fn missing_column_and_nulls_are_errors() {
        let err = OutboxColumns::from_relation(
            &typed(&[("id", UUID), ("type", TEXT)]),
            &ColumnMap::default(),
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("aggregate_id"), "{err}");
        assert!(err.to_string().contains("columns.key"), "{err}");
        let cols = OutboxColumns::from_relation(
            &typed(&[
                ("id", TEXT),
                ("aggregate_type", TEXT),
                ("aggregate_id", TEXT),
                ("type", TEXT),
                ("payload", JSONB),
            ]),
            &ColumnMap::default(),
            &[],
        )
        .unwrap();
        let err = cols
            .row(&vec![t(""), t("A"), t("1"), t("t"), t("{}")], commit())
            .unwrap_err();
        assert!(
            matches!(err, RowError::Invalid { ref column, .. } if column == "id"),
            "{err}"
        );
        let err = cols
            .row(
                &vec![t("e-1"), TupleValue::Null, t("1"), t("t"), t("{}")],
                commit(),
            )
            .unwrap_err();
        assert_eq!(
            err,
            RowError::NotText {
                column: "aggregate_type".into()
            }
        );
        // A NULL key is read as empty (a bad record: empty_key), a NULL
        // payload as NULL, no timestamp column as the commit time.
        let row = cols
            .row(
                &vec![t("e-1"), t("A"), TupleValue::Null, t("t"), TupleValue::Null],
                commit(),
            )
            .unwrap();
        assert_eq!((row.aggregate_id.as_str(), &row.payload), ("", &Payload::Null));
        assert_eq!(row.created_at, CreatedAt::At(commit()));
        assert!(matches!(
            cols.row(&vec![t("x")], commit()),
            Err(RowError::ColumnCount { .. })
        ));
    }

    #[test]
    fn debeziums_table_through_a_column_map() {
        let rel = typed(&[
            ("id", UUID),
            ("aggregatetype", VARCHAR),
            ("aggregateid", VARCHAR),
            ("type", VARCHAR),
            ("payload", JSONB),
        ]);
        // outboxd's defaults do not fit it, and say which setting to set.
        let err = OutboxColumns::from_relation(&rel, &ColumnMap::default(), &[]).unwrap_err();
        assert!(err.to_string().contains("columns.key"), "{err}");
        let m = map(r#"key = "aggregateid"
                       route = "aggregatetype""#);
        let cols = OutboxColumns::from_relation(&rel, &m, &[]).unwrap();
        assert_eq!(cols.role_column(Role::Headers), None, "no headers column: none");
        assert_eq!(cols.role_column(Role::Timestamp), None);
        let row = cols
            .row(
                &vec![
                    t("0190a5a4-8c1e-7000-8000-000000000001"),
                    t("Order"),
                    t("1001"),
                    t("OrderPlaced"),
                    t(r#"{"a": 1}"#),
                ],
                commit(),
            )
            .unwrap();
        assert_eq!(
            (row.aggregate_type.as_str(), row.aggregate_id.as_str()),
            ("Order", "1001")
        );
        assert_eq!(row.headers, "{}");
        assert_eq!(row.created_at, CreatedAt::At(commit()), "the commit time");
        let facts = cols.facts();
        assert_eq!(
            facts.key,
            Fact {
                kind: Kind::Text,
                optional: true
            },
            "nullability unknown: optional"
        );
    }

    #[test]
    fn column_names_are_matched_exactly_with_a_hint() {
        let rel = typed(&[
            ("id", UUID),
            ("aggregateType", VARCHAR),
            ("aggregateId", VARCHAR),
            ("payload", JSONB),
        ]);
        let err = OutboxColumns::from_relation(&rel, &map(r#"key = "aggregateid""#), &[]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("it has \"aggregateId\"") && text.contains("columns.key"),
            "{text}"
        );
        let m = map(r#"key = "aggregateId"
                       route = "aggregateType"
                       type = false"#);
        assert!(OutboxColumns::from_relation(&rel, &m, &[]).is_ok());
        // A named optional role must exist; a default one may be missing.
        let err = OutboxColumns::from_relation(
            &rel,
            &map(r#"key = "aggregateId"
                                                             route = "aggregateType"
                                                             headers = "meta""#),
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("columns.headers"), "{err}");
    }

    #[test]
    fn column_types_are_checked_by_role() {
        let rel = |payload: u32, ts: u32, key: u32| {
            typed(&[
                ("id", UUID),
                ("aggregate_type", TEXT),
                ("aggregate_id", key),
                ("payload", payload),
                ("created_at", ts),
            ])
        };
        let ok = |r: &Relation| OutboxColumns::from_relation(r, &ColumnMap::default(), &[]);
        for (payload, ts, key) in [
            (JSONB, TSTZ, TEXT),
            (JSON, TS, UUID),
            (TEXT, INT8, INT8),
            (VARCHAR, TSTZ, INT4),
            (BYTEA_OID, TSTZ, TEXT),
        ] {
            assert!(ok(&rel(payload, ts, key)).is_ok(), "{payload} {ts} {key}");
        }
        for (payload, ts, key, setting) in [
            (INT8, TSTZ, TEXT, "columns.payload"),
            (JSONB, INT4, TEXT, "columns.timestamp"),
            (JSONB, TEXT, TEXT, "columns.timestamp"),
            (JSONB, TSTZ, JSONB, "columns.key"),
        ] {
            let err = ok(&rel(payload, ts, key)).unwrap_err();
            assert!(err.to_string().contains(setting), "{err}");
        }
        // A domain over jsonb: the catalog tells what the relation does not.
        let domain = rel(70_000, TSTZ, TEXT);
        let catalog = vec![TableColumn {
            name: "payload".into(),
            type_oid: 70_000,
            kind: Kind::Jsonb,
            type_name: "payload_json".into(),
            not_null: true,
            default: None,
        }];
        let cols = OutboxColumns::from_relation(&domain, &ColumnMap::default(), &catalog).unwrap();
        assert_eq!(
            cols.facts().payload,
            Fact {
                kind: Kind::Jsonb,
                optional: false
            }
        );
    }

    #[test]
    fn timestamps_of_every_kind() {
        assert_eq!(
            CreatedAt::read("2026-11-30 11:50:36.5", Kind::Timestamp).to_string(),
            "2026-11-30T11:50:36.500000Z",
            "a timestamp without a zone is UTC"
        );
        assert_eq!(
            CreatedAt::read("1796000000123", Kind::Int(64)).to_string(),
            "2026-11-30T00:53:20.123000Z"
        );
        for (text, kind) in [
            ("infinity", Kind::Timestamp),
            ("-infinity", Kind::Timestamptz),
            ("9223372036854775807", Kind::Int(64)),
            ("0044-03-15 00:00:00 BC", Kind::Timestamp),
        ] {
            assert_eq!(
                CreatedAt::read(text, kind),
                CreatedAt::Unrepresentable(text.into()),
                "{text}"
            );
        }
    }

    #[test]
    fn text_payloads_are_json_only_where_they_are() {
        let text = |s: &str| Payload::Text(s.into());
        let json = |p: &Payload, how| match p.json_value(how) {
            Ok(JsonPayload::Json(j)) => j.into_owned(),
            other => panic!("{other:?}"),
        };
        assert_eq!(json(&text(r#"{"a": 1}"#), TextPayload::Auto), r#"{"a": 1}"#);
        assert_eq!(json(&text("not json {"), TextPayload::Auto), r#""not json {""#);
        assert_eq!(json(&text("12"), TextPayload::String), r#""12""#);
        assert_eq!(json(&text(" 1e400 "), TextPayload::Json), " 1e400 ");
        assert!(text("not json {").json_value(TextPayload::Json).is_err());
        assert_eq!(json(&Payload::Null, TextPayload::Json), "null");
        for blank in [Payload::Null, text(""), text(" \t\n")] {
            assert!(blank.is_blank(), "{blank:?}");
        }
        assert!(!Payload::Json("\"\"".into()).is_blank());
        // Java's trim(): up to U+0020, not Unicode's white space.
        assert!(text("\u{1}\u{20}").is_blank());
        assert!(!text("\u{3000}").is_blank() && !text("\u{a0}").is_blank());
        assert!(!Payload::Bytes(Vec::new()).is_blank(), "bytes never are");
        // Whatever the text, what is embedded is valid JSON.
        for s in ["", "\"", "{", "[1,", "\u{0}", "a\"b", "NaN", "1e400", "{}"] {
            let j = json(&text(s), TextPayload::Auto);
            assert!(
                serde_json::from_str::<&serde_json::value::RawValue>(&j).is_ok(),
                "{s:?} → {j}"
            );
        }
    }

    #[test]
    fn additional_columns_keep_what_they_are() {
        let rel = typed(&[
            ("id", UUID),
            ("aggregate_type", TEXT),
            ("aggregate_id", TEXT),
            ("payload", TEXT),
            ("part", INT4),
            ("meta", JSONB),
            ("flag", 16),
        ]);
        let m = map(r#"additional = [
            { column = "part", placement = "partition" },
            { column = "meta", placement = "header" },
            { column = "flag", placement = "header" },
            { column = "gone", placement = "header" },
        ]
        additional_missing = "ignore""#);
        let cols = OutboxColumns::from_relation(&rel, &m, &[]).unwrap();
        let row = cols
            .row(
                &vec![t("e"), t("A"), t("k"), t("x"), t("3"), t(r#"{"a": 1}"#), t("t")],
                commit(),
            )
            .unwrap();
        assert_eq!(
            row.extra,
            [
                Extra::Number("3".into()),
                Extra::Json(r#"{"a": 1}"#.into()),
                Extra::Bool(true),
                Extra::Missing
            ]
        );
        // With `error`, the missing one is refused; a partition column must
        // be an integer.
        let strict = map(r#"additional = [{ column = "gone", placement = "header" }]"#);
        assert!(OutboxColumns::from_relation(&rel, &strict, &[])
            .unwrap_err()
            .to_string()
            .contains("columns.additional"));
        let bad = map(r#"additional = [{ column = "meta", placement = "partition" }]"#);
        assert!(OutboxColumns::from_relation(&rel, &bad, &[])
            .unwrap_err()
            .to_string()
            .contains("integer"));
    }

    #[test]
    fn timestamptz_offsets() {
        assert_eq!(
            parse_timestamptz("2026-01-02 03:04:05+00").unwrap().to_rfc3339(),
            "2026-01-02T03:04:05+00:00"
        );
        assert_eq!(
            parse_timestamptz("2026-01-02 03:04:05.5-05:30")
                .unwrap()
                .to_rfc3339(),
            "2026-01-02T08:34:05.500+00:00"
        );
        assert!(parse_timestamptz("infinity").is_err());
        // Seconds in the offset (historic zones) take the slow path.
        assert_eq!(
            parse_timestamptz("1900-01-01 00:00:00+00:19:32")
                .unwrap()
                .to_rfc3339(),
            "1899-12-31T23:40:28+00:00"
        );
        assert!(parse_timestamptz("2026-13-02 03:04:05+00").is_err());
        assert!(parse_timestamptz("2026-01-02 03:04:05").is_err());
    }

    #[test]
    fn the_timestamp_read_last_is_remembered_only_for_its_own_text() {
        let uncached = |s: &str| fast_timestamptz(s.as_bytes()).map_or_else(|| slow_timestamptz(s), Ok);
        let long = format!("2026-01-02 03:04:05.123456+00{}", ":00".repeat(4));
        let texts = [
            "2026-01-02 03:04:05.123456+00",
            "2026-01-02 03:04:05.123456+00",
            "2026-01-02 03:04:05.12345+00",
            "2026-01-02 03:04:05.123456+00",
            "2026-01-02 03:04:05.123456+01",
            "2026-01-02 03:04:05.123456",
            "2026-01-02 03:04:05.123456+00",
            "2026-01-02 03:04:05.123456+00:00:01",
            "2026-01-02 03:04:05.123456+00",
            &long,
            &long,
            "infinity",
            "infinity",
            "2026-01-02 03:04:05.123456+0",
            "2026-01-02 03:04:05.123456+00",
        ];
        for s in texts {
            assert_eq!(parse_timestamptz(s), uncached(s), "{s}");
        }
    }
}
