//! Copying each rank's output: prefixed lines on the console, raw lines in
//! per-rank log files, and the last lines kept for the failure summary.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::Sender;
use parking_lot::Mutex;

/// Lines of each rank's output kept for the failure summary.
pub const TAIL_LINES: usize = 20;
/// Longest line kept in the tail (longer ones are cut).
const TAIL_LINE_MAX: usize = 4096;

/// The last [`TAIL_LINES`] lines a rank wrote, stdout and stderr together.
#[derive(Clone, Default)]
pub struct Tail(Arc<Mutex<VecDeque<String>>>);

impl Tail {
    fn push(&self, line: &[u8]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let cut = &line[..line.len().min(TAIL_LINE_MAX)];
        let mut q = self.0.lock();
        if q.len() == TAIL_LINES {
            q.pop_front();
        }
        q.push_back(String::from_utf8_lossy(cut).into_owned());
    }

    /// The lines kept, oldest first.
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().iter().cloned().collect()
    }
}

/// Which stream of a rank.
#[derive(Debug, Clone, Copy)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Where one rank's output goes.
pub struct Sinks {
    /// `[rank N]: `.
    pub prefix: Arc<[u8]>,
    /// Whether the console shows it.
    pub console: bool,
    /// The folder of its log files, when logging to files.
    pub log_dir: Option<PathBuf>,
    /// Its last lines.
    pub tail: Tail,
}

impl Sinks {
    /// Makes the rank's log folder (0700) and creates its two files (0600,
    /// replacing earlier ones of this user's). The folder must be this
    /// user's own and the files are never opened through a link, so another
    /// local user can neither read a rank's output nor aim it at a file of
    /// their choice (see `cohort_runtime::private_fs`).
    pub fn open_files(&self) -> io::Result<(Option<File>, Option<File>)> {
        let Some(dir) = &self.log_dir else { return Ok((None, None)) };
        let folder = cohort_runtime::private_fs::PrivateDir::open_or_create(dir)?;
        let open = |name: &str| folder.create_file(name).map(Some);
        Ok((open("stdout.log")?, open("stderr.log")?))
    }
}

/// The log folder of `rank` in `attempt` under `log_dir`.
pub fn rank_log_dir(log_dir: &Path, attempt: u32, rank: usize) -> PathBuf {
    log_dir.join(format!("attempt_{attempt}")).join(format!("rank_{rank}"))
}

/// Starts a thread that copies `pipe` line by line until it closes. The
/// thread holds `done` until then, so whoever owns its receiver learns when
/// every reader has finished.
pub fn spawn_reader(
    pipe: impl Read + Send + 'static,
    stream: Stream,
    sinks: &Sinks,
    file: Option<File>,
    done: Sender<()>,
) -> io::Result<JoinHandle<()>> {
    let prefix = sinks.prefix.clone();
    let console = sinks.console;
    let tail = sinks.tail.clone();
    std::thread::Builder::new().name("cohort-output".into()).spawn(move || {
        let _done = done;
        copy_lines(pipe, stream, &prefix, console, file, &tail);
    })
}

fn copy_lines(pipe: impl Read, stream: Stream, prefix: &[u8], console: bool, mut file: Option<File>, tail: &Tail) {
    let mut reader = BufReader::with_capacity(64 << 10, pipe);
    let mut line = Vec::with_capacity(256);
    let mut out = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
        tail.push(&line);
        if let Some(f) = &mut file {
            // A full disk must not stop the rank: drop the file, keep going.
            if f.write_all(&line).is_err() {
                file = None;
            }
        }
        if console {
            out.clear();
            out.extend_from_slice(prefix);
            out.extend_from_slice(&line);
            if !line.ends_with(b"\n") {
                out.push(b'\n');
            }
            // One write per line under the lock, so lines of ranks never mix.
            // A closed console (`cohort run ... | head`) is not the rank's
            // problem: ignore write errors.
            let _ = match stream {
                Stream::Stdout => io::stdout().lock().write_all(&out),
                Stream::Stderr => io::stderr().lock().write_all(&out),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let t = Tail::default();
        for i in 0..30 {
            t.push(format!("line {i}\n").as_bytes());
        }
        let lines = t.lines();
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines[0], "line 10");
        assert_eq!(lines[19], "line 29");
    }

    #[test]
    fn lines_go_to_file_and_tail() {
        let dir = std::env::temp_dir().join(format!("cohort-output-test-{}", std::process::id()));
        let sinks = Sinks {
            prefix: Arc::from(&b"[rank 0]: "[..]),
            console: false,
            log_dir: Some(dir.clone()),
            tail: Tail::default(),
        };
        let (out, _) = sinks.open_files().unwrap();
        copy_lines(&b"a\nb\nno newline"[..], Stream::Stdout, b"", false, out, &sinks.tail);
        assert_eq!(std::fs::read_to_string(dir.join("stdout.log")).unwrap(), "a\nb\nno newline");
        assert_eq!(sinks.tail.lines(), ["a", "b", "no newline"]);
        let _ = std::fs::remove_dir_all(dir);
    }
}
