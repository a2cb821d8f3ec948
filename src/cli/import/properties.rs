//! Java `.properties` text, as `java.util.Properties.load` reads it: the
//! format of a Kafka Connect standalone connector or worker file.
//!
//! * lines starting (after whitespace) with `#` or `!` are comments, and
//!   never continue;
//! * a line ending in an odd number of `\` continues on the next, whose
//!   leading whitespace is dropped;
//! * the key ends at the first unescaped `=`, `:` or whitespace; then
//!   whitespace, at most one `=` or `:`, and whitespace again are skipped;
//! * `\t`, `\n`, `\r`, `\f` and `\uXXXX` are escapes, and `\` before any
//!   other character stands for it; trailing whitespace of a value is kept;
//! * the last of duplicate keys wins.
//!
//! The file is read as UTF-8 (Java reads ISO-8859-1; non-ASCII characters
//! in a connector file are written as `\u` escapes by Java's own tools).

use std::collections::BTreeMap;

/// A property file's pairs; the last of duplicate keys wins.
pub fn parse(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let mut lines = text.lines().enumerate();
    while let Some((number, line)) = lines.next() {
        let trimmed = line.trim_start_matches([' ', '\t', '\x0c']);
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with('!') {
            continue;
        }
        let mut logical = String::from(trimmed);
        while ends_in_odd_backslashes(&logical) {
            logical.pop();
            match lines.next() {
                Some((_, next)) => logical.push_str(next.trim_start_matches([' ', '\t', '\x0c'])),
                None => break,
            }
        }
        let (key, value) = split(&logical);
        let key = unescape(key).map_err(|e| format!("line {}: {e}", number + 1))?;
        let value = unescape(value).map_err(|e| format!("line {}: {e}", number + 1))?;
        out.insert(key, value);
    }
    Ok(out)
}

fn ends_in_odd_backslashes(s: &str) -> bool {
    s.bytes().rev().take_while(|&b| b == b'\\').count() % 2 == 1
}

/// The raw key and raw value of a logical line.
fn split(line: &str) -> (&str, &str) {
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'=' | b':' | b' ' | b'\t' | b'\x0c' => break,
            _ => i += 1,
        }
    }
    let i = i.min(bytes.len());
    let key = &line[..i];
    let mut rest = &line[i..];
    rest = rest.trim_start_matches([' ', '\t', '\x0c']);
    if let Some(r) = rest.strip_prefix(['=', ':']) {
        rest = r.trim_start_matches([' ', '\t', '\x0c']);
    }
    (key, rest)
}

fn unescape(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('f') => out.push('\x0c'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                let code = u32::from_str_radix(&hex, 16)
                    .ok()
                    .filter(|_| hex.len() == 4)
                    .ok_or_else(|| format!("\\u{hex} is no \\uXXXX escape"))?;
                out.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_java_reads() {
        let text = "# a comment\n! another\n  name=outbox\nslot.name : debezium\nplugin.name pgoutput\n\
                    transforms.outbox.route.topic.replacement=outbox.event.${routedByValue}\n\
                    table.include.list=public.outbox,\\\n    public.other\n\
                    a\\=b=c\\:d\nunicode=\\u00e9t\\u00e9\ntrailing=kept   \nempty=\nname=last\n\
                    path=C:\\\\dir\\\\x\n";
        let p = parse(text).unwrap();
        assert_eq!(p["name"], "last", "the last duplicate wins");
        assert_eq!(p["slot.name"], "debezium");
        assert_eq!(p["plugin.name"], "pgoutput");
        assert_eq!(
            p["transforms.outbox.route.topic.replacement"],
            "outbox.event.${routedByValue}"
        );
        assert_eq!(p["table.include.list"], "public.outbox,public.other");
        assert_eq!(p["a=b"], "c:d");
        assert_eq!(p["unicode"], "été");
        assert_eq!(p["trailing"], "kept   ");
        assert_eq!(p["empty"], "");
        assert_eq!(p["path"], "C:\\dir\\x");
        assert!(parse("x=\\u12").is_err());
        // A comment never continues, and an even run of backslashes does
        // not either.
        let p = parse("# c \\\nk=v\\\\\nj=w").unwrap();
        assert_eq!((p["k"].as_str(), p["j"].as_str()), ("v\\", "w"));
    }
}
