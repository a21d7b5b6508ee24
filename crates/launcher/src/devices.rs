//! `cohort devices` (every backend's devices and their properties) and
//! `cohort peers` (which device can address which, and copy bandwidth
//! between every pair).

use std::process::ExitCode;
use std::time::Instant;

use cohort_runtime::{Client, CpuRuntime, CudaRuntime, DeviceProperties, Runtime, WgpuRuntime};

use crate::cli::PeersArgs;

/// The clients of backend `R`, or why it has none.
fn clients_of<R: Runtime>() -> Result<Vec<Client>, String> {
    match R::device_count() {
        Err(e) => Err(e.to_string()),
        Ok(0) => Err("no devices".into()),
        Ok(_) => R::clients().map_err(|e| e.to_string()),
    }
}

fn backend(name: &str) -> Result<Vec<Client>, String> {
    match name {
        "cpu" => clients_of::<CpuRuntime>(),
        "cuda" => clients_of::<CudaRuntime>(),
        "wgpu" => clients_of::<WgpuRuntime>(),
        other => Err(format!("unknown backend {other}: use cpu, cuda or wgpu")),
    }
}

fn describe(p: &DeviceProperties) -> String {
    let memory =
        p.memory_bytes.map_or("memory n/a".to_string(), |m| format!("{:.1} GiB", m as f64 / (1u64 << 30) as f64));
    let cc = p.compute_capability.map_or(String::new(), |(a, b)| format!(", compute {a}.{b}"));
    format!(
        "{}: {} ({memory}, {} compute units{cc}, max binding {} MiB, {} timing, {} graphs)",
        p.device,
        p.name,
        p.compute_units,
        p.max_binding_size >> 20,
        if p.device_timing { "device" } else { "host" },
        if p.native_graphs { "native" } else { "recorded" }
    )
}

/// Runs `f` with this process's stderr (fd 2) sent to a memory file, and
/// returns what was written there meanwhile: the Vulkan loader and drivers
/// that wgpu loads print their own complaints (`XDG_RUNTIME_DIR is
/// invalid or not set`, ICD warnings) straight to fd 2, where they would
/// read as cohort's errors. Where fd 2 cannot be redirected, `f` runs as is.
fn capture_stderr<T>(f: impl FnOnce() -> T) -> (T, String) {
    use std::io::{Read, Seek, Write};
    use std::os::fd::{AsRawFd, FromRawFd};
    let _ = std::io::stderr().flush();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns
    // a new descriptor or -1.
    let mem = unsafe { libc::memfd_create(c"cohort-driver-messages".as_ptr(), libc::MFD_CLOEXEC) };
    if mem < 0 {
        return (f(), String::new());
    }
    // SAFETY: `mem` is a descriptor we just created and own alone.
    let mut mem = unsafe { std::fs::File::from_raw_fd(mem) };
    // SAFETY: dup of fd 2, which is open for the life of the process (or
    // dup fails with -1, handled).
    let saved = unsafe { libc::dup(2) };
    // SAFETY: both descriptors are open; dup2 atomically points fd 2 at the
    // memory file.
    if saved < 0 || unsafe { libc::dup2(mem.as_raw_fd(), 2) } < 0 {
        if saved >= 0 {
            // SAFETY: `saved` is our own duplicate.
            unsafe { libc::close(saved) };
        }
        return (f(), String::new());
    }
    let out = f();
    let _ = std::io::stderr().flush();
    // SAFETY: `saved` is the duplicate of the original fd 2 made above; it
    // is put back and then closed once.
    unsafe {
        libc::dup2(saved, 2);
        libc::close(saved);
    }
    let mut text = String::new();
    if mem.rewind().is_ok() {
        let _ = mem.read_to_string(&mut text);
    }
    (out, text)
}

