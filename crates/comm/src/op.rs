//! One description of a collective: which one ([`Collective`]), its element
//! type, its reduction, its root or endpoints, and how many elements each
//! member's block holds ([`Op`]).
//!
//! Both front ends turn their arguments into an [`Op`] once (the argument
//! checks return it); the fingerprints ranks compare, the flight recorder,
//! `verify`, the host engine and the device path all read the same value.
//! Roots and endpoints are members of whoever runs it: an executor that runs
//! a collective among some members only (a send/recv between two devices of
//! a group) sees it through `Op::on_slots`.

use std::fmt;

use crate::ops::{DType, ReduceOp};

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every member's source reduced into every member's destination.
    AllReduce,
    /// Every member's source reduced into the root's destination.
    Reduce,
    /// The root's source copied to every member's destination.
    Broadcast,
    /// Every member's source concatenated into every member's destination.
    AllGather,
    /// Every member's source reduced; member `m` gets block `m`.
    ReduceScatter,
    /// Block `k` of member `m`'s source goes to block `m` of member `k`.
    AllToAll,
    /// Every member's source concatenated into the root's destination.
    Gather,
    /// Block `m` of the root's source goes to member `m`.
    Scatter,
    /// A message from one member to another (the bench and tests run a
    /// ring of them: member `m` sends to member `m + 1`).
    SendRecv,
    /// Every member waits for every other; no bytes move.
    Barrier,
}

impl Collective {
    /// Every collective that moves data, in a fixed order (the barrier,
    /// which moves none, is left out).
    pub const ALL: [Collective; 9] = [
        Collective::AllReduce,
        Collective::Reduce,
        Collective::Broadcast,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::Gather,
        Collective::Scatter,
        Collective::SendRecv,
    ];

    /// The name of the `ClientGroup` method, used by errors, logs, the
    /// flight recorder and fingerprints.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::Reduce => "reduce",
            Collective::Broadcast => "broadcast",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::SendRecv => "send_recv",
            Collective::Barrier => "barrier",
        }
    }

    /// Parses a name as [`Collective::name`] gives it (`-` for `_` too).
    pub fn parse(name: &str) -> Option<Collective> {
        let name = name.replace('-', "_");
        Collective::every().find(|c| c.name() == name)
    }

    /// Whether it reduces (takes a [`ReduceOp`]).
    pub fn reduces(self) -> bool {
        matches!(self, Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter)
    }

    /// Whether it takes a root.
    pub fn rooted(self) -> bool {
        matches!(self, Collective::Reduce | Collective::Broadcast | Collective::Gather | Collective::Scatter)
    }

    /// Whether it has an in-place form.
    pub fn has_in_place(self) -> bool {
        !matches!(self, Collective::SendRecv | Collective::Barrier)
    }

    /// Whether its buffers split into one block per member (`size / n`
    /// bytes each): the gathers, scatters and all-to-all.
    pub fn blocked(self) -> bool {
        matches!(
            self,
            Collective::AllGather
                | Collective::ReduceScatter
                | Collective::AllToAll
                | Collective::Gather
                | Collective::Scatter
        )
    }

    /// Bytes of one member's source and destination when a block holds
    /// `block` bytes among `n` members (a block is the whole buffer of the
    /// collectives that are not [`Collective::blocked`]).
    pub fn lengths(self, block: usize, n: usize) -> (usize, usize) {
        match self {
            Collective::AllGather | Collective::Gather => (block, n * block),
            Collective::ReduceScatter | Collective::Scatter => (n * block, block),
            Collective::AllToAll => (n * block, n * block),
            Collective::Barrier => (0, 0),
            _ => (block, block),
        }
    }

    /// nccl-tests' bus-bandwidth factor over `n` members: busbw = algbw ×
    /// factor, where algbw = size / time and size is the largest buffer.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather
            | Collective::ReduceScatter
            | Collective::AllToAll
            | Collective::Gather
            | Collective::Scatter => (n - 1.0) / n,
            Collective::Reduce | Collective::Broadcast | Collective::SendRecv => 1.0,
            Collective::Barrier => 0.0,
        }
    }

    /// The least memory traffic of the collective on one host, in copies of
    /// `size` bytes (one copy reads and writes `size` bytes): half of the
    /// bytes every input must be read and every output written. All-reduce
    /// reads n buffers and writes n: `n`.
    pub fn host_copies(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce | Collective::AllToAll => n,
            Collective::Reduce | Collective::Broadcast | Collective::AllGather | Collective::ReduceScatter => {
                (n + 1.0) / 2.0
            }
            Collective::Gather | Collective::Scatter | Collective::SendRecv => 1.0,
            Collective::Barrier => 0.0,
        }
    }

    /// Every collective, the barrier too.
    fn every() -> impl Iterator<Item = Collective> {
        Collective::ALL.into_iter().chain([Collective::Barrier])
    }

    /// Its code on the wire (fixed: the ranks of one job compare them).
    pub(crate) fn code(self) -> u8 {
        match self {
            Collective::AllReduce => 0,
            Collective::Reduce => 1,
            Collective::Broadcast => 2,
            Collective::AllGather => 3,
            Collective::ReduceScatter => 4,
            Collective::AllToAll => 5,
            Collective::Gather => 6,
            Collective::Scatter => 7,
            Collective::Barrier => 8,
            Collective::SendRecv => 9,
        }
    }

    /// The collective of a wire code.
    pub(crate) fn from_code(code: u8) -> Option<Collective> {
        Collective::every().find(|c| c.code() == code)
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One collective call, described once: which collective, its element
/// type, its reduction (reducing collectives only), its root (rooted ones)
/// or endpoints (send/recv), and the elements of one member's block.
///
/// Made by the constructors, which take exactly what each collective needs,
/// so a description is consistent by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Op {
    collective: Collective,
    dtype: DType,
    reduce: Option<ReduceOp>,
    /// The root member; a send/recv's sender.
    root: Option<usize>,
    /// A send/recv's receiver.
    peer: Option<usize>,
    count: usize,
}

