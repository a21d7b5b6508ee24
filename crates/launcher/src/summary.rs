//! How a rank ended, the failure summary, and the job verdict that launchers
//! exchange through the store.

use std::fmt::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use crate::output::LastLines;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Ending {
    /// Reads a wait status.
    pub fn of(status: ExitStatus) -> Ending {
        match (status.code(), status.signal()) {
            (Some(c), _) => Ending::Code(c),
            (None, Some(s)) => Ending::Signal(s),
            // Stopped/continued statuses never come from `wait`; call it 1.
            (None, None) => Ending::Code(1),
        }
    }

    /// Whether it exited with code 0.
    pub fn success(self) -> bool {
        self == Ending::Code(0)
    }

    /// The launcher's exit code when this ending failed the job, as
    /// `mpirun` gives it: the rank's own exit code, or 128 + the signal's
    /// number for a signal (as a shell reports it).
    pub fn launcher_code(self) -> u8 {
        match self {
            // Exit codes are 0-255 on Unix; a failure is never 0.
            Ending::Code(c) => u8::try_from(c & 0xff).ok().filter(|&c| c != 0).unwrap_or(1),
            Ending::Signal(s) => 128u8.saturating_add(s as u8),
        }
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Ending::Code(c) => write!(f, "exited with code {c}"),
            Ending::Signal(s) => write!(f, "was killed by signal {} ({s})", signal_name(s)),
        }
    }
}

/// The conventional name of a signal, e.g. `SIGKILL`.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("SIG{sig}"),
    };
    name.to_string()
}

/// The first rank of a group that failed, and what it said last.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Global rank.
    pub rank: usize,
    /// Rank on its node.
    pub local_rank: usize,
    /// Its node.
    pub node_rank: u32,
    /// Its process id.
    pub pid: u32,
    /// How it ended.
    pub ending: Ending,
    /// Time from its start to its end.
    pub after: Duration,
    /// Its last lines of output, stream by stream.
    pub tail: LastLines,
    /// Ranks in the job (with one, no other rank was stopped).
    pub world_size: usize,
    /// Ranks of this node that had exited with code 0 before it failed,
    /// while others still ran, in the order they exited.
    pub left_early: Vec<EarlyExit>,
    /// Where the ranks parted, from their flight recorders, when the ranks
    /// that left early never came to a collective the others waited in.
    pub parted_in: Option<Parting>,
}

/// A rank that exited with code 0 while other ranks of its node still ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EarlyExit {
    /// Global rank.
    pub rank: usize,
    /// Rank on its node.
    pub local_rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Time from its start to its exit.
    pub after: Duration,
}

/// The first collective that not every rank finished, as the flight
/// recorders tell it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parting {
    /// The collective and its group, e.g. `#1 all_reduce(sum) 1024 × f32 in
    /// group comm1`.
    pub collective: String,
    /// Ranks that were inside it and never finished it.
    pub waiting: Vec<usize>,
    /// Ranks that never came to it (no call recorded, or no recorder).
    pub absent: Vec<usize>,
}

impl Failure {
    /// The multi-line summary printed when the job fails.
    pub fn summary(&self) -> String {
        let first = if self.world_size > 1 { " first" } else { "" };
        let others = if self.others_ran() { "; the other ranks were stopped" } else { "" };
        let how = format!(
            "it {} after {:.2} s (local rank {} on node {}, pid {}){others}",
            self.ending,
            self.after.as_secs_f64(),
            self.local_rank,
            self.node_rank,
            self.pid,
        );
        let mut s = match self.blamed() {
            Some((left, parting)) => {
                format!("{}; then rank {} failed: {how}", left_while_waited(&left, parting), self.rank)
            }
            None if self.left_early.is_empty() => format!("rank {} failed{first}: {how}", self.rank),
            None => {
                let left: Vec<String> = self.left_early.iter().map(ranked_exit).collect();
                format!(
                    "rank {} failed{first}: {how}\n  before that, with code 0, exited: {}",
                    self.rank,
                    left.join("; ")
                )
            }
        };
        s.push_str(&self.last_lines());
        s
    }

    /// Whether another rank still ran when this one failed (one of another
    /// node, or of this node that had not exited with code 0 before).
    fn others_ran(&self) -> bool {
        self.world_size > 1 + self.left_early.len()
    }

    /// The ranks that left early and never came to the collective the
    /// others waited in, with that collective: the ranks to blame.
    fn blamed(&self) -> Option<(Vec<&EarlyExit>, &Parting)> {
        let parting = self.parted_in.as_ref()?;
        let left: Vec<&EarlyExit> = self.left_early.iter().filter(|e| parting.absent.contains(&e.rank)).collect();
        (!left.is_empty()).then_some((left, parting))
    }

