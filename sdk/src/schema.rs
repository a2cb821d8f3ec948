//! The outbox schema: table and column names, the shipped migrations, and
//! validated SQL identifiers. The daemon uses these too, so the table
//! layout has one source of truth.

use std::fmt;

/// The outbox table's default name (resolved through `search_path`).
pub const DEFAULT_OUTBOX_TABLE: &str = "public.outbox";

/// Column names of the outbox table (`migrations/0001_outbox.sql`).
pub mod column {
    pub const ID: &str = "id";
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    pub const AGGREGATE_ID: &str = "aggregate_id";
    pub const TYPE: &str = "type";
    pub const PAYLOAD: &str = "payload";
    pub const HEADERS: &str = "headers";
    pub const CREATED_AT: &str = "created_at";
    pub const PUBLISHED_AT: &str = "published_at";
}

/// One numbered, append-only SQL migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every migration, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_outbox.sql",
        sql: include_str!("../../migrations/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "0002_event_store.sql",
        sql: include_str!("../../migrations/0002_event_store.sql"),
    },
    Migration {
        version: 3,
        name: "0003_orders.sql",
        sql: include_str!("../../migrations/0003_orders.sql"),
    },
    Migration {
        version: 4,
        name: "0004_event_store_aggregate_type.sql",
        sql: include_str!("../../migrations/0004_event_store_aggregate_type.sql"),
    },
    Migration {
        version: 5,
        name: "0005_event_metadata.sql",
        sql: include_str!("../../migrations/0005_event_metadata.sql"),
    },
    Migration {
        version: 6,
        name: "0006_event_time_index.sql",
        sql: include_str!("../../migrations/0006_event_time_index.sql"),
    },
    Migration {
        version: 7,
        name: "0007_outbox_emit.sql",
        sql: include_str!("../../migrations/0007_outbox_emit.sql"),
    },
    Migration {
        version: 8,
        name: "0008_outbox_order_and_emit_grants.sql",
        sql: include_str!("../../migrations/0008_outbox_order_and_emit_grants.sql"),
    },
    Migration {
        version: 9,
        name: "0009_outboxd_parked.sql",
        sql: include_str!("../../migrations/0009_outboxd_parked.sql"),
    },
    Migration {
        version: 10,
        name: "0010_outboxd_parked_handback.sql",
        sql: include_str!("../../migrations/0010_outboxd_parked_handback.sql"),
    },
];

/// PostgreSQL truncates identifiers longer than this (NAMEDATALEN - 1).
const MAX_IDENT_BYTES: usize = 63;

/// A name was not acceptable as an SQL identifier.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid {kind} name {name:?}: {reason}")]
pub struct IdentError {
    kind: &'static str,
    name: String,
    reason: &'static str,
}

/// Checks `name` against the identifier grammar outbox names must follow:
/// ASCII letters (lowercase only when `lowercase_only`), digits and
/// underscores, starting with a letter or underscore, at most 63 bytes.
/// Nothing else is accepted, so a validated name can be quoted without
/// escaping and can never inject SQL.
pub fn validate_identifier(kind: &'static str, name: &str, lowercase_only: bool) -> Result<(), IdentError> {
    let err = |reason| IdentError {
        kind,
        name: name.to_owned(),
        reason,
    };
    let Some(&first) = name.as_bytes().first() else {
        return Err(err("it is empty"));
    };
    if name.len() > MAX_IDENT_BYTES {
        return Err(err("it is longer than 63 bytes"));
    }
    if !(first.is_ascii_alphabetic() || first == b'_') {
        return Err(err("it must start with a letter or an underscore"));
    }
    let ok = |b: u8| {
        b == b'_'
            || b.is_ascii_digit()
            || b.is_ascii_lowercase()
            || (!lowercase_only && b.is_ascii_uppercase())
    };
    if !name.bytes().all(ok) {
        return Err(err(if lowercase_only {
            "use only lowercase letters, digits and underscores"
        } else {
            "use only letters, digits and underscores"
        }));
    }
    Ok(())
}

/// A double-quoted identifier for SQL text. Only validated names reach it.
#[derive(Clone, Copy, Debug)]
pub struct Quoted<'a>(pub(crate) &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Validation excludes '"', so no escaping is needed; quoting keeps case.
        write!(f, "\"{}\"", self.0)
    }
}

impl<'a> Quoted<'a> {
    /// Quotes a name that passed [`validate_identifier`].
    pub fn validated(name: &'a str) -> Self {
        Quoted(name)
    }
}

/// A table name with its schema, `schema.table` (`public` when omitted).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    /// Parses and validates `schema.table` or `table`.
    pub fn new(qualified: &str) -> Result<Self, IdentError> {
        let (schema, name) = qualified.split_once('.').unwrap_or(("public", qualified));
        validate_identifier("schema", schema, false)?;
        validate_identifier("table", name, false).map_err(|mut e| {
            e.name = qualified.to_owned();
            e
        })?;
        Ok(TableName {
            schema: schema.to_owned(),
            name: name.to_owned(),
        })
    }

    /// The default outbox table.
    pub fn outbox() -> Self {
        TableName {
            schema: "public".into(),
            name: "outbox".into(),
        }
    }

    /// `"schema"."table"` for SQL text.
    pub fn quoted(&self) -> impl fmt::Display + '_ {
        QualifiedQuoted(self)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

struct QualifiedQuoted<'a>(&'a TableName);

impl fmt::Display for QualifiedQuoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", Quoted(&self.0.schema), Quoted(&self.0.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_parse_and_quote() {
        assert_eq!(
            TableName::new("app.outbox").unwrap().quoted().to_string(),
            "\"app\".\"outbox\""
        );
        assert_eq!(TableName::new("outbox").unwrap(), TableName::outbox());
        assert_eq!(TableName::outbox().to_string(), DEFAULT_OUTBOX_TABLE);
    }

    #[test]
    fn hostile_names_are_refused() {
        let evil = "x\"; drop table t; --";
        assert!(TableName::new(evil).is_err());
        assert!(TableName::new(&format!("public.{evil}")).is_err());
        assert!(TableName::new("a.b.c").is_err());
        assert!(validate_identifier("slot", "Upper", true).is_err());
        assert!(validate_identifier("slot", "", true).is_err());
        assert!(validate_identifier("slot", "1abc", true).is_err());
        assert!(validate_identifier("slot", &"a".repeat(64), true).is_err());
        let msg = validate_identifier("slot", evil, true).unwrap_err().to_string();
        assert!(
            msg.contains("invalid slot name") && msg.contains("lowercase"),
            "{msg}"
        );
    }

    #[test]
    fn migrations_are_numbered_in_order() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1);
            assert!(m.name.starts_with(&format!("{:04}_", m.version)));
            assert!(!m.sql.trim().is_empty());
        }
    }
}
