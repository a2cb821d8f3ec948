//! The commands besides `run`: `check` ([`check`]), `status` ([`status`]),
//! `replay` ([`replay`]), `retention` ([`retention`]), and the recovery
//! steps of `progress` ([`progress`]).

pub mod check;
pub mod parked;
pub mod progress;
pub mod replay;
pub mod retention;
pub mod status;
