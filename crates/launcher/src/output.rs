//! Copying each rank's output: prefixed lines on the console, raw lines in
//! per-rank log files, and the last lines kept for the failure summary.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use cohort_comm::trace::printable;
use cohort_runtime::private_fs::{PrivateDir, PrivateFsError};
use crossbeam::channel::Sender;
use parking_lot::Mutex;

/// Lines of each stream of a rank kept for the failure summary.
pub const TAIL_LINES: usize = 20;
/// Longest line kept in the tail (longer ones are cut).
const TAIL_LINE_MAX: usize = 4096;
/// Longest piece of a line copied at once: a longer line is split into
/// pieces of this size (each its own prefixed line on the console; the log
/// file gets the bytes unchanged), so one enormous line costs the launcher
/// this much memory, not the line's size.
pub const LINE_MAX: usize = 64 << 10;

/// What the readers of one attempt are doing, so the supervisor waits for
/// every line without waiting forever on a pipe that an escaped process
/// holds open and never writes to.
#[derive(Clone, Default)]
pub struct Activity(Arc<ActivityInner>);

#[derive(Default)]
struct ActivityInner {
    /// Pieces copied so far, all readers together.
    copied: AtomicU64,
    /// Readers in a write to the console or a file now (a slow consumer,
    /// `cohort run ... | less`, holds them there).
    writing: AtomicUsize,
}

impl Activity {
    /// Pieces copied so far.
    pub fn copied(&self) -> u64 {
        self.0.copied.load(Ordering::SeqCst)
    }

    /// Whether a reader is writing now.
    pub fn writing(&self) -> bool {
        self.0.writing.load(Ordering::SeqCst) > 0
    }
}

/// Counts a reader as writing while it lives.
struct Writing<'a>(&'a ActivityInner);

impl<'a> Writing<'a> {
    fn start(a: &'a ActivityInner) -> Self {
        a.writing.fetch_add(1, Ordering::SeqCst);
        Writing(a)
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.writing.fetch_sub(1, Ordering::SeqCst);
        self.0.copied.fetch_add(1, Ordering::SeqCst);
    }
}

/// The last [`TAIL_LINES`] lines a rank wrote on each of its streams, kept
/// apart: across two pipes, read by two threads, the order the lines arrive
/// in is not the order the rank wrote them, so one merged list could push a
/// stream's last lines out (a rank's final error after a burst of stdout).
/// A line is kept as a terminal would show it: a line longer than
/// [`TAIL_LINE_MAX`] (read in pieces) keeps its end, and a line rewritten
/// with `\r` (a progress bar) its last text, marked.
#[derive(Clone, Default)]
pub struct Tail(Arc<Mutex<Kept>>);

/// What a [`Tail`] holds.
#[derive(Default)]
struct Kept {
    /// The lines, printable.
    lines: LastLines,
    /// Each stream's line being read (its last line, until its `\n`).
    open: [OpenLine; 2],
}

/// The end of a stream's unfinished line, as raw bytes.
#[derive(Default)]
struct OpenLine {
    /// Whether the stream's last kept line is this one (no `\n` yet).
    open: bool,
    /// Its last [`TAIL_LINE_MAX`] bytes since its last `\r`.
    bytes: Vec<u8>,
    /// Whether bytes before those were dropped.
    cut: bool,
    /// A `\r` came last: the next text starts the line over.
    restart: bool,
    /// Text was written over after a `\r` (shown as a leading `\r`).
    rewritten: bool,
}

impl OpenLine {
    /// Adds a piece of the line (no `\n` in it).
    fn add(&mut self, piece: &[u8]) {
        for (i, text) in piece.split(|&b| b == b'\r').enumerate() {
            self.restart |= i > 0;
            if text.is_empty() {
                continue;
            }
            if std::mem::take(&mut self.restart) {
                self.rewritten |= self.cut || !self.bytes.is_empty();
                self.bytes.clear();
                self.cut = false;
            }
            self.bytes.extend_from_slice(text);
            if self.bytes.len() > TAIL_LINE_MAX {
                let mut start = self.bytes.len() - TAIL_LINE_MAX;
                // Not in the middle of a character.
                while self.bytes.get(start).is_some_and(|b| b & 0xc0 == 0x80) {
                    start += 1;
                }
                self.bytes.drain(..start);
                self.cut = true;
            }
        }
    }

    /// The line as the summary shows it: printable, with `…` where its
    /// start was cut and a leading `\r` (two characters) where text was
    /// written over, so a line's quote never passes for a whole line.
    fn text(&self) -> String {
        let text = printable(&String::from_utf8_lossy(&self.bytes)).into_owned();
        let rewritten = if self.rewritten { "\\r" } else { "" };
        let cut = if self.cut { "…" } else { "" };
        format!("{rewritten}{cut}{text}")
    }
}

