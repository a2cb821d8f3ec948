//! Timeline history: where each ancestor timeline of a server ended.
//!
//! A promotion (or a point-in-time recovery) starts a new timeline. WAL
//! before the switch point is the same on the old and the new timeline;
//! past it, the old timeline's WAL may never have reached the new one, and
//! the same LSNs may now hold other records. So a position recorded on an
//! ancestor timeline still means the same on this server only if it lies
//! at or before that timeline's switch point. `TIMELINE_HISTORY <tli>`
//! returns the history file of timeline `tli`: one line per ancestor,
//! `<ancestor tli> <switch LSN> <reason>`, tab-separated.

use std::collections::BTreeMap;

use crate::lsn::Lsn;

/// The parsed history file of one timeline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TimelineHistory {
    /// Ancestor timeline → the LSN at which it was left.
    ends: BTreeMap<u32, Lsn>,
}

impl TimelineHistory {
    /// Parses a history file; blank lines and `#` comments are skipped, as
    /// PostgreSQL does.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut ends = BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(tli), Some(lsn)) = (fields.next(), fields.next()) else {
                return Err(format!("timeline history line {line:?} has no switch point"));
            };
            let tli: u32 = tli
                .parse()
                .map_err(|_| format!("timeline history line {line:?}: bad timeline {tli:?}"))?;
            let lsn: Lsn = lsn
                .parse()
                .map_err(|_| format!("timeline history line {line:?}: bad LSN {lsn:?}"))?;
            ends.insert(tli, lsn);
        }
        Ok(TimelineHistory { ends })
    }

    /// Where `timeline` was left on the way to this one; `None` when it is
    /// not an ancestor.
    pub fn switch_point(&self, timeline: u32) -> Option<Lsn> {
        self.ends.get(&timeline).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_postgresql_writes() {
        let h = TimelineHistory::parse(
            "1\t0/3000060\tno recovery target specified\n\n# a comment\n2\t0/5A00028\tno recovery target specified\n",
        )
        .unwrap();
        assert_eq!(h.switch_point(1), Some(Lsn(0x300_0060)));
        assert_eq!(h.switch_point(2), Some(Lsn(0x5A0_0028)));
        assert_eq!(h.switch_point(3), None);
        assert!(TimelineHistory::parse("1\n").is_err());
        assert!(TimelineHistory::parse("x\t0/1\tr\n").is_err());
        assert!(TimelineHistory::parse("1\tzz\tr\n").is_err());
        assert_eq!(TimelineHistory::parse("").unwrap(), TimelineHistory::default());
    }
}
