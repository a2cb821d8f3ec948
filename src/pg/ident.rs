//! Validated SQL names.
//!
//! Slot, publication and table names come from configuration and end up in
//! SQL and replication commands. They are checked against a strict grammar
//! here, once, and only the validated types can be formatted into SQL: a name
//! such as `x"; drop table t; --` is refused with an error and never reaches
//! any SQL text. Valid names are still double-quoted when used.

use std::fmt;

/// PostgreSQL truncates identifiers longer than this (NAMEDATALEN - 1).
const MAX_IDENT_BYTES: usize = 63;

/// A name was not acceptable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid {kind} name {name:?}: {reason}")]
pub struct IdentError {
    kind: &'static str,
    name: String,
    reason: &'static str,
}

fn check(kind: &'static str, name: &str, lowercase_only: bool) -> Result<(), IdentError> {
    let err = |reason| IdentError {
        kind,
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(err("it is empty"));
    }
    if name.len() > MAX_IDENT_BYTES {
        return Err(err("it is longer than 63 bytes"));
    }
    let first = name.as_bytes()[0];
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

fn quote(f: &mut fmt::Formatter<'_>, ident: &str) -> fmt::Result {
    // Validation excludes '"', so no escaping is needed; quoting keeps case.
    write!(f, "\"{ident}\"")
}

/// A replication slot name: PostgreSQL allows only `[a-z0-9_]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SlotName(String);

impl SlotName {
    pub fn new(name: &str) -> Result<Self, IdentError> {
        check("replication slot", name, true)?;
        Ok(SlotName(name.to_owned()))
    }

    /// The bare name, for comparison with catalog values and parameters.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The quoted identifier for SQL and replication commands.
    pub fn quoted(&self) -> impl fmt::Display + '_ {
        Quoted(&self.0)
    }
}

/// A publication name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PublicationName(String);

impl PublicationName {
    pub fn new(name: &str) -> Result<Self, IdentError> {
        check("publication", name, false)?;
        Ok(PublicationName(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn quoted(&self) -> impl fmt::Display + '_ {
        Quoted(&self.0)
    }
}

/// A table name with its schema, `schema.table` (`public` when omitted).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    pub fn new(qualified: &str) -> Result<Self, IdentError> {
        let (schema, name) = match qualified.split_once('.') {
            Some((s, n)) => (s, n),
            None => ("public", qualified),
        };
        check("schema", schema, false)?;
        check("table", name, false).map_err(|mut e| {
            e.name = qualified.to_owned();
            e
        })?;
        Ok(TableName {
            schema: schema.to_owned(),
            name: name.to_owned(),
        })
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

struct Quoted<'a>(&'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        quote(f, self.0)
    }
}

struct QualifiedQuoted<'a>(&'a TableName);

impl fmt::Display for QualifiedQuoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        quote(f, &self.0.schema)?;
        f.write_str(".")?;
        quote(f, &self.0.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_quotes_plain_names() {
        assert_eq!(
            SlotName::new("outboxd_1").unwrap().quoted().to_string(),
            "\"outboxd_1\""
        );
        assert_eq!(
            PublicationName::new("Outbox").unwrap().quoted().to_string(),
            "\"Outbox\""
        );
        let t = TableName::new("app.outbox").unwrap();
        assert_eq!(t.quoted().to_string(), "\"app\".\"outbox\"");
        assert_eq!(TableName::new("outbox").unwrap().to_string(), "public.outbox");
    }

    #[test]
    fn rejects_injection_and_oddities() {
        let evil = "x\"; drop table t; --";
        assert!(SlotName::new(evil).is_err());
        assert!(PublicationName::new(evil).is_err());
        assert!(TableName::new(evil).is_err());
        assert!(TableName::new(&format!("public.{evil}")).is_err());
        assert!(SlotName::new("Upper").is_err(), "slot names are lowercase only");
        assert!(SlotName::new("").is_err());
        assert!(SlotName::new("1abc").is_err());
        assert!(SlotName::new(&"a".repeat(64)).is_err());
        assert!(TableName::new("a.b.c").is_err());
        let msg = SlotName::new(evil).unwrap_err().to_string();
        assert!(
            msg.contains("invalid replication slot name") && msg.contains("lowercase"),
            "{msg}"
        );
    }
}