/// A rank's last lines, stream by stream, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LastLines {
    /// Its last lines on stdout.
    pub stdout: VecDeque<String>,
    /// Its last lines on stderr.
    pub stderr: VecDeque<String>,
}

impl LastLines {
    /// Whether the rank wrote nothing.
    pub fn is_empty(&self) -> bool {
        self.stdout.is_empty() && self.stderr.is_empty()
    }
}

impl Tail {
    /// Adds a piece that [`read_piece`] read: a whole line, or a part of a
    /// longer one (no `\n` at its end).
    fn push(&self, stream: Stream, piece: &[u8]) {
        let (body, ends) = match piece.strip_suffix(b"\n") {
            Some(body) => (body, true),
            None => (piece, false),
        };
        let mut kept = self.0.lock();
        let Kept { lines, open } = &mut *kept;
        let (q, line) = match stream {
            Stream::Stdout => (&mut lines.stdout, &mut open[0]),
            Stream::Stderr => (&mut lines.stderr, &mut open[1]),
        };
        if !line.open {
            *line = OpenLine { open: true, ..OpenLine::default() };
            if q.len() == TAIL_LINES {
                q.pop_front();
            }
            q.push_back(String::new());
        }
        line.add(body);
        if let Some(last) = q.back_mut() {
            *last = line.text();
        }
        // `\r\n` ends a line, and starts no new one.
        line.open = !ends;
    }

    /// The lines kept.
    pub fn lines(&self) -> LastLines {
        self.0.lock().lines.clone()
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
    /// Its readers' progress, shared by every rank of the attempt.
    pub activity: Activity,
}

impl Sinks {
    /// Makes the rank's log folder (0700, see [`open_log_dir`]) and creates
    /// its two files (0600, replacing earlier ones of this user's). The
    /// folder must be this user's own, reached through no link, and the
    /// files are never opened through a link, so another
    /// local user can neither read a rank's output nor aim it at a file of
    /// their choice (see `cohort_runtime::private_fs`).
    pub fn open_files(&self) -> io::Result<(Option<File>, Option<File>)> {
        let Some(dir) = &self.log_dir else { return Ok((None, None)) };
        let folder = open_log_dir(dir)?;
        let open = |name: &str| folder.create_file(name).map(Some);
        Ok((open("stdout.log")?, open("stderr.log")?))
    }
}

/// Opens (making it where missing) the log folder `dir` as a private folder
/// (see `cohort_runtime::private_fs`). A symbolic link on the path as given
/// is followed only when no other user could have placed or replaced it
/// ([`trusted_link`]): a link in the middle sends the logs wherever it
/// points, a place another user may choose, while system links
/// (`/home -> var/home`, `/scratch -> /lustre/..`) and the user's own are
/// what a path usually runs through. The last component is never a link
/// (`PrivateDir` refuses it). A file on the path is named as not a folder.
pub fn open_log_dir(dir: &Path) -> Result<PrivateDir, PrivateFsError> {
    let mut path = PathBuf::new();
    for part in dir.components() {
        path.push(part);
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() && !trusted_link(&path, &m) => {
                return Err(PrivateFsError::Symlink { path })
            }
            Ok(m) if m.file_type().is_symlink() => {}
            // A file where a folder must be: named, not "Not a directory".
            Ok(m) if !m.is_dir() => return Err(PrivateFsError::WrongKind { path, expected: "folder" }),
            _ => {}
        }
    }
    PrivateDir::open_or_create(dir)
}

/// Whether the link at `path` (its `lstat` is `link`) was placed by root or
/// this user, in a folder of root or this user where no other user may
/// replace it (not writable by group or others, or sticky, as `/tmp` is).
fn trusted_link(path: &Path, link: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if link.uid() != 0 && link.uid() != me {
        return false;
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // A folder's owner may always replace its entries; others may where
    // they can write to it, unless it is sticky.
    std::fs::metadata(parent).is_ok_and(|folder| {
        let owned = folder.uid() == 0 || folder.uid() == me;
        let open_to_others = folder.mode() & 0o022 != 0 && folder.mode() & 0o1000 == 0;
        owned && !open_to_others
    })
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
    let copy = Copy {
        stream,
        prefix: sinks.prefix.clone(),
        console: sinks.console,
        tail: sinks.tail.clone(),
        activity: sinks.activity.clone(),
        file_name: sinks.log_dir.as_ref().map(|d| d.join(stream.file_name())),
    };
    std::thread::Builder::new().name("cohort-output".into()).spawn(move || {
        let _done = done;
        copy.run(pipe, file, &mut io::stderr());
    })
}

impl Stream {
    fn file_name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout.log",
            Stream::Stderr => "stderr.log",
        }
    }
}

