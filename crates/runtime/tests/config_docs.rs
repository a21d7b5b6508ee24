//! `docs/configuration.md` lists exactly the variables `cohort_runtime::config`
//! declares, with the same defaults.

use cohort_runtime::config;

/// The `(name, default)` of each row of the doc's table whose first cell is
/// a `COHORT_*` name in backticks.
fn documented() -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    text.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.trim().strip_prefix('|')?.split('|').map(str::trim).collect();
            let name = cells.first()?.strip_prefix('`')?.strip_suffix('`')?;
            name.starts_with("COHORT_").then(|| (name.to_string(), cells.get(1).copied().unwrap_or("").to_string()))
        })
        .collect()
}

#[test]
fn the_doc_lists_every_declared_variable_with_its_default() {
    let declared: Vec<(String, String)> =
        config::ALL.iter().map(|s| (s.decl().name.to_string(), s.decl().default.to_string())).collect();
    let documented = documented();
    let missing: Vec<_> = declared.iter().filter(|d| !documented.contains(d)).collect();
    let extra: Vec<_> = documented.iter().filter(|d| !declared.contains(d)).collect();
    assert!(
        missing.is_empty() && extra.is_empty() && documented.len() == declared.len(),
        "docs/configuration.md and cohort_runtime::config differ.\n\
         declared but not documented (name, default): {missing:?}\n\
         documented but not declared: {extra:?}\n\
         The table `cohort config --markdown` prints is:\n{}",
        config::markdown_table()
    );
}
