//! A Chrome/Perfetto timeline of collectives and copies.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use parking_lot::Mutex;
use serde::Serialize;

/// One complete event ("ph": "X") of the Chrome trace format.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineEvent {
    /// What ran: "all_reduce", "to_client", ...
    pub name: String,
    /// Category: "collective" or "copy".
    pub cat: String,
    pub ph: &'static str,
    /// Start, in microseconds since the Unix epoch.
    pub ts: u64,
    /// Duration in microseconds.
    pub dur: u64,
    /// The rank (one row group per rank).
    pub pid: usize,
    /// The device index (one row per device).
    pub tid: u32,
    /// Details shown when the event is selected.
    pub args: serde_json::Value,
}

/// Appends events to a trace file in the Chrome JSON array format, whose
/// closing `]` is optional: a process that dies mid-run still leaves a
/// readable file.
pub struct Timeline {
    path: PathBuf,
    out: Mutex<BufWriter<File>>,
}

impl Timeline {
    /// Creates the file at `path` (mode 0600, replacing an earlier file of
    /// this user's) and writes the opening `[`. A link at `path`, or another
    /// user's file there, is refused rather than written through (see
    /// `cohort_runtime::private_fs::create_private_file`).
    pub fn create(path: &Path) -> std::io::Result<Timeline> {
        let mut file = cohort_runtime::private_fs::create_private_file(path)?;
        file.write_all(b"[\n")?;
        Ok(Timeline { path: path.to_path_buf(), out: Mutex::new(BufWriter::new(file)) })
    }

    /// The timeline of this process when `COHORT_TIMELINE` is set: the file
    /// it names, with `.rank<N>` inserted before the extension when `RANK`
    /// is set (so ranks sharing a path do not clobber each other). A `RANK`
    /// that is not a whole number (`../x`) is refused with one error rather
    /// than put into the path.
    pub fn from_env() -> Option<&'static Timeline> {
        static GLOBAL: OnceLock<Option<Timeline>> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                // Any path is a valid COHORT_TIMELINE, so this cannot fail.
                let path = cohort_runtime::config::TIMELINE.get().ok()??;
                let path = match std::env::var_os("RANK") {
                    Some(rank) => {
                        let Some(rank) = rank.to_str().and_then(|r| r.trim().parse::<usize>().ok()) else {
                            tracing::error!(
                                "COHORT_TIMELINE: no timeline: RANK={rank:?} is not a whole number, so it cannot name \
                                 this rank's file beside {}",
                                path.display()
                            );
                            return None;
                        };
                        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                        let ext = path.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or("json".into());
                        path.with_file_name(format!("{stem}.rank{rank}.{ext}"))
                    }
                    None => path,
                };
                match Timeline::create(&path) {
                    Ok(t) => Some(t),
                    Err(err) => {
                        tracing::error!("COHORT_TIMELINE: cannot create {}: {err}", path.display());
                        None
                    }
                }
            })
            .as_ref()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event and flushes it to the file (a failed write is
    /// logged once and otherwise ignored).
    pub fn record(&self, event: &TimelineEvent) {
        let Ok(line) = serde_json::to_string(event) else { return };
        let mut out = self.out.lock();
        if let Err(err) = writeln!(out, "{line},").and_then(|()| out.flush()) {
            // A full disk should not stop the job, but the trace is then
            // incomplete: say so once.
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| tracing::warn!("COHORT_TIMELINE: writing the trace failed ({err}); events are lost"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_form_a_chrome_trace() {
        let path = std::env::temp_dir().join(format!("cohort-timeline-{}.json", std::process::id()));
        let timeline = Timeline::create(&path).unwrap();
        for i in 0..2 {
            timeline.record(&TimelineEvent {
                name: "all_reduce".into(),
                cat: "collective".into(),
                ph: "X",
                ts: 1000 + i,
                dur: 5,
                pid: 0,
                tid: i as u32,
                args: serde_json::json!({"bytes": 64}),
            });
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // The array format tolerates the trailing comma and missing `]`;
        // closing it gives strict JSON.
        let strict = format!("{}]", text.trim_end().trim_end_matches(','));
        let events: Vec<serde_json::Value> = serde_json::from_str(&strict).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[1]["ph"], "X");
        assert_eq!(events[1]["tid"], 1);
        std::fs::remove_file(path).unwrap();
    }
}
