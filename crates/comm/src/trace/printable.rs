//! Text a dump or a rank wrote, made safe to show on a terminal.

use std::borrow::Cow;

/// `text` with its control characters and bidirectional-text controls
/// written as Rust escapes (`\u{1b}`, `\r`, `\0`), borrowed when it has
/// none: for strings from dumps and from ranks' output that cohort quotes
/// on a terminal, where an escape sequence could drive the terminal or a
/// `\r` forge a line of cohort's own.
pub fn printable(text: &str) -> Cow<'_, str> {
    let hidden = |c: char| {
        c.is_control()
            || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(hidden) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hidden(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_and_bidi_characters_show_as_escapes_and_plain_text_is_borrowed() {
        assert_eq!(printable("a\x1b[31mb\rc\0d\te\u{9b}f\u{202e}g"), r"a\u{1b}[31mb\rc\0d\te\u{9b}f\u{202e}g");
        assert!(matches!(printable("plain 'text' \"é\" \\ ✓"), Cow::Borrowed("plain 'text' \"é\" \\ ✓")));
    }
}
