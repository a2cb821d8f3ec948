//! What the benchmark reads from the operating system and from outboxd's
//! metrics: a process's peak RSS, CPU time and start time, percentiles,
//! and the commit → ack histogram.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs_f64()
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// The fields of `/proc/PID/stat` after the command name; index 0 is the
/// state (field 3 in proc(5)'s 1-based numbering).
fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// A running process's peak RSS (`VmHWM`, MiB) and CPU seconds
/// (`utime + stime`). The kernel keeps the peak, so one reading at the end
/// of a run is the peak of the whole run.
pub fn usage(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm_kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0.0);
    let fields = stat_fields(pid);
    // utime and stime are fields 14 and 15.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
        .sum();
    (hwm_kib / 1024.0, ticks / clk_tck())
}

/// One reading of the threads of some processes: each thread's id, class
/// and CPU seconds (`utime + stime`). The class is the thread's name with
/// its digits and trailing separators dropped (`C2 CompilerThread0` and
/// `C2 CompilerThread1` are one class), so a JVM's request handlers, its
/// network threads, its JIT compilers and its garbage collector each show.
#[derive(Clone, Debug, Default)]
pub struct Threads(std::collections::BTreeMap<(u32, u32), (String, f64)>);

/// The threads of `pids` now (a process that is gone has none).
pub fn threads(pids: &[u32]) -> Threads {
    let mut out = std::collections::BTreeMap::new();
    let tck = clk_tck();
    for &pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
                continue;
            };
            // A thread that exits while the directory is read has no stat.
            let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let class: String = stat[open + 1..close]
                .chars()
                .filter(|c| !c.is_ascii_digit())
                .collect::<String>()
                .trim_end_matches(['-', '_', '#', ' '])
                .to_owned();
            // After the name: state, then utime and stime at 11 and 12
            // (fields 14 and 15 of proc(5)).
            let ticks: f64 = stat[close + 1..]
                .split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|f| f.parse::<f64>().ok())
                .sum();
            out.insert((pid, tid), (class, ticks / tck));
        }
    }
    Threads(out)
}

/// What each thread class spent between two readings.
#[derive(Clone, Debug, Default)]
pub struct ThreadDelta {
    /// CPU seconds by class, of the threads alive at the later reading.
    pub by_class: std::collections::BTreeMap<String, f64>,
    /// The classes of the threads that exited between the readings: their
    /// CPU since the earlier one is not in `by_class` (the kernel keeps it
    /// only in the process's total), so a class listed here is counted
    /// short.
    pub exited: Vec<String>,
}

impl Threads {
    /// What the threads spent from this reading to `later`.
    pub fn delta(&self, later: &Threads) -> ThreadDelta {
        let mut by_class = std::collections::BTreeMap::new();
        for (id, (class, secs)) in &later.0 {
            let before = self.0.get(id).map_or(0.0, |(_, s)| *s);
            *by_class.entry(class.clone()).or_insert(0.0) += secs - before;
        }
        let exited = self
            .0
            .iter()
            .filter(|(id, _)| !later.0.contains_key(id))
            .map(|(_, (class, _))| class.clone())
            .collect();
        ThreadDelta { by_class, exited }
    }
}

impl ThreadDelta {
    /// The CPU seconds of the classes `matching` picks.
    pub fn of(&self, matching: impl Fn(&str) -> bool) -> f64 {
        self.by_class
            .iter()
            .filter(|(class, _)| matching(class))
            .map(|(_, s)| s)
            .sum()
    }

    /// Whether a thread of a class `matching` picks exited between the
    /// readings (so [`ThreadDelta::of`] counts it short).
    pub fn lost(&self, matching: impl Fn(&str) -> bool) -> bool {
        self.exited.iter().any(|class| matching(class))
    }

    /// The classes, the largest first, as "class 0.12 s" items, and those
    /// with threads that exited.
    pub fn summary(&self) -> String {
        let mut rows: Vec<(&String, f64)> = self
            .by_class
            .iter()
            .map(|(k, v)| (k, *v))
            .filter(|(_, d)| *d >= 0.01)
            .collect();
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut out = rows
            .iter()
            .map(|(k, d)| format!("{k} {d:.2} s"))
            .collect::<Vec<_>>()
            .join(", ");
        if !self.exited.is_empty() {
            out.push_str(&format!(
                "; exited meanwhile, not counted since: {}",
                self.exited.join(", ")
            ));
        }
        out
    }
}

