//! Where a process learns its rank: the environment its launcher set.
//!
//! Understands, in this order: cohort's and torchrun's variables (RANK,
//! WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Open
//! MPI's (OMPI_COMM_WORLD_*), MPICH's and Intel MPI's (PMI_RANK, PMI_SIZE) and
//! Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of
//! SLURM_STEP_NODELIST). When none is set the error lists what it looked for.

use std::collections::HashMap;

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    /// `cohort run` or torchrun.
    Torchrun,
    OpenMpi,
    /// MPICH, Intel MPI and other PMI launchers.
    Pmi,
    Slurm,
}

impl LaunchSource {
    /// The variables this launcher names a process's rank, world size,
    /// local rank and local world size in.
    pub fn variables(self) -> [&'static str; 4] {
        match self {
            LaunchSource::Torchrun => ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            LaunchSource::OpenMpi => [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
            LaunchSource::Pmi => ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            LaunchSource::Slurm => ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"],
        }
    }
}

/// The most ranks a job may have: 4,194,304, as many as Linux runs
/// processes on one machine (`cohort run -n`'s own limit). The store's
/// barriers count arrivals in 32 bits and every rank sizes tables by the
/// world, so a larger (mistyped) world size is refused before anything
/// waits or allocates; `cohort trace` sets aside a dump that claims more.
pub const MAX_WORLD_SIZE: usize = 1 << 22;

/// A process's place in a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub source: LaunchSource,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Host of the rendezvous store, when the launcher named one.
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
}

/// Why the environment does not describe a job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchEnvError {
    #[error(
        "no launcher environment found: looked for RANK/WORLD_SIZE (cohort run, torchrun), \
         OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (Open MPI), PMI_RANK/PMI_SIZE (MPICH) and \
         SLURM_PROCID/SLURM_NTASKS (srun); start the program with `cohort run`, mpirun or srun, or set them"
    )]
    NotFound,
    #[error("{name}={value:?} is not a whole number (set by {launcher:?})")]
    NotANumber { name: &'static str, value: String, launcher: LaunchSource },
    #[error("{name} is missing: {launcher:?} set {present} but not {name}")]
    Missing { name: &'static str, present: &'static str, launcher: LaunchSource },
    #[error(
        "rank {rank} is not below the world size {world_size}: {}={rank}, {}={world_size} ({launcher:?} variables)",
        launcher.variables()[0], launcher.variables()[1]
    )]
    RankOutOfRange { rank: usize, world_size: usize, launcher: LaunchSource },
    #[error(
        "local rank {local_rank} is not below the local world size {local_world_size}: {}={local_rank}, \
         {}={local_world_size} ({launcher:?} variables; each unset one defaults to the rank's and the world's)",
        launcher.variables()[2], launcher.variables()[3]
    )]
    LocalRankOutOfRange { local_rank: usize, local_world_size: usize, launcher: LaunchSource },
    #[error("world size is 0: {}=0 ({launcher:?} variables): a job has at least one rank", launcher.variables()[1])]
    EmptyWorld { launcher: LaunchSource },
    #[error(
        "world size {world_size} is more than a job can have ({MAX_WORLD_SIZE} ranks): {}={world_size} \
         ({launcher:?} variables)",
        launcher.variables()[1]
    )]
    HugeWorld { world_size: usize, launcher: LaunchSource },
    #[error("{name}={value:?} is not a port number (1-65535)")]
    BadPort { name: &'static str, value: String },
}

impl LaunchEnv {
    /// Reads the process environment. A name or value that is not UTF-8
    /// is read with U+FFFD in place of the bytes it cannot hold (any
    /// variable may hold such bytes; one cohort reads is then refused by its
    /// own check, naming it).
    pub fn from_process() -> Result<LaunchEnv, LaunchEnvError> {
        let vars =
            std::env::vars_os().map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()));
        Self::from_vars(&vars.collect())
    }

    /// Reads the given variables (for tests and for launchers that pass a
    /// copy).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<LaunchEnv, LaunchEnvError> {
        let get = |name: &str| vars.get(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let number = |name: &'static str, source: LaunchSource| -> Result<Option<usize>, LaunchEnvError> {
            match get(name) {
                None => Ok(None),
                Some(value) => value.parse::<usize>().map(Some).map_err(|_| LaunchEnvError::NotANumber {
                    name,
                    value,
                    launcher: source,
                }),
            }
        };
        let required = |name: &'static str, present: &'static str, source: LaunchSource| {
            number(name, source)?.ok_or(LaunchEnvError::Missing { name, present, launcher: source })
        };
        let port = |name: &'static str| -> Result<Option<u16>, LaunchEnvError> {
            match get(name) {
                None => Ok(None),
                Some(value) => match value.parse::<u16>() {
                    Ok(p) if p > 0 => Ok(Some(p)),
                    _ => Err(LaunchEnvError::BadPort { name, value }),
                },
            }
        };

        use LaunchSource::{OpenMpi, Pmi, Slurm, Torchrun};
        // torchrun's variables are found by either of its first two; the
        // other launchers' by the rank.
        let source = [Torchrun, OpenMpi, Pmi, Slurm]
            .into_iter()
            .find(|s| {
                let [rank, world, ..] = s.variables();
                get(rank).is_some() || (*s == Torchrun && get(world).is_some())
            })
            .ok_or(LaunchEnvError::NotFound)?;
        let [r, w, lr, lw] = source.variables();
        let (rank_found_by, world_found_by) = if source == Torchrun { (w, r) } else { (r, r) };
        let rank = required(r, rank_found_by, source)?;
        let world_size = required(w, world_found_by, source)?;
        let (local_rank, local_world_size, master_addr) = match source {
            // Slurm's local count is a list (`2(x3),1`): the first node's.
            Slurm => (
                number(lr, source)?.unwrap_or(0),
                get(lw).and_then(|t| first_tasks_per_node(&t)).unwrap_or(world_size),
                get("MASTER_ADDR").or_else(|| {
                    get("SLURM_STEP_NODELIST").or_else(|| get("SLURM_JOB_NODELIST")).and_then(|l| first_host(&l))
                }),
            ),
            _ => (number(lr, source)?.unwrap_or(rank), number(lw, source)?.unwrap_or(world_size), get("MASTER_ADDR")),
        };

        if world_size == 0 {
            return Err(LaunchEnvError::EmptyWorld { launcher: source });
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(LaunchEnvError::HugeWorld { world_size, launcher: source });
        }
        if rank >= world_size {
            return Err(LaunchEnvError::RankOutOfRange { rank, world_size, launcher: source });
        }
        if local_rank >= local_world_size {
            return Err(LaunchEnvError::LocalRankOutOfRange { local_rank, local_world_size, launcher: source });
        }
        Ok(LaunchEnv {
            source,
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port: port("MASTER_PORT")?,
        })
    }
}

