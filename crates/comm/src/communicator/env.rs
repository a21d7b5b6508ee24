//! Where [`Communicator::from_env`](super::Communicator::from_env) finds the
//! store and the secret.

use cohort_runtime::config;

use crate::launch_env::{LaunchEnv, LaunchSource};
use crate::store::StoreServer;

use super::error::ConnectError;

/// The rendezvous a process joins.
pub(crate) struct Found {
    pub rank: usize,
    pub world_size: usize,
    pub store_addr: String,
    pub secret: String,
    /// Rank 0's own store, when no launcher serves one.
    pub server: Option<StoreServer>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// The job id the MPI or Slurm launcher gave, if any.
fn job_id() -> Option<String> {
    var("OMPI_MCA_ess_base_jobid")
        .or_else(|| var("SLURM_JOB_ID").map(|j| format!("{j}.{}", var("SLURM_STEP_ID").unwrap_or_default())))
        .or_else(|| var("PMI_ID").and(var("PMIX_NAMESPACE")))
        .or_else(|| var("PMIX_NAMESPACE"))
}

/// A port in 20000..40000 derived from the job id (FNV-1a), so that
/// concurrent jobs on one node rarely collide; 29500 without one.
fn derived_port(job: Option<&str>) -> u16 {
    match job {
        None => 29500,
        Some(job) => {
            let hash = job.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
            20000 + (hash % 20000) as u16
        }
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

pub(crate) fn resolve() -> Result<Found, ConnectError> {
    let env = LaunchEnv::from_process()?;
    let (rank, world_size) = (env.rank, env.world_size);
    if let Some(store_addr) = config::STORE_ADDR.get()? {
        let secret = config::JOB_SECRET.get()?.ok_or_else(|| {
            ConnectError::Config("COHORT_STORE_ADDR is set but COHORT_JOB_SECRET is not: set both".into())
        })?;
        return Ok(Found { rank, world_size, store_addr, secret, server: None });
    }
    if env.source == LaunchSource::Torchrun && env.master_addr.is_none() {
        return Err(ConnectError::Config(
            "MASTER_ADDR is missing: RANK and WORLD_SIZE are set (torchrun-style) but nothing names the host of \
             the rendezvous store; set MASTER_ADDR (and MASTER_PORT) to rank 0's host on every rank, or start the \
             job with `cohort run`"
                .into(),
        ));
    }
    let job = job_id();
    let host = env.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
    let port = env.master_port.unwrap_or_else(|| derived_port(job.as_deref()));
    let single_node = env.local_world_size == world_size;
    let secret = match (config::JOB_SECRET.get()?, &job) {
        (Some(s), _) => s,
        (None, Some(job)) if single_node => {
            if rank == 0 {
                tracing::warn!(
                    "COHORT_JOB_SECRET is unset: using a secret derived from the job id {job}, which anyone on \
                     this node who can see the job id can derive too; export COHORT_JOB_SECRET for a real one"
                );
            }
            format!("cohort-derived-{job}")
        }
        (None, _) => {
            let why = if single_node { "no job id to derive one from" } else { "the job spans several nodes" };
            return Err(ConnectError::Config(format!(
                "COHORT_JOB_SECRET is unset and {why}: run `export COHORT_JOB_SECRET=$(openssl rand -hex 32)` \
                 before the launcher ({:?}) so every rank gets it",
                env.source
            )));
        }
    };
    let store_addr = format!("{}:{port}", bracket(&host));
    let server = if rank == 0 {
        let bind = if env.source == LaunchSource::Torchrun { store_addr.clone() } else { format!("0.0.0.0:{port}") };
        let bind = if host == "127.0.0.1" || host == "localhost" { store_addr.clone() } else { bind };
        Some(StoreServer::bind(bind.as_str(), &secret).map_err(|e| {
            ConnectError::Config(format!(
                "rank 0 could not serve the rendezvous store on {bind}: {e}; set MASTER_PORT to a free port \
                 (the same for every rank)"
            ))
        })?)
    } else {
        None
    };
    Ok(Found { rank, world_size, store_addr, secret, server })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_the_job() {
        assert_eq!(derived_port(None), 29500);
        let p = derived_port(Some("3529703425"));
        assert!((20000..40000).contains(&p));
        assert_eq!(p, derived_port(Some("3529703425")));
    }
}
