//! Validated SQL names.
//!
//! Slot, publication and table names come from configuration and end up in
//! SQL and replication commands. They are checked once against the strict
//! grammar of [`outbox_sdk::schema::validate_identifier`], and only these
//! validated types can be formatted into SQL: a name such as
//! `x"; drop table t; --` is refused and never reaches any SQL text. Valid
//! names are still double-quoted when used.

use std::fmt;

use outbox_sdk::schema::{validate_identifier, Quoted};
pub use outbox_sdk::schema::{IdentError, TableName};

/// A replication slot name: PostgreSQL allows only `[a-z0-9_]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SlotName(String);

impl SlotName {
    pub fn new(name: &str) -> Result<Self, IdentError> {
        validate_identifier("replication slot", name, true)?;
        Ok(SlotName(name.to_owned()))
    }

    /// The bare name, for comparison with catalog values and parameters.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The quoted identifier for SQL and replication commands.
    pub fn quoted(&self) -> impl fmt::Display + '_ {
        Quoted::validated(&self.0)
    }
}

/// A publication name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PublicationName(String);

impl PublicationName {
    pub fn new(name: &str) -> Result<Self, IdentError> {
        validate_identifier("publication", name, false)?;
        Ok(PublicationName(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn quoted(&self) -> impl fmt::Display + '_ {
        Quoted::validated(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_and_publication_names() {
        assert_eq!(
            SlotName::new("outboxd_1").unwrap().quoted().to_string(),
            "\"outboxd_1\""
        );
        assert_eq!(
            PublicationName::new("Outbox").unwrap().quoted().to_string(),
            "\"Outbox\""
        );
        let evil = "x\"; drop table t; --";
        assert!(SlotName::new(evil).is_err());
        assert!(PublicationName::new(evil).is_err());
        assert!(SlotName::new("Upper").is_err(), "slot names are lowercase only");
        let msg = SlotName::new(evil).unwrap_err().to_string();
        assert!(
            msg.contains("invalid replication slot name") && msg.contains("lowercase"),
            "{msg}"
        );
    }
}
