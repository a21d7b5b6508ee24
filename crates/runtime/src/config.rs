//! Every `COHORT_*` environment variable, declared once: its name, its
//! default, what it means and what a valid value is.
//!
//! Each variable is one `static` below (as NCCL declares each knob with one
//! `NCCL_PARAM` line), and [`ALL`] lists them. A declaration is a [`Param`]
//! when the variable has a typed default, or a [`Var`] when unset means
//! "not given" (the reader decides what that means). Their typed getters read
//! the process environment each time they are called:
//!
//! ```
//! use cohort_runtime::config;
//!
//! // A Param: the value, or its default when unset or empty.
//! let timeout: std::time::Duration = config::TIMEOUT.get()?;
//! // A Var: `None` when unset or empty.
//! let timeline: Option<std::path::PathBuf> = config::TIMELINE.get()?;
//! // The name, for messages and for setting it in a child's environment.
//! assert_eq!(config::TIMEOUT.name, "COHORT_TIMEOUT");
//! # let _ = (timeout, timeline);
//! # Ok::<(), config::ConfigError>(())
//! ```
//!
//! A set value that cannot be used is a [`ConfigError`] that names the
//! variable, its value, what is wrong and what is expected; it is never
//! replaced by the default in silence. An empty (or all-blank) value counts
//! as unset.
//!
//! To add a variable: declare a `static` with [`Param::new`] or
//! [`Var::new`], add it to [`ALL`], and add its row to
//! `docs/configuration.md` (a test fails until the two agree; `cohort config
//! --markdown` prints the rows).

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::ops::Deref;
use std::path::PathBuf;
use std::time::Duration;

/// A `COHORT_*` variable whose value cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value} cannot be used: {problem}; set it to {expected}, or unset it for the default ({default})")]
pub struct ConfigError {
    /// The variable, e.g. `COHORT_TIMEOUT`.
    pub name: &'static str,
    /// Its value as set, quoted (`<hidden>` for a secret).
    pub value: String,
    /// What is wrong with it.
    pub problem: String,
    /// What a valid value is.
    pub expected: &'static str,
    /// What applies when it is unset.
    pub default: &'static str,
}

/// What every declaration has, whatever its type: reached through
/// [`Param`] and [`Var`] (`config::TIMEOUT.name`).
#[derive(Debug)]
pub struct Decl {
    /// The variable's name.
    pub name: &'static str,
    /// What applies when it is unset, as documented.
    pub default: &'static str,
    /// What it does.
    pub meaning: &'static str,
    /// What a valid value is (used in errors).
    pub expected: &'static str,
    /// Its value is a secret: shown masked, never in errors or logs.
    pub secret: bool,
    /// `cohort run` sets it for each rank (a user rarely sets it by hand).
    pub set_by_launcher: bool,
}

impl Decl {
    /// The raw value: `None` when unset, empty or all blank.
    pub fn raw(&self) -> Option<OsString> {
        std::env::var_os(self.name).filter(|v| !is_blank(v))
    }

    /// Whether it is set to a non-blank value.
    pub fn is_set(&self) -> bool {
        self.raw().is_some()
    }

    /// The value as shown to people: quoted, or `<hidden>` for a secret.
    pub fn display(&self, raw: &OsStr) -> String {
        if self.secret {
            "<hidden>".into()
        } else {
            format!("{:?}", raw.to_string_lossy())
        }
    }

    /// The error saying that `raw`, this variable's value, cannot be used
    /// because of `problem` (for readers that check more than the parser).
    pub fn invalid(&self, raw: &OsStr, problem: String) -> ConfigError {
        ConfigError {
            name: self.name,
            value: self.display(raw),
            problem,
            expected: self.expected,
            default: self.default,
        }
    }
}

fn is_blank(raw: &OsStr) -> bool {
    raw.to_str().map_or(raw.is_empty(), |s| s.trim().is_empty())
}

/// A parser of a set (non-blank) value: the value, or what is wrong with it.
pub type Parser<T> = fn(&OsStr) -> Result<T, String>;

/// A variable with a typed default: [`Param::get`] gives the value, or the
/// default when it is unset.
pub struct Param<T: 'static> {
    decl: Decl,
    /// The value when unset.
    pub fallback: T,
    parse: Parser<T>,
}

/// A variable without a typed default: [`Var::get`] gives `None` when it is
/// unset, and the reader decides what that means (its [`Decl::default`] says).
pub struct Var<T: 'static> {
    decl: Decl,
    parse: Parser<T>,
}

impl<T> Deref for Param<T> {
    type Target = Decl;
    fn deref(&self) -> &Decl {
        &self.decl
    }
}