/// The first host of a Slurm node list: `node[01-04,07],gpu5` → `node01`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => return true,
                _ => {}
            }
            false
        })
        .map(|(i, _)| i)
        .unwrap_or(list.len());
    let first = &list[..end];
    match first.find('[') {
        None => Some(first.to_string()),
        Some(open) => {
            let prefix = &first[..open];
            let inner = first[open + 1..].trim_end_matches(']');
            let first_range = inner.split(',').next()?;
            let first_index = first_range.split('-').next()?;
            Some(format!("{prefix}{first_index}"))
        }
    }
}

/// Tasks on the first node from SLURM_TASKS_PER_NODE (`4(x2),3` → 4).
fn first_tasks_per_node(value: &str) -> Option<usize> {
    value.split(',').next()?.split('(').next()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_that_is_not_utf8_is_read_not_panicked_on() {
        use std::os::unix::ffi::OsStrExt;
        // Any variable of the process, not only cohort's: `env::vars()`
        // panicked on it, so every rank exited 101.
        let bytes = std::ffi::OsStr::from_bytes(b"\xff\xfe");
        std::env::set_var("COHORT_TEST_NOT_UTF8", bytes);
        let read = std::panic::catch_unwind(LaunchEnv::from_process);
        std::env::remove_var("COHORT_TEST_NOT_UTF8");
        assert!(read.is_ok(), "reading the environment panicked on a value that is not UTF-8");
    }

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn torchrun_variables() {
        let env = LaunchEnv::from_vars(&vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(
            env,
            LaunchEnv {
                source: LaunchSource::Torchrun,
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                master_addr: Some("10.0.0.1".into()),
                master_port: Some(29500)
            }
        );
    }

    #[test]
    fn open_mpi_pmi_and_slurm() {
        let ompi = LaunchEnv::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]))
        .unwrap();
        assert_eq!((ompi.source, ompi.rank, ompi.world_size, ompi.local_rank), (LaunchSource::OpenMpi, 2, 4, 2));
        let pmi = LaunchEnv::from_vars(&vars(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")])).unwrap();
        assert_eq!((pmi.source, pmi.rank, pmi.world_size), (LaunchSource::Pmi, 1, 2));
        let slurm = LaunchEnv::from_vars(&vars(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_NODELIST", "gpu[03-04,09],login1"),
        ]))
        .unwrap();
        assert_eq!((slurm.rank, slurm.local_rank, slurm.local_world_size), (6, 2, 4));
        assert_eq!(slurm.master_addr.as_deref(), Some("gpu03"));
    }

    #[test]
    fn bad_environments_say_what_is_wrong() {
        let err = LaunchEnv::from_vars(&vars(&[])).unwrap_err();
        assert!(err.to_string().contains("OMPI_COMM_WORLD_RANK") && err.to_string().contains("SLURM_PROCID"));
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert_eq!(err, LaunchEnvError::RankOutOfRange { rank: 4, world_size: 4, launcher: LaunchSource::Torchrun });
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "one"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert!(err.to_string().contains("\"one\""), "{err}");
        let err = LaunchEnv::from_vars(&vars(&[("RANK", "0")])).unwrap_err();
        assert!(err.to_string().contains("WORLD_SIZE is missing"), "{err}");
        let err =
            LaunchEnv::from_vars(&vars(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "99999")])).unwrap_err();
        assert!(matches!(err, LaunchEnvError::BadPort { .. }));
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node[01-04,07],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("single").as_deref(), Some("single"));
        assert_eq!(first_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_host("").as_deref(), None);
    }
}
