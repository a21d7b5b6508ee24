//! The peer-memory fast path of device groups: which all-reduces and
//! all-gathers run as cohort's own kernels over peer memory (one-shot or
//! two-shot) instead of NCCL, and the per-machine crossover table that
//! decides it.
//!
//! A call can take the fast path when it is an all-reduce or an all-gather
//! of 2 to [`PEER_MAX_RANKS`] devices that all reach each other's memory,
//! with at most [`PEER_MAX_BYTES`] per member. Every element type and
//! operator is claimed: the kernels fold the members in member order and
//! round after every step as the host reference does, so every member gets
//! the same bits. Everything else goes to NCCL.
//!
//! [`Algo::Auto`] looks the call up in the [`Crossover`] table of this
//! machine: the file `crossover.tsv` beside the NVRTC cache (in
//! `COHORT_CACHE_DIR`), which `nccl_bench --write-crossover` measures and
//! writes; rows it lacks come from [`Crossover::builtin`]. `COHORT_ALGO`
//! and [`crate::ClientGroup::with_algo`] force a path.

use std::path::PathBuf;
use std::sync::OnceLock;

use cohort_runtime::backend::{Binding, PeerAlgo, PeerCall, PEER_MAX_BYTES, PEER_MAX_RANKS};
use cohort_runtime::private_fs::PrivateDir;

pub use cohort_runtime::config::AlgoChoice as Algo;

use crate::op::{Collective, Op};

/// The path one collective takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// NCCL.
    Nccl,
    /// The one-shot peer kernel (all-gathers: the peer all-gather kernel).
    OneShot,
    /// The two-shot peer kernel.
    TwoShot,
}

impl Path {
    /// The name the flight recorder, the timeline and the benches print.
    pub fn name(self) -> &'static str {
        match self {
            Path::Nccl => "nccl",
            Path::OneShot => "oneshot",
            Path::TwoShot => "twoshot",
        }
    }

    /// The peer kernel of a path (`None` for NCCL).
    pub(crate) fn peer(self) -> Option<PeerAlgo> {
        match self {
            Path::Nccl => None,
            Path::OneShot => Some(PeerAlgo::OneShot),
            Path::TwoShot => Some(PeerAlgo::TwoShot),
        }
    }
}

/// Which collectives a crossover row is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TableKind {
    AllReduce,
    AllGather,
}

impl TableKind {
    fn name(self) -> &'static str {
        match self {
            TableKind::AllReduce => "all_reduce",
            TableKind::AllGather => "all_gather",
        }
    }
}

/// One row: on `device` (the device's name, `*` for any) with `ranks`
/// members, calls of up to `one_shot_max` bytes per member take the
/// one-shot kernel, up to `two_shot_max` the two-shot kernel, larger ones
/// NCCL (all-gathers use `one_shot_max` alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossoverRow {
    pub device: String,
    pub ranks: usize,
    pub kind: TableKind,
    pub one_shot_max: u64,
    pub two_shot_max: u64,
}

/// A crossover table: the sizes at which each path stops paying.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Crossover {
    pub rows: Vec<CrossoverRow>,
}

/// The largest crossover table file read: 64 KiB, about a thousand rows (a
/// measured table has a few per device model).
pub const MAX_TABLE_BYTES: u64 = 64 << 10;

const HEADER: &str = "# cohort crossover v1: device\tranks\tcollective\tone_shot_max_bytes\ttwo_shot_max_bytes";

impl Crossover {
    /// The table used where the machine has none, for any device: for two
    /// members the crossovers measured on two NVLinked H200s
    /// (docs/benchmarks.md: the one-shot kernel beat NCCL and the two-shot
    /// kernel up to the arena's 8 MiB, the all-gather kernel up to 4 MiB per
    /// member); for more members, where the one-shot kernel reads `n - 1`
    /// inputs, unmeasured guesses (one-shot to 256 KiB, two-shot to 8 MiB,
    /// all-gather to 1 MiB).
    pub fn builtin() -> Crossover {
        let row = |ranks, kind, one_shot_max, two_shot_max| CrossoverRow {
            device: "*".into(),
            ranks,
            kind,
            one_shot_max,
            two_shot_max,
        };
        Crossover {
            rows: vec![
                row(2, TableKind::AllReduce, 8 << 20, 8 << 20),
                row(2, TableKind::AllGather, 4 << 20, 0),
                row(0, TableKind::AllReduce, 256 << 10, 8 << 20),
                row(0, TableKind::AllGather, 1 << 20, 0),
            ],
        }
    }

