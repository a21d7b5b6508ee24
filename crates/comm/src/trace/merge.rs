//! Merging every rank's flight recorder to find where a job got stuck.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::Path;

use super::printable;
use super::recorder::{CollectiveFingerprint, RecordState, RecorderDump};
use crate::launch_env::MAX_WORLD_SIZE;

/// A collective that not every rank finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Straggler {
    pub group: String,
    /// The job ranks of the group, where its records name them (a group
    /// split from the job's communicator; `None`: every rank), in order,
    /// each once.
    pub members: Option<Vec<usize>>,
    pub fingerprint: CollectiveFingerprint,
    /// Ranks that finished it.
    pub finished: Vec<usize>,
    /// Ranks that started it but did not finish (stuck inside, or failed).
    pub stuck: Vec<usize>,
    /// Ranks whose recorder never saw it (never arrived).
    pub never_arrived: Vec<usize>,
    /// Ranks that called a different collective at this sequence number.
    pub mismatched: Vec<(usize, CollectiveFingerprint)>,
    /// Failure reasons by rank.
    pub failures: Vec<(usize, String)>,
}

/// The largest file [`merge_files`] reads as a dump: 256 MiB, about 700,000
/// records (`COHORT_FLIGHT_RECORDER` keeps 2,000 by default, about 0.7 MB).
/// A larger file is set aside unread.
pub const MAX_DUMP_BYTES: u64 = 256 << 20;

/// How many set-aside dumps a report names; the rest are only counted.
const NAMED_SKIPS: usize = 100;

/// A dump the merge set aside, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The file (or, for [`merge`], `dump <index>`).
    pub source: String,
    /// What is wrong with it, naming the field and value.
    pub reason: String,
}

/// The merged view of all ranks' recorders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeReport {
    /// Ranks with a usable dump, in order.
    pub ranks: Vec<usize>,
    pub world_size: usize,
    /// Ranks of the world with no dump.
    pub missing_dumps: Vec<usize>,
    /// The first collective (lowest sequence number per group) that some
    /// rank did not finish, if any.
    pub first_unfinished: Option<Straggler>,
    /// Collectives every rank finished.
    pub completed: usize,
    /// Dumps that could not be used (unreadable, not a dump, a rank outside
    /// its world, a second dump of one rank), the first 100 of them.
    pub skipped: Vec<Skipped>,
    /// How many more were set aside than `skipped` names.
    pub more_skipped: usize,
}

/// Collects the dumps set aside, naming the first [`NAMED_SKIPS`].
#[derive(Default)]
struct SetAside {
    named: Vec<Skipped>,
    more: usize,
}

impl SetAside {
    fn add(&mut self, source: String, reason: String) {
        if self.named.len() < NAMED_SKIPS {
            let (source, reason) = (printable(&source).into_owned(), printable(&reason).into_owned());
            self.named.push(Skipped { source, reason });
        } else {
            self.more += 1;
        }
    }
}

/// Escapes the control characters of every string of `dump` (see
/// [`printable`]).
fn defang(dump: &mut RecorderDump) {
    fn fix(s: &mut String) {
        if let Cow::Owned(clean) = printable(s) {
            *s = clean;
        }
    }
    fn fix_cow(s: &mut Cow<'static, str>) {
        if let Cow::Owned(clean) = printable(s) {
            *s = clean.into();
        }
    }
    fix(&mut dump.host);
    fix(&mut dump.reason);
    dump.startup.iter_mut().for_each(|(phase, _)| fix(phase));
    for record in &mut dump.records {
        fix(&mut record.group);
        fix_cow(&mut record.fingerprint.kind);
        fix_cow(&mut record.fingerprint.dtype);
        if let Some(op) = &mut record.fingerprint.op {
            fix_cow(op);
        }
        if let Some(path) = &mut record.path {
            fix(path);
        }
        if let RecordState::Failed(reason) = &mut record.state {
            fix(reason);
        }
    }
}

/// Why `dump` cannot be merged on its own, if it cannot.
fn implausible(dump: &RecorderDump) -> Option<String> {
    if dump.world_size == 0 || dump.world_size > MAX_WORLD_SIZE {
        return Some(format!(
            "its world_size {} is not between 1 and {MAX_WORLD_SIZE} (the most ranks a job can have)",
            dump.world_size
        ));
    }
    if dump.rank >= dump.world_size {
        return Some(format!("its rank {} is not below its world_size {}", dump.rank, dump.world_size));
    }
    None
}

