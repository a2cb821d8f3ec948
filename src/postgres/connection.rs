//! A logical replication connection (`replication=database`).
//!
//! tokio-postgres cannot enter CopyBoth mode, so this module speaks the
//! frontend/backend protocol itself, using `postgres-protocol` for message
//! encoding, backend message parsing and the SCRAM exchange:
//!
//! 1. connect over TCP or a Unix socket, negotiate TLS per `sslmode`;
//! 2. send the startup packet with `replication=database` plus
//!    `DateStyle=ISO` and `TimeZone=UTC`, so that text values (timestamps in
//!    particular) have one fixed format;
//! 3. authenticate: trust, cleartext, md5 or SCRAM-SHA-256;
//! 4. run replication commands as simple queries (`IDENTIFY_SYSTEM`,
//!    `CREATE_REPLICATION_SLOT`), then `START_REPLICATION`, which turns the
//!    connection into a [`ReplicationStream`].
//!
//! Frames are read into one growing buffer; CopyData payloads are handed out
//! as zero-copy `Bytes` slices of it. Reading is cancel-safe: a frame is
//! only consumed once it is complete, so [`ReplicationStream::next_message`]
//! can sit in a `tokio::select!` next to timers.

use crate::postgres::timeline::TimelineHistory;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256, SCRAM_SHA_256};
use postgres_protocol::message::backend::{ErrorResponseBody, Message};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use crate::config::conninfo::{PgConnectConfig, PgHost, SslMode, TargetSessionAttrs};
use crate::config::ident::{PublicationName, SlotName};
use crate::lsn::Lsn;
use crate::postgres::copy_both::{ReplicationMessage, StandbyStatusUpdate};
use crate::postgres::error::{PgError, ServerError};
use crate::postgres::tls;

/// PostgreSQL refuses messages over 1 GiB; anything larger is a broken stream.
const MAX_FRAME: usize = 1 << 30;
const READ_CHUNK: usize = 256 * 1024;

trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}

/// One backend frame, with the replication-specific ones split out
/// (postgres-protocol does not know CopyBothResponse).
enum Frame {
    CopyData(Bytes),
    CopyBothResponse,
    CopyDone,
    Other(Message),
}

/// What `IDENTIFY_SYSTEM` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SystemIdentity {
    pub system_id: String,
    pub timeline: u32,
    /// The current WAL flush position.
    pub xlogpos: Lsn,
    pub dbname: Option<String>,
}

/// Rows of a simple query, all values in text form.
#[derive(Clone, Debug, Default)]
pub struct QueryResult {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl QueryResult {
    fn value(&self, row: usize, column: &str) -> Option<&str> {
        let idx = self.columns.iter().position(|c| c == column)?;
        self.rows.get(row)?.get(idx)?.as_deref()
    }
}

/// Options for `START_REPLICATION`.
#[derive(Clone, Debug)]
pub struct StartOptions {
    pub slot: SlotName,
    pub publication: PublicationName,
    /// Where to start; `0/0` resumes from the slot's `confirmed_flush_lsn`.
    pub start_lsn: Lsn,
    /// Also stream logical decoding messages (`pg_logical_emit_message`).
    pub messages: bool,
}

/// A connection in replication mode, before streaming starts.
pub struct ReplicationConnection {
    io: Box<dyn Transport>,
    read_buf: BytesMut,
    write_buf: BytesMut,
    backend_pid: i32,
}

impl std::fmt::Debug for ReplicationConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationConnection")
            .field("backend_pid", &self.backend_pid)
            .finish()
    }
}

fn server_error(body: &ErrorResponseBody) -> ServerError {
    let mut e = ServerError {
        severity: "ERROR".into(),
        code: "XX000".into(),
        message: String::new(),
        detail: None,
        hint: None,
    };
    let mut fields = body.fields();
    while let Ok(Some(f)) = fields.next() {
        let v = String::from_utf8_lossy(f.value_bytes()).into_owned();
        match f.type_() {
            b'V' => e.severity = v,
            b'C' => e.code = v,
            b'M' => e.message = v,
            b'D' => e.detail = Some(v),
            b'H' => e.hint = Some(v),
            _ => {}
        }
    }
    e
}

use crate::config::conninfo::{
    TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_INTERVAL, TCP_KEEPALIVE_RETRIES, TCP_USER_TIMEOUT,
};

fn keep_alive(s: &TcpStream) -> std::io::Result<()> {
    let sock = socket2::SockRef::from(s);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(TCP_KEEPALIVE_IDLE)
        .with_interval(TCP_KEEPALIVE_INTERVAL)
        .with_retries(TCP_KEEPALIVE_RETRIES);
    sock.set_tcp_keepalive(&keepalive)?;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    sock.set_tcp_user_timeout(Some(TCP_USER_TIMEOUT))?;
    Ok(())
}

