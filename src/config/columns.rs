//! `[columns]`: which column of the outbox table plays which role.
//!
//! outboxd needs seven roles from a row. Each may be renamed, so that the
//! table a team already has (Debezium's `aggregatetype`/`aggregateid`, a
//! TypeORM entity's `"aggregateId"`, a Kafka-record-shaped `topic`/`key`/
//! `value`) is read as it is:
//!
//! | role        | default          | required | absent means                    |
//! |-------------|------------------|----------|---------------------------------|
//! | `id`        | `id`             | yes      |                                 |
//! | `key`       | `aggregate_id`   | yes      |                                 |
//! | `route`     | `aggregate_type` | no       | the topic is fixed (no `{aggregate_type}` in it) |
//! | `type`      | `type`           | no       | no `type` header                |
//! | `payload`   | `payload`        | yes      |                                 |
//! | `headers`   | `headers`        | no       | no headers from the row         |
//! | `timestamp` | `created_at`     | no       | the transaction's commit time   |
//!
//! A role left at its default is read when the table has a column of that
//! name; an optional role's default column may be missing. A role named
//! here must exist. `false` says the table has no such column (only the
//! optional roles). `additional` places further columns as headers, into
//! the envelope, or as the partition (Debezium's
//! `table.fields.additional.placement`).
//!
//! This module holds names only. What a column's values mean, its types
//! and how a row is read, is [`crate::source::outbox`]'s.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// PostgreSQL truncates longer identifiers (NAMEDATALEN - 1).
const MAX_COLUMN_BYTES: usize = 63;

/// A column name, exactly as the catalog holds it (case kept: a
/// mixed-case name is a quoted identifier). Any character but NUL.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ColumnName(String);

impl ColumnName {
    pub fn new(name: &str) -> Result<Self, String> {
        if name.is_empty() {
            return Err("a column name cannot be empty".into());
        }
        if name.len() > MAX_COLUMN_BYTES {
            return Err(format!(
                "{name:?} is longer than 63 bytes, which PostgreSQL truncates"
            ));
        }
        if name.contains('\0') {
            return Err(format!("{name:?} holds a NUL character"));
        }
        Ok(ColumnName(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The quoted identifier for SQL text: `"aggregateId"`, with any `"`
    /// doubled.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0.replace('"', "\"\""))
    }
}

impl fmt::Display for ColumnName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A role's setting: left at its default, a column named (or several: the
/// first the table has is read, so that a rename can be rolled out with
/// both names), or `false`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ColumnSetting {
    #[default]
    Default,
    Named(Vec<ColumnName>),
    Absent,
}

impl<'de> Deserialize<'de> for ColumnSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bool(bool),
            Text(String),
            List(Vec<String>),
        }
        let names = |list: Vec<String>| {
            if list.is_empty() {
                return Err(serde::de::Error::custom(
                    "name at least one column, or write false when the table has none",
                ));
            }
            list.iter()
                .map(|t| ColumnName::new(t))
                .collect::<Result<Vec<_>, _>>()
                .map(ColumnSetting::Named)
                .map_err(serde::de::Error::custom)
        };
        match Raw::deserialize(d)? {
            Raw::Bool(false) => Ok(ColumnSetting::Absent),
            Raw::Bool(true) => Err(serde::de::Error::custom(
                "name the column, or write false when the table has none",
            )),
            Raw::Text(t) => names(vec![t]),
            Raw::List(list) => names(list),
        }
    }
}

/// Where an additional column goes.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// A Kafka header named `name` (default: the column's name).
    Header,
    /// A member of the envelope value (`routing.value = "envelope"` or
    /// `"debezium-envelope"`), named `name`.
    Envelope,
    /// The record's partition: an integer column; NULL leaves it to the
    /// partitioner.
    Partition,
}

/// `[[columns.additional]]`
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AdditionalColumn {
    /// The column.
    pub column: String,
    /// `header`, `envelope` or `partition`.
    pub placement: Placement,
    /// The header's or the envelope member's name (default: the column's).
    #[serde(default)]
    pub name: Option<String>,
}

