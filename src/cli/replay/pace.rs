//! Throttling (`--rate`) and progress for a replay.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// The most lost time a throttled replay makes up after a stall.
pub const MAX_BURST: Duration = Duration::from_secs(1);

/// Keeps a replay at or under `rate` records a second, on average since
/// it started. After a stall (a slow batch read, a busy machine) it makes
/// up at most [`MAX_BURST`] of lost time, so the broker and consumers never
/// see a burst larger than that.
#[derive(Debug)]
pub struct Throttle {
    rate: Option<f64>,
    started: tokio::time::Instant,
    admitted: u64,
}

impl Throttle {
    pub fn new(rate: Option<f64>) -> Self {
        Throttle {
            rate: rate.filter(|r| *r > 0.0),
            started: tokio::time::Instant::now(),
            admitted: 0,
        }
    }

    /// Waits until one more record may be sent.
    pub async fn admit(&mut self) {
        if let Some(rate) = self.rate {
            let due = self.started + Duration::from_secs_f64(self.admitted as f64 / rate);
            let now = tokio::time::Instant::now();
            if now > due + MAX_BURST {
                // Forget the stall beyond the allowed burst.
                self.started += now - due - MAX_BURST;
            } else {
                tokio::time::sleep_until(due).await;
            }
        }
        self.admitted += 1;
    }
}

/// Progress: a line redrawn on a terminal, a line every ten seconds
/// otherwise (a log collector, a CI job), on stderr.
#[derive(Debug)]
pub struct Progress {
    total: u64,
    started: Instant,
    last_shown: Option<Instant>,
    terminal: bool,
    every: Duration,
}

impl Progress {
    pub fn new(total: u64) -> Self {
        let terminal = std::io::stderr().is_terminal();
        Progress {
            total,
            started: Instant::now(),
            last_shown: None,
            terminal,
            every: if terminal {
                Duration::from_millis(200)
            } else {
                Duration::from_secs(10)
            },
        }
    }

    /// `done` of the total are handled; shows it when it is time to.
    pub fn update(&mut self, done: u64) {
        let now = Instant::now();
        if self.last_shown.is_some_and(|t| now - t < self.every) {
            return;
        }
        self.last_shown = Some(now);
        self.show(done);
    }

    fn show(&self, done: u64) {
        let line = progress_line(done, self.total, self.started.elapsed());
        let mut err = std::io::stderr().lock();
        let _ = if self.terminal {
            write!(err, "\r\x1b[2K{line}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }

    /// Ends the progress line on a terminal.
    pub fn finish(&mut self, done: u64) {
        if self.terminal {
            self.show(done);
            let _ = writeln!(std::io::stderr());
        }
    }
}

/// `replay: 1200/5000 rows (24%), 400/s, about 10 s left`.
pub fn progress_line(done: u64, total: u64, elapsed: Duration) -> String {
    let rate = done as f64 / elapsed.as_secs_f64().max(0.001);
    let percent = (done * 100).checked_div(total).unwrap_or(100);
    let left = if rate > 0.0 && total > done {
        format!(", about {} s left", ((total - done) as f64 / rate).ceil() as u64)
    } else {
        String::new()
    };
    format!("replay: {done}/{total} rows ({percent}%), {rate:.0}/s{left}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_how_far_how_fast_and_how_long() {
        assert_eq!(
            progress_line(1200, 5000, Duration::from_secs(3)),
            "replay: 1200/5000 rows (24%), 400/s, about 10 s left"
        );
        assert_eq!(
            progress_line(0, 0, Duration::ZERO),
            "replay: 0/0 rows (100%), 0/s"
        );
    }

    #[tokio::test]
    async fn the_throttle_never_runs_ahead_of_the_rate() {
        // A lower bound only: a busy machine may be slower, never faster.
        let mut t = Throttle::new(Some(1000.0));
        let start = std::time::Instant::now();
        for _ in 0..201 {
            t.admit().await;
        }
        assert!(
            start.elapsed() >= Duration::from_millis(200),
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test]
    async fn after_a_stall_the_throttle_makes_up_one_second_at_most() {
        let mut t = Throttle::new(Some(100.0));
        t.admit().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // 1.5 s behind: one second's worth goes at once, then the rate
        // holds again (a lower bound only: a busy machine is slower).
        let start = std::time::Instant::now();
        for _ in 0..100 {
            t.admit().await;
        }
        let burst = start.elapsed();
        for _ in 0..20 {
            t.admit().await;
        }
        assert!(
            start.elapsed() >= burst + Duration::from_millis(190),
            "{:?} after a burst of {burst:?}",
            start.elapsed()
        );
    }
}