async fn open_transport(cfg: &PgConnectConfig) -> Result<Box<dyn Transport>, PgError> {
    let target = cfg.target();
    let server = cfg.endpoint();
    let connect = async {
        match &server.host {
            PgHost::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{}", server.port));
                let s = UnixStream::connect(&path).await?;
                Ok::<Box<dyn Transport>, std::io::Error>(Box::new(s))
            }
            PgHost::Tcp(host) => {
                let s = TcpStream::connect((host.as_str(), server.port)).await?;
                s.set_nodelay(true)?;
                keep_alive(&s)?;
                Ok::<Box<dyn Transport>, std::io::Error>(Box::new(s))
            }
        }
    };
    let io = tokio::time::timeout(cfg.connect_timeout, connect)
        .await
        .map_err(|_| PgError::ConnectTimeout {
            target: target.clone(),
            secs: cfg.connect_timeout.as_secs(),
        })?
        .map_err(|source| PgError::Connect {
            target: target.clone(),
            source,
        })?;

    let PgHost::Tcp(host) = &server.host else {
        return Ok(io); // libpq does not use TLS on Unix sockets either
    };
    let Some(tls_config) = tls::client_config(cfg)? else {
        return Ok(io);
    };
    let mut io = io;
    let mut req = BytesMut::new();
    frontend::ssl_request(&mut req);
    io.write_all(&req).await?;
    let mut answer = [0u8; 1];
    io.read_exact(&mut answer).await?;
    match answer[0] {
        b'S' => {
            let name = tls::server_name(host)?;
            let stream = tokio_rustls::TlsConnector::from(tls_config)
                .connect(name, io)
                .await
                .map_err(PgError::TlsHandshake)?;
            Ok(Box::new(stream))
        }
        b'N' if cfg.sslmode == SslMode::Prefer => Ok(io),
        b'N' => Err(PgError::TlsRefused(match cfg.sslmode {
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            _ => "verify-full",
        })),
        other => Err(PgError::Protocol(format!(
            "answer 0x{other:02x} to the TLS request"
        ))),
    }
}

impl ReplicationConnection {
    /// Connects to the first of the configured servers that accepts the
    /// connection (and, with `target_session_attrs=read-write`, whose
    /// sessions can write), as libpq tries them. The error is the last
    /// server's; the log says why each earlier one was passed over.
    pub async fn connect(cfg: &PgConnectConfig) -> Result<Self, PgError> {
        let mut last = None;
        for server in cfg.each_server() {
            match Self::connect_one(&server).await {
                Ok(mut conn) => match cfg.target_session_attrs {
                    TargetSessionAttrs::Any => return Ok(conn),
                    TargetSessionAttrs::ReadWrite => {
                        match conn.simple_query("SHOW transaction_read_only").await {
                            Ok(r)
                                if r.rows.first().and_then(|r| r.first()).and_then(|v| v.as_deref())
                                    == Some("off") =>
                            {
                                return Ok(conn);
                            }
                            Ok(_) => {
                                tracing::info!(server = %server.endpoint(), "server is read-only (a standby?); trying the next one");
                                last = Some(PgError::ReadOnly {
                                    target: server.target(),
                                });
                            }
                            // As libpq: a server that cannot answer is passed over.
                            Err(e) => {
                                tracing::info!(server = %server.endpoint(), error = %e, "cannot tell whether this server can write; trying the next one");
                                last = Some(e);
                            }
                        }
                    }
                },
                Err(e) => {
                    if cfg.hosts.len() > 1 {
                        tracing::info!(server = %server.endpoint(), error = %e, "cannot use this server; trying the next one");
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| PgError::Protocol("no server to connect to".into())))
    }

    /// Connects to one server, authenticates and waits until it is ready.
    async fn connect_one(cfg: &PgConnectConfig) -> Result<Self, PgError> {
        let io = open_transport(cfg).await?;
        let mut conn = ReplicationConnection {
            io,
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: BytesMut::with_capacity(1024),
            backend_pid: 0,
        };
        let params = [
            ("user", cfg.user.as_str()),
            ("database", cfg.dbname.as_str()),
            ("replication", "database"),
            ("application_name", cfg.application_name.as_str()),
            ("client_encoding", "UTF8"),
            ("DateStyle", "ISO"),
            ("TimeZone", "UTC"),
        ];
        frontend::startup_message(params.iter().copied(), &mut conn.write_buf)?;
        conn.flush().await?;
        conn.authenticate(cfg).await?;
        conn.wait_ready().await?;
        Ok(conn)
    }

    /// The PID of the walsender serving this connection.
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    async fn flush(&mut self) -> Result<(), PgError> {
        let buf = self.write_buf.split();
        self.io.write_all(&buf).await?;
        self.io.flush().await?;
        Ok(())
    }

    /// Reads one complete frame. Cancel-safe.
    async fn read_frame(&mut self) -> Result<Frame, PgError> {
        loop {
            if self.read_buf.len() >= 5 {
                let tag = self.read_buf[0];
                let len = u32::from_be_bytes([
                    self.read_buf[1],
                    self.read_buf[2],
                    self.read_buf[3],
                    self.read_buf[4],
                ]) as usize;
                if !(4..=MAX_FRAME).contains(&len) {
                    return Err(PgError::Protocol(format!(
                        "message {:?} has invalid length {len}",
                        char::from(tag)
                    )));
                }
                let total = len + 1;
                if self.read_buf.len() >= total {
                    return Ok(match tag {
                        b'd' => Frame::CopyData(self.read_buf.split_to(total).freeze().slice(5..)),
                        b'W' => {
                            let _ = self.read_buf.split_to(total);
                            Frame::CopyBothResponse
                        }
                        b'c' => {
                            let _ = self.read_buf.split_to(total);
                            Frame::CopyDone
                        }
                        _ => match Message::parse(&mut self.read_buf)? {
                            Some(m) => Frame::Other(m),
                            None => {
                                return Err(PgError::Protocol("complete frame reported as partial".into()))
                            }
                        },
                    });
                }
                self.read_buf
                    .reserve((total - self.read_buf.len()).max(READ_CHUNK));
            } else {
                self.read_buf.reserve(READ_CHUNK);
            }
            let n = self.io.read_buf(&mut self.read_buf).await?;
            if n == 0 {
                return Err(PgError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the server closed the connection",
                )));
            }
        }
    }

