//! Warming the broker until its JIT compiler has settled.
//!
//! A broker that has just started spends much of its CPU compiling its
//! own hot paths: HotSpot's compiler threads took 0.45–1.03 s of each
//! 200,000-event drain, 42–49% of the broker's CPU, in a run whose warm-up
//! was three fixed rounds (measured with [`crate::measure::threads`]). On
//! two cores those threads take the CPU the walsender and the relay need,
//! at moments of their own choosing. A broker in production has run for
//! days and compiles little. So a warm-up round is repeated until the
//! compiler threads took at most [`SETTLED_SHARE`] of the broker's CPU in
//! [`QUIET_ROUNDS`] rounds in a row, at most [`MAX_ROUNDS`] rounds or
//! [`MAX_SECS`]; each drain then reports what the compiler still took.
//!
//! The broker's CPU is its process's (`/proc/PID/stat`, which keeps what
//! exited threads spent); the compiler's is summed over its threads,
//! which HotSpot starts and stops as its queue grows and shrinks. A round
//! in which a compiler thread exited is counted short, so it is never
//! taken as quiet.

use std::time::{Duration, Instant};

use crate::measure::{threads, usage, ThreadDelta};

/// The compiler threads' most share of the broker's CPU in a settled round.
pub const SETTLED_SHARE: f64 = 0.05;
/// Settled rounds in a row before the warm-up ends.
pub const QUIET_ROUNDS: usize = 2;
/// The warm-up ends after this many rounds, settled or not.
pub const MAX_ROUNDS: usize = 40;
/// Or after this long.
pub const MAX_SECS: u64 = 240;

/// A HotSpot JIT compiler thread (`C1 CompilerThread0`, `C2
/// CompilerThread1`, digits dropped by [`threads`]; the kernel cuts the
/// name at 15 bytes).
pub fn is_compiler(class: &str) -> bool {
    class.contains("CompilerThre")
}

/// The broker's CPU between two points, and its compiler's share of it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Jit {
    /// The broker processes' CPU seconds.
    pub total_s: f64,
    /// Of it, the compiler threads' (at least, when `short`).
    pub compiler_s: f64,
    /// A compiler thread exited meanwhile: `compiler_s` is counted short.
    pub short: bool,
}

impl Jit {
    /// Quiet: the broker was read, it worked, and its compiler took at most
    /// `share` of that, counted whole.
    pub fn quiet(&self, share: f64) -> bool {
        self.total_s > 0.0 && !self.short && self.compiler_s <= share * self.total_s
    }

    /// For the log: "0.12 s of its 1.30 s (9.2%)".
    pub fn describe(&self) -> String {
        if self.total_s <= 0.0 {
            return "not measured (the broker's CPU did not move or could not be read)".to_owned();
        }
        format!(
            "{}{:.2} s of its {:.2} s ({:.1}%)",
            if self.short { "at least " } else { "" },
            self.compiler_s,
            self.total_s,
            100.0 * self.compiler_s / self.total_s
        )
    }
}

/// A start point for [`Meter::stop`]: the broker's CPU and threads now.
#[derive(Clone, Debug)]
pub struct Meter {
    pids: Vec<u32>,
    total_s: f64,
    threads: crate::measure::Threads,
}

impl Meter {
    pub fn start(pids: &[u32]) -> Meter {
        Meter {
            pids: pids.to_vec(),
            total_s: pids.iter().map(|&p| usage(p).1).sum(),
            threads: threads(pids),
        }
    }

    /// What the broker spent since [`Meter::start`], with the per-class
    /// breakdown of its threads.
    pub fn stop(&self) -> (Jit, ThreadDelta) {
        let total_s = self.pids.iter().map(|&p| usage(p).1).sum::<f64>() - self.total_s;
        let delta = self.threads.delta(&threads(&self.pids));
        let jit = Jit {
            total_s,
            compiler_s: delta.of(is_compiler),
            short: delta.lost(is_compiler),
        };
        (jit, delta)
    }
}

/// Runs `round` (one warm-up round, which names itself in the log) until
/// the broker's compiler has settled. Returns the rounds run and whether
/// it settled.
pub fn until_settled(broker_pids: &[u32], mut round: impl FnMut(usize)) -> (usize, bool) {
    let start = Instant::now();
    let mut quiet = 0;
    let mut rounds = 0;
    while rounds < MAX_ROUNDS && start.elapsed() < Duration::from_secs(MAX_SECS) {
        let meter = Meter::start(broker_pids);
        round(rounds);
        rounds += 1;
        let (jit, _) = meter.stop();
        eprintln!(
            "bench: warm-up round {rounds}: the broker's JIT compiler {}",
            jit.describe()
        );
        quiet = if jit.quiet(SETTLED_SHARE) { quiet + 1 } else { 0 };
        if quiet >= QUIET_ROUNDS {
            eprintln!("bench: the broker's JIT compiler settled after {rounds} warm-up rounds");
            return (rounds, true);
        }
    }
    eprintln!(
        "bench: the broker's JIT compiler did not settle in {rounds} warm-up rounds ({:.0} s); measuring anyway",
        start.elapsed().as_secs_f64()
    );
    (rounds, false)
}