/// Merges dumps in memory. A dump whose `world_size` is 0 or above
/// [`MAX_WORLD_SIZE`], whose `rank` is not below its `world_size`, or whose
/// rank an earlier dump already gave, is set aside (named `dump <index>` in
/// [`MergeReport::skipped`]).
pub fn merge(dumps: &[RecorderDump]) -> MergeReport {
    merge_named(dumps.iter().enumerate().map(|(i, d)| (format!("dump {i}"), d)), SetAside::default())
}

/// What each rank recorded of one collective: its fingerprint and state.
type PerRank<'a> = BTreeMap<usize, (&'a CollectiveFingerprint, &'a RecordState)>;

fn merge_named<'a>(dumps: impl Iterator<Item = (String, &'a RecorderDump)>, mut aside: SetAside) -> MergeReport {
    let mut by_rank: BTreeMap<usize, (String, &RecorderDump)> = BTreeMap::new();
    for (source, dump) in dumps {
        if let Some(reason) = implausible(dump) {
            aside.add(source, reason);
        } else if let Some((first, _)) = by_rank.get(&dump.rank) {
            let reason = format!("it claims rank {}, as {first} does (dumps of two jobs in one folder?)", dump.rank);
            aside.add(source, reason);
        } else {
            by_rank.insert(dump.rank, (source, dump));
        }
    }
    let ranks: Vec<usize> = by_rank.keys().copied().collect();
    let dumps: Vec<&RecorderDump> = by_rank.values().map(|(_, d)| *d).collect();
    let world_size = dumps.iter().map(|d| d.world_size).max().unwrap_or(0);
    let missing_dumps = (0..world_size).filter(|r| ranks.binary_search(r).is_err()).collect();
    // (group, seq) -> per rank (fingerprint, state)
    let mut table: BTreeMap<(&str, u64), PerRank> = BTreeMap::new();
    // Who takes part in each (group, seq), where a record says so: the
    // listed ranks that have a dump.
    let mut among: BTreeMap<(&str, u64), &[usize]> = BTreeMap::new();
    let mut oldest_seen: HashMap<(usize, &str), u64> = HashMap::new();
    for dump in &dumps {
        for record in &dump.records {
            let key = (record.group.as_str(), record.fingerprint.seq);
            if let Some(ranks) = &record.ranks {
                among.insert(key, ranks);
            }
            table.entry(key).or_default().insert(dump.rank, (&record.fingerprint, &record.state));
            let oldest = oldest_seen.entry((dump.rank, record.group.as_str())).or_insert(u64::MAX);
            *oldest = (*oldest).min(record.fingerprint.seq);
        }
    }
    // Per group, the oldest sequence number each rank with records kept, in
    // order: how many ranks dropped a given collective is one search.
    let mut oldest_by_group: HashMap<&str, Vec<u64>> = HashMap::new();
    for (&(_, group), &oldest) in &oldest_seen {
        oldest_by_group.entry(group).or_default().push(oldest);
    }
    oldest_by_group.values_mut().for_each(|v| v.sort_unstable());
    let members_of = |key: &(&str, u64)| -> Option<HashSet<usize>> {
        among.get(key).map(|list| list.iter().copied().filter(|r| ranks.binary_search(r).is_ok()).collect())
    };
    let dropped = |rank: usize, group: &str, seq: u64| oldest_seen.get(&(rank, group)).is_some_and(|&o| o > seq);

    // Which collectives every taking part rank finished: a walk over each
    // collective's own records (never over every rank per collective).
    let mut completed = 0;
    let mut first_unfinished: Option<(&str, u64)> = None;
    for (&(group, seq), per_rank) in &table {
        let members = members_of(&(group, seq));
        let takes_part = |rank: &usize| members.as_ref().is_none_or(|m| m.contains(rank));
        let reference = per_rank.values().next().map(|(f, _)| *f).expect("an entry has a rank");
        let mut finished = 0;
        let mut mismatched = false;
        for (rank, (fingerprint, state)) in per_rank {
            if takes_part(rank) {
                mismatched |= *fingerprint != reference;
                finished += usize::from(matches!(state, RecordState::Completed));
            }
        }
        // A rank whose ring buffer starts after this sequence number dropped
        // it (and so got past it).
        let (participants, dropped_it) = match &members {
            None => {
                let oldest = oldest_by_group.get(group).map_or(&[][..], |v| v.as_slice());
                (ranks.len(), oldest.len() - oldest.partition_point(|&o| o <= seq))
            }
            Some(m) => (m.len(), m.iter().filter(|&&r| dropped(r, group, seq)).count()),
        };
        // A rank without a dump cannot say; where every rank that has one
        // finished, the collective counts as finished (ring algorithms do
        // not finish anywhere unless every rank took part).
        if finished + dropped_it == participants && !mismatched {
            completed += 1;
        } else if first_unfinished.is_none_or(|(_, first)| seq < first) {
            first_unfinished = Some((group, seq));
        }
    }
    let first_unfinished = first_unfinished.map(|(group, seq)| {
        let per_rank = &table[&(group, seq)];
        let members = members_of(&(group, seq));
        let reference = per_rank.values().next().map(|(f, _)| (*f).clone()).expect("an entry has a rank");
        let mut straggler = Straggler {
            group: group.to_string(),
            members: among.get(&(group, seq)).map(|list| {
                let mut members = list.to_vec();
                members.sort_unstable();
                members.dedup();
                members
            }),
            fingerprint: reference.clone(),
            finished: vec![],
            stuck: vec![],
            never_arrived: vec![],
            mismatched: vec![],
            failures: vec![],
        };
        for &rank in ranks.iter().filter(|r| members.as_ref().is_none_or(|m| m.contains(r))) {
            match per_rank.get(&rank) {
                Some((fingerprint, state)) => {
                    if **fingerprint != reference {
                        straggler.mismatched.push((rank, (*fingerprint).clone()));
                    }
                    match state {
                        RecordState::Completed => straggler.finished.push(rank),
                        RecordState::Started => straggler.stuck.push(rank),
                        RecordState::Failed(reason) => {
                            straggler.stuck.push(rank);
                            straggler.failures.push((rank, reason.clone()));
                        }
                    }
                }
                None if dropped(rank, group, seq) => straggler.finished.push(rank),
                None => straggler.never_arrived.push(rank),
            }
        }
        straggler
    });
    MergeReport {
        ranks,
        world_size,
        missing_dumps,
        first_unfinished,
        completed,
        skipped: aside.named,
        more_skipped: aside.more,
    }
}