    /// Reads a table written by [`Crossover::to_text`]; a bad line is an
    /// error naming it.
    pub fn parse(text: &str) -> Result<Crossover, String> {
        let mut rows = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end();
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: &str| format!("line {}: {why}: {line:?}", n + 1);
            let fields: Vec<&str> = line.split('\t').collect();
            if fields.len() != 5 {
                return Err(bad("expected 5 tab-separated fields"));
            }
            let number = |s: &str, what: &str| {
                s.trim().parse::<u64>().map_err(|_| bad(&format!("{what} is not a whole number")))
            };
            let kind = match fields[2].trim() {
                "all_reduce" => TableKind::AllReduce,
                "all_gather" => TableKind::AllGather,
                _ => return Err(bad("the collective is neither all_reduce nor all_gather")),
            };
            rows.push(CrossoverRow {
                device: fields[0].to_string(),
                ranks: number(fields[1], "ranks")? as usize,
                kind,
                one_shot_max: number(fields[3], "one_shot_max_bytes")?,
                two_shot_max: number(fields[4], "two_shot_max_bytes")?,
            });
        }
        Ok(Crossover { rows })
    }

    /// The table as text (one row a line, tab-separated).
    pub fn to_text(&self) -> String {
        let mut out = format!("{HEADER}\n");
        for r in &self.rows {
            out.push_str(&format!(
                "{}\t{}\t{}\t{}\t{}\n",
                r.device,
                r.ranks,
                r.kind.name(),
                r.one_shot_max,
                r.two_shot_max
            ));
        }
        out
    }

    /// The row for `device` with `ranks` members: an exact match, else one
    /// for any member count (`0`) of that device, else one for any device
    /// (`*`).
    pub fn row(&self, device: &str, ranks: usize, kind: TableKind) -> Option<&CrossoverRow> {
        let pick = |device: &str, ranks: usize| {
            self.rows.iter().find(|r| r.kind == kind && r.device == device && r.ranks == ranks)
        };
        pick(device, ranks).or_else(|| pick(device, 0)).or_else(|| pick("*", ranks)).or_else(|| pick("*", 0))
    }

    /// Adds or replaces the row of its device, member count and kind.
    pub fn set(&mut self, row: CrossoverRow) {
        self.rows.retain(|r| !(r.device == row.device && r.ranks == row.ranks && r.kind == row.kind));
        self.rows.push(row);
    }

    /// Where this machine's table lives: `crossover.tsv` in the folder
    /// that holds the NVRTC cache (`COHORT_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/cohort`, else `$HOME/.cache/cohort`).
    pub fn path() -> Option<PathBuf> {
        let dir = match cohort_runtime::config::CACHE_DIR.get() {
            Ok(Some(dir)) => dir,
            _ => match std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).filter(|d| d.is_absolute()) {
                Some(xdg) => xdg.join("cohort"),
                None => PathBuf::from(std::env::var_os("HOME").filter(|h| !h.is_empty())?).join(".cache/cohort"),
            },
        };
        Some(dir.join("crossover.tsv"))
    }

    /// This machine's table with the built-in rows behind it. A table that
    /// cannot be read is logged (once per process: `machine_table` reads
    /// it once) and ignored: the built-in rows decide.
    pub fn for_machine() -> Crossover {
        let mut table = Crossover::builtin();
        let Some(path) = Crossover::path() else { return table };
        match Crossover::read(&path) {
            Ok(Some(found)) => {
                // Measured rows go first: they win over the built-in ones.
                let mut rows = found.rows;
                rows.append(&mut table.rows);
                table.rows = rows;
            }
            Ok(None) => {}
            Err(err) => tracing::warn!("the crossover table is ignored (the built-in choice applies): {err}"),
        }
        table
    }

    /// Reads the table file at `path` (`Ok(None)` where there is none).
    /// The error names the file and the problem: its folder or it refused by
    /// [`PrivateDir`] (a link, not this user's, writable by others, not a
    /// regular file: a FIFO is refused at once), larger than
    /// `MAX_TABLE_BYTES` (64 KiB; never read), not UTF-8, or a bad line.
    pub fn read(path: &std::path::Path) -> Result<Option<Crossover>, String> {
        use std::io::Read;
        let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
            return Err(format!("{} is not a file path", path.display()));
        };
        let dir = if dir.as_os_str().is_empty() { std::path::Path::new(".") } else { dir };
        let folder = PrivateDir::open(dir).map_err(|e| e.to_string())?;
        let Some(file) = folder.open_file(name).map_err(|e| e.to_string())? else { return Ok(None) };
        let size = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
        if size > MAX_TABLE_BYTES {
            return Err(format!(
                "{} is {size} bytes, more than the {} KiB a crossover table may be",
                path.display(),
                MAX_TABLE_BYTES >> 10
            ));
        }
        let mut text = String::new();
        file.take(MAX_TABLE_BYTES).read_to_string(&mut text).map_err(|e| format!("{}: {e}", path.display()))?;
        Crossover::parse(&text).map(Some).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes the table to [`Crossover::path`] (a private folder, replaced
    /// atomically); returns the path.
    pub fn save(&self) -> Result<PathBuf, String> {
        let path = Crossover::path().ok_or("no cache folder: set COHORT_CACHE_DIR or HOME")?;
        let dir = path.parent().ok_or("the crossover path has no folder")?;
        let dir = PrivateDir::open_or_create(dir).map_err(|e| e.to_string())?;
        let mut file = dir.create_file("crossover.tsv.tmp").map_err(|e| e.to_string())?;
        std::io::Write::write_all(&mut file, self.to_text().as_bytes()).map_err(|e| e.to_string())?;
        dir.rename("crossover.tsv.tmp", "crossover.tsv").map_err(|e| e.to_string())?;
        Ok(path)
    }
}

