//! PostgreSQL: the logical replication client and the pgoutput decoder.
//!
//! * [`conninfo`]: libpq-style connection URL;
//! * [`tls`]: `sslmode` on rustls;
//! * [`connection`]: startup, authentication, replication commands, CopyBoth;
//! * [`copy_both`]: XLogData, keepalive and standby status update messages;
//! * [`pgoutput`]: the pure pgoutput decoder;
//! * [`outbox_stream`]: the decoded stream reduced to outbox transactions;
//! * [`admin`]: publication and slot management on an ordinary connection;
//! * [`failover`]: whether the slot would survive a promotion (17+);
//! * [`publication`]: proof that the publication delivers every outbox
//!   INSERT, at start and, through a guard, while streaming;
//! * [`ident`]: validated, quoted SQL names;
//! * [`timeline`]: where ancestor timelines ended (`TIMELINE_HISTORY`).

pub mod admin;
pub mod connection;
pub mod conninfo;
pub mod copy_both;
pub mod error;
pub mod failover;
pub mod ident;
pub mod outbox_stream;
pub mod pgoutput;
pub mod publication;
pub mod timeline;
pub mod tls;