impl Op {
    fn new(collective: Collective, dtype: DType, count: usize) -> Op {
        Op { collective, dtype, reduce: None, root: None, peer: None, count }
    }

    /// All-reduce of `count` elements per member.
    pub fn all_reduce(dtype: DType, op: ReduceOp, count: usize) -> Op {
        Op { reduce: Some(op), ..Op::new(Collective::AllReduce, dtype, count) }
    }

    /// Reduce of `count` elements per member into member `root`.
    pub fn reduce(dtype: DType, op: ReduceOp, root: usize, count: usize) -> Op {
        Op { reduce: Some(op), root: Some(root), ..Op::new(Collective::Reduce, dtype, count) }
    }

    /// Broadcast of `count` elements from member `root`.
    pub fn broadcast(dtype: DType, root: usize, count: usize) -> Op {
        Op { root: Some(root), ..Op::new(Collective::Broadcast, dtype, count) }
    }

    /// All-gather of `count` elements per member.
    pub fn all_gather(dtype: DType, count: usize) -> Op {
        Op::new(Collective::AllGather, dtype, count)
    }

    /// Reduce-scatter giving every member `count` elements.
    pub fn reduce_scatter(dtype: DType, op: ReduceOp, count: usize) -> Op {
        Op { reduce: Some(op), ..Op::new(Collective::ReduceScatter, dtype, count) }
    }

    /// All-to-all of blocks of `count` elements.
    pub fn all_to_all(dtype: DType, count: usize) -> Op {
        Op::new(Collective::AllToAll, dtype, count)
    }

    /// Gather of `count` elements per member into member `root`.
    pub fn gather(dtype: DType, root: usize, count: usize) -> Op {
        Op { root: Some(root), ..Op::new(Collective::Gather, dtype, count) }
    }

    /// Scatter of `count` elements to each member from member `root`.
    pub fn scatter(dtype: DType, root: usize, count: usize) -> Op {
        Op { root: Some(root), ..Op::new(Collective::Scatter, dtype, count) }
    }