/// `cohort devices`: lists every backend's devices; a backend without any
/// says why. Exits 0 (finding no GPU is an answer, not a failure). What the
/// wgpu driver stack prints to stderr while probing is not shown as
/// cohort's: a note counts it, and `COHORT_LOG=debug` shows it.
pub fn devices() -> ExitCode {
    for name in ["cpu", "cuda", "wgpu"] {
        let (found, noise) =
            if name == "wgpu" { capture_stderr(|| backend(name)) } else { (backend(name), String::new()) };
        match found {
            Ok(clients) => {
                println!("{name}: {} device(s)", clients.len());
                for c in &clients {
                    println!("  {}", describe(c.properties()));
                }
            }
            Err(why) => println!("{name}: none: {why}"),
        }
        let lines: Vec<&str> = noise.lines().filter(|l| !l.trim().is_empty()).collect();
        if !lines.is_empty() {
            println!(
                "  ({} line(s) from the {name} driver stack while probing, not cohort's errors; COHORT_LOG=debug \
                 shows them)",
                lines.len()
            );
            for line in lines {
                tracing::debug!(backend = name, "driver: {line}");
            }
        }
    }
    ExitCode::SUCCESS
}

/// `cohort peers`: the peer-access matrix ("peer": direct access, "host":
/// copies go through host memory) and the measured copy bandwidth of
/// `to_client` from every device to every other.
pub fn peers(args: PeersArgs) -> ExitCode {
    let name = match args.backend.as_deref() {
        Some(b) => b.to_string(),
        None if CudaRuntime::device_count().is_ok_and(|n| n > 1) => "cuda".into(),
        None => "cpu".into(),
    };
    let clients = match backend(&name) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("cohort: error: {name}: {why}");
            return ExitCode::from(1);
        }
    };
    let n = clients.len();
    let bytes = (args.mib * (1 << 20) as f64) as usize;
    println!("{name}: {n} device(s); access (peer = direct, host = staged through host memory)");
    print!("{:>8}", "");
    for j in 0..n {
        print!("{:>8}", format!("{j}"));
    }
    println!();
    for (i, a) in clients.iter().enumerate() {
        print!("{:>8}", format!("{i}"));
        for b in &clients {
            let what = if a.service_id() == b.service_id() {
                "-"
            } else if a.can_access_peer(b) {
                "peer"
            } else {
                "host"
            };
            print!("{what:>8}");
        }
        println!();
    }
    println!(
        "copy bandwidth with to_client, {} MiB, GB/s (row: from, column: to; median of {})",
        args.mib, args.iters as usize
    );
    print!("{:>8}", "");
    for j in 0..n {
        print!("{:>8}", format!("{j}"));
    }
    println!();
    for (i, a) in clients.iter().enumerate() {
        print!("{:>8}", format!("{i}"));
        let mut fill = Vec::new();
        if fill.try_reserve_exact(bytes).is_err() {
            println!();
            eprintln!("cohort: error: cannot allocate {} MiB of host memory to copy from (--mib)", args.mib);
            return ExitCode::from(1);
        }
        fill.resize(bytes, 1u8);
        let src = a.create_from_slice(&fill);
        for b in &clients {
            if a.service_id() == b.service_id() {
                print!("{:>8}", "-");
                continue;
            }
            match bandwidth(&src, a, b, bytes, args.iters as usize) {
                Ok(gbs) => print!("{gbs:>8.2}"),
                Err(e) => {
                    println!();
                    eprintln!("cohort: error: copy {} -> {}: {e}", a.device_id(), b.device_id());
                    return ExitCode::from(1);
                }
            }
        }
        println!();
    }
    ExitCode::SUCCESS
}

fn bandwidth(src: &cohort_runtime::Handle, a: &Client, b: &Client, bytes: usize, iters: usize) -> Result<f64, String> {
    let mut times = Vec::new();
    for i in 0..iters + 1 {
        let t = Instant::now();
        let dst = cohort_comm::to_client(src, a, b).map_err(|e| e.to_string())?;
        b.sync_buffers([&dst]).map_err(|e| e.to_string())?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(bytes as f64 / times[times.len() / 2] / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_noise_on_fd_2_is_captured_not_shown() {
        let noise = b"MESA: error: XDG_RUNTIME_DIR is invalid or not set in the environment.\n";
        let (value, text) = capture_stderr(|| {
            // SAFETY: writes `noise`, which outlives the call, to fd 2, as a
            // C library would.
            unsafe { libc::write(2, noise.as_ptr().cast(), noise.len()) };
            7
        });
        assert_eq!(value, 7);
        assert!(text.contains("XDG_RUNTIME_DIR is invalid"), "{text:?}");
        // fd 2 is the real stderr again.
        let (_, again) = capture_stderr(|| ());
        assert!(again.is_empty());
    }
}