/// Reads every `*.json` dump in the given folders (and the files given) and
/// merges them. A file that cannot be used is set aside, named with the
/// reason in [`MergeReport::skipped`], and the rest are merged: a link or
/// anything but a regular file inside a folder (a FIFO is never opened for
/// long: nothing blocks), a file over [`MAX_DUMP_BYTES`] (never read), an
/// empty file, one that is not a dump's JSON (truncated, foreign), one
/// named `rank<N>.json` that holds another rank, and the dumps [`merge`]
/// sets aside. Errs, naming the files and reasons, when no dump is usable.
pub fn merge_files(paths: &[&Path]) -> Result<MergeReport, String> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let entries = std::fs::read_dir(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let start = files.len();
            for entry in entries.flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "json") {
                    files.push((p, true));
                }
            }
            files[start..].sort();
        } else {
            files.push((path.to_path_buf(), false));
        }
    }
    if files.is_empty() {
        return Err("no flight-recorder dumps (rank<N>.json) found".into());
    }
    let mut aside = SetAside::default();
    let mut dumps = Vec::new();
    for (file, in_folder) in files {
        let source = file.display().to_string();
        match read_dump(&file, in_folder) {
            Ok(dump) => dumps.push((source, dump)),
            Err(reason) => aside.add(source, reason),
        }
    }
    let report = merge_named(dumps.iter().map(|(source, dump)| (source.clone(), dump)), aside);
    if report.ranks.is_empty() {
        let mut why: Vec<String> = report.skipped.iter().map(|s| format!("\n  {}: {}", s.source, s.reason)).collect();
        if report.more_skipped > 0 {
            why.push(format!("\n  … and {} more", report.more_skipped));
        }
        return Err(format!("no usable flight-recorder dump:{}", why.concat()));
    }
    Ok(report)
}

