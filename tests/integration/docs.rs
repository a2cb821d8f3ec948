//! The documentation cannot drift from the code: every relative link and
//! anchor resolves, the configuration reference lists exactly the keys the
//! config types accept, every config key, metric, test and module the docs
//! name exists, and every metric and reason label is documented.
//!
//! The keys come from the types themselves: every section denies unknown
//! fields, so a probe key in a section makes serde list the section's
//! fields (`expected one of ...`). No list is kept by hand.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use outboxd::config::Config;
use outboxd::metrics::{Metrics, DEAD_LETTER_REASONS, PUBLISH_ERROR_REASONS};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md, docs/*.md and the other Markdown files readers reach from them.
fn markdown_files() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md"), root.join("BENCHMARKS.md")];
    for dir in ["docs", "helm/outboxd", "deploy", "examples", "jvm"] {
        collect_markdown(&root.join(dir), &mut files);
    }
    files.retain(|f| f.exists());
    files
}

fn collect_markdown(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect_markdown(&p, out);
        } else if p.extension().is_some_and(|e| e == "md") {
            out.push(p);
        }
    }
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// The lines of a Markdown file outside fenced code blocks, numbered.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The inline code spans of a line.
fn code_spans(line: &str) -> Vec<&str> {
    let mut spans = Vec::new();
    let mut rest = line;
    while let Some(open) = rest.find('`') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else { break };
        spans.push(&after[..close]);
        rest = &after[close + 1..];
    }
    spans
}

/// `line` with its code spans blanked out.
fn without_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else {
            out.push(if in_code { ' ' } else { c });
        }
    }
    out
}

/// The targets of the inline links `[text](target)` and reference
/// definitions `[label]: target` of a line.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut out = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.trim_matches(['<', '>']).to_owned());
        rest = &after[end..];
    }
    let t = line.trim_start();
    if t.starts_with('[') {
        if let Some(def) = t.find("]: ") {
            out.push(t[def + 3..].split_whitespace().next().unwrap_or("").to_owned());
        }
    }
    out
}

/// GitHub's anchor for a heading: lowercase, punctuation dropped, spaces
/// as hyphens; a repeated heading gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let files = markdown_files();
    assert!(files.len() > 10, "found only {files:?}");
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in prose(&text) {
            for target in link_targets(line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().unwrap().join(path)
                };
                let here = format!("{}:{n}: {target}", rel(file));
                if !resolved.exists() {
                    broken.push(format!("{here}: no such file"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    if resolved.extension().is_some_and(|e| e == "md") {
                        let target_text = std::fs::read_to_string(&resolved).unwrap();
                        if !anchors(&target_text).contains(anchor) {
                            broken.push(format!(
                                "{here}: no heading with this anchor in {}",
                                rel(&resolved)
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The folders of the repository a code span may name a file in.
const TREE: &[&str] = &[
    "src/",
    "sdk/",
    "tests/",
    "scripts/",
    "docs/",
    "migrations/",
    "config/",
    "helm/",
    "deploy/",
    "examples/",
    "benches/",
    "jvm/",
    ".ci/",
];

#[test]
fn every_repository_path_the_docs_name_exists() {
    let mut missing = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in prose(&text) {
            for span in code_spans(line) {
                let path = span.split_whitespace().next().unwrap_or("");
                let path = path.split(':').next().unwrap_or("");
                if !TREE.iter().any(|t| path.starts_with(t)) || path.contains(['*', '<', '{', '$']) {
                    continue;
                }
                if !root().join(path).exists() {
                    missing.push(format!("{}:{n}: `{span}`", rel(&file)));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "paths that do not exist:\n{}",
        missing.join("\n")
    );
}

const MINIMAL: &str = "[postgres]\nurl = \"postgres://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n";
const PROBE: &str = "zz_probe_key";

fn insert_probe(table: &mut toml::Table, path: &[&str]) {
    match path.split_first() {
        None => {
            table.insert(PROBE.into(), toml::Value::Integer(1));
        }
        Some((first, rest)) => {
            let entry = table
                .entry(first.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !entry.is_table() {
                *entry = toml::Value::Table(toml::Table::new());
            }
            insert_probe(entry.as_table_mut().unwrap(), rest);
        }
    }
}

/// The fields of the section at `path` (empty: the top level), or `None`
/// when `path` is not a section (a value, or a free table of strings).
fn section_fields(path: &[&str]) -> Option<Vec<String>> {
    let mut doc: toml::Table = MINIMAL.parse().unwrap();
    insert_probe(&mut doc, path);
    let text = toml::to_string(&doc).unwrap();
    let err = match Config::from_toml(&text, |_| None) {
        Ok(_) => panic!("{path:?}: a probe key was accepted:\n{text}"),
        Err(e) => e.to_string(),
    };
    if !err.contains(&format!("unknown field `{PROBE}`")) {
        return None;
    }
    let list = err.split("expected ").nth(1).unwrap_or("");
    Some(list.split('`').skip(1).step_by(2).map(str::to_owned).collect())
}

/// Every key the config types accept, as dotted paths: sections (`kafka`)
/// and keys (`kafka.brokers`); `true` marks a section.
fn type_keys() -> BTreeMap<String, bool> {
    fn walk(path: &mut Vec<String>, out: &mut BTreeMap<String, bool>) {
        let parts: Vec<&str> = path.iter().map(String::as_str).collect();
        let Some(fields) = section_fields(&parts) else {
            out.insert(path.join("."), false);
            return;
        };
        assert!(!fields.is_empty(), "{path:?} lists no fields");
        if !path.is_empty() {
            out.insert(path.join("."), true);
        }
        for f in fields {
            path.push(f);
            walk(path, out);
            path.pop();
        }
    }
    let mut out = BTreeMap::new();
    walk(&mut Vec::new(), &mut out);
    out
}

/// The keys of the reference tables of docs/configuration.md: rows that
/// start with a code span.
fn documented_keys() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    prose(&text)
        .into_iter()
        .filter_map(|(_, line)| {
            let row = line.strip_prefix("| `")?;
            Some(row[..row.find('`')?].to_owned())
        })
        .collect()
}

#[test]
fn the_configuration_reference_lists_exactly_the_keys_the_types_accept() {
    let types = type_keys();
    assert!(types.contains_key("postgres.url") && types.contains_key("kafka.exactly_once.max_events"));
    let keys: BTreeSet<String> = types
        .iter()
        .filter(|(_, section)| !**section)
        .map(|(k, _)| k.clone())
        .collect();
    let documented = documented_keys();
    let missing: Vec<_> = keys.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&keys).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/configuration.md is out of step with the config types.\n\
         accepted but not documented: {missing:?}\n\
         documented but not accepted: {unknown:?}"
    );
}

/// A code span that names a config key: it starts with a section name and
/// a dot (`kafka.delivery`, `routing.value = "payload"`) or is a section
/// header (`[kafka.options]`).
fn mentioned_key<'a>(span: &'a str, sections: &BTreeSet<&str>) -> Option<&'a str> {
    let span = span.trim();
    let key = match span.strip_prefix('[') {
        Some(header) => header.strip_suffix(']')?,
        None => {
            let end = span
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
                .unwrap_or(span.len());
            span[..end].trim_end_matches('.')
        }
    };
    // A file name (`polling.rs`), not a key.
    if [".rs", ".md", ".toml", ".sql", ".sh", ".py", ".yaml", ".json"]
        .iter()
        .any(|ext| key.ends_with(ext))
    {
        return None;
    }
    let (first, _) = key.split_once('.').unwrap_or((key, ""));
    (sections.contains(first) && (key.contains('.') || span.starts_with('['))).then_some(key)
}

/// Kafka's own settings whose names start like a section of ours.
const NOT_CONFIG_KEYS: &[&str] = &["log.message.timestamp.after.max.ms"];

#[test]
fn every_config_key_the_docs_name_exists() {
    let types = type_keys();
    let sections: BTreeSet<&str> = types
        .iter()
        .filter(|(k, section)| **section && !k.contains('.'))
        .map(|(k, _)| k.as_str())
        .collect();
    // Free tables: `[kafka.options]` holds librdkafka's names.
    let free: Vec<&String> = types
        .iter()
        .filter(|(_, section)| !**section)
        .map(|(k, _)| k)
        .collect();
    let mut unknown = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in prose(&text) {
            for span in code_spans(line) {
                let Some(key) = mentioned_key(span, &sections) else {
                    continue;
                };
                let known = types.contains_key(key)
                    || NOT_CONFIG_KEYS.contains(&key)
                    || free.iter().any(|f| key.starts_with(&format!("{f}.")));
                if !known {
                    unknown.push(format!("{}:{n}: `{span}`", rel(&file)));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "config keys the types do not accept:\n{}",
        unknown.join("\n")
    );
}

/// The metric families outboxd exports, with every labelled family touched
/// so that it shows.
fn exported_metrics() -> BTreeSet<String> {
    let m = Metrics::new().unwrap();
    m.kafka_transactions.with_label_values(&["committed"]).inc();
    m.build_info.with_label_values(&["test"]).set(1);
    // With [coordination], the replica's group has a few of its own.
    let coordination = outboxd::coordination::Status {
        classes: vec![outboxd::coordination::ClassStatus::default()],
        ..Default::default()
    };
    let text = m.encode() + &coordination.metrics_text();
    let names: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(names.len() > 15, "{names:?}");
    names
}

/// Test functions and items under `dir`, by file.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Whether some file under `dir` defines an item called `name`.
fn defines(dir: &Path, name: &str) -> bool {
    let mut files = Vec::new();
    if dir.is_dir() {
        rust_files(dir, &mut files);
    } else {
        files.push(dir.to_owned());
    }
    let patterns = [
        "fn ", "struct ", "enum ", "mod ", "const ", "trait ", "type ", "static ",
    ];
    files.iter().any(|f| {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        patterns.iter().any(|p| {
            let needle = format!("{p}{name}");
            text.match_indices(&needle).any(|(at, _)| {
                let next = text[at + needle.len()..].chars().next();
                !next.is_some_and(|c| c.is_alphanumeric() || c == '_')
            })
        })
    })
}

/// Resolves `a::b::c` from `base`: folders and files as far as they go,
/// then items defined in what is left.
fn resolves(base: &Path, segments: &[&str]) -> Option<bool> {
    let first = segments[0];
    let mut at = if base.join(first).is_dir() {
        base.join(first)
    } else if base.join(format!("{first}.rs")).is_file() {
        base.join(format!("{first}.rs"))
    } else {
        return None;
    };
    for (i, seg) in segments.iter().enumerate().skip(1) {
        if at.is_dir() && at.join(seg).is_dir() {
            at = at.join(seg);
        } else if at.is_dir() && at.join(format!("{seg}.rs")).is_file() {
            at = at.join(format!("{seg}.rs"));
        } else {
            return Some(segments[i..].iter().all(|s| defines(&at, s)));
        }
    }
    Some(true)
}

/// Whether `file` declares a test function or a module called `name`.
fn declares_test(file: &Path, name: &str) -> bool {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    if text.contains(&format!("mod {name};")) {
        return true;
    }
    text.match_indices(&format!("fn {name}(")).any(|(at, _)| {
        let before = String::from_utf8_lossy(&text.as_bytes()[at.saturating_sub(120)..at]);
        before.contains("#[test]") || before.contains("#[tokio::test")
    })
}

/// The module paths (`every_version::slots::name`) of the tests and test
/// modules called `name` under `dir`.
fn test_paths(dir: &Path, name: &str) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    files
        .iter()
        .filter(|f| declares_test(f, name))
        .map(|f| {
            let module = f.strip_prefix(dir).unwrap().with_extension("");
            let mut parts: Vec<String> = module.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            parts.push(name.to_owned());
            parts.join("::")
        })
        .collect()
}

#[test]
fn every_metric_test_and_module_the_docs_name_exists_and_every_metric_is_documented() {
    let metrics = exported_metrics();
    let root = root();
    let trees = [
        root.join("tests/integration"),
        root.join("src"),
        root.join("sdk/src"),
    ];
    let mut unknown = Vec::new();
    let mut mentioned = BTreeSet::new();
    // Tables the migrations create (`outboxd_parked`) are named too.
    let tables: BTreeSet<String> =
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations"))
            .unwrap()
            .flat_map(|e| {
                let sql = std::fs::read_to_string(e.unwrap().path()).unwrap();
                sql.lines()
                    .filter_map(|l| l.trim().strip_prefix("CREATE TABLE IF NOT EXISTS "))
                    .filter_map(|rest| rest.split_whitespace().next().map(str::to_owned))
                    .collect::<Vec<_>>()
            })
            .collect();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in prose(&text) {
            for span in code_spans(line) {
                let span = span.trim();
                let here = || format!("{}:{n}: `{span}`", rel(&file));
                // A metric, perhaps with labels or a comparison.
                if let Some(name) = span.strip_prefix("outboxd_").map(|_| {
                    let end = span
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(span.len());
                    &span[..end]
                }) {
                    let family = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| name.strip_suffix(s))
                        .filter(|f| metrics.contains(*f))
                        .unwrap_or(name);
                    if metrics.contains(family) {
                        mentioned.insert(family.to_owned());
                    } else if !trees.iter().any(|t| defines(t, name)) && !tables.contains(name) {
                        unknown.push(format!("{}: no such metric, test or table", here()));
                    }
                    continue;
                }
                // A Rust path: a test (`relay::confirmed_lsn_...`) or a
                // module or item (`kafka::sink`, `config::Delivery`).
                let path = span
                    .trim_start_matches("crate::")
                    .trim_start_matches("outboxd::")
                    .trim_start_matches("outbox_sdk::");
                let segments: Vec<&str> = path.split("::").collect();
                let is_path = segments.len() > 1
                    && segments
                        .iter()
                        .all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
                if !is_path {
                    continue;
                }
                let found: Vec<bool> = trees.iter().filter_map(|t| resolves(t, &segments)).collect();
                if found.contains(&true) {
                    continue;
                }
                let last = segments[segments.len() - 1];
                let tests = test_paths(&trees[0], last);
                if !tests.is_empty() {
                    unknown.push(format!("{}: the test is {}", here(), tests.join(" or ")));
                } else if !found.is_empty() {
                    unknown.push(format!("{}: no such test, module or item", here()));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "names the docs use that the code does not have:\n{}",
        unknown.join("\n")
    );
    let undocumented: Vec<_> = metrics.difference(&mentioned).collect();
    assert!(
        undocumented.is_empty(),
        "metrics no document names: {undocumented:?}"
    );
    // Every reason label is listed where its metric is described.
    let ops = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    for (metric, reasons) in [
        ("outboxd_publish_errors_total", PUBLISH_ERROR_REASONS),
        ("outboxd_dead_letters_total", DEAD_LETTER_REASONS),
    ] {
        let row = ops
            .lines()
            .find(|l| l.starts_with(&format!("| `{metric}")))
            .unwrap_or_else(|| panic!("docs/operations.md has no table row for {metric}"));
        let listed: BTreeSet<&str> = code_spans(row).into_iter().collect();
        let missing: Vec<_> = reasons.iter().filter(|r| !listed.contains(**r)).collect();
        assert!(
            missing.is_empty(),
            "{metric}: reasons not in docs/operations.md: {missing:?}"
        );
    }
}

/// `text` with its whitespace collapsed and the `#` of TOML comments gone,
/// so a phrase matches across wrapped lines.
fn flattened(text: &str) -> String {
    text.lines()
        .flat_map(|l| l.trim_start().trim_start_matches('#').split_whitespace())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The in-flight budget the docs state is the code's: consumers size their
/// deduplication windows from docs/guarantees.md.
#[test]
fn the_documented_inflight_budget_is_the_one_the_code_grows() {
    use outboxd::config::kafka::budget::*;
    let grouped = |n: usize| {
        let s = n.to_string();
        let mut out = String::new();
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    };
    let records_to = FLOOR_RECORDS / PER_PARTITION_RECORDS;
    let bytes_to = FLOOR_BYTES / PER_PARTITION_BYTES;
    let kib = PER_PARTITION_BYTES >> 10;
    let (floor, each, ceiling) = (
        grouped(FLOOR_RECORDS),
        PER_PARTITION_RECORDS,
        grouped(CEILING_RECORDS),
    );
    for (file, phrases) in [
        (
            "docs/configuration.md",
            vec![
                format!(
                    "`{FLOOR_RECORDS}` up to {records_to} partitions, {each} per partition beyond, at most `{CEILING_RECORDS}`"
                ),
                format!("up to {bytes_to} partitions, {kib} KiB per partition beyond"),
            ],
        ),
        (
            "docs/guarantees.md",
            vec![format!(
                "{floor} up to {records_to} partitions, {each} more per partition the session writes to beyond, at most {ceiling}"
            )],
        ),
        (
            "config/outboxd.toml",
            vec![format!(
                "{floor} events up to {records_to} partitions and {each} per partition beyond, 4 MiB up to {bytes_to} partitions and {kib} KiB per partition beyond; at most {ceiling} events and 16 MiB"
            )],
        ),
    ] {
        let text = flattened(&std::fs::read_to_string(root().join(file)).unwrap());
        for phrase in phrases {
            assert!(text.contains(&phrase), "{file} does not say: {phrase}");
        }
    }
    assert_eq!(
        (FLOOR_BYTES, CEILING_BYTES),
        (4 << 20, 16 << 20),
        "the docs say 4 MiB and 16 MiB"
    );
}
