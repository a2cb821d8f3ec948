//! The SDK's errors.

/// tokio-postgres prints only "db error" for server errors: show the
/// server's message and SQLSTATE, or the underlying cause.
pub fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        );
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// A database or input problem.
#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    #[error("PostgreSQL: {}", describe(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    #[error("stored JSON does not match the expected shape: {0}")]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Ident(#[from] crate::schema::IdentError),
    #[error("migration {name} changed after it was applied (checksum {applied} in the database, {current} now): migrations are append-only, add a new one instead")]
    MigrationChanged {
        name: &'static str,
        applied: String,
        current: String,
    },
}

impl SdkError {
    /// The SQLSTATE of a server error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            SdkError::Db(e) => e.code().map(|c| c.code()),
            _ => None,
        }
    }
}