/// Reads one dump file with the checks of [`merge_files`]; `in_folder`:
/// found by listing a folder (so a link there is refused, not followed).
fn read_dump(file: &Path, in_folder: bool) -> Result<RecorderDump, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut flags = libc::O_NONBLOCK;
    if in_folder {
        flags |= libc::O_NOFOLLOW;
    }
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(file);
    let handle = match opened {
        Ok(handle) => handle,
        Err(e) if in_folder && e.raw_os_error() == Some(libc::ELOOP) => {
            return Err("it is a symbolic link: cohort does not follow links in a trace folder (ranks write their \
                        dumps as plain files); name the file itself to read it"
                .into())
        }
        Err(e) => return Err(format!("cannot open it: {e}")),
    };
    let meta = handle.metadata().map_err(|e| format!("cannot stat it: {e}"))?;
    if !meta.is_file() {
        return Err("it is not a regular file (a folder, FIFO, socket or device is never a dump)".into());
    }
    if meta.len() > MAX_DUMP_BYTES {
        return Err(format!("it is {} bytes, more than the {} MiB a dump may be", meta.len(), MAX_DUMP_BYTES >> 20));
    }
    let mut bytes = Vec::new();
    handle.take(MAX_DUMP_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() as u64 > MAX_DUMP_BYTES {
        return Err(format!("it grew past the {} MiB a dump may be while being read", MAX_DUMP_BYTES >> 20));
    }
    if bytes.is_empty() {
        return Err("it is empty (not a cohort flight-recorder dump)".into());
    }
    let mut dump: RecorderDump =
        serde_json::from_slice(&bytes).map_err(|e| format!("it is not a cohort flight-recorder dump: {e}"))?;
    defang(&mut dump);
    let named_rank = file
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("rank")?.strip_suffix(".json")?.parse::<usize>().ok());
    if let Some(named) = named_rank.filter(|&n| n != dump.rank) {
        return Err(format!("it is named for rank {named} but holds rank {}", dump.rank));
    }
    Ok(dump)
}

/// Ranks in order, runs of three or more as `first-last`.
fn list(ranks: &[usize]) -> String {
    if ranks.is_empty() {
        return "none".into();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j].wrapping_add(1) {
            j += 1;
        }
        if j >= i + 2 {
            parts.push(format!("{}-{}", ranks[i], ranks[j]));
        } else {
            parts.extend(ranks[i..=j].iter().map(|r| r.to_string()));
        }
        i = j + 1;
    }
    parts.join(", ")
}