    /// A message of `count` elements from member `from` to member `to`
    /// (the same member: a copy).
    pub fn send_recv(dtype: DType, from: usize, to: usize, count: usize) -> Op {
        Op { root: Some(from), peer: Some(to), ..Op::new(Collective::SendRecv, dtype, count) }
    }

    /// A barrier.
    pub fn barrier() -> Op {
        Op::new(Collective::Barrier, DType::U8, 0)
    }

    /// Which collective.
    pub fn collective(&self) -> Collective {
        self.collective
    }

    /// The collective's name.
    pub fn name(&self) -> &'static str {
        self.collective.name()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The reduction of the reducing collectives.
    pub fn reduce_op(&self) -> Option<ReduceOp> {
        self.reduce
    }

    /// The root member of the rooted collectives.
    pub fn root(&self) -> Option<usize> {
        self.root.filter(|_| self.collective.rooted())
    }

    /// A send/recv's sender and receiver.
    pub fn endpoints(&self) -> Option<(usize, usize)> {
        match (self.collective, self.root, self.peer) {
            (Collective::SendRecv, Some(from), Some(to)) => Some((from, to)),
            _ => None,
        }
    }

    /// Elements of one member's block.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Bytes of one member's block.
    pub fn block_bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// This collective as an executor sees it when it runs among `members`
    /// only: roots and endpoints become positions in `members` (slots).
    /// Identity when `members` is every member in order.
    pub(crate) fn on_slots(&self, members: &[usize]) -> Op {
        let slot = |m: usize| members.iter().position(|&x| x == m).unwrap_or(m);
        Op { root: self.root.map(slot), peer: self.peer.map(slot), ..*self }
    }

    /// Blocks in `slot`'s source among `n` members (0: it brings none).
    pub(crate) fn in_blocks(&self, slot: usize, n: usize) -> usize {
        match self.collective {
            Collective::AllReduce | Collective::Reduce | Collective::AllGather | Collective::Gather => 1,
            Collective::ReduceScatter | Collective::AllToAll => n,
            Collective::Broadcast => usize::from(self.root == Some(slot)),
            Collective::Scatter if self.root == Some(slot) => n,
            Collective::Scatter | Collective::Barrier => 0,
            Collective::SendRecv => usize::from(self.root == Some(slot)),
        }
    }

    /// Blocks in `slot`'s destination among `n` members (0: it gets none).
    pub(crate) fn out_blocks(&self, slot: usize, n: usize) -> usize {
        match self.collective {
            Collective::AllReduce | Collective::Broadcast | Collective::ReduceScatter | Collective::Scatter => 1,
            Collective::AllGather | Collective::AllToAll => n,
            Collective::Reduce => usize::from(self.root == Some(slot)),
            Collective::Gather if self.root == Some(slot) => n,
            Collective::Gather | Collective::Barrier => 0,
            Collective::SendRecv => usize::from(self.peer == Some(slot)),
        }
    }

    /// Bytes of the description on the wire.
    pub(crate) const WIRE_LEN: usize = 20;

    /// The wire form: collective, reduction, element type, count, root and
    /// receiver (every field, so two ranks' encodings are equal exactly
    /// when their descriptions are).
    pub(crate) fn encode(&self) -> [u8; Op::WIRE_LEN] {
        let mut b = [0u8; Op::WIRE_LEN];
        b[0] = self.collective.code();
        b[1] = self.reduce.map_or(0xff, |op| ReduceOp::ALL.iter().position(|o| *o == op).expect("listed") as u8);
        b[2] = DType::ALL.iter().position(|d| *d == self.dtype).expect("listed") as u8;
        b[3] = u8::from(self.root.is_some()) | u8::from(self.peer.is_some()) << 1;
        b[4..12].copy_from_slice(&(self.count as u64).to_le_bytes());
        b[12..16].copy_from_slice(&(self.root.unwrap_or(0) as u32).to_le_bytes());
        b[16..20].copy_from_slice(&(self.peer.unwrap_or(0) as u32).to_le_bytes());
        b
    }