impl<T> Deref for Var<T> {
    type Target = Decl;
    fn deref(&self) -> &Decl {
        &self.decl
    }
}

const fn decl(name: &'static str, default: &'static str, meaning: &'static str, expected: &'static str) -> Decl {
    Decl { name, default, meaning, expected, secret: false, set_by_launcher: false }
}

impl<T: Clone> Param<T> {
    /// Declares `name`, worth `fallback` (documented as `default`) when
    /// unset; `parse` turns a set value into `T` (its error says what is
    /// wrong; `expected` says what is right).
    pub const fn new(
        name: &'static str,
        fallback: T,
        default: &'static str,
        meaning: &'static str,
        expected: &'static str,
        parse: Parser<T>,
    ) -> Self {
        Param { decl: decl(name, default, meaning, expected), fallback, parse }
    }

    /// Marks it as set by `cohort run` for its ranks.
    pub const fn from_launcher(mut self) -> Self {
        self.decl.set_by_launcher = true;
        self
    }

    /// The value in the environment, or the default when unset; an error
    /// naming the variable when the value cannot be used.
    pub fn get(&self) -> Result<T, ConfigError> {
        match self.raw() {
            None => Ok(self.fallback.clone()),
            Some(raw) => self.parse_value(&raw),
        }
    }

    /// Parses `raw` as a value of this variable (without reading the
    /// environment).
    pub fn parse_value(&self, raw: &OsStr) -> Result<T, ConfigError> {
        (self.parse)(raw).map_err(|problem| self.invalid(raw, problem))
    }
}

impl<T> Var<T> {
    /// Declares `name` (what applies when unset is documented as
    /// `default`); `parse` turns a set value into `T`.
    pub const fn new(
        name: &'static str,
        default: &'static str,
        meaning: &'static str,
        expected: &'static str,
        parse: Parser<T>,
    ) -> Self {
        Var { decl: decl(name, default, meaning, expected), parse }
    }

    /// Marks it as set by `cohort run` for its ranks.
    pub const fn from_launcher(mut self) -> Self {
        self.decl.set_by_launcher = true;
        self
    }

    /// Marks its value as a secret (masked wherever it is shown).
    pub const fn secret(mut self) -> Self {
        self.decl.secret = true;
        self
    }

    /// The value in the environment, `None` when unset (or blank); an error
    /// naming the variable when the value cannot be used.
    pub fn get(&self) -> Result<Option<T>, ConfigError> {
        self.raw().map(|raw| self.parse_value(&raw)).transpose()
    }

    /// Parses `raw` as a value of this variable (without reading the
    /// environment).
    pub fn parse_value(&self, raw: &OsStr) -> Result<T, ConfigError> {
        (self.parse)(raw).map_err(|problem| self.invalid(raw, problem))
    }
}

/// Any declared variable, whatever its type: what [`ALL`] lists.
pub trait Setting: Sync {
    /// Its name, default, meaning and flags.
    fn decl(&self) -> &Decl;
    /// Checks its current value: `Ok(None)` when unset, `Ok(Some(raw))` when
    /// set to a usable value, the error otherwise.
    fn check(&self) -> Result<Option<OsString>, ConfigError>;
}

impl<T: Clone + Sync + 'static> Setting for Param<T> {
    fn decl(&self) -> &Decl {
        &self.decl
    }
    fn check(&self) -> Result<Option<OsString>, ConfigError> {
        self.raw().map(|raw| self.parse_value(&raw).map(|_| raw)).transpose()
    }
}

impl<T: 'static> Setting for Var<T> {
    fn decl(&self) -> &Decl {
        &self.decl
    }
    fn check(&self) -> Result<Option<OsString>, ConfigError> {
        self.raw().map(|raw| self.parse_value(&raw).map(|_| raw)).transpose()
    }
}

/// Checks the current values of `settings`: the first that cannot be used.
pub fn check(settings: &[&dyn Setting]) -> Result<(), ConfigError> {
    settings.iter().try_for_each(|s| s.check().map(drop))
}

/// Every set variable of [`ALL`] whose value cannot be used.
pub fn invalid() -> Vec<ConfigError> {
    ALL.iter().filter_map(|s| s.check().err()).collect()
}

/// The declaration of `name`, if cohort reads such a variable.
pub fn find(name: &str) -> Option<&'static dyn Setting> {
    ALL.iter().copied().find(|s| s.decl().name == name)
}

/// The rows of `docs/configuration.md`: a markdown table of every variable's
/// name, default and meaning.
pub fn markdown_table() -> String {
    let mut out = String::from("| variable | default | meaning |\n| --- | --- | --- |\n");
    for s in ALL {
        let d = s.decl();
        let _ = writeln!(out, "| `{}` | {} | {} |", d.name, d.default, d.meaning);
    }
    out
}