/// This process's table (read once).
pub(crate) fn machine_table() -> &'static Crossover {
    static TABLE: OnceLock<Crossover> = OnceLock::new();
    TABLE.get_or_init(Crossover::for_machine)
}

/// The peer kernel call that runs `op` from `src` into `dst` with `algo`
/// (`None`: no kernel runs this collective).
pub(crate) fn peer_call_for(op: &Op, algo: PeerAlgo, src: Binding, dst: Binding) -> Option<PeerCall> {
    match (op.collective(), op.reduce_op()) {
        (Collective::AllReduce, Some(reduce)) => {
            Some(PeerCall::AllReduce { src, dst, dtype: op.dtype(), op: reduce, algo })
        }
        (Collective::AllGather, _) => Some(PeerCall::AllGather { src, dst }),
        _ => None,
    }
}

/// Whether a peer kernel can run `op` among `ranks` members at all.
pub fn claimed(op: &Op, ranks: usize) -> Option<TableKind> {
    if !(2..=PEER_MAX_RANKS).contains(&ranks) {
        return None;
    }
    let bytes = op.block_bytes() as u64;
    if bytes == 0 || bytes > PEER_MAX_BYTES {
        return None;
    }
    match op.collective() {
        Collective::AllReduce => Some(TableKind::AllReduce),
        Collective::AllGather => Some(TableKind::AllGather),
        _ => None,
    }
}

/// The path of `op` among `ranks` members of `device` under `algo`, with
/// `table`. Forced peer paths apply where a peer kernel can run; the rest
/// goes to NCCL.
pub fn choose_with(table: &Crossover, algo: Algo, op: &Op, ranks: usize, device: &str) -> Path {
    let Some(kind) = claimed(op, ranks) else { return Path::Nccl };
    let bytes = op.block_bytes() as u64;
    match (algo, kind) {
        (Algo::Nccl, _) => Path::Nccl,
        (Algo::OneShot, _) | (Algo::TwoShot, TableKind::AllGather) => Path::OneShot,
        (Algo::TwoShot, TableKind::AllReduce) => Path::TwoShot,
        (Algo::Auto, kind) => match table.row(device, ranks, kind) {
            Some(row) if bytes <= row.one_shot_max => Path::OneShot,
            Some(row) if kind == TableKind::AllReduce && bytes <= row.two_shot_max => Path::TwoShot,
            _ => Path::Nccl,
        },
    }
}

/// [`choose_with`] this machine's table.
pub fn choose(algo: Algo, op: &Op, ranks: usize, device: &str) -> Path {
    choose_with(machine_table(), algo, op, ranks, device)
}

