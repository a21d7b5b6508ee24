//! `cohort`: launch and watch the ranks of a job (`cohort run`), like
//! torchrun; list devices (`cohort devices`) and their peer access and copy
//! bandwidth (`cohort peers`); merge the ranks' flight recorders (`cohort
//! trace`); serve a rendezvous store (`cohort store`); show where a running
//! job's ranks are (`cohort status`); show the `COHORT_*`
//! variables (`cohort config`).
//!
//! Logs go to stderr through `tracing`, filtered by `COHORT_LOG` (falling
//! back to `RUST_LOG`; default `warn`).

/// `eprintln!` for the launcher's own messages that ignores a console that
/// went away (`cohort run ... 2>&1 | head`): `eprintln!` panics there, and
/// the launcher must go on looking after its ranks and exit with their code.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod cli;
mod config;
mod devices;
mod escapees;
mod fd_limit;
mod output;
mod process_limit;
mod reaper;
mod rendezvous;
mod run;
mod run_file;
mod settings;
mod signals;
mod spawn;
mod status;
mod summary;
mod supervisor;
mod timings;
mod torchrun;
mod trace;
mod watchdog;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let argv = match torchrun::split_program(std::env::args_os().collect()) {
        Ok(argv) => argv,
        Err(e) => {
            say!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let cli = match cli::Cli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    // An unusable COHORT_LOG stops every command but `cohort config`, which
    // shows it among the others.
    let filter = match settings::log_filter() {
        Ok(filter) => filter,
        Err(_) if matches!(cli.command, cli::Command::Config(_)) => EnvFilter::new("warn"),
        Err(err) => {
            say!("cohort: error: {err}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    // Commands that only print end as `cat` or `grep` do when their reader
    // goes away (`cohort config | head -1`): by SIGPIPE, not a panic. `cohort
    // run`, `cohort store` and the reaper keep it ignored: they must outlive
    // their console to look after their ranks and clients.
    if !matches!(cli.command, cli::Command::Run(_) | cli::Command::Store(_) | cli::Command::Reaper) {
        // SAFETY: restoring a signal's default disposition has no preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match cli.command {
        cli::Command::Run(args) => run::run(*args),
        cli::Command::Devices => devices::devices(),
        cli::Command::Peers(args) => devices::peers(args),
        cli::Command::Trace(args) => trace::trace(args),
        cli::Command::Store(args) => trace::store(args),
        cli::Command::Status(args) => status::status(args),
        cli::Command::Config(args) => settings::config(args),
        cli::Command::Reaper => reaper::serve(),
    }
}
