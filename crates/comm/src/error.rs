//! The errors of forming a group and of calling a collective.

use cohort_runtime::{ConfigError, DType, DeviceId, ServerError};

/// Why a group could not be formed or a collective was refused.
///
/// Argument errors are returned before anything is queued on any member: no
/// buffer is written or marked. Failures while a collective runs are not
/// returned here: they mark every destination of the collective, and a read
/// of one returns the cause as a [`ServerError`].
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum CommError {
    /// `ClientGroup::new` got no clients.
    #[error("a group needs at least one client; pass one client per device")]
    EmptyGroup,
    /// One device was listed twice.
    #[error(
        "device {device} is listed twice (members {first} and {second}): a group holds one client per device; \
         drop the duplicate"
    )]
    DuplicateDevice { device: DeviceId, first: usize, second: usize },
    /// Clients of different runtimes were mixed in one group.
    #[error(
        "member {member} is a {other} client but member 0 is a {first} client: a group holds clients of one \
         runtime; move buffers between runtimes with `to_client`"
    )]
    MixedRuntimes { member: usize, first: &'static str, other: &'static str },
    /// The number of buffers given is not one per member.
    #[error("{operation}: {what} has {got} buffers but the group has {expected} members; pass one per member")]
    BufferCount { operation: &'static str, what: &'static str, expected: usize, got: usize },
    /// A buffer belongs to another device than its member's.
    #[error(
        "{operation}: {what} of member {member} is on {handle_device} but member {member} is {member_device}; \
         pass each member a buffer of its own device (move it with `to_client`)"
    )]
    ForeignHandle {
        operation: &'static str,
        what: &'static str,
        member: usize,
        handle_device: DeviceId,
        member_device: DeviceId,
    },
    /// A buffer is not a whole number of elements.
    #[error(
        "{operation}: {what} of member {member} holds {bytes} bytes, which is not a whole number of {dtype} \
         elements ({elem} bytes each)"
    )]
    PartialElement {
        operation: &'static str,
        what: &'static str,
        member: usize,
        bytes: u64,
        dtype: String,
        elem: usize,
    },
    /// A buffer has the wrong size for the collective: its size and the
    /// size it must have, in bytes (`expected`, `got`), which the message
    /// counts in elements of `dtype` first.
    #[error(
        "{operation}: {what} of member {member} holds {} but must hold {} ({why})",
        elements(.got, .dtype),
        elements(.expected, .dtype)
    )]
    WrongSize {
        operation: &'static str,
        what: &'static str,
        member: usize,
        dtype: DType,
        expected: u64,
        got: u64,
        why: String,
    },
    /// A root (or send/recv endpoint) is not a member.
    #[error("{operation}: {what} {index} is not a member: the group has members 0..{members}")]
    NotAMember { operation: &'static str, what: &'static str, index: usize, members: usize },
    /// A buffer the call needs from this process was not passed.
    #[error(
        "{operation}: the {what} of member {member} is missing; this process holds member {member}, so it must \
         pass that buffer"
    )]
    MissingBuffer { operation: &'static str, what: &'static str, member: usize },
    /// A member's destination is foreign memory adopted read-only (a
    /// DLPack tensor flagged so), which the collective would write.
    #[error(
        "{operation}: the destination of member {member} is read-only ({bytes} bytes of foreign memory adopted \
         with Access::ReadOnly, such as a DLPack tensor flagged read-only), and {operation} writes its \
         destination; pass a writable buffer as the destination and copy the result out of it"
    )]
    ReadOnly { operation: &'static str, member: usize, bytes: u64 },
    /// A member's source and destination overlap in a way the collective
    /// cannot run in place.
    #[error("{operation}: the source and destination of member {member} overlap: {detail}")]
    Overlap { operation: &'static str, member: usize, detail: String },
    /// A member's stream is inside a graph capture window.
    #[error(
        "{operation}: member {member}'s stream is capturing a graph; host-staged collectives cannot be captured, \
         run it before start_capture or after stop_capture"
    )]
    Capturing { operation: &'static str, member: usize },
    /// Some members' streams are capturing a graph and others' are not.
    #[error(
        "{operation}: member {member}'s stream is not capturing a graph while other members' are; \
         a collective is captured on every member's stream or on none"
    )]
    CapturingPartly { operation: &'static str, member: usize },
    /// The host path asked for is not available on this runtime.
    #[error("the direct host path needs device memory the host can address; {backend} devices cannot: use HostPath::Staged or HostPath::Auto")]
    DirectUnsupported { backend: &'static str },
    /// A member's part could not be queued (its device closed, say). The
    /// members already queued fail at once and mark their destinations.
    #[error("{operation}: could not queue member {member}'s part on {device}: {source}")]
    Enqueue { operation: &'static str, member: usize, device: DeviceId, source: ServerError },
    /// A collective the caller waits on (barrier, `to_client`) failed.
    #[error("{operation} failed: {source}")]
    Failed { operation: &'static str, source: ServerError },
    /// Two calls of a grouped call touch the same memory and one of them
    /// writes it.
    #[error(
        "group: calls {earlier} and {later} of the same group touch the same memory and one of them writes it; \
         the calls of a group run as one, concurrently, and must not depend on each other: end the group \
         before call {later}"
    )]
    DependentCalls { earlier: usize, later: usize },
    /// A mesh's dimensions do not lay out the group's members.
    #[error(
        "a mesh of {shape} does not lay out {members} members: give each dimension a distinct name and a size of \
         at least 1, whose product is the number of members"
    )]
    MeshShape { shape: String, members: usize },
    /// A mesh has no dimension of that name.
    #[error("the mesh has no dimension {name:?}; its dimensions are {names}")]
    NoSuchDimension { name: String, names: String },
    /// A bounded wait on a collective's handle ([`Work::wait_timeout`](crate::Work::wait_timeout))
    /// ended before every local part finished. The collective goes on.
    #[error(
        "{operation}{scope} has not finished within {waited_ms} ms: {missing}; the collective is \
         not cancelled: wait again, or find what keeps those devices busy (earlier work, or members that never \
         called it)"
    )]
    Unfinished { operation: &'static str, scope: String, missing: String, waited_ms: u64 },
    /// The ranks of a communicator called a split or subgroup with
    /// arguments that cannot form one set of groups (different member
    /// lists, say); the message names the ranks.
    #[error(
        "{operation}: {detail}; every rank of the parent must call it, in the same order, with the same arguments"
    )]
    GroupDisagreement { operation: &'static str, detail: String },
    /// A group's members are listed in a way it cannot be formed (a member
    /// listed twice, out of range, or a layout across processes that is
    /// not one block of devices per rank).
    #[error("{operation}: {detail}")]
    InvalidGroup { operation: &'static str, detail: String },
    /// A group's links could not be formed (a store or link failure).
    #[error("{operation}: forming the group's links failed: {detail}")]
    GroupSetup { operation: &'static str, detail: String },
    /// A `COHORT_*` variable has a value that cannot be used (the message
    /// names it and says what is expected).
    #[error(transparent)]
    Variable(#[from] ConfigError),
}

/// `bytes` counted in elements of `dtype`, then in bytes: `3 f32 elements
/// (12 bytes)`; `13 bytes (not a whole number of f32 elements)`.
fn elements(bytes: &u64, dtype: &DType) -> String {
    let size = dtype.size() as u64;
    match (bytes / size, bytes % size) {
        (1, 0) => format!("1 {dtype} element ({bytes} bytes)"),
        (count, 0) => format!("{count} {dtype} elements ({bytes} bytes)"),
        _ => format!("{bytes} bytes (not a whole number of {dtype} elements)"),
    }
}
