//! Commands outboxd prints for an operator to run (in errors and in
//! `outboxd replay`'s resume line) quote their arguments the way a POSIX
//! shell needs, so they can be pasted as they are.

/// `s` quoted for a POSIX shell when it needs to be.
pub fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=+,@%".contains(c))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words_quote_what_a_shell_would_split() {
        assert_eq!(shell_word("/etc/outboxd.toml"), "/etc/outboxd.toml");
        assert_eq!(shell_word("2026-12-01T10:00:00Z"), "2026-12-01T10:00:00Z");
        assert_eq!(shell_word("my config.toml"), "'my config.toml'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
