//! What the benches share: sizes as nccl-tests writes them, the median of
//! trials, and the exit of a run that counts wrong elements. Included by
//! the examples (`#[path]`), not an example itself.

#![allow(dead_code)]

use std::process::ExitCode;

/// A size in bytes: a number, with an optional K, M or G (powers of 1024).
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, shift) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 10),
        Some('M' | 'm') => (&text[..text.len() - 1], 20),
        Some('G' | 'g') => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    let n = digits.parse::<usize>().map_err(|e| format!("{text:?} is not a size: {e}"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("{text:?} is too large a size"))
}

/// The median of `values` (the upper one of an even count); sorts them.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The exit of bench `name`'s run: success when it found no wrong element,
/// else failure, saying how many or why.
pub fn exit(name: &str, run: Result<usize, Box<dyn std::error::Error>>) -> ExitCode {
    match run {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            eprintln!("{name}: {wrong} wrong elements");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("{name}: {err}");
            ExitCode::FAILURE
        }
    }
}