// ---------------------------------------------------------------- parsers

/// The value as text; not valid UTF-8 is an error.
fn text(raw: &OsStr) -> Result<&str, String> {
    raw.to_str().map(str::trim).ok_or_else(|| "it is not valid UTF-8".to_string())
}

fn whole<N: std::str::FromStr>(raw: &OsStr) -> Result<N, String> {
    let s = text(raw)?;
    s.parse::<N>().map_err(|_| {
        if s.starts_with('-') {
            "it is negative".to_string()
        } else if s.bytes().all(|b| b.is_ascii_digit()) {
            "it is too large".to_string()
        } else {
            "it is not a whole number".to_string()
        }
    })
}

/// A whole number, 0 allowed.
pub fn parse_count(raw: &OsStr) -> Result<usize, String> {
    whole(raw)
}

/// A whole number of at least 1.
pub fn parse_positive(raw: &OsStr) -> Result<usize, String> {
    match whole::<usize>(raw)? {
        0 => Err("it is 0".into()),
        n => Ok(n),
    }
}

fn parse_u32(raw: &OsStr) -> Result<u32, String> {
    whole(raw)
}

fn parse_fds(raw: &OsStr) -> Result<Vec<i32>, String> {
    let list = text(raw)?;
    let mut fds: Vec<i32> = Vec::new();
    for fd in list.split(',') {
        let fd: u32 = whole(OsStr::new(fd.trim()))?;
        let fd = i32::try_from(fd).map_err(|_| format!("{fd} is not a descriptor number"))?;
        if fd <= 2 {
            return Err(format!("{fd} is standard input, output or error, not a socket of the node's relay"));
        }
        if fds.contains(&fd) {
            return Err(format!("{fd} is listed twice"));
        }
        fds.push(fd);
    }
    Ok(fds)
}

fn parse_positive_u32(raw: &OsStr) -> Result<u32, String> {
    match whole::<u32>(raw)? {
        0 => Err("it is 0".into()),
        n => Ok(n),
    }
}

fn parse_micros(raw: &OsStr) -> Result<u64, String> {
    whole(raw)
}

/// The longest timeout accepted, in seconds (about 31 years): longer ones
/// would overflow the deadlines computed from them.
pub const MAX_SECONDS: f64 = 1e9;
/// The shortest timeout accepted, in seconds.
pub const MIN_SECONDS: f64 = 1e-3;

/// Seconds, fractions allowed, from [`MIN_SECONDS`] to [`MAX_SECONDS`].
pub fn parse_seconds(raw: &OsStr) -> Result<Duration, String> {
    let s = text(raw)?;
    let secs: f64 = s.parse().map_err(|_| "it is not a number".to_string())?;
    if secs.is_nan() {
        return Err("it is not a number".into());
    }
    if secs <= 0.0 {
        return Err(if secs == 0.0 { "it is 0" } else { "it is negative" }.into());
    }
    if secs < MIN_SECONDS {
        return Err(format!("it is shorter than {MIN_SECONDS} s"));
    }
    if secs > MAX_SECONDS {
        return Err(format!("it is longer than {MAX_SECONDS:e} s"));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

/// A switch: 1, true, yes, on or 0, false, no, off (any case).
pub fn parse_flag(raw: &OsStr) -> Result<bool, String> {
    match text(raw)?.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err("it is not a switch".into()),
    }
}

/// Any path (not interpreted).
pub fn parse_path(raw: &OsStr) -> Result<PathBuf, String> {
    Ok(PathBuf::from(raw))
}

/// Any text, trimmed.
pub fn parse_text(raw: &OsStr) -> Result<String, String> {
    text(raw).map(str::to_string)
}

/// Any text, not trimmed (a secret is taken byte for byte).
fn parse_secret(raw: &OsStr) -> Result<String, String> {
    raw.to_str().map(str::to_string).ok_or_else(|| "it is not valid UTF-8".to_string())
}

/// `host:port` (an IPv6 host in brackets), the port from 1 to 65535.
pub fn parse_host_port(raw: &OsStr) -> Result<String, String> {
    let s = text(raw)?;
    let (host, port) = s.rsplit_once(':').ok_or_else(|| "it has no :PORT".to_string())?;
    if host.is_empty() {
        return Err("it has no host".into());
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err("an IPv6 host must be in brackets".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(s.to_string()),
        _ => Err(format!("{port:?} is not a port (1-65535)")),
    }
}

/// The graphics APIs wgpu may open devices through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphicsApi {
    /// Vulkan (`vulkan`, `vk`).
    Vulkan,
    /// OpenGL / GLES (`gl`, `gles`, `opengl`).
    Gl,
    /// Metal (`metal`).
    Metal,
    /// Direct3D 12 (`dx12`, `d3d12`).
    Dx12,
}

/// A comma-separated list of graphics APIs.
pub fn parse_apis(raw: &OsStr) -> Result<Vec<GraphicsApi>, String> {
    let mut apis = Vec::new();
    for part in text(raw)?.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let api = match part.to_ascii_lowercase().as_str() {
            "vulkan" | "vk" => GraphicsApi::Vulkan,
            "gl" | "gles" | "opengl" => GraphicsApi::Gl,
            "metal" => GraphicsApi::Metal,
            "dx12" | "d3d12" => GraphicsApi::Dx12,
            _ => return Err(format!("{part:?} is not a backend")),
        };
        if !apis.contains(&api) {
            apis.push(api);
        }
    }
    if apis.is_empty() {
        return Err("it names no backend".into());
    }
    Ok(apis)
}