    async fn read_message(&mut self) -> Result<Message, PgError> {
        match self.read_frame().await? {
            Frame::Other(m) => Ok(m),
            Frame::CopyData(_) => Err(PgError::Protocol("CopyData outside of COPY".into())),
            Frame::CopyBothResponse => Err(PgError::Protocol("unexpected CopyBothResponse".into())),
            Frame::CopyDone => Err(PgError::Protocol("CopyDone outside of COPY".into())),
        }
    }

    async fn authenticate(&mut self, cfg: &PgConnectConfig) -> Result<(), PgError> {
        let password = |method: &'static str| {
            cfg.password
                .as_deref()
                .map(str::as_bytes)
                .ok_or(PgError::PasswordRequired { method })
        };
        let mut scram: Option<ScramSha256> = None;
        loop {
            match self.read_message().await? {
                Message::AuthenticationOk => return Ok(()),
                Message::AuthenticationCleartextPassword => {
                    frontend::password_message(password("password")?, &mut self.write_buf)?;
                    self.flush().await?;
                }
                Message::AuthenticationMd5Password(body) => {
                    let hash = md5_hash(cfg.user.as_bytes(), password("md5")?, body.salt());
                    frontend::password_message(hash.as_bytes(), &mut self.write_buf)?;
                    self.flush().await?;
                }
                Message::AuthenticationSasl(body) => {
                    let mut mechanisms = body.mechanisms();
                    let mut found = false;
                    while let Some(m) = mechanisms.next()? {
                        found |= m == SCRAM_SHA_256;
                    }
                    if !found {
                        return Err(PgError::UnsupportedAuth("SASL without SCRAM-SHA-256".into()));
                    }
                    // Channel binding is not offered ("n"): the server accepts
                    // this on TLS and plain connections alike.
                    let s = ScramSha256::new(password("scram-sha-256")?, ChannelBinding::unsupported());
                    frontend::sasl_initial_response(SCRAM_SHA_256, s.message(), &mut self.write_buf)?;
                    self.flush().await?;
                    scram = Some(s);
                }
                Message::AuthenticationSaslContinue(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| PgError::Protocol("SASL continue before SASL start".into()))?;
                    s.update(body.data()).map_err(PgError::Scram)?;
                    frontend::sasl_response(s.message(), &mut self.write_buf)?;
                    self.flush().await?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| PgError::Protocol("SASL final before SASL start".into()))?;
                    s.finish(body.data()).map_err(PgError::Scram)?;
                }
                Message::ErrorResponse(body) => return Err(PgError::Server(server_error(&body))),
                Message::AuthenticationKerberosV5 => {
                    return Err(PgError::UnsupportedAuth("Kerberos V5".into()))
                }
                Message::AuthenticationGss | Message::AuthenticationGssContinue(_) => {
                    return Err(PgError::UnsupportedAuth("GSSAPI".into()))
                }
                Message::AuthenticationSspi => return Err(PgError::UnsupportedAuth("SSPI".into())),
                Message::AuthenticationScmCredential => {
                    return Err(PgError::UnsupportedAuth("SCM credential".into()))
                }
                Message::NoticeResponse(_) => {}
                _ => {
                    return Err(PgError::Protocol(
                        "unexpected message during authentication".into(),
                    ))
                }
            }
        }
    }

    async fn wait_ready(&mut self) -> Result<(), PgError> {
        let mut error = None;
        loop {
            match self.read_message().await? {
                Message::ReadyForQuery(_) => return error.map_or(Ok(()), Err),
                Message::BackendKeyData(k) => self.backend_pid = k.process_id(),
                Message::ErrorResponse(body) => {
                    let e = PgError::Server(server_error(&body));
                    // Startup errors are followed by connection close, not ReadyForQuery.
                    if self.backend_pid == 0 {
                        return Err(e);
                    }
                    error = Some(e);
                }
                _ => {}
            }
        }
    }

    /// Runs one command with the simple query protocol.
    pub async fn simple_query(&mut self, sql: &str) -> Result<QueryResult, PgError> {
        frontend::query(sql, &mut self.write_buf)?;
        self.flush().await?;
        let mut result = QueryResult::default();
        let mut error = None;
        loop {
            match self.read_message().await? {
                Message::RowDescription(body) => {
                    let mut fields = body.fields();
                    while let Some(f) = fields.next()? {
                        result.columns.push(f.name().to_owned());
                    }
                }
                Message::DataRow(body) => {
                    let buf = body.buffer();
                    let mut ranges = body.ranges();
                    let mut row = Vec::with_capacity(result.columns.len());
                    while let Some(r) = ranges.next()? {
                        row.push(r.map(|r| String::from_utf8_lossy(&buf[r]).into_owned()));
                    }
                    result.rows.push(row);
                }
                Message::ErrorResponse(body) => error = Some(PgError::Server(server_error(&body))),
                Message::ReadyForQuery(_) => return error.map_or(Ok(result), Err),
                _ => {}
            }
        }
    }

    /// Connects (as [`ReplicationConnection::connect`]) only to ask
    /// `IDENTIFY_SYSTEM`: the system identifier keys what outboxd keeps
    /// about this PostgreSQL system.
    pub async fn identify(cfg: &PgConnectConfig) -> Result<SystemIdentity, PgError> {
        Self::connect(cfg).await?.identify_system().await
    }

    /// `TIMELINE_HISTORY`: where each ancestor of `timeline` ended (only
    /// timelines after the first have a history).
    pub async fn timeline_history(&mut self, timeline: u32) -> Result<TimelineHistory, PgError> {
        let r = self.simple_query(&format!("TIMELINE_HISTORY {timeline}")).await?;
        let content = r
            .value(0, "content")
            .ok_or_else(|| PgError::Protocol("TIMELINE_HISTORY returned no content".into()))?;
        TimelineHistory::parse(content).map_err(PgError::Protocol)
    }

    /// `IDENTIFY_SYSTEM`.
    pub async fn identify_system(&mut self) -> Result<SystemIdentity, PgError> {
        let r = self.simple_query("IDENTIFY_SYSTEM").await?;
        let missing = |c: &str| PgError::Protocol(format!("IDENTIFY_SYSTEM returned no {c}"));
        let xlogpos = r.value(0, "xlogpos").ok_or_else(|| missing("xlogpos"))?;
        Ok(SystemIdentity {
            system_id: r
                .value(0, "systemid")
                .ok_or_else(|| missing("systemid"))?
                .to_owned(),
            timeline: r
                .value(0, "timeline")
                .and_then(|t| t.parse().ok())
                .ok_or_else(|| missing("timeline"))?,
            xlogpos: xlogpos
                .parse()
                .map_err(|_| PgError::Protocol(format!("bad xlogpos {xlogpos:?}")))?,
            dbname: r.value(0, "dbname").map(str::to_owned),
        })
    }

    /// `CREATE_REPLICATION_SLOT … LOGICAL pgoutput`; returns the slot's
    /// consistent point, the first LSN it will stream. With `failover`
    /// (PostgreSQL 17+) the slot is a failover slot: standbys with
    /// `sync_replication_slots = on` keep a copy that survives a promotion.
    pub async fn create_logical_slot(&mut self, slot: &SlotName, failover: bool) -> Result<Lsn, PgError> {
        let sql = if failover {
            // The option list exists since PostgreSQL 15, FAILOVER since 17.
            format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT 'nothing', FAILOVER true)",
                slot.quoted()
            )
        } else {
            // The older spelling, accepted from PostgreSQL 10 on.
            format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput NOEXPORT_SNAPSHOT",
                slot.quoted()
            )
        };
        let r = self.simple_query(&sql).await?;
        let point = r.value(0, "consistent_point").ok_or_else(|| {
            PgError::Protocol("CREATE_REPLICATION_SLOT returned no consistent_point".into())
        })?;
        point
            .parse()
            .map_err(|_| PgError::Protocol(format!("bad consistent_point {point:?}")))
    }

    /// `ALTER_REPLICATION_SLOT … (FAILOVER …)` (PostgreSQL 17+): turns an
    /// existing slot into a failover slot, or back.
    pub async fn alter_slot_failover(&mut self, slot: &SlotName, failover: bool) -> Result<(), PgError> {
        let sql = format!("ALTER_REPLICATION_SLOT {} (FAILOVER {failover})", slot.quoted());
        self.simple_query(&sql).await.map(|_| ())
    }

    /// `START_REPLICATION`: the connection becomes a stream of WAL messages.
    pub async fn start_replication(mut self, opts: &StartOptions) -> Result<ReplicationStream, PgError> {
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {} (proto_version '1', publication_names '{}', messages '{}')",
            opts.slot.quoted(),
            opts.start_lsn,
            opts.publication.quoted(),
            opts.messages
        );
        frontend::query(&sql, &mut self.write_buf)?;
        self.flush().await?;
        loop {
            match self.read_frame().await? {
                Frame::CopyBothResponse => return Ok(ReplicationStream { conn: self }),
                Frame::Other(Message::ErrorResponse(body)) => {
                    let err = server_error(&body);
                    // Drain to ReadyForQuery so the error is all we report.
                    while !matches!(self.read_message().await, Ok(Message::ReadyForQuery(_)) | Err(_)) {}
                    return Err(PgError::Server(err));
                }
                Frame::Other(Message::NoticeResponse(_) | Message::ParameterStatus(_)) => {}
                _ => return Err(PgError::Protocol("unexpected answer to START_REPLICATION".into())),
            }
        }
    }
}

