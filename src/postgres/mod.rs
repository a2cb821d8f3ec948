//! PostgreSQL, the wire: the logical replication client, the pgoutput
//! decoder, and catalog reads. The connection URL and SQL names are
//! configuration values (`crate::config::conninfo`, `crate::config::ident`).
//!
//! * [`tls`]: `sslmode` on rustls;
//! * [`connection`]: startup, authentication, replication commands, CopyBoth;
//! * [`copy_both`]: XLogData, keepalive and standby status update messages;
//! * [`pgoutput`]: the pure pgoutput decoder;
//! * [`admin`]: publication and slot management on an ordinary connection;
//! * [`failover`]: whether the slot would survive a promotion (17+);
//! * [`publication`]: proof that the publication delivers every outbox
//!   INSERT, at start and, through a guard, while streaming;
//! * [`timeline`]: where ancestor timelines ended (`TIMELINE_HISTORY`).

pub mod admin;
pub mod connection;
pub mod copy_both;
pub mod error;
pub mod failover;
pub mod pgoutput;
pub mod publication;
pub mod timeline;
pub mod tls;
