//! Errors of the replication connection.

use std::fmt;
use std::io;

use crate::config::conninfo::ConnInfoError;
use crate::config::ident::IdentError;
use crate::postgres::copy_both::CopyDataError;
use crate::postgres::pgoutput::DecodeError;
use crate::postgres::tls::TlsConfigError;

/// An `ErrorResponse` from the server, with its SQLSTATE kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerError {
    pub severity: String,
    /// The five-character SQLSTATE, e.g. `28P01` for a wrong password.
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} (SQLSTATE {})", self.severity, self.message, self.code)?;
        if let Some(d) = &self.detail {
            write!(f, "; detail: {d}")?;
        }
        if let Some(h) = &self.hint {
            write!(f, "; hint: {h}")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong on a replication connection.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error(transparent)]
    ConnInfo(#[from] ConnInfoError),
    #[error(transparent)]
    Ident(#[from] IdentError),
    #[error(
        "cannot connect to PostgreSQL at {target}: {source}; is the server running and reachable from here?"
    )]
    Connect { target: String, source: io::Error },
    #[error("timed out after {secs}s connecting to PostgreSQL at {target}; check the host, port and firewall, or raise connect_timeout")]
    ConnectTimeout { target: String, secs: u64 },
    #[error("connection to PostgreSQL lost: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    TlsConfig(#[from] TlsConfigError),
    #[error("TLS handshake with PostgreSQL failed: {0}")]
    TlsHandshake(io::Error),
    #[error("the server does not accept TLS connections but sslmode={0} requires TLS: enable ssl in postgresql.conf or use sslmode=prefer")]
    TlsRefused(&'static str),
    #[error("the server asks for a password ({method}) but the postgres url has none: use postgres://user:${{PGPASSWORD}}@host/db")]
    PasswordRequired { method: &'static str },
    #[error("the server asks for {0} authentication, which outboxd does not support: use scram-sha-256 (or md5) for this user in pg_hba.conf")]
    UnsupportedAuth(String),
    #[error("SCRAM-SHA-256 authentication failed: {0}")]
    Scram(io::Error),
    #[error("PostgreSQL at {target} is read-only (a standby, or default_transaction_read_only = on) and target_session_attrs=read-write asks for a server that can write; waiting for a primary among the listed hosts")]
    ReadOnly { target: String },
    #[error("PostgreSQL {0}")]
    Server(ServerError),
    #[error("unexpected message from PostgreSQL: {0}")]
    Protocol(String),
    #[error("undecodable pgoutput message at {lsn}: {source}")]
    Decode {
        lsn: crate::lsn::Lsn,
        source: DecodeError,
    },
    #[error(transparent)]
    CopyData(#[from] CopyDataError),
}

impl PgError {
    /// The SQLSTATE when the server answered with an error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            PgError::Server(e) => Some(&e.code),
            _ => None,
        }
    }

    /// The server rejected the credentials (SQLSTATE class 28).
    pub fn is_auth_failure(&self) -> bool {
        self.sqlstate().is_some_and(|c| c.starts_with("28"))
    }

    /// A retry with backoff may succeed: the network, a restarting server,
    /// too many connections, or a slot still held by a previous walsender.
    pub fn is_transient(&self) -> bool {
        match self {
            PgError::Connect { .. }
            | PgError::ConnectTimeout { .. }
            | PgError::Io(_)
            | PgError::TlsHandshake(_)
            // During a failover every listed server may be a standby for a
            // moment; the promotion makes one of them writable.
            | PgError::ReadOnly { .. } => true,
            PgError::Server(e) => {
                let c = e.code.as_str();
                c.starts_with("08") // connection exception
                    || c.starts_with("57P") // admin shutdown, crash shutdown, cannot connect now
                    || c == "53300" // too many connections
                    || c == "55006" // object in use: slot active for another PID
                    || c == "40001"
                    || c == "40P01"
            }
            _ => false,
        }
    }
}