impl fmt::Display for MergeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.skipped.is_empty() {
            writeln!(f, "dumps set aside: {}", self.skipped.len() + self.more_skipped)?;
            for s in &self.skipped {
                writeln!(f, "  {}: {}", s.source, s.reason)?;
            }
            if self.more_skipped > 0 {
                writeln!(f, "  … and {} more", self.more_skipped)?;
            }
        }
        writeln!(f, "ranks with a dump: {} of {}", self.ranks.len(), self.world_size)?;
        if !self.missing_dumps.is_empty() {
            writeln!(f, "ranks without a dump (ended before writing one?): {}", list(&self.missing_dumps))?;
        }
        writeln!(f, "collectives every rank finished: {}", self.completed)?;
        match &self.first_unfinished {
            None => writeln!(f, "every recorded collective finished on every rank"),
            Some(s) => {
                write!(f, "first collective not finished everywhere: {} in group {}", s.fingerprint, s.group)?;
                match &s.members {
                    Some(members) => writeln!(f, " (ranks {})", list(members))?,
                    None => writeln!(f)?,
                }
                writeln!(f, "  finished:       {}", list(&s.finished))?;
                writeln!(f, "  stuck inside:   {}", list(&s.stuck))?;
                writeln!(f, "  never arrived:  {}", list(&s.never_arrived))?;
                for (rank, other) in &s.mismatched {
                    writeln!(f, "  rank {rank} called {other} instead")?;
                }
                for (rank, reason) in &s.failures {
                    writeln!(f, "  rank {rank} failed: {reason}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::recorder::CollectiveRecord;

    fn record(seq: u64, kind: &'static str, state: RecordState) -> CollectiveRecord {
        CollectiveRecord {
            group: "world".into(),
            fingerprint: CollectiveFingerprint {
                seq,
                kind: kind.into(),
                op: None,
                dtype: "f32".into(),
                count: 4,
                root: None,
            },
            started_us: seq,
            ended_us: None,
            state,
            id: 0,
            ranks: None,
            path: None,
        }
    }

    fn dump(rank: usize, records: Vec<CollectiveRecord>) -> RecorderDump {
        RecorderDump {
            rank,
            world_size: 3,
            host: "h".into(),
            pid: 1,
            reason: "test".into(),
            written_us: 0,
            records,
            startup: vec![],
        }
    }

    #[test]
    fn points_at_the_first_collective_a_rank_never_reached() {
        use RecordState::*;
        let dumps = vec![
            dump(0, vec![record(0, "all_reduce", Completed), record(1, "broadcast", Started)]),
            dump(1, vec![record(0, "all_reduce", Completed), record(1, "broadcast", Started)]),
            dump(2, vec![record(0, "all_reduce", Completed)]),
        ];
        let report = merge(&dumps);
        assert_eq!(report.completed, 1);
        let s = report.first_unfinished.clone().unwrap();
        assert_eq!(s.fingerprint.seq, 1);
        assert_eq!(s.stuck, vec![0, 1]);
        assert_eq!(s.never_arrived, vec![2]);
        assert!(report.to_string().contains("never arrived:  2"), "{report}");
    }

    #[test]
    fn reports_mismatched_collectives_and_missing_dumps() {
        use RecordState::*;
        let dumps = vec![
            dump(0, vec![record(0, "all_reduce", Failed("mismatch".into()))]),
            dump(1, vec![record(0, "all_gather", Failed("mismatch".into()))]),
        ];
        let report = merge(&dumps);
        assert_eq!(report.missing_dumps, vec![2]);
        let s = report.first_unfinished.unwrap();
        assert_eq!(s.mismatched.len(), 1);
        assert_eq!(s.mismatched[0].0, 1);
        assert_eq!(s.failures.len(), 2);
    }

    #[test]
    fn names_a_groups_members() {
        use RecordState::*;
        let among = |mut r: CollectiveRecord| {
            r.group = "comm1.s0c1".into();
            r.ranks = Some(vec![1, 2]);
            r
        };
        let dumps = vec![
            dump(0, vec![record(0, "all_reduce", Completed)]),
            dump(1, vec![record(0, "all_reduce", Completed), among(record(0, "broadcast", Failed("mismatch".into())))]),
            dump(
                2,
                vec![record(0, "all_reduce", Completed), among(record(0, "all_reduce", Failed("mismatch".into())))],
            ),
        ];
        let report = merge(&dumps);
        let s = report.first_unfinished.clone().unwrap();
        assert_eq!((s.group.as_str(), s.members.clone()), ("comm1.s0c1", Some(vec![1, 2])));
        assert!(report.to_string().contains("in group comm1.s0c1 (ranks 1, 2)"), "{report}");
    }

    /// Runs `f` on a thread; fails (rather than hangs) when it has not
    /// answered within `secs`.
    fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(secs)).expect("no answer in time: hung or far too slow")
    }

    fn with_world(mut d: RecorderDump, world_size: usize) -> RecorderDump {
        d.world_size = world_size;
        d
    }

    #[test]
    fn a_huge_world_size_or_rank_is_set_aside_not_counted_to() {
        use RecordState::*;
        let dumps = vec![
            dump(0, vec![record(0, "all_reduce", Completed)]),
            with_world(dump(1, vec![record(0, "all_reduce", Completed)]), usize::MAX),
            dump(7, vec![record(0, "all_reduce", Completed)]),
            with_world(dump(2, vec![]), 0),
            dump(2, vec![record(0, "all_reduce", Started)]),
        ];
        let report = within(20, move || merge(&dumps));
        assert_eq!((report.ranks.clone(), report.world_size), (vec![0, 2], 3), "{report}");
        assert_eq!(report.missing_dumps, vec![1]);
        let reasons: Vec<&str> = report.skipped.iter().map(|s| s.reason.as_str()).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert!(
            reasons[0].contains("world_size 18446744073709551615") && reasons[0].contains("4194304"),
            "{reasons:?}"
        );
        assert!(reasons[1].contains("rank 7") && reasons[1].contains("world_size 3"), "{reasons:?}");
        assert!(reasons[2].contains("world_size 0"), "{reasons:?}");
        assert!(report.to_string().contains("set aside"), "{report}");
        assert_eq!(report.first_unfinished.unwrap().stuck, vec![2]);
    }

    #[test]
    fn a_second_dump_of_one_rank_is_set_aside_naming_the_first() {
        use RecordState::*;
        let dumps = vec![
            dump(0, vec![record(0, "all_reduce", Completed)]),
            dump(1, vec![record(0, "all_reduce", Completed)]),
            dump(1, vec![record(0, "all_reduce", Started)]),
            dump(2, vec![record(0, "all_reduce", Completed)]),
        ];
        let report = merge(&dumps);
        assert_eq!(report.ranks, vec![0, 1, 2]);
        assert_eq!(report.completed, 1, "{report}");
        assert!(report.first_unfinished.is_none(), "{report}");
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].source, "dump 2");
        assert!(report.skipped[0].reason.contains("rank 1, as dump 1 does"), "{:?}", report.skipped);
    }

    #[test]
    fn sequence_numbers_near_the_top_and_empty_records_merge() {
        use RecordState::*;
        let top = u64::MAX;
        let dumps = vec![
            dump(0, vec![record(top - 1, "all_reduce", Completed), record(top, "broadcast", Completed)]),
            dump(1, vec![record(top - 1, "all_reduce", Completed), record(top, "broadcast", Started)]),
            dump(2, vec![]),
        ];
        let report = merge(&dumps);
        assert_eq!(report.completed, 0, "{report}");
        let s = report.first_unfinished.clone().unwrap();
        assert_eq!((s.fingerprint.seq, s.finished.clone(), s.never_arrived.clone()), (top - 1, vec![0, 1], vec![2]));
        assert!(report.to_string().contains("#18446744073709551614 all_reduce"), "{report}");
        assert_eq!(merge(&[]).to_string().lines().next(), Some("ranks with a dump: 0 of 0"));
    }

    #[test]
    fn many_ranks_each_at_its_own_collective_merge_without_a_quadratic_walk() {
        use RecordState::*;
        let n = 100_000;
        let dumps: Vec<RecorderDump> = (0..n)
            .map(|rank| {
                let mut r = record(rank as u64, "all_reduce", Completed);
                if rank % 2 == 1 {
                    r.ranks = Some(vec![rank, (rank + 1) % n]);
                }
                with_world(dump(rank, vec![r]), n)
            })
            .collect();
        let report = within(60, move || merge(&dumps));
        // Rank r finished #r and its ring starts there, so it got past every
        // earlier one: #0 (every rank's) and each odd #r (ranks r and r + 1)
        // but the last (ranks 99999 and 0) finished; #2 is the first that
        // ranks 0 and 1 never reached.
        assert_eq!((report.ranks.len(), report.completed), (n, 50_000));
        let s = report.first_unfinished.unwrap();
        assert_eq!((s.fingerprint.seq, s.never_arrived.clone(), s.finished.len()), (2, vec![0, 1], n - 2));
    }

    #[test]
    fn a_long_run_of_missing_ranks_prints_as_one_range() {
        use RecordState::*;
        let dumps = vec![with_world(dump(1, vec![record(0, "all_reduce", Completed)]), 4_194_304)];
        let report = within(60, move || merge(&dumps));
        assert_eq!(report.missing_dumps.len(), 4_194_303);
        let text = report.to_string();
        assert!(text.contains("(ended before writing one?): 0, 2-4194303\n"), "{}", &text[..text.len().min(500)]);
        assert!(text.len() < 1000, "{} bytes", text.len());
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("cohort-merge-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write_dump(path: &Path, d: &RecorderDump) {
        std::fs::write(path, serde_json::to_vec(d).unwrap()).unwrap();
    }

    fn reason_for<'a>(report: &'a MergeReport, name: &str) -> &'a str {
        let found = report.skipped.iter().find(|s| s.source.ends_with(name));
        found.map(|s| s.reason.as_str()).unwrap_or_else(|| panic!("{name} not set aside: {report}"))
    }

    #[test]
    fn unreadable_or_foreign_files_are_set_aside_by_name() {
        use RecordState::*;
        let dir = scratch("foreign");
        write_dump(&dir.join("rank0.json"), &dump(0, vec![record(0, "all_reduce", Completed)]));
        let whole = serde_json::to_vec(&dump(1, vec![record(0, "all_reduce", Completed)])).unwrap();
        std::fs::write(dir.join("rank1.json"), &whole[..whole.len() / 2]).unwrap();
        std::fs::write(dir.join("notes.json"), b"not json at all").unwrap();
        std::fs::write(dir.join("empty.json"), b"").unwrap();
        write_dump(&dir.join("rank5.json"), &dump(2, vec![record(0, "all_reduce", Completed)]));
        std::fs::write(dir.join("README"), b"ignored: not .json").unwrap();
        let report = merge_files(&[dir.as_path()]).unwrap();
        assert_eq!(report.ranks, vec![0], "{report}");
        assert!(reason_for(&report, "rank1.json").contains("not a cohort flight-recorder dump"), "{report}");
        assert!(reason_for(&report, "notes.json").contains("not a cohort flight-recorder dump"), "{report}");
        assert!(reason_for(&report, "empty.json").contains("empty"), "{report}");
        assert!(reason_for(&report, "rank5.json").contains("holds rank 2"), "{report}");
        assert_eq!(report.skipped.len(), 4, "{report}");
        let text = report.to_string();
        assert!(text.contains(&format!("{}: ", dir.join("rank1.json").display())), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
        // Nothing usable at all: an error naming each file.
        let dir = scratch("nothing");
        std::fs::write(dir.join("rank0.json"), b"{").unwrap();
        write_dump(&dir.join("rank1.json"), &with_world(dump(1, vec![]), usize::MAX));
        let err = merge_files(&[dir.as_path()]).unwrap_err();
        assert!(err.contains("no usable flight-recorder dump") && err.contains("rank0.json"), "{err}");
        assert!(err.contains("rank1.json: its world_size 18446744073709551615"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fifos_links_and_link_loops_are_set_aside_without_blocking() {
        use RecordState::*;
        let dir = scratch("special");
        write_dump(&dir.join("rank0.json"), &dump(0, vec![record(0, "all_reduce", Completed)]));
        let fifo = std::ffi::CString::new(dir.join("rank1.json").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `fifo` is NUL-terminated.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let outside = scratch("special-outside");
        write_dump(&outside.join("theirs.json"), &dump(2, vec![record(0, "all_reduce", Completed)]));
        std::os::unix::fs::symlink(outside.join("theirs.json"), dir.join("rank2.json")).unwrap();
        std::os::unix::fs::symlink(dir.join("b.json"), dir.join("a.json")).unwrap();
        std::os::unix::fs::symlink(dir.join("a.json"), dir.join("b.json")).unwrap();
        std::fs::create_dir(dir.join("rank3.json")).unwrap();
        let path = dir.clone();
        let report = within(20, move || merge_files(&[path.as_path()]).unwrap());
        assert_eq!(report.ranks, vec![0], "{report}");
        assert!(reason_for(&report, "rank1.json").contains("not a regular file"), "{report}");
        assert!(reason_for(&report, "rank2.json").contains("symbolic link"), "{report}");
        assert!(reason_for(&report, "a.json").contains("symbolic link"), "{report}");
        assert!(reason_for(&report, "rank3.json").contains("not a regular file"), "{report}");
        // A FIFO named on the command line does not block either.
        let fifo_path = dir.join("rank1.json");
        let err = within(20, move || merge_files(&[fifo_path.as_path()]).unwrap_err());
        assert!(err.contains("rank1.json") && err.contains("not a regular file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&outside).unwrap();
    }

    #[test]
    fn an_oversized_dump_is_set_aside_unread() {
        use RecordState::*;
        let dir = scratch("huge");
        write_dump(&dir.join("rank0.json"), &dump(0, vec![record(0, "all_reduce", Completed)]));
        // 2 GiB, sparse: takes no disk.
        std::fs::File::create(dir.join("rank1.json")).unwrap().set_len(2 << 30).unwrap();
        let path = dir.clone();
        let report = within(20, move || merge_files(&[path.as_path()]).unwrap());
        assert_eq!(report.ranks, vec![0], "{report}");
        let reason = reason_for(&report, "rank1.json");
        assert!(reason.contains("2147483648 bytes") && reason.contains("256 MiB"), "{reason}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn control_characters_in_a_dump_are_shown_escaped_not_sent_to_the_terminal() {
        use RecordState::*;
        let dir = scratch("escapes");
        let mut r = record(0, "all_reduce\u{1b}[2J", Failed("boom\u{7}\r\nforged line".into()));
        r.group = "w\u{1b}]0;title\u{7}".into();
        r.ranks = Some(vec![2, 0, 0, 1]);
        write_dump(&dir.join("rank0.json"), &dump(0, vec![r]));
        let text = merge_files(&[dir.as_path()]).unwrap().to_string();
        assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
        assert!(text.contains(r"all_reduce\u{1b}[2J") && text.contains(r"boom\u{7}\r\nforged line"), "{text}");
        assert!(text.contains(r"in group w\u{1b}]0;title\u{7} (ranks 0-2)"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