/// How a `Communicator` moves bytes between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// MPI under `mpirun` when built with the `mpi` feature, else host links.
    Auto,
    /// MPI messages (needs the `mpi` feature).
    Mpi,
    /// cohort's own links: shared memory within a node, TCP across.
    Host,
}

/// `auto`, `mpi` or `host` (`shm` and `tcp` mean `host`).
pub fn parse_transport(raw: &OsStr) -> Result<TransportChoice, String> {
    match text(raw)?.to_ascii_lowercase().as_str() {
        "auto" => Ok(TransportChoice::Auto),
        "mpi" => Ok(TransportChoice::Mpi),
        "host" | "shm" | "tcp" => Ok(TransportChoice::Host),
        _ => Err("it is not a transport".into()),
    }
}

/// Which path a device collective that a peer-memory kernel can run takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlgoChoice {
    /// By size and member count, from the machine's crossover table.
    Auto,
    /// Always the collective library (NCCL).
    Nccl,
    /// The one-shot peer-memory kernel wherever it can run.
    OneShot,
    /// The two-shot peer-memory kernel wherever it can run.
    TwoShot,
}

/// `auto`, `nccl`, `oneshot` or `twoshot` (`one-shot`, `two-shot` too).
pub fn parse_algo(raw: &OsStr) -> Result<AlgoChoice, String> {
    match text(raw)?.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
        "auto" => Ok(AlgoChoice::Auto),
        "nccl" => Ok(AlgoChoice::Nccl),
        "oneshot" => Ok(AlgoChoice::OneShot),
        "twoshot" => Ok(AlgoChoice::TwoShot),
        _ => Err("it is not a collective path".into()),
    }
}

/// The largest shared-memory ring accepted, in bytes (1 GiB).
pub const MAX_SHM_RING: usize = 1 << 30;

fn parse_ring(raw: &OsStr) -> Result<usize, String> {
    match parse_positive(raw)? {
        n if n > MAX_SHM_RING => Err("it is larger than 1 GiB (1073741824)".into()),
        n => Ok(n),
    }
}

fn parse_mib(raw: &OsStr) -> Result<usize, String> {
    match parse_count(raw)? {
        n if n > usize::MAX >> 20 => Err("it is too large: the bytes do not fit in memory addresses".into()),
        n => Ok(n),
    }
}

// ---------------------------------------------------------- declarations

/// The job's secret, which every rank and launcher proves to the rendezvous
/// store.
pub static JOB_SECRET: Var<String> = Var::new(
    "COHORT_JOB_SECRET",
    "made per job by `cohort run` on one node; required across nodes",
    "Secret every rank proves to the rendezvous store; export the same one on every node",
    "any text, the same on every node",
    parse_secret,
)
.secret();

/// The rendezvous store's address, set by `cohort run` for its ranks.
pub static STORE_ADDR: Var<String> = Var::new(
    "COHORT_STORE_ADDR",
    "set by `cohort run`; else MASTER_ADDR:MASTER_PORT",
    "Address of the rendezvous store the ranks join",
    "HOST:PORT",
    parse_host_port,
)
.from_launcher();

/// The descriptors of a rank's ends of its node relay's sockets, set by
/// `cohort run` for its ranks when it starts a relay.
pub static STORE_FD: Var<Vec<i32>> = Var::new(
    "COHORT_STORE_FD",
    "set by `cohort run` when this node runs 2 or more ranks; else unset",
    "Inherited sockets through which this rank reaches the rendezvous store (its node relay's: the first for its communicator, the others for that communicator's second connections); the rank connects directly when unset or once they are used. The first store client of the process claims them all (close-on-exec from then on) when each is a Unix socket made by it or an ancestor (the launcher, also through a wrapper); a program the rank starts that inherits the variable finds them closed or reused, and connects directly. Descriptors 0–2 or one listed twice are errors naming the variable",
    "file descriptor numbers, comma-separated",
    parse_fds,
)
.from_launcher();