/// A connection in CopyBoth mode, streaming WAL.
#[derive(Debug)]
pub struct ReplicationStream {
    conn: ReplicationConnection,
}

impl ReplicationStream {
    /// The walsender's PID.
    pub fn backend_pid(&self) -> i32 {
        self.conn.backend_pid
    }

    /// The next XLogData or keepalive; `None` when the server ended the
    /// stream. Cancel-safe.
    pub async fn next_message(&mut self) -> Result<Option<ReplicationMessage>, PgError> {
        loop {
            match self.conn.read_frame().await? {
                Frame::CopyData(payload) => return Ok(Some(ReplicationMessage::parse(payload)?)),
                Frame::CopyDone => return Ok(None),
                Frame::Other(Message::ErrorResponse(body)) => {
                    return Err(PgError::Server(server_error(&body)))
                }
                Frame::Other(_) => {}
                Frame::CopyBothResponse => {
                    return Err(PgError::Protocol("CopyBothResponse while streaming".into()))
                }
            }
        }
    }

    /// Sends a standby status update.
    pub async fn send_status(&mut self, update: &StandbyStatusUpdate) -> Result<(), PgError> {
        frontend::CopyData::new(update.encode())?.write(&mut self.conn.write_buf);
        self.conn.flush().await
    }

    /// Ends streaming cleanly: CopyDone, then wait (bounded) for the server
    /// to finish, then Terminate.
    pub async fn stop(mut self, wait: Duration) -> Result<(), PgError> {
        frontend::copy_done(&mut self.conn.write_buf);
        self.conn.flush().await?;
        let drain = async {
            loop {
                match self.conn.read_frame().await? {
                    Frame::Other(Message::ReadyForQuery(_)) => return Ok::<_, PgError>(()),
                    Frame::Other(Message::ErrorResponse(body)) => {
                        return Err(PgError::Server(server_error(&body)))
                    }
                    _ => {}
                }
            }
        };
        match tokio::time::timeout(wait, drain).await {
            Ok(r) => r?,
            Err(_) => tracing::warn!("server did not finish the replication stream in time; closing"),
        }
        frontend::terminate(&mut self.conn.write_buf);
        let _ = self.conn.flush().await;
        Ok(())
    }
}