/// `columns.additional_missing`: an additional column the table lacks.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum AdditionalMissing {
    /// `run` refuses to start and `check` fails, naming the column.
    #[default]
    Error,
    /// The placement is left out.
    Ignore,
}

/// `[columns]`
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ColumnsConfig {
    /// The event id (the `id` header consumers deduplicate by): uuid, text
    /// or an integer. Default `id`.
    #[serde(default)]
    pub id: ColumnSetting,
    /// The Kafka key, which keeps an aggregate's events in order: text,
    /// uuid or an integer. Default `aggregate_id`.
    #[serde(default)]
    pub key: ColumnSetting,
    /// What `{aggregate_type}` in `routing.topic` stands for. Default
    /// `aggregate_type`; `false` for a fixed topic.
    #[serde(default)]
    pub route: ColumnSetting,
    /// The event type (the `type` header, CloudEvents' type, registry
    /// rules). Default `type`; `false`: none.
    #[serde(default, rename = "type")]
    pub event_type: ColumnSetting,
    /// The payload: jsonb, json, text or bytea. Default `payload`.
    #[serde(default)]
    pub payload: ColumnSetting,
    /// A JSON object whose members become headers: jsonb, json or text.
    /// Default `headers`; `false`: none.
    #[serde(default)]
    pub headers: ColumnSetting,
    /// When the event happened: timestamptz, timestamp (read as UTC) or
    /// bigint (milliseconds since the Unix epoch). Default `created_at`;
    /// `false`: the commit time.
    #[serde(default)]
    pub timestamp: ColumnSetting,
    /// Further columns, placed as headers, envelope members or the
    /// partition.
    #[serde(default)]
    pub additional: Vec<AdditionalColumn>,
    /// `error` (default) or `ignore`: an additional column the table lacks.
    #[serde(default)]
    pub additional_missing: AdditionalMissing,
}

/// The roles a row has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Id,
    Key,
    Route,
    Type,
    Payload,
    Headers,
    Timestamp,
}

impl Role {
    pub const ALL: [Role; 7] = [
        Role::Id,
        Role::Key,
        Role::Route,
        Role::Type,
        Role::Payload,
        Role::Headers,
        Role::Timestamp,
    ];

    /// The column read when the role is left at its default.
    pub fn default_column(self) -> &'static str {
        match self {
            Role::Id => "id",
            Role::Key => "aggregate_id",
            Role::Route => "aggregate_type",
            Role::Type => "type",
            Role::Payload => "payload",
            Role::Headers => "headers",
            Role::Timestamp => "created_at",
        }
    }

    /// The setting that names it, for errors.
    pub fn setting(self) -> &'static str {
        match self {
            Role::Id => "columns.id",
            Role::Key => "columns.key",
            Role::Route => "columns.route",
            Role::Type => "columns.type",
            Role::Payload => "columns.payload",
            Role::Headers => "columns.headers",
            Role::Timestamp => "columns.timestamp",
        }
    }

    /// Whether every row needs it.
    pub fn required(self) -> bool {
        matches!(self, Role::Id | Role::Key | Role::Payload)
    }
}

/// A role's column after validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleColumn {
    /// `None`: the table has none (`false`).
    pub name: Option<ColumnName>,
    /// Further names it may have (a rename in progress): the first of
    /// `name` and these that the table has is read.
    pub aliases: Vec<ColumnName>,
    /// Named in the file: it must exist. A default may be missing when the
    /// role is optional.
    pub explicit: bool,
    /// Something configured needs it (the topic template uses it, or a
    /// value format): it must exist whether explicit or not.
    pub needed: bool,
}

/// A placement after validation: the additional column it reads is
/// `ColumnMap::extra[extra]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedColumn {
    pub extra: usize,
    pub placement: Placement,
    /// The header's or envelope member's name.
    pub name: String,
}

/// Every column outboxd reads from a row, by role, plus the additional
/// columns the topic template and the placements read (a row carries
/// their values in this order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnMap {
    roles: [RoleColumn; 7],
    /// Additional columns, in the order a row carries their values.
    pub extra: Vec<ColumnName>,
    pub placements: Vec<PlacedColumn>,
    /// With `Ignore`, a placement's column may be missing.
    pub missing: AdditionalMissing,
}