/// The path `COHORT_ALGO` asks for (`Auto` when unset; an unusable value
/// is refused by `ClientGroup::new` and means `Auto` here).
pub fn algo_from_env() -> Algo {
    cohort_runtime::config::ALGO.get().unwrap_or(Algo::Auto)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{DType, ReduceOp};

    fn sum(bytes: usize) -> Op {
        Op::all_reduce(DType::F32, ReduceOp::Sum, bytes / 4)
    }

    #[test]
    fn auto_picks_by_size_and_forced_paths_apply_only_where_a_kernel_can_run() {
        let table = Crossover::builtin();
        let pick = |algo, op: &Op, ranks| choose_with(&table, algo, op, ranks, "NVIDIA H200");
        assert_eq!(pick(Algo::Auto, &sum(8), 2), Path::OneShot);
        assert_eq!(pick(Algo::Auto, &sum(8 << 20), 2), Path::OneShot);
        assert_eq!(pick(Algo::Auto, &sum(256 << 10), 4), Path::OneShot);
        assert_eq!(pick(Algo::Auto, &sum(1 << 20), 4), Path::TwoShot);
        assert_eq!(pick(Algo::Auto, &sum(64 << 20), 2), Path::Nccl);
        assert_eq!(pick(Algo::Nccl, &sum(8), 2), Path::Nccl);
        assert_eq!(pick(Algo::TwoShot, &sum(8), 2), Path::TwoShot);
        assert_eq!(pick(Algo::OneShot, &sum(4 << 20), 2), Path::OneShot);
        // Past the arena, one member, nine members, nothing to move, or a
        // collective without a kernel: NCCL whatever is forced.
        assert_eq!(pick(Algo::OneShot, &sum(16 << 20), 2), Path::Nccl);
        assert_eq!(pick(Algo::OneShot, &sum(8), 1), Path::Nccl);
        assert_eq!(pick(Algo::OneShot, &sum(8), 9), Path::Nccl);
        assert_eq!(pick(Algo::OneShot, &sum(0), 2), Path::Nccl);
        assert_eq!(pick(Algo::OneShot, &Op::broadcast(DType::F32, 0, 4), 2), Path::Nccl);
        // All-gathers have one kernel.
        let gather = Op::all_gather(DType::BF16, 64);
        assert_eq!(pick(Algo::TwoShot, &gather, 4), Path::OneShot);
        assert_eq!(pick(Algo::Auto, &gather, 4), Path::OneShot);
        assert_eq!(pick(Algo::Auto, &Op::all_gather(DType::U8, 2 << 20), 4), Path::Nccl);
        assert_eq!(pick(Algo::Auto, &Op::all_gather(DType::U8, 2 << 20), 2), Path::OneShot);
    }

    #[test]
    fn measured_rows_win_and_the_most_specific_row_applies() {
        let mut table = Crossover::parse(
            "# comment\nNVIDIA H200\t2\tall_reduce\t65536\t1048576\nNVIDIA H200\t0\tall_reduce\t0\t0\n",
        )
        .unwrap();
        table.rows.extend(Crossover::builtin().rows);
        assert_eq!(choose_with(&table, Algo::Auto, &sum(65536), 2, "NVIDIA H200"), Path::OneShot);
        assert_eq!(choose_with(&table, Algo::Auto, &sum(131072), 2, "NVIDIA H200"), Path::TwoShot);
        // Four H200s: the device's any-count row sends everything to NCCL.
        assert_eq!(choose_with(&table, Algo::Auto, &sum(8), 4, "NVIDIA H200"), Path::Nccl);
        // Another device falls back to the built-in rows.
        assert_eq!(choose_with(&table, Algo::Auto, &sum(8), 4, "NVIDIA H100"), Path::OneShot);
        assert_eq!(choose_with(&table, Algo::Auto, &sum(4 << 20), 2, "NVIDIA H100"), Path::OneShot);
    }

    #[test]
    fn the_flight_recorder_keeps_the_path_that_ran() {
        use crate::trace::{FlightRecorder, Ranks, Row, Watched};
        let op = sum(64);
        let row = Row { category: "collective", tid: 0 };
        let watched = Watched::start(&"peer-path-test".into(), 7, &op, 1, Ranks::Every, row, None);
        watched.set_path(Path::TwoShot.name());
        watched.set_path(Path::Nccl.name()); // the first path noted stays
        watched.ended(Ok(()));
        drop(watched);
        let records = FlightRecorder::global().snapshot();
        let mine = records.iter().rev().find(|r| r.group == "peer-path-test").expect("recorded");
        assert_eq!(mine.path.as_deref(), Some("twoshot"));
        assert_eq!(mine.fingerprint.seq, 7);
    }

    #[test]
    fn a_table_survives_its_text_and_bad_lines_are_named() {
        let mut table = Crossover::builtin();
        table.set(CrossoverRow {
            device: "NVIDIA H200".into(),
            ranks: 2,
            kind: TableKind::AllReduce,
            one_shot_max: 1,
            two_shot_max: 2,
        });
        table.set(CrossoverRow {
            device: "NVIDIA H200".into(),
            ranks: 2,
            kind: TableKind::AllReduce,
            one_shot_max: 3,
            two_shot_max: 4,
        });
        assert_eq!(table.rows.len(), 5);
        assert_eq!(Crossover::parse(&table.to_text()).unwrap(), table);
        let err = Crossover::parse("x\t2\tall_reduce\t1\n").unwrap_err();
        assert!(err.starts_with("line 1: expected 5"), "{err}");
        let err = Crossover::parse("\n\nx\t2\tbroadcast\t1\t2\n").unwrap_err();
        assert!(err.contains("line 3") && err.contains("neither"), "{err}");
        let err = Crossover::parse("x\tmany\tall_reduce\t1\t2\n").unwrap_err();
        assert!(err.contains("ranks is not a whole number"), "{err}");
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("cohort-crossover-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `Crossover::read` on a thread: fails (rather than hangs) when it has
    /// not answered within 10 s.
    fn read_within(path: &std::path::Path) -> Result<Option<Crossover>, String> {
        let path = path.to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(Crossover::read(&path));
        });
        rx.recv_timeout(std::time::Duration::from_secs(10)).expect("reading the table blocked")
    }

    #[test]
    fn a_broken_table_file_is_an_error_naming_it_never_a_hang() {
        let dir = scratch("broken");
        let path = dir.join("crossover.tsv");
        assert_eq!(read_within(&path), Ok(None), "no table: the built-in rows");
        let refused = |what: &str, expect: &str| {
            let err = read_within(&path).unwrap_err();
            assert!(err.contains(&path.display().to_string()) && err.contains(expect), "{what}: {err}");
        };
        for (text, expect) in [
            ("NVIDIA H200\t2\tall_reduce\tNaN\t1\n", "line 1: one_shot_max_bytes is not a whole number"),
            ("NVIDIA H200\t2\tall_reduce\t1\t-5\n", "two_shot_max_bytes is not a whole number"),
            ("NVIDIA H200\t2\tall_reduce\t1\t18446744073709551616\n", "two_shot_max_bytes is not a whole number"),
            ("NVIDIA H200\t2\tall_red", "expected 5 tab-separated fields"),
        ] {
            std::fs::write(&path, text).unwrap();
            refused(text, expect);
        }
        std::fs::write(&path, b"\xff\xfe not text\n").unwrap();
        refused("not UTF-8", "UTF-8");
        // 2 GiB, sparse: refused unread.
        std::fs::File::create(&path).unwrap().set_len(2 << 30).unwrap();
        refused("2 GiB", "2147483648 bytes");
        std::fs::remove_file(&path).unwrap();
        let fifo = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `fifo` is NUL-terminated.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        refused("a FIFO", "not a regular file");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        refused("a folder", "not a regular file");
        std::fs::remove_dir(&path).unwrap();
        std::fs::write(dir.join("elsewhere.tsv"), "x\t2\tall_reduce\t1\t2\n").unwrap();
        std::os::unix::fs::symlink(dir.join("elsewhere.tsv"), &path).unwrap();
        refused("a link", "symbolic link");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "").unwrap();
        assert_eq!(read_within(&path), Ok(Some(Crossover::default())), "empty: no rows, the built-in ones apply");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn odd_but_well_formed_rows_stay_within_what_a_kernel_can_run() {
        // Huge, unsorted (two-shot below one-shot) and duplicated rows.
        let text = "NVIDIA H200\t2\tall_reduce\t18446744073709551615\t0\n\
                    NVIDIA H200\t2\tall_reduce\t0\t0\n\
                    NVIDIA H200\t4\tall_reduce\t1048576\t4096\n\
                    NVIDIA H200\t18446744073709551615\tall_gather\t1\t1\n";
        let mut table = Crossover::parse(text).unwrap();
        table.rows.extend(Crossover::builtin().rows);
        let pick = |bytes, ranks| choose_with(&table, Algo::Auto, &sum(bytes), ranks, "NVIDIA H200");
        // The first of two duplicated rows wins; past the arena is NCCL whatever a row says.
        assert_eq!(pick(8 << 20, 2), Path::OneShot);
        assert_eq!(pick(PEER_MAX_BYTES as usize * 2, 2), Path::Nccl);
        // A two-shot limit below the one-shot one: one-shot, then NCCL.
        assert_eq!((pick(1 << 20, 4), pick(2 << 20, 4)), (Path::OneShot, Path::Nccl));
    }
}
