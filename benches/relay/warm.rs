//! Warming the broker until its JIT compiler has settled.
//!
//! A broker that has just started spends much of its CPU compiling its
//! own hot paths: C2's compiler threads took 0.45–1.03 s of a 200,000-event
//! drain, as much as the request handlers, in a run whose warm-up was three
//! fixed rounds (measured with [`crate::measure::thread_cpu`]). On two
//! cores those threads take the CPU the walsender and the relay need, at
//! moments of their own choosing, so which drain met them decided a ratio
//! more than the relay did. A broker in production has run for days and
//! compiles nothing. So a warm-up round is repeated until the compiler
//! threads took at most [`SETTLED_SHARE`] of the broker's CPU in
//! [`QUIET_ROUNDS`] rounds in a row, at most [`MAX_ROUNDS`] rounds or
//! [`MAX_SECS`]; each drain then prints what the compiler still took.

use std::time::{Duration, Instant};

use crate::measure::thread_cpu;

/// The compiler threads' most share of the broker's CPU in a settled round.
pub const SETTLED_SHARE: f64 = 0.05;
/// Settled rounds in a row before the warm-up ends.
pub const QUIET_ROUNDS: usize = 2;
/// The warm-up ends after this many rounds, settled or not.
pub const MAX_ROUNDS: usize = 40;
/// Or after this long.
pub const MAX_SECS: u64 = 240;

/// The CPU seconds of `pids`' JIT compiler threads, and of all their
/// threads.
pub fn compiler_and_total(pids: &[u32]) -> (f64, f64) {
    let mut compiler = 0.0;
    let mut total = 0.0;
    for &pid in pids {
        for (class, secs) in thread_cpu(pid) {
            if is_compiler(&class) {
                compiler += secs;
            }
            total += secs;
        }
    }
    (compiler, total)
}

/// A HotSpot JIT compiler thread (`C1 CompilerThread0`, `C2
/// CompilerThread1`, with digits dropped by [`thread_cpu`]).
pub fn is_compiler(class: &str) -> bool {
    class.contains("CompilerThre")
}

/// Runs `round` (one warm-up round, which names itself in the log) until
/// the broker's compiler has settled. Returns the rounds run.
pub fn until_settled(broker_pids: &[u32], mut round: impl FnMut(usize)) -> usize {
    let start = Instant::now();
    let mut quiet = 0;
    let mut rounds = 0;
    while rounds < MAX_ROUNDS && start.elapsed() < Duration::from_secs(MAX_SECS) {
        let (c0, t0) = compiler_and_total(broker_pids);
        round(rounds);
        rounds += 1;
        let (c1, t1) = compiler_and_total(broker_pids);
        let (compiler, total) = (c1 - c0, t1 - t0);
        let share = if total > 0.0 { compiler / total } else { 0.0 };
        eprintln!(
            "bench: warm-up round {rounds}: the broker's JIT compiler {compiler:.2} s of its {total:.2} s ({:.0}%)",
            share * 100.0
        );
        quiet = if share <= SETTLED_SHARE { quiet + 1 } else { 0 };
        if quiet >= QUIET_ROUNDS {
            eprintln!("bench: the broker's JIT compiler settled after {rounds} warm-up rounds");
            return rounds;
        }
    }
    eprintln!(
        "bench: the broker's JIT compiler did not settle in {rounds} warm-up rounds ({:.0} s); measuring anyway",
        start.elapsed().as_secs_f64()
    );
    rounds
}