impl Default for ColumnMap {
    /// Today's shape: every role at its default.
    fn default() -> Self {
        let Ok(map) = ColumnMap::new(&ColumnsConfig::default()) else {
            unreachable!("the default columns are valid")
        };
        map
    }
}

impl ColumnMap {
    /// The roles of `[columns]`; the additional columns follow with
    /// [`ColumnMap::place`], and the template's with
    /// [`ColumnMap::read_column`]. Errors name the key.
    pub fn new(c: &ColumnsConfig) -> Result<Self, (String, String)> {
        let role = |r: Role, s: &ColumnSetting| -> Result<RoleColumn, (String, String)> {
            Ok(match s {
                ColumnSetting::Default => RoleColumn {
                    name: Some(ColumnName(r.default_column().to_owned())),
                    aliases: Vec::new(),
                    explicit: false,
                    needed: r.required(),
                },
                ColumnSetting::Named(names) => RoleColumn {
                    name: names.first().cloned(),
                    aliases: names.iter().skip(1).cloned().collect(),
                    explicit: true,
                    needed: r.required(),
                },
                ColumnSetting::Absent if r.required() => {
                    return Err((
                        r.setting().to_owned(),
                        "every row needs one: name its column".to_owned(),
                    ))
                }
                ColumnSetting::Absent => RoleColumn {
                    name: None,
                    aliases: Vec::new(),
                    explicit: true,
                    needed: false,
                },
            })
        };
        let mut map = ColumnMap {
            roles: [
                role(Role::Id, &c.id)?,
                role(Role::Key, &c.key)?,
                role(Role::Route, &c.route)?,
                role(Role::Type, &c.event_type)?,
                role(Role::Payload, &c.payload)?,
                role(Role::Headers, &c.headers)?,
                role(Role::Timestamp, &c.timestamp)?,
            ],
            extra: Vec::new(),
            placements: Vec::new(),
            missing: c.additional_missing,
        };
        let payload = map.role(Role::Payload).name.clone();
        for (i, a) in c.additional.iter().enumerate() {
            let key = format!("columns.additional[{i}]");
            let column = ColumnName::new(&a.column).map_err(|e| (format!("{key}.column"), e))?;
            if Some(&column) == payload.as_ref() {
                return Err((
                    format!("{key}.column"),
                    format!("{column:?} is the payload column; place another"),
                ));
            }
            let name = match (a.placement, &a.name) {
                (Placement::Partition, Some(_)) => {
                    return Err((format!("{key}.name"), "a partition placement has no name".into()))
                }
                (_, Some(n)) if n.is_empty() => {
                    return Err((format!("{key}.name"), "must not be empty".into()))
                }
                (_, Some(n)) => n.clone(),
                (_, None) => column.as_str().to_owned(),
            };
            if a.placement == Placement::Partition
                && map.placements.iter().any(|p| p.placement == Placement::Partition)
            {
                return Err((
                    format!("{key}.placement"),
                    "only one column can pick the partition".into(),
                ));
            }
            if a.placement != Placement::Partition
                && map
                    .placements
                    .iter()
                    .any(|p| p.placement == a.placement && p.name == name)
            {
                return Err((
                    format!("{key}.name"),
                    format!("two {:?} placements are named {name:?}", a.placement),
                ));
            }
            let extra = map.read_column(&column);
            map.placements.push(PlacedColumn {
                extra,
                placement: a.placement,
                name,
            });
        }
        Ok(map)
    }

    pub fn role(&self, r: Role) -> &RoleColumn {
        &self.roles[r as usize]
    }

    /// The role's column name, when the table has one.
    pub fn column(&self, r: Role) -> Option<&ColumnName> {
        self.role(r).name.as_ref()
    }

    /// Marks a role as needed: it must exist even at its default.
    pub fn need(&mut self, r: Role) -> Result<(), String> {
        let role = &mut self.roles[r as usize];
        if role.name.is_none() {
            return Err(format!("{} is false: the table has no such column", r.setting()));
        }
        role.needed = true;
        Ok(())
    }