/// Whether `cohort run` relays its ranks' store traffic.
pub static STORE_RELAY: Param<bool> = Param::new(
    "COHORT_STORE_RELAY",
    true,
    "1",
    "0 makes `cohort run` let every rank connect to the rendezvous store itself instead of through one relay per node",
    "1, true, yes, on or 0, false, no, off",
    parse_flag,
);

/// The default timeout of collectives and of forming a communicator.
pub static TIMEOUT: Param<Duration> = Param::new(
    "COHORT_TIMEOUT",
    Duration::from_secs(600),
    "600",
    "Seconds a collective (or forming a communicator) waits for the other members before it fails",
    "a number of seconds from 0.001 to 1e9 (fractions allowed)",
    parse_seconds,
);

/// How many CPU devices the CPU backend has.
pub static CPU_DEVICES: Param<usize> = Param::new(
    "COHORT_CPU_DEVICES",
    4,
    "4",
    "Number of CPU devices (server threads) the CPU backend offers; `cohort run -n cpu` starts one rank per device",
    "a whole number of at least 1",
    parse_positive,
);

/// How many wgpu devices to open on the first adapter.
pub static WGPU_DEVICES: Var<usize> = Var::new(
    "COHORT_WGPU_DEVICES",
    "one device per adapter",
    "Open this many wgpu devices, all on the first adapter (to test several devices on one GPU or on lavapipe)",
    "a whole number of at least 1",
    parse_positive,
);

/// How many CUDA devices the CUDA backend shows, spread over the GPUs.
pub static CUDA_DEVICES: Var<usize> = Var::new(
    "COHORT_CUDA_DEVICES",
    "one device per GPU",
    "Show this many CUDA devices, device i on GPU i mod (GPUs seen), each with its own thread and streams, at most 16 per GPU (to test several devices on one GPU; NCCL takes one device per GPU)",
    "a whole number of at least 1",
    parse_positive,
);

/// Which graphics APIs wgpu looks for adapters through.
pub static WGPU_BACKEND: Var<Vec<GraphicsApi>> = Var::new(
    "COHORT_WGPU_BACKEND",
    "vulkan,metal,dx12; gl when they find none",
    "Graphics APIs the wgpu backend looks for adapters through",
    "a comma-separated list of vulkan, gl, metal, dx12",
    parse_apis,
);

/// How a `Communicator` moves bytes between ranks.
pub static TRANSPORT: Param<TransportChoice> = Param::new(
    "COHORT_TRANSPORT",
    TransportChoice::Auto,
    "auto",
    "How a Communicator moves bytes between ranks: mpi (MPI messages, needs the `mpi` feature), host (shared memory within a node, TCP across), auto (mpi under mpirun when built with it, else host)",
    "auto, mpi or host",
    parse_transport,
);

/// Refuses NCCL even where libnccl is installed.
pub static DISABLE_NCCL: Param<bool> = Param::new(
    "COHORT_DISABLE_NCCL",
    false,
    "0",
    "1 makes CUDA collectives use host staging instead of NCCL, as if libnccl were missing",
    "1, true, yes, on or 0, false, no, off",
    parse_flag,
);

/// Sends groups of one CUDA device through NCCL too.
pub static NCCL_SINGLE: Param<bool> = Param::new(
    "COHORT_NCCL_SINGLE",
    false,
    "0",
    "1 sends a group of one CUDA device through a one-rank NCCL communicator instead of plain device copies",
    "1, true, yes, on or 0, false, no, off",
    parse_flag,
);

/// The cap on one fused buffer of a grouped call's all-reduces.
pub static FUSION_MB: Param<usize> = Param::new(
    "COHORT_FUSION_MB",
    64,
    "64",
    "MiB of one fused buffer: a grouped call's NCCL all-reduces of one element type and operator are packed into buffers of at most this size, each reduced by one NCCL all-reduce (0 turns fusion off); every rank must agree",
    "a whole number of MiB (0 turns fusion off)",
    parse_mib,
);

/// Which path device all-reduces and all-gathers take.
pub static ALGO: Param<AlgoChoice> = Param::new(
    "COHORT_ALGO",
    AlgoChoice::Auto,
    "auto",
    "Path of CUDA all-reduces and all-gathers of 2 to 8 devices: auto (by size and member count from the machine's crossover table), nccl, oneshot or twoshot (peer-memory kernels wherever they can run; other calls go to NCCL); a Communicator's ranks follow rank 0's, and a Communicator takes the peer kernels only when rank 0 sets oneshot or twoshot",
    "auto, nccl, oneshot or twoshot",
    parse_algo,
);

