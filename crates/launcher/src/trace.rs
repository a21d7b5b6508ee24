//! `cohort trace` (merge the ranks' flight recorders), `cohort store`
//! (serve a rendezvous store), and the flight-recorder part of `cohort
//! run`'s failure summary.

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use cohort_comm::store::StoreServer;
use cohort_comm::trace::merge_files;
use cohort_runtime::config;

use crate::cli::{StoreArgs, TraceArgs};

/// `cohort trace <dir|file>...`: prints the merged report; exits 0 when
/// every recorded collective finished on every rank, 2 when one did not,
/// and 1 when the dumps cannot be read.
pub fn trace(args: TraceArgs) -> ExitCode {
    let paths: Vec<&Path> = args.paths.iter().map(|p| p.as_path()).collect();
    match merge_files(&paths) {
        Ok(report) => {
            print!("{report}");
            ExitCode::from(if report.first_unfinished.is_some() { 2 } else { 0 })
        }
        Err(e) => {
            say!("cohort: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Removes the flight-recorder dumps (`rank<N>.json`) an earlier run left
/// in `dir`. Does not create it: a rank that writes a dump makes it (0700,
/// see `cohort_runtime::private_fs`), so a job that writes none leaves no
/// empty folder behind. A folder that is not this user's own is left alone.
pub fn clear_dumps(dir: &Path) {
    if !dir.exists() {
        return;
    }
    let folder = match cohort_runtime::private_fs::PrivateDir::open(dir) {
        Ok(folder) => folder,
        Err(e) => {
            tracing::warn!("cannot use the trace folder: {e}");
            return;
        }
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_dump = name
            .strip_prefix("rank")
            .and_then(|rest| rest.strip_suffix(".json"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if is_dump {
            folder.remove(&name);
        }
    }
}

/// The merged report of the dumps in `dir`, for the failure summary, or
/// `None` when no rank wrote one.
pub fn report(dir: &Path) -> Option<String> {
    let has_dumps = std::fs::read_dir(dir).ok()?.flatten().any(|e| e.path().extension().is_some_and(|x| x == "json"));
    if !has_dumps {
        return None;
    }
    match merge_files(&[dir]) {
        Ok(report) => {
            // The dumps are the ranks' own writing.
            let body: String =
                report.to_string().lines().map(|l| format!("\n  {}", cohort_comm::trace::printable(l))).collect();
            Some(format!("flight recorder ({}; `cohort trace {}`):{body}", dir.display(), dir.display()))
        }
        // It may name a file a rank put there.
        Err(e) => Some(format!("flight recorder: {}", cohort_comm::trace::printable(&e.to_string()))),
    }
}

/// `cohort store`: serves a store until killed.
pub fn store(args: StoreArgs) -> ExitCode {
    let secret = match config::JOB_SECRET.get() {
        Ok(Some(secret)) => secret,
        Ok(None) => {
            let name = config::JOB_SECRET.name;
            say!("cohort: error: export {name} (the job's secret; every rank and launcher must use it)");
            return ExitCode::from(1);
        }
        Err(e) => {
            say!("cohort: error: {e}");
            return ExitCode::from(1);
        }
    };
    let host = if args.host.contains(':') { format!("[{}]", args.host) } else { args.host.clone() };
    match StoreServer::bind(format!("{host}:{}", args.port).as_str(), &secret) {
        Ok(server) => {
            // A closed stdout does not stop the store serving.
            let _ = writeln!(std::io::stdout(), "cohort store: listening on {}", server.local_addr());
            loop {
                std::thread::park();
            }
        }
        Err(e) => {
            say!("cohort: error: cannot serve the store on {host}:{}: {e}", args.port);
            ExitCode::from(1)
        }
    }
}
