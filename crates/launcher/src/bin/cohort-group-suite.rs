//! Groups of a `Communicator` across processes, checked against the host:
//!
//! ```text
//! cohort run -n 4 -- cohort-group-suite                    # a 2×4 mesh of 4 ranks × 2 CPU devices
//! cohort run -n 4 -- cohort-group-suite --backend wgpu     # the same on wgpu devices (COHORT_WGPU_DEVICES ≥ 8)
//! cohort run -n 2 -- cohort-group-suite --devices 1 --dims 1x2
//! cohort run -n 4 -- cohort-group-suite desync 3           # in the group of odd ranks, rank 3 calls a broadcast
//! ```
//!
//! `mesh` (the default): lays every member of the job (`--devices` per
//! rank, default 2) out over `--dims RxC` (default 2x4), and along each
//! dimension all-reduces, all-gathers and runs a grouped call of both in
//! every group, comparing with what the host computes from every member's
//! input. Rank 0 prints `group suite passed: ...`. Exits 1 with `rank R:
//! error: ...` on the first wrong value or error.

use std::process::ExitCode;

use cohort_comm::{rank_clients, Buffer, Collectives, Communicator, Mesh, ReduceOp, World};

const K: usize = 37;

/// Member `m`'s input.
fn input(m: usize) -> Vec<f32> {
    (0..K).map(|j| (m * 1000 + j) as f32).collect()
}

fn check<T: PartialEq + std::fmt::Debug>(got: T, want: T, what: &str) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

fn mesh(comm: &Communicator, rows: usize, cols: usize) -> Result<String, String> {
    let e = |e: cohort_comm::Error| e.to_string();
    let mesh = Mesh::new(comm, &[("dp", rows), ("tp", cols)]).map_err(|e| e.to_string())?;
    let l = comm.local_devices();
    let mut checks = 0;
    for (dim, axis, size, stride) in [("dp", 0, rows, cols), ("tp", 1, cols, 1)] {
        for slot in 0..l {
            let m = comm.rank() * l + slot;
            let group = mesh.group_of(dim, m).map_err(|e| e.to_string())?;
            let coord = mesh.coords(m)[axis];
            if coord != group.first_member() {
                continue; // once per group, from this process's first member in it
            }
            let line: Vec<usize> = (0..size).map(|k| m - coord * stride + k * stride).collect();
            let clients = group.clients();
            let src: Vec<Buffer<f32>> = (0..clients.len())
                .map(|i| Buffer::from_slice(&clients[i], &input(line[coord + i])))
                .collect::<Result<_, _>>()
                .map_err(e)?;
            let sum: Vec<f32> = (0..K).map(|j| line.iter().map(|&g| input(g)[j]).sum()).collect();
            let all: Vec<f32> = line.iter().flat_map(|&g| input(g)).collect();
            let dst = group.zeros::<f32>(K).map_err(e)?;
            group.all_reduce(&src, &dst, ReduceOp::Sum).map_err(e)?.wait().map_err(|e| e.to_string())?;
            let gathered = group.zeros::<f32>(K * size).map_err(e)?;
            group.all_gather(&src, &gathered).map_err(e)?;
            // The same two as one grouped call.
            let (dst2, gathered2) = (group.zeros::<f32>(K).map_err(e)?, group.zeros::<f32>(K * size).map_err(e)?);
            group
                .group(|g| {
                    g.all_reduce(&src, &dst2, ReduceOp::Sum)?;
                    g.all_gather(&src, &gathered2)
                })
                .map_err(e)?
                .wait()
                .map_err(|e| e.to_string())?;
            for i in 0..clients.len() {
                let at = format!("along {dim} over members {line:?}, member {}", line[coord + i]);
                check(dst[i].to_vec().map_err(e)?, sum.clone(), &format!("all_reduce {at}"))?;
                check(gathered[i].to_vec().map_err(e)?, all.clone(), &format!("all_gather {at}"))?;
                check(dst2[i].to_vec().map_err(e)?, sum.clone(), &format!("grouped all_reduce {at}"))?;
                check(gathered2[i].to_vec().map_err(e)?, all.clone(), &format!("grouped all_gather {at}"))?;
                checks += 4;
            }
        }
    }
    // Every rank's checks, summed on the parent.
    let counts: Vec<Buffer<u64>> = (0..l)
        .map(|slot| Buffer::from_slice(&comm.clients()[slot], &[if slot == 0 { checks as u64 } else { 0 }]))
        .collect::<Result<_, _>>()
        .map_err(e)?;
    comm.all_reduce(&counts, &counts, ReduceOp::Sum).map_err(e)?;
    Ok(format!("{} checks", counts[0].to_vec().map_err(e)?[0]))
}

/// Ranks split by parity; in the group of `who`, `who` calls a broadcast
/// where the others all-reduce.
fn desync(comm: &Communicator, who: usize) -> Result<String, String> {
    let group = comm.split(Some((comm.rank() % 2) as u32), 0).map_err(|e| e.to_string())?.expect("every rank joins");
    let x = group.replicate(&[1.0f32; 64]).map_err(|e| e.to_string())?;
    if comm.rank() == who {
        group.broadcast(&x, &x, 0).map_err(|e| e.to_string())?;
    } else {
        group.all_reduce(&x, &x, ReduceOp::Sum).map_err(|e| e.to_string())?;
    }
    x[0].to_vec().map_err(|e| e.to_string())?;
    comm.barrier().map_err(|e| e.to_string())?;
    Ok("no desync seen".into())
}

fn run() -> Result<(), String> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut option = |name: &str, default: &str| -> String {
        match args.iter().position(|a| a == name) {
            Some(at) if at + 1 < args.len() => {
                let value = args.remove(at + 1);
                args.remove(at);
                value
            }
            _ => default.to_string(),
        }
    };
    let backend = option("--backend", "cpu");
    let devices: usize = option("--devices", "2").parse().map_err(|_| "--devices takes a number")?;
    let dims = option("--dims", "2x4");
    let (rows, cols) = dims
        .split_once('x')
        .and_then(|(r, c)| Some((r.parse().ok()?, c.parse().ok()?)))
        .ok_or("--dims takes RxC, such as 2x4")?;
    let world =
        World::join(rank_clients(&backend, Some(devices)).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let World::Ranks(comm) = &world else {
        return Err("run it under cohort run, mpirun or srun: it checks groups across processes".into());
    };
    let done = match args.first().map(String::as_str) {
        None | Some("mesh") => mesh(comm, rows, cols)?,
        Some("desync") => desync(comm, args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1))?,
        Some(other) => return Err(format!("unknown mode {other:?}: mesh or desync")),
    };
    if comm.rank() == 0 {
        println!(
            "group suite passed: {} ranks × {} devices ({backend}), {rows}x{cols} mesh, {done}",
            comm.size(),
            comm.local_devices()
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let rank = std::env::var("RANK").unwrap_or_else(|_| "?".into());
            eprintln!("rank {rank}: error: {e}");
            ExitCode::FAILURE
        }
    }
}