/// The libnccl file to load.
pub static NCCL_LIBRARY: Var<PathBuf> = Var::new(
    "COHORT_NCCL_LIBRARY",
    "libnccl.so.2, then libnccl.so, on the library path",
    "Path of the libnccl file the CUDA backend loads",
    "a path to libnccl",
    parse_path,
);

/// The pinned host pool's limit per CUDA device.
pub static PINNED_LIMIT_MB: Param<usize> = Param::new(
    "COHORT_PINNED_LIMIT_MB",
    2048,
    "2048",
    "MiB of page-locked host memory each CUDA device keeps for fast copies; past it, copies go through pageable memory",
    "a whole number of MiB (0 pins nothing)",
    parse_mib,
);

/// Where compiled CUDA kernels are cached between runs.
pub static CACHE_DIR: Var<PathBuf> = Var::new(
    "COHORT_CACHE_DIR",
    "$XDG_CACHE_HOME/cohort, else $HOME/.cache/cohort",
    "Folder of the user's own (0700, not writable by others) where NVRTC-compiled CUDA kernels are cached between runs, in its nvrtc/ subfolder; each entry carries a hash of its source and options, checked before it is loaded",
    "a folder path",
    parse_path,
);

/// Bytes of one shared-memory ring between two ranks on a node.
pub static SHM_RING: Param<usize> = Param::new(
    "COHORT_SHM_RING",
    4 << 20,
    "4194304",
    "Bytes of each shared-memory ring between two ranks of a node (rounded up to a power of two, at least 4096); every rank of a node must agree",
    "a whole number of bytes from 1 to 1073741824",
    parse_ring,
);

/// Collectives the flight recorder keeps.
pub static FLIGHT_RECORDER: Param<usize> = Param::new(
    "COHORT_FLIGHT_RECORDER",
    2000,
    "2000",
    "Number of recent collectives the flight recorder keeps for dumps (0 keeps none)",
    "a whole number (0 turns the recorder off)",
    parse_count,
);

/// Where flight-recorder dumps are written.
pub static TRACE_DIR: Var<PathBuf> = Var::new(
    "COHORT_TRACE_DIR",
    "cohort-trace",
    "Folder the flight recorder dumps each rank's rankN.json to (on a timeout, abort, mismatch or SIGUSR1); `cohort run` sets it",
    "a folder path",
    parse_path,
)
.from_launcher();

/// Chrome-trace timeline of the collectives.
pub static TIMELINE: Var<PathBuf> = Var::new(
    "COHORT_TIMELINE",
    "no timeline",
    "File each process writes a Chrome trace of its collectives to (path.rankN.json per rank under a launcher)",
    "a file path",
    parse_path,
);

/// How long waiting threads poll before they sleep.
pub static SPIN_US: Var<u64> = Var::new(
    "COHORT_SPIN_US",
    "50 with 4 or more hardware threads, else 0",
    "Microseconds a waiting thread polls for work before it sleeps",
    "a whole number of microseconds",
    parse_micros,
);

/// Whether ranks compare collective fingerprints.
pub static DESYNC_CHECK: Param<bool> = Param::new(
    "COHORT_DESYNC_CHECK",
    true,
    "1",
    "0 stops ranks comparing each collective's description (desync detection); every rank must agree",
    "1, true, yes, on or 0, false, no, off",
    parse_flag,
);

/// The log filter of `cohort` and the examples.
pub static LOG: Var<String> = Var::new(
    "COHORT_LOG",
    "RUST_LOG, else warn",
    "Log filter (tracing's EnvFilter syntax, e.g. info or cohort_comm=debug)",
    "a tracing filter such as warn, info or cohort_comm=debug",
    parse_text,
);

/// Which attempt of the job this is.
pub static RESTART_COUNT: Param<u32> = Param::new(
    "COHORT_RESTART_COUNT",
    0,
    "0",
    "Restarts of the job so far (0 on the first attempt); set by `cohort run --max-restarts`",
    "a whole number",
    parse_u32,
)
.from_launcher();

/// Nodes in the job.
pub static NNODES: Param<u32> = Param::new(
    "COHORT_NNODES",
    1,
    "1",
    "Number of nodes in the job; set by `cohort run --nnodes`",
    "a whole number of at least 1",
    parse_positive_u32,
)
.from_launcher();

