//! `cohort config`: every `COHORT_*` variable with its current value, its
//! default and what it means; and the log filter `cohort` itself uses.

use std::process::ExitCode;

use cohort_runtime::config::{self, ConfigError};
use tracing_subscriber::EnvFilter;

use crate::cli::ConfigArgs;

/// The log filter: `COHORT_LOG` when set (an error naming it when it is not
/// a filter), else `RUST_LOG`, else `warn`.
pub fn log_filter() -> Result<EnvFilter, ConfigError> {
    match config::LOG.get()? {
        Some(text) => EnvFilter::try_new(&text).map_err(|e| {
            let raw = config::LOG.raw().unwrap_or_default();
            config::LOG.invalid(&raw, format!("it is not a log filter ({e})"))
        }),
        None => Ok(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"))),
    }
}

/// What one variable's line says about its value.
fn describe(setting: &dyn config::Setting) -> (String, Option<ConfigError>) {
    let decl = setting.decl();
    let mut checked = setting.check();
    if decl.name == config::LOG.name && checked.is_ok() {
        // The runtime takes any text; only tracing can tell a filter.
        checked = log_filter().map(|_| decl.raw());
    }
    match checked {
        Ok(None) => ("unset".into(), None),
        Ok(Some(raw)) => (decl.display(&raw), None),
        Err(err) => (err.value.clone(), Some(err)),
    }
}

/// Prints every variable (or, with `--markdown`, the table of
/// `docs/configuration.md`). Exits with 1 when a set value cannot be used.
pub fn config(args: ConfigArgs) -> ExitCode {
    if args.markdown {
        print!("{}", config::markdown_table());
        return ExitCode::SUCCESS;
    }
    let mut invalid = 0;
    for setting in config::ALL.iter().copied() {
        let decl = setting.decl();
        let (value, problem) = describe(setting);
        println!("{} = {value}", decl.name);
        if let Some(err) = problem {
            invalid += 1;
            println!("    INVALID: {}; expected {}", err.problem, err.expected);
        }
        println!("    default: {}", decl.default);
        println!("    {}", decl.meaning);
    }
    let unknown: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.starts_with("COHORT_") && config::find(k).is_none())
        .collect();
    for name in &unknown {
        println!("{name} is set, but cohort reads no variable of that name (a typo?)");
    }
    if invalid > 0 {
        eprintln!(
            "cohort config: {invalid} variable{} set to a value that cannot be used (marked INVALID above); fix or \
             unset {}",
            if invalid == 1 { " is" } else { "s are" },
            if invalid == 1 { "it" } else { "them" }
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