    /// The rank's last lines, stderr's last (the nearer its end, often
    /// why it ended).
    fn last_lines(&self) -> String {
        let mut s = String::new();
        if self.tail.is_empty() {
            let _ = write!(s, "\n  rank {} wrote no output", self.rank);
        }
        for (name, lines) in [("stdout", &self.tail.stdout), ("stderr", &self.tail.stderr)] {
            if lines.is_empty() {
                continue;
            }
            let n = lines.len();
            let count = if n == 1 { "line".to_string() } else { format!("{n} lines") };
            let _ = write!(s, "\n  last {count} of rank {}'s {name}:", self.rank);
            for line in lines {
                let _ = write!(s, "\n    [rank {}]: {line}", self.rank);
            }
        }
        s
    }
}

/// `after 0.21 s (local rank 1, pid 7)`.
fn exit_time(e: &EarlyExit) -> String {
    format!("after {:.2} s (local rank {}, pid {})", e.after.as_secs_f64(), e.local_rank, e.pid)
}

/// `rank 1 after 0.21 s (local rank 1, pid 7)`.
fn ranked_exit(e: &EarlyExit) -> String {
    format!("rank {} {}", e.rank, exit_time(e))
}

/// `rank 1 left the job early: it exited with code 0 after 0.21 s (local
/// rank 1, pid 7) while rank 0 waited for it in #1 all_reduce(sum) ...`.
fn left_while_waited(left: &[&EarlyExit], parting: &Parting) -> String {
    let waiting = match parting.waiting.as_slice() {
        [] => "the other ranks".to_string(),
        [one] => format!("rank {one}"),
        many => format!("ranks {}", list(many)),
    };
    let (who, it) = match left {
        [one] => (format!("rank {} left the job early: it exited with code 0 {}", one.rank, exit_time(one)), "it"),
        many => {
            let ranks = list(&many.iter().map(|e| e.rank).collect::<Vec<_>>());
            let each: Vec<String> = many.iter().map(|e| ranked_exit(e)).collect();
            (format!("ranks {ranks} left the job early: they exited with code 0 ({})", each.join("; ")), "them")
        }
    };
    format!("{who} while {waiting} waited for {it} in {}", parting.collective)
}

/// What to say of the ranks of a node that had exited with code 0 while
/// others still ran, when the job was stopped for another cause (a
/// timeout, a signal, another node's failure): ranks that wait for one that
/// left (to join, or in a collective) never finish.
pub fn left_before_the_stop(left: &[EarlyExit]) -> String {
    let (who, them, they) = match left {
        [one] => (format!("rank {} exited with code 0 {}", one.rank, exit_time(one)), "it", "it"),
        many => {
            let ranks = list(&many.iter().map(|e| e.rank).collect::<Vec<_>>());
            let each: Vec<String> = many.iter().map(ranked_exit).collect();
            (format!("ranks {ranks} exited with code 0 ({})", each.join("; ")), "them", "they")
        }
    };
    format!(
        "{who} before the job was stopped, while other ranks still ran: if those waited for {them} (to join, or \
         in a collective), {they} left the job early"
    )
}

fn list(ranks: &[usize]) -> String {
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

impl Failure {
    /// The summary when this rank stopped heartbeating for `silent` and
    /// was killed.
    pub fn unresponsive_summary(&self, silent: Duration) -> String {
        let others = if self.others_ran() { " and the other ranks were stopped" } else { "" };
        let mut s = format!(
            "rank {} stopped answering: no heartbeat for {:.1} s after {:.2} s (local rank {} on node {}, pid {}: \
             stopped with SIGSTOP, frozen in a debugger, or hung in the kernel?); it was killed{others}; \
             --heartbeat-timeout sets the limit",
            self.rank,
            silent.as_secs_f64(),
            self.after.as_secs_f64(),
            self.local_rank,
            self.node_rank,
            self.pid,
        );
        s.push_str(&self.last_lines());
        s
    }
}

/// How the job went, as every launcher agrees on it through the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every rank of every node exited with code 0.
    Ok,
    /// The job failed.
    Failed {
        /// Whether a restart may help (a rank failed) or not (interrupted,
        /// timed out, a launcher vanished).
        restartable: bool,
        /// The code every launcher exits with.
        exit_code: u8,
        /// What happened, for the user.
        summary: String,
    },
}