/// One reader's settings.
struct Copy {
    stream: Stream,
    prefix: Arc<[u8]>,
    console: bool,
    tail: Tail,
    activity: Activity,
    /// The log file's path, for the message when it cannot be written.
    file_name: Option<PathBuf>,
}

/// Reads up to and including the next `\n`, or [`LINE_MAX`] bytes of a
/// longer line, into `line`; 0 at the end of the pipe.
fn read_piece(reader: &mut impl BufRead, line: &mut Vec<u8>) -> io::Result<usize> {
    line.clear();
    loop {
        let buf = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(line.len());
        }
        let room = LINE_MAX - line.len();
        let window = &buf[..buf.len().min(room)];
        if let Some(i) = window.iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&window[..=i]);
            reader.consume(i + 1);
            return Ok(line.len());
        }
        let n = window.len();
        line.extend_from_slice(window);
        reader.consume(n);
        if line.len() >= LINE_MAX {
            return Ok(line.len());
        }
    }
}

impl Copy {
    /// Copies `pipe` until it closes; `report` gets the one message about a
    /// log file that could not be written (a full disk).
    fn run(&self, pipe: impl Read, mut file: Option<File>, report: &mut impl Write) {
        let mut reader = BufReader::with_capacity(LINE_MAX, pipe);
        let mut line = Vec::with_capacity(256);
        let mut out = Vec::with_capacity(256);
        let full_disk_said = AtomicBool::new(false);
        loop {
            match read_piece(&mut reader, &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let _writing = Writing::start(&self.activity.0);
            self.tail.push(self.stream, &line);
            if let Some(f) = &mut file {
                // A full disk must not stop the rank: say so once, drop the
                // file, keep going.
                if let Err(e) = f.write_all(&line) {
                    if !full_disk_said.swap(true, Ordering::Relaxed) {
                        let path = self.file_name.as_ref().map_or("?".into(), |p| p.display().to_string());
                        let rest = if self.console { "the console still shows it" } else { "the rest is lost" };
                        let _ = writeln!(
                            report,
                            "cohort: cannot write {path}: {e}; stopped logging this stream to it ({rest}): free \
                             space under --log-dir"
                        );
                    }
                    file = None;
                }
            }
            if self.console {
                out.clear();
                out.extend_from_slice(&self.prefix);
                out.extend_from_slice(&line);
                if !line.ends_with(b"\n") {
                    out.push(b'\n');
                }
                // One write per line under the lock, so lines of ranks never mix.
                // A closed console (`cohort run ... | head`) is not the rank's
                // problem: ignore write errors.
                let _ = match self.stream {
                    Stream::Stdout => io::stdout().lock().write_all(&out),
                    Stream::Stderr => io::stderr().lock().write_all(&out),
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines_of_each_stream() {
        let t = Tail::default();
        t.push(Stream::Stderr, b"the error\n");
        for i in 0..30 {
            t.push(Stream::Stdout, format!("line {i}\n").as_bytes());
        }
        let lines = t.lines();
        assert_eq!(lines.stdout.len(), TAIL_LINES);
        assert_eq!(lines.stdout[0], "line 10");
        assert_eq!(lines.stdout[19], "line 29");
        // Thirty later lines of stdout did not push stderr's out.
        assert_eq!(lines.stderr, ["the error"]);
    }

    /// A line longer than a piece is one line in the tail, its end kept
    /// (the nearer the rank's end) and its cut start marked; a line the
    /// rank rewrote with '\r' (a progress bar) shows as a terminal shows
    /// it, its last text. Before, each 64 KiB piece was a line of its own
    /// holding its first 4 KiB: "last 5 lines" for one line, 20 KB of it,
    /// and a progress bar's state of 64 KiB before the end.
    #[test]
    fn a_long_or_rewritten_line_is_one_line_of_the_tail_as_a_terminal_shows_it() {
        let (copy, sinks) = copier(false, None);
        let mut big = vec![b'x'; 5 * LINE_MAX];
        big.extend_from_slice("the end ✓".as_bytes());
        copy.run(&big[..], None, &mut Vec::new());
        let stdout = sinks.tail.lines().stdout;
        assert_eq!(stdout.len(), 1, "one line");
        assert!(stdout[0].starts_with('…') && stdout[0].ends_with("xxthe end ✓"), "{}", &stdout[0][..20]);
        assert!(stdout[0].len() <= TAIL_LINE_MAX + '…'.len_utf8(), "{}", stdout[0].len());

        let (copy, sinks) = copier(false, None);
        let mut bar: Vec<u8> = b"epoch 1\n".to_vec();
        for i in 0..=5000 {
            bar.extend_from_slice(format!("\r{i:5}/5000 [=====>    ]").as_bytes());
        }
        bar.extend_from_slice(b"\r");
        copy.run(&bar[..], None, &mut Vec::new());
        assert_eq!(sinks.tail.lines().stdout, ["epoch 1", "\\r 5000/5000 [=====>    ]"]);

        let (copy, sinks) = copier(false, None);
        copy.run(&b"crlf\r\nold\rnew\nkept\r\n"[..], None, &mut Vec::new());
        assert_eq!(sinks.tail.lines().stdout, ["crlf", "\\rnew", "kept"]);
    }

    /// A file in the middle of the log path is named as not a folder
    /// (was "cannot use f/sub: Not a directory (os error 20)").
    #[test]
    fn a_file_on_the_log_path_is_named() {
        let dir = std::env::temp_dir().join(format!("cohort-logpath-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, "").unwrap();
        let Err(err) = open_log_dir(&file.join("sub/deeper")) else { panic!("a path under a file was taken") };
        let err = err.to_string();
        assert_eq!(err, format!("{} is not a folder; remove it or choose another path", file.display()));
        let _ = std::fs::remove_dir_all(dir);
    }

    fn copier(console: bool, log_dir: Option<PathBuf>) -> (Copy, Sinks) {
        let sinks = Sinks {
            prefix: Arc::from(&b"[rank 0]: "[..]),
            console,
            log_dir: log_dir.clone(),
            tail: Tail::default(),
            activity: Activity::default(),
        };
        let copy = Copy {
            stream: Stream::Stdout,
            prefix: Arc::from(&b""[..]),
            console,
            tail: sinks.tail.clone(),
            activity: sinks.activity.clone(),
            file_name: log_dir.map(|d| d.join("stdout.log")),
        };
        (copy, sinks)
    }

    #[test]
    fn lines_go_to_file_and_tail() {
        let dir = std::env::temp_dir().join(format!("cohort-output-test-{}", std::process::id()));
        let (copy, sinks) = copier(false, Some(dir.clone()));
        let (out, _) = sinks.open_files().unwrap();
        let mut report = Vec::new();
        copy.run(&b"a\nb\nno newline"[..], out, &mut report);
        assert_eq!(std::fs::read_to_string(dir.join("stdout.log")).unwrap(), "a\nb\nno newline");
        assert_eq!(sinks.tail.lines().stdout, ["a", "b", "no newline"]);
        assert!(report.is_empty());
        assert_eq!(sinks.activity.copied(), 3);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn an_enormous_line_is_split_into_bounded_pieces() {
        let big = vec![b'x'; 5 * LINE_MAX + 10];
        let mut reader = BufReader::with_capacity(LINE_MAX, &big[..]);
        let mut piece = Vec::new();
        let mut sizes = Vec::new();
        while read_piece(&mut reader, &mut piece).unwrap() > 0 {
            sizes.push(piece.len());
            assert!(piece.capacity() <= 2 * LINE_MAX, "the piece buffer stays bounded");
        }
        assert_eq!(sizes, [LINE_MAX, LINE_MAX, LINE_MAX, LINE_MAX, LINE_MAX, 10]);
        let (copy, sinks) = copier(false, None);
        copy.run(&big[..], None, &mut Vec::new());
        assert!(sinks.tail.lines().stdout.iter().all(|l| l.len() <= TAIL_LINE_MAX + '…'.len_utf8()));
    }

    #[test]
    fn a_full_disk_is_reported_once() {
        // /dev/full fails every write with ENOSPC, as a full --log-dir does.
        let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else { return };
        let (copy, sinks) = copier(false, Some(PathBuf::from("/logs/attempt_0/rank_3")));
        let mut report = Vec::new();
        copy.run(&b"one\ntwo\nthree\n"[..], Some(full), &mut report);
        let report = String::from_utf8(report).unwrap();
        assert_eq!(report.lines().count(), 1, "{report}");
        assert!(report.contains("/logs/attempt_0/rank_3/stdout.log") && report.contains("No space left"), "{report}");
        assert!(report.contains("the rest is lost") && report.contains("--log-dir"), "{report}");
        assert_eq!(sinks.tail.lines().stdout, ["one", "two", "three"], "the tail still has every line");
    }
}