    /// Decodes [`Op::encode`]'s bytes; `None` when they describe no
    /// consistent call.
    pub(crate) fn decode(b: &[u8]) -> Option<Op> {
        if b.len() != Op::WIRE_LEN {
            return None;
        }
        let collective = Collective::from_code(b[0])?;
        let dtype = *DType::ALL.get(b[2] as usize)?;
        let count = usize::try_from(u64::from_le_bytes(b[4..12].try_into().ok()?)).ok()?;
        let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize;
        let root = (b[3] & 1 != 0).then(|| word(12));
        let peer = (b[3] & 2 != 0).then(|| word(16));
        let reduce = match b[1] {
            0xff => None,
            i => Some(*ReduceOp::ALL.get(i as usize)?),
        };
        let op = Op { collective, dtype, reduce, root, peer, count };
        let consistent = reduce.is_some() == collective.reduces()
            && root.is_some() == (collective.rooted() || collective == Collective::SendRecv)
            && peer.is_some() == (collective == Collective::SendRecv);
        consistent.then_some(op)
    }
}

impl Op {
    /// Its arguments in words: `f32 × 1024, op sum`, `bf16 × 8, op max,
    /// root 3`, `u8 × 4, from 0 to 1`.
    pub(crate) fn arguments(&self) -> String {
        let mut words = format!("{} × {}", self.dtype, self.count);
        if let Some(op) = self.reduce {
            words += &format!(", op {op}");
        }
        if let Some(root) = self.root() {
            words += &format!(", root {root}");
        }
        if let Some((from, to)) = self.endpoints() {
            words += &format!(", from {from} to {to}");
        }
        words
    }
}

impl fmt::Display for Op {
    /// `all_reduce (f32 × 1024, op sum)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.arguments())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_codes_are_stable() {
        for c in Collective::every() {
            assert_eq!(Collective::parse(c.name()), Some(c));
            assert_eq!(Collective::from_code(c.code()), Some(c));
        }
        assert_eq!(Collective::parse("all-reduce"), Some(Collective::AllReduce));
        assert_eq!(Collective::Barrier.code(), 8);
        assert_eq!(Collective::SendRecv.code(), 9);
        assert!(!Collective::ALL.contains(&Collective::Barrier));
    }

    #[test]
    fn every_description_round_trips_on_the_wire() {
        let ops = [
            Op::all_reduce(DType::F32, ReduceOp::Avg, 10),
            Op::reduce(DType::BF16, ReduceOp::Max, 3, 1 << 40),
            Op::broadcast(DType::U8, 1, 7),
            Op::all_gather(DType::I64, 0),
            Op::reduce_scatter(DType::F16, ReduceOp::Min, 5),
            Op::all_to_all(DType::U32, 2),
            Op::gather(DType::F64, 0, 9),
            Op::scatter(DType::I8, 2, 1),
            Op::send_recv(DType::F32, 4, 0, 3),
            Op::barrier(),
        ];
        for op in ops {
            assert_eq!(Op::decode(&op.encode()), Some(op), "{op}");
        }
        assert_eq!(Op::decode(&[0xee; Op::WIRE_LEN]), None);
    }

    #[test]
    fn slots_map_roots_and_blocks_follow_them() {
        let op = Op::send_recv(DType::U8, 5, 2, 4).on_slots(&[5, 2]);
        assert_eq!(op.endpoints(), Some((0, 1)));
        assert_eq!((op.in_blocks(0, 2), op.out_blocks(0, 2)), (1, 0));
        assert_eq!((op.in_blocks(1, 2), op.out_blocks(1, 2)), (0, 1));
        let scatter = Op::scatter(DType::F32, 1, 4);
        assert_eq!((scatter.in_blocks(1, 3), scatter.in_blocks(0, 3), scatter.out_blocks(0, 3)), (3, 0, 1));
        assert_eq!(scatter.to_string(), "scatter (f32 × 4, root 1)");
    }
}