impl Verdict {
    /// Bytes for the store.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Verdict::Ok => b"ok".to_vec(),
            Verdict::Failed { restartable, exit_code, summary } => {
                format!("fail {} {exit_code}\n{summary}", u8::from(*restartable)).into_bytes()
            }
        }
    }

    /// Reads bytes from the store; anything unreadable is a non-restartable
    /// failure that quotes it.
    pub fn decode(bytes: &[u8]) -> Verdict {
        let text = String::from_utf8_lossy(bytes);
        if text == "ok" {
            return Verdict::Ok;
        }
        let (head, summary) = text.split_once('\n').unwrap_or((&text, ""));
        let mut parts = head.split(' ');
        if let (Some("fail"), Some(r), Some(code)) = (parts.next(), parts.next(), parts.next()) {
            if let Ok(exit_code) = code.parse() {
                return Verdict::Failed { restartable: r == "1", exit_code, summary: summary.into() };
            }
        }
        Verdict::Failed { restartable: false, exit_code: 1, summary: format!("unreadable verdict: {text}") }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_round_trip() {
        let v = Verdict::Failed { restartable: true, exit_code: 137, summary: "a\nb".into() };
        assert_eq!(Verdict::decode(&v.encode()), v);
        assert_eq!(Verdict::decode(&Verdict::Ok.encode()), Verdict::Ok);
        assert!(matches!(Verdict::decode(b"junk"), Verdict::Failed { restartable: false, .. }));
    }

    #[test]
    fn endings_read_well() {
        assert_eq!(Ending::Code(3).to_string(), "exited with code 3");
        assert_eq!(Ending::Signal(9).to_string(), "was killed by signal SIGKILL (9)");
        assert_eq!(Ending::Signal(9).launcher_code(), 137);
        assert_eq!(Ending::Code(3).launcher_code(), 3);
        assert_eq!(Ending::Code(256).launcher_code(), 1);
    }

    #[test]
    fn a_rank_that_left_early_is_named_where_the_others_waited_for_it() {
        let left = |rank: usize| EarlyExit {
            rank,
            local_rank: rank,
            pid: 10 + rank as u32,
            after: Duration::from_millis(210),
        };
        let mut f = Failure {
            rank: 0,
            local_rank: 0,
            node_rank: 0,
            pid: 10,
            ending: Ending::Code(1),
            after: Duration::from_secs(3),
            tail: LastLines { stdout: Default::default(), stderr: ["rank 1 went away".to_string()].into() },
            world_size: 4,
            left_early: vec![left(1)],
            parted_in: Some(Parting {
                collective: "#1 all_reduce(sum) 1024 × f32 in group comm1".into(),
                waiting: vec![0, 2],
                absent: vec![1, 3],
            }),
        };
        let s = f.summary();
        assert!(
            s.starts_with(
                "rank 1 left the job early: it exited with code 0 after 0.21 s (local rank 1, pid 11) while ranks \
                 0, 2 waited for it in #1 all_reduce(sum) 1024 × f32 in group comm1; then rank 0 failed: it exited \
                 with code 1 after 3.00 s (local rank 0 on node 0, pid 10); the other ranks were stopped\n"
            ),
            "{s}"
        );
        assert!(s.ends_with("last line of rank 0's stderr:\n    [rank 0]: rank 1 went away"), "{s}");
        f.left_early.push(left(3));
        assert!(
            f.summary().starts_with("ranks 1, 3 left the job early: they exited with code 0 (rank 1 after"),
            "{}",
            f.summary()
        );
        // No recorder puts them outside the collective: named, not blamed.
        f.parted_in = None;
        let s = f.summary();
        assert!(s.starts_with("rank 0 failed first: it exited with code 1"), "{s}");
        assert!(
            s.contains("\n  before that, with code 0, exited: rank 1 after 0.21 s (local rank 1, pid 11); rank 3"),
            "{s}"
        );
    }

    #[test]
    fn ranks_that_exited_0_before_a_stop_are_named() {
        let left = |rank: usize| EarlyExit { rank, local_rank: rank, pid: 7, after: Duration::from_millis(10) };
        assert_eq!(
            left_before_the_stop(&[left(1)]),
            "rank 1 exited with code 0 after 0.01 s (local rank 1, pid 7) before the job was stopped, while other \
             ranks still ran: if those waited for it (to join, or in a collective), it left the job early"
        );
        let two = left_before_the_stop(&[left(1), left(2)]);
        assert!(two.starts_with("ranks 1, 2 exited with code 0 (rank 1 after 0.01 s"), "{two}");
        assert!(two.ends_with("if those waited for them (to join, or in a collective), they left the job early"));
    }

    #[test]
    fn one_rank_summary_names_no_others() {
        let mut f = Failure {
            rank: 0,
            local_rank: 0,
            node_rank: 0,
            pid: 1,
            ending: Ending::Code(2),
            after: Duration::from_secs(1),
            tail: LastLines::default(),
            world_size: 1,
            left_early: vec![],
            parted_in: None,
        };
        let one = f.summary();
        assert!(one.starts_with("rank 0 failed: it exited with code 2") && !one.contains("other ranks"), "{one}");
        assert!(!f.unresponsive_summary(Duration::from_secs(3)).contains("other ranks"));
        f.world_size = 2;
        assert!(f.summary().contains("rank 0 failed first") && f.summary().contains("the other ranks were stopped"));
        // The other rank had exited with code 0: none was left to stop.
        f.left_early = vec![EarlyExit { rank: 1, local_rank: 1, pid: 2, after: Duration::from_millis(5) }];
        let s = f.summary();
        assert!(s.contains("before that, with code 0, exited: rank 1") && !s.contains("other ranks"), "{s}");
        assert!(!f.unresponsive_summary(Duration::from_secs(3)).contains("other ranks"));
        f.world_size = 3;
        assert!(f.summary().contains("the other ranks were stopped"));
    }
}