/// The log directories of the broker process `pid`: `log.dirs` (or
/// `log.dir`) of the `server.properties` its command line names.
pub fn broker_log_dirs(pid: u32) -> Vec<std::path::PathBuf> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let Some(props) = cmdline
        .split(|b| *b == 0)
        .filter_map(|a| std::str::from_utf8(a).ok())
        .find(|a| a.ends_with("server.properties"))
    else {
        return Vec::new();
    };
    let text = std::fs::read_to_string(props).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("log.dirs=").or_else(|| l.strip_prefix("log.dir=")))
        .map(|v| v.split(',').map(|d| std::path::PathBuf::from(d.trim())).collect())
        .unwrap_or_default()
}

/// The record batches the broker stored in `topic`'s partitions at
/// offsets from `from[p]` on (partition `p`), read from its log segments
/// in `dirs`: (batches, records). A v2 batch starts with its base offset
/// (8 bytes) and length (4, what follows the first 12 bytes); its record
/// count sits at byte 57.
pub fn stored_batches(dirs: &[std::path::PathBuf], topic: &str, from: &[i64]) -> (u64, u64) {
    let (mut batches, mut records) = (0u64, 0u64);
    for (p, &first) in from.iter().enumerate() {
        for dir in dirs {
            let Ok(files) = std::fs::read_dir(dir.join(format!("{topic}-{p}"))) else {
                continue;
            };
            for file in files.flatten() {
                if file.path().extension().is_none_or(|e| e != "log") {
                    continue;
                }
                let data = std::fs::read(file.path()).unwrap_or_default();
                let mut at = 0usize;
                while at + 61 <= data.len() {
                    let base = i64::from_be_bytes(data[at..at + 8].try_into().unwrap());
                    let length = i32::from_be_bytes(data[at + 8..at + 12].try_into().unwrap());
                    if length <= 0 {
                        break;
                    }
                    if base >= first {
                        batches += 1;
                        records += u64::from(u32::from_be_bytes(data[at + 57..at + 61].try_into().unwrap()));
                    }
                    at += 12 + length as usize;
                }
            }
        }
    }
    (batches, records)
}

/// When a running process started, in Unix seconds (to the kernel's clock
/// tick, 10 ms). Start-up is measured from here for every relay, so the
/// launcher in front of it (a shell script for Kafka Connect) is not
/// counted against it.
pub fn started_at(pid: u32) -> f64 {
    let now = unix_now();
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .expect("/proc/uptime");
    // starttime is field 22: clock ticks after boot.
    let ticks: f64 = stat_fields(pid)
        .get(19)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("process {pid} is gone; its start time is unknown"));
    now - uptime + ticks / clk_tck()
}

/// The p-quantile of sorted samples (nearest rank).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

/// The median of unsorted samples.
pub fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    percentile(&s, 0.5)
}

/// p-quantile from Prometheus cumulative buckets, linearly interpolated.
pub fn histogram_quantile(buckets: &[(f64, f64)], p: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    let rank = total * p;
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return prev.0;
            }
            let width = count - prev.1;
            let frac = if width > 0.0 { (rank - prev.1) / width } else { 0.0 };
            return prev.0 + (le - prev.0) * frac;
        }
        prev = (le, count);
    }
    f64::NAN
}

/// outboxd's `/metrics` page, or an empty string.
pub fn scrape(port: u16) -> String {
    ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .unwrap_or_default()
}

/// The buckets of `outboxd_commit_to_ack_seconds` as (le, cumulative count).
pub fn ack_histogram(text: &str) -> Vec<(f64, f64)> {
    histogram(text, "outboxd_commit_to_ack_seconds", "")
}

/// Exactly-once: the Kafka commit histogram's buckets.
pub fn commit_histogram(text: &str) -> Vec<(f64, f64)> {
    histogram(text, "outboxd_kafka_commit_seconds", "")
}

/// A histogram's cumulative buckets `(le, count)` from the exposition, of
/// the series whose labels hold `label` (any, when it is empty).
pub fn histogram(text: &str, name: &str, label: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    text.lines()
        .filter(|l| l.starts_with(&prefix) && l.contains(label))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}
