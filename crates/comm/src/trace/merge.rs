//! Merging every rank's flight recorder to find where a job got stuck.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use super::recorder::{CollectiveFingerprint, RecordState, RecorderDump};

/// A collective that not every rank finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Straggler {
    pub group: String,
    /// The job ranks of the group, where its records name them (a group
    /// split from the job's communicator; `None`: every rank).
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

/// The merged view of all ranks' recorders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeReport {
    pub ranks: Vec<usize>,
    pub world_size: usize,
    /// Ranks of the world with no dump.
    pub missing_dumps: Vec<usize>,
    /// The first collective (lowest sequence number per group) that some
    /// rank did not finish, if any.
    pub first_unfinished: Option<Straggler>,
    /// Collectives every rank finished.
    pub completed: usize,
}

/// Merges dumps in memory.
pub fn merge(dumps: &[RecorderDump]) -> MergeReport {
    let world_size = dumps.iter().map(|d| d.world_size).max().unwrap_or(0);
    let ranks: Vec<usize> = dumps.iter().map(|d| d.rank).collect();
    let missing_dumps = (0..world_size).filter(|r| !ranks.contains(r)).collect();
    // (group, seq) -> per rank (fingerprint, state)
    let mut table: BTreeMap<(String, u64), BTreeMap<usize, (CollectiveFingerprint, RecordState)>> = BTreeMap::new();
    // Who takes part in each (group, seq), where a record says so.
    let mut among: BTreeMap<(String, u64), Vec<usize>> = BTreeMap::new();
    let mut oldest_seen: BTreeMap<(usize, String), u64> = BTreeMap::new();
    for dump in dumps {
        for record in &dump.records {
            let key = (record.group.clone(), record.fingerprint.seq);
            if let Some(ranks) = &record.ranks {
                among.insert(key.clone(), ranks.clone());
            }
            table.entry(key).or_default().insert(dump.rank, (record.fingerprint.clone(), record.state.clone()));
            let oldest = oldest_seen.entry((dump.rank, record.group.clone())).or_insert(u64::MAX);
            *oldest = (*oldest).min(record.fingerprint.seq);
        }
    }
    let mut completed = 0;
    let mut first_unfinished: Option<Straggler> = None;
    for ((group, seq), per_rank) in &table {
        let participants: Vec<usize> = match among.get(&(group.clone(), *seq)) {
            Some(list) => ranks.iter().copied().filter(|r| list.contains(r)).collect(),
            None => ranks.clone(),
        };
        let reference = per_rank.values().next().map(|(f, _)| f.clone()).expect("an entry has a rank");
        let mut straggler = Straggler {
            group: group.clone(),
            members: among.get(&(group.clone(), *seq)).cloned(),
            fingerprint: reference.clone(),
            finished: vec![],
            stuck: vec![],
            never_arrived: vec![],
            mismatched: vec![],
            failures: vec![],
        };
        for &rank in &participants {
            match per_rank.get(&rank) {
                Some((fingerprint, state)) => {
                    if *fingerprint != reference {
                        straggler.mismatched.push((rank, fingerprint.clone()));
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
                None => {
                    // A rank whose ring buffer starts after this sequence
                    // number dropped it (and so got past it).
                    let dropped = oldest_seen.get(&(rank, group.clone())).is_some_and(|&oldest| oldest > *seq);
                    if dropped {
                        straggler.finished.push(rank);
                    } else {
                        straggler.never_arrived.push(rank);
                    }
                }
            }
        }
        let all_finished = straggler.finished.len() == participants.len() && straggler.mismatched.is_empty();
        // A rank without a dump cannot say; where every rank that has one
        // finished, the collective counts as finished (ring algorithms do
        // not finish anywhere unless every rank took part).
        if all_finished {
            completed += 1;
        } else if first_unfinished.as_ref().is_none_or(|f| straggler.fingerprint.seq < f.fingerprint.seq) {
            first_unfinished = Some(straggler);
        }
    }
    MergeReport { ranks, world_size, missing_dumps, first_unfinished, completed }
}

/// Reads every `*.json` dump in `dir` (or the given files) and merges them.
pub fn merge_files(paths: &[&Path]) -> Result<MergeReport, String> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let entries = std::fs::read_dir(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            for entry in entries.flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "json") {
                    files.push(p);
                }
            }
        } else {
            files.push(path.to_path_buf());
        }
    }
    if files.is_empty() {
        return Err("no flight-recorder dumps (rank<N>.json) found".into());
    }
    let mut dumps = Vec::new();
    for file in files {
        let bytes = std::fs::read(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        let dump: RecorderDump = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{} is not a cohort flight-recorder dump: {e}", file.display()))?;
        dumps.push(dump);
    }
    dumps.sort_by_key(|d| d.rank);
    Ok(merge(&dumps))
}

fn list(ranks: &[usize]) -> String {
    if ranks.is_empty() {
        return "none".into();
    }
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

impl fmt::Display for MergeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "ranks with a dump: {} of {}", self.ranks.len(), self.world_size)?;
        if !self.missing_dumps.is_empty() {
            writeln!(f, "ranks without a dump (dead before writing?): {}", list(&self.missing_dumps))?;
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
}
