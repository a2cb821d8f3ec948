//! A pool of PostgreSQL clients (deadpool), each connected with outboxd's
//! own connect (the same URL syntax, TLS rules and secrets handling as the
//! daemon).

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use outboxd::config::conninfo::PgConnectConfig;
use outboxd::postgres::admin::AdminError;

#[derive(Debug)]
pub struct Manager {
    cfg: PgConnectConfig,
}

impl managed::Manager for Manager {
    type Type = tokio_postgres::Client;
    type Error = AdminError;

    async fn create(&self) -> Result<tokio_postgres::Client, AdminError> {
        outboxd::postgres::admin::connect(&self.cfg).await
    }

    async fn recycle(&self, client: &mut tokio_postgres::Client, _: &Metrics) -> RecycleResult<AdminError> {
        if client.is_closed() {
            return Err(RecycleError::message("the connection is closed"));
        }
        Ok(())
    }
}

pub type Pool = managed::Pool<Manager>;
pub type PoolError = managed::PoolError<AdminError>;

pub fn new(cfg: PgConnectConfig, size: usize) -> Result<Pool, managed::BuildError> {
    Pool::builder(Manager { cfg }).max_size(size).build()
}
