//! The commands besides `run`: `check` ([`check`]), `status` ([`status`]),
//! `replay` ([`replay`]), `retention` ([`retention`]), the recovery
//! steps of `progress` ([`progress`]), and `import debezium` ([`import`]).

pub mod check;
pub mod import;
pub mod parked;
pub mod progress;
pub mod replay;
pub mod retention;
pub mod status;