/// Every variable cohort reads, in the order `cohort config` and
/// `docs/configuration.md` list them.
pub static ALL: [&dyn Setting; 26] = [
    &JOB_SECRET,
    &STORE_ADDR,
    &STORE_FD,
    &STORE_RELAY,
    &TIMEOUT,
    &CPU_DEVICES,
    &WGPU_DEVICES,
    &WGPU_BACKEND,
    &CUDA_DEVICES,
    &TRANSPORT,
    &DISABLE_NCCL,
    &NCCL_SINGLE,
    &FUSION_MB,
    &ALGO,
    &NCCL_LIBRARY,
    &PINNED_LIMIT_MB,
    &CACHE_DIR,
    &SHM_RING,
    &FLIGHT_RECORDER,
    &TRACE_DIR,
    &TIMELINE,
    &SPIN_US,
    &DESYNC_CHECK,
    &LOG,
    &RESTART_COUNT,
    &NNODES,
];

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    #[test]
    fn timeouts_that_cannot_be_used_name_the_variable() {
        for (bad, problem) in [
            ("abc", "not a number"),
            ("1e30", "longer than"),
            ("1.8e19", "longer than"),
            ("inf", "longer than"),
            ("-inf", "negative"),
            ("nan", "not a number"),
            ("-5", "negative"),
            ("0", "is 0"),
            ("0.0", "is 0"),
            ("1e-12", "shorter than"),
        ] {
            let err = TIMEOUT.parse_value(os(bad)).unwrap_err();
            assert_eq!(err.name, "COHORT_TIMEOUT");
            let msg = err.to_string();
            assert!(msg.starts_with(&format!("COHORT_TIMEOUT=\"{bad}\"")), "{bad}: {msg}");
            assert!(msg.contains(problem), "{bad}: {msg}");
            assert!(msg.contains("a number of seconds") && msg.contains("default (600)"), "{msg}");
        }
        assert_eq!(TIMEOUT.parse_value(os(" 2.5 ")), Ok(Duration::from_millis(2500)));
        assert_eq!(TIMEOUT.parse_value(os("1e9")), Ok(Duration::from_secs(1_000_000_000)));
    }

    #[test]
    fn counts_and_sizes() {
        for bad in ["0", "-1", "four", "1.5", "99999999999999999999999"] {
            let err = CPU_DEVICES.parse_value(os(bad)).unwrap_err().to_string();
            assert!(err.contains("COHORT_CPU_DEVICES") && err.contains("at least 1"), "{bad}: {err}");
        }
        assert!(CPU_DEVICES.parse_value(os("99999999999999999999999")).unwrap_err().problem.contains("too large"));
        assert!(CPU_DEVICES.parse_value(os("-1")).unwrap_err().problem.contains("negative"));
        assert_eq!(CPU_DEVICES.parse_value(os("8")), Ok(8));
        for bad in ["0", "-1", "two", "2.0", "", "99999999999999999999999"] {
            let err = CUDA_DEVICES.parse_value(os(bad)).unwrap_err().to_string();
            assert!(err.contains("COHORT_CUDA_DEVICES") && err.contains("at least 1"), "{bad:?}: {err}");
        }
        assert_eq!(CUDA_DEVICES.parse_value(os("3")), Ok(3));
        assert_eq!(FLIGHT_RECORDER.parse_value(os("0")), Ok(0));
        assert!(SHM_RING.parse_value(os("0")).is_err());
        assert!(SHM_RING.parse_value(os("18446744073709551615")).unwrap_err().problem.contains("1 GiB"));
        assert_eq!(SHM_RING.parse_value(os("5000")), Ok(5000));
        assert!(PINNED_LIMIT_MB.parse_value(os(&(usize::MAX >> 19).to_string())).is_err());
        assert_eq!(PINNED_LIMIT_MB.parse_value(os("0")), Ok(0));
        assert!(SPIN_US.parse_value(os("fast")).unwrap_err().to_string().contains("COHORT_SPIN_US"));
        assert!(NNODES.parse_value(os("0")).is_err());
        assert_eq!(RESTART_COUNT.parse_value(os("3")), Ok(3));
    }

    #[test]
    fn flags_transports_and_apis() {
        for (raw, on) in [("1", true), ("TRUE", true), ("on", true), ("0", false), ("no", false), ("Off", false)] {
            assert_eq!(DISABLE_NCCL.parse_value(os(raw)), Ok(on), "{raw}");
        }
        let err = DISABLE_NCCL.parse_value(os("maybe")).unwrap_err().to_string();
        assert!(err.contains("COHORT_DISABLE_NCCL=\"maybe\"") && err.contains("not a switch"), "{err}");
        assert_eq!(TRANSPORT.parse_value(os("shm")), Ok(TransportChoice::Host));
        assert_eq!(ALGO.parse_value(os("One-Shot")), Ok(AlgoChoice::OneShot));
        assert_eq!(ALGO.parse_value(os("twoshot")), Ok(AlgoChoice::TwoShot));
        assert_eq!(ALGO.parse_value(os(ALGO.default)), Ok(AlgoChoice::Auto));
        let err = ALGO.parse_value(os("ring")).unwrap_err().to_string();
        assert!(err.starts_with("COHORT_ALGO=\"ring\"") && err.contains("auto, nccl, oneshot or twoshot"), "{err}");
        assert_eq!(TRANSPORT.parse_value(os("MPI")), Ok(TransportChoice::Mpi));
        assert!(TRANSPORT.parse_value(os("ib")).unwrap_err().to_string().contains("auto, mpi or host"));
        assert_eq!(WGPU_BACKEND.parse_value(os("vk, GL,vulkan")), Ok(vec![GraphicsApi::Vulkan, GraphicsApi::Gl]));
        let err = WGPU_BACKEND.parse_value(os("vulkan,cuda")).unwrap_err().to_string();
        assert!(err.contains("COHORT_WGPU_BACKEND") && err.contains("\"cuda\" is not a backend"), "{err}");
        assert!(WGPU_BACKEND.parse_value(os(",")).is_err());
    }

    #[test]
    fn store_addresses() {
        assert_eq!(STORE_ADDR.parse_value(os("node0:29500")), Ok("node0:29500".into()));
        assert_eq!(STORE_ADDR.parse_value(os("[::1]:5")), Ok("[::1]:5".into()));
        for bad in ["node0", "node0:0", "node0:http", ":5", "::1:5"] {
            let err = STORE_ADDR.parse_value(os(bad)).unwrap_err().to_string();
            assert!(err.contains("COHORT_STORE_ADDR") && err.contains("HOST:PORT"), "{bad}: {err}");
        }
    }

    #[test]
    fn not_utf8_is_an_error_except_for_paths() {
        use std::os::unix::ffi::OsStrExt;
        let raw = OsStr::from_bytes(b"\xff5");
        assert!(TIMEOUT.parse_value(raw).unwrap_err().problem.contains("UTF-8"));
        assert_eq!(CACHE_DIR.parse_value(raw), Ok(PathBuf::from(raw)));
    }

    #[test]
    fn secrets_are_masked() {
        assert_eq!(JOB_SECRET.display(os("hunter2")), "<hidden>");
        assert_eq!(TIMEOUT.display(os("5")), "\"5\"");
        assert!(JOB_SECRET.secret && !TIMEOUT.secret);
    }

    #[test]
    fn the_environment_is_read_and_blank_is_unset() {
        // COHORT_NNODES is read by nothing in this crate's tests.
        std::env::set_var(NNODES.name, "  ");
        assert_eq!(NNODES.get(), Ok(1));
        assert!(matches!(NNODES.check(), Ok(None)));
        std::env::set_var(NNODES.name, "3");
        assert_eq!(NNODES.get(), Ok(3));
        std::env::set_var(NNODES.name, "three");
        let err = NNODES.get().unwrap_err();
        assert_eq!((err.name, err.value.as_str()), ("COHORT_NNODES", "\"three\""));
        assert!(invalid().iter().any(|e| e.name == "COHORT_NNODES"));
        assert!(check(&[&TIMEOUT, &NNODES]).is_err());
        std::env::remove_var(NNODES.name);
        assert_eq!(NNODES.get(), Ok(1));
    }

    #[test]
    fn every_typed_default_is_its_documented_default() {
        assert_eq!(TIMEOUT.parse_value(os(TIMEOUT.default)), Ok(TIMEOUT.fallback));
        for p in [&CPU_DEVICES, &PINNED_LIMIT_MB, &SHM_RING, &FLIGHT_RECORDER, &FUSION_MB] {
            assert_eq!(p.parse_value(os(p.default)), Ok(p.fallback), "{}", p.name);
        }
        for p in [&DISABLE_NCCL, &NCCL_SINGLE, &DESYNC_CHECK] {
            assert_eq!(p.parse_value(os(p.default)), Ok(p.fallback), "{}", p.name);
        }
        for p in [&RESTART_COUNT, &NNODES] {
            assert_eq!(p.parse_value(os(p.default)), Ok(p.fallback), "{}", p.name);
        }
        assert_eq!(TRANSPORT.parse_value(os(TRANSPORT.default)), Ok(TRANSPORT.fallback));
    }

    #[test]
    fn names_are_unique_and_prefixed() {
        let mut names: Vec<_> = ALL.iter().map(|s| s.decl().name).collect();
        assert!(names.iter().all(|n| n.starts_with("COHORT_")));
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        assert!(find("COHORT_TIMEOUT").is_some() && find("COHORT_TIMOUT").is_none());
        assert!(ALL.iter().all(|s| !s.decl().meaning.contains('|') && !s.decl().default.contains('|')));
    }
}