    /// The role a column plays, when it plays one.
    pub fn role_of(&self, column: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|&r| {
            let role = self.role(r);
            role.name
                .iter()
                .chain(&role.aliases)
                .any(|c| c.as_str() == column)
        })
    }

    /// The index in a row's additional values of `column`, added when it
    /// is not read yet.
    pub fn read_column(&mut self, column: &ColumnName) -> usize {
        match self.extra.iter().position(|c| c == column) {
            Some(i) => i,
            None => {
                self.extra.push(column.clone());
                self.extra.len() - 1
            }
        }
    }

    /// Whether the additional column `extra` may be missing (it serves
    /// placements only, and `additional_missing = "ignore"`).
    pub fn may_miss(&self, extra: usize, in_template: bool) -> bool {
        !in_template
            && self.missing == AdditionalMissing::Ignore
            && self.placements.iter().any(|p| p.extra == extra)
    }

    /// The placement that picks the partition, if any.
    pub fn partition(&self) -> Option<&PlacedColumn> {
        self.placements
            .iter()
            .find(|p| p.placement == Placement::Partition)
    }

    /// Every column a row is read from, each once: the roles' (when the
    /// table is not said to lack them) and the additional ones.
    pub fn read_columns(&self) -> Vec<&ColumnName> {
        let mut out: Vec<&ColumnName> = Vec::new();
        let roles = self.roles.iter().flat_map(|r| r.name.iter().chain(&r.aliases));
        for c in roles.chain(&self.extra) {
            if !out.contains(&c) {
                out.push(c);
            }
        }
        out
    }

    /// Whether every role is at its default and nothing else is read:
    /// today's shape.
    pub fn is_default(&self) -> bool {
        self.roles.iter().all(|r| !r.explicit) && self.extra.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ColumnMap, (String, String)> {
        let c: ColumnsConfig = toml::from_str(text).map_err(|e| (String::new(), e.to_string()))?;
        ColumnMap::new(&c)
    }

    #[test]
    fn defaults_are_todays_shape() {
        let m = parse("").unwrap();
        assert!(m.is_default());
        assert_eq!(m.column(Role::Key).unwrap().as_str(), "aggregate_id");
        assert!(m.role(Role::Id).needed && !m.role(Role::Headers).needed);
        assert_eq!(m, ColumnMap::default());
    }

    #[test]
    fn renamed_absent_and_placed() {
        let m = parse(
            r#"
            key = "aggregateId"
            route = "aggregatetype"
            headers = false
            additional = [
              { column = "type", placement = "header", name = "eventType" },
              { column = "part", placement = "partition" },
              { column = "tenant", placement = "envelope" },
            ]
            "#,
        )
        .unwrap();
        assert_eq!(m.column(Role::Key).unwrap().quoted(), "\"aggregateId\"");
        assert!(m.column(Role::Headers).is_none());
        assert_eq!(m.extra.len(), 3);
        assert_eq!(m.placements[0].name, "eventType");
        assert_eq!(m.placements[2].name, "tenant");
        assert_eq!(m.partition().unwrap().extra, 1);
        assert_eq!(m.role_of("aggregatetype"), Some(Role::Route));
        assert!(!m.is_default());
    }

    #[test]
    fn refusals_name_the_key() {
        for (text, key) in [
            ("id = false", "columns.id"),
            ("payload = false", "columns.payload"),
            ("key = true", ""),
            ("key = \"\"", ""),
            (
                "additional = [{ column = \"p\", placement = \"partition\", name = \"x\" }]",
                "columns.additional[0].name",
            ),
            (
                "additional = [{ column = \"a\", placement = \"partition\" }, { column = \"b\", placement = \"partition\" }]",
                "columns.additional[1].placement",
            ),
            (
                "additional = [{ column = \"a\", placement = \"header\", name = \"h\" }, { column = \"b\", placement = \"header\", name = \"h\" }]",
                "columns.additional[1].name",
            ),
            (
                "additional = [{ column = \"payload\", placement = \"header\" }]",
                "columns.additional[0].column",
            ),
        ] {
            let (path, _) = parse(text).unwrap_err();
            assert_eq!(path, key, "{text}");
        }
        assert!(ColumnName::new(&"x".repeat(64)).is_err());
        assert_eq!(ColumnName::new("a\"b").unwrap().quoted(), "\"a\"\"b\"");
    }
}
