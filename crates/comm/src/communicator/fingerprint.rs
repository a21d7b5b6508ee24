//! What each rank says it is calling: a collective's fingerprint.
//!
//! Every collective of a communicator gets the next sequence number, and its
//! fingerprint (sequence number, kind, reduction, element type, element
//! count, root) travels to the ring successor before any data; a successor
//! whose own fingerprint differs stops with an error naming both sides. The
//! check costs one 32-byte message per rank and collective (one extra hop of
//! latency: a few microseconds over shared memory, one round trip on TCP).

use std::fmt;

use crate::ops::{DType, ReduceOp};

/// Bytes of an encoded fingerprint.
pub(crate) const LEN: usize = 32;

const MAGIC: [u8; 4] = *b"COHF";

/// The kinds of calls that carry a fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather,
    Scatter,
    Barrier,
    /// A point-to-point message; its sequence number counts messages from
    /// the sender to the receiver and its root is the sender's rank.
    SendRecv,
}

const CALLS: [Call; 10] = [
    Call::AllReduce,
    Call::Reduce,
    Call::Broadcast,
    Call::AllGather,
    Call::ReduceScatter,
    Call::AllToAll,
    Call::Gather,
    Call::Scatter,
    Call::Barrier,
    Call::SendRecv,
];

impl Call {
    /// The method's name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Call::AllReduce => "all_reduce",
            Call::Reduce => "reduce",
            Call::Broadcast => "broadcast",
            Call::AllGather => "all_gather",
            Call::ReduceScatter => "reduce_scatter",
            Call::AllToAll => "all_to_all",
            Call::Gather => "gather",
            Call::Scatter => "scatter",
            Call::Barrier => "barrier",
            Call::SendRecv => "send/recv",
        }
    }
}

/// One call's identity, as every rank must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    pub seq: u64,
    pub call: Call,
    pub op: Option<ReduceOp>,
    pub dtype: DType,
    /// Elements of one member's segment.
    pub count: u64,
    /// Root member (rooted collectives) or sender rank (send/recv).
    pub root: Option<u32>,
}

impl Fingerprint {
    pub(crate) fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4] = CALLS.iter().position(|c| *c == self.call).expect("listed") as u8;
        b[5] = self.op.map_or(0xff, |op| ReduceOp::ALL.iter().position(|o| *o == op).expect("listed") as u8);
        b[6] = DType::ALL.iter().position(|d| *d == self.dtype).expect("listed") as u8;
        b[7] = u8::from(self.root.is_some());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..28].copy_from_slice(&self.root.unwrap_or(0).to_le_bytes());
        b
    }

    /// Decodes what a peer sent; `None` when it is not a fingerprint at all
    /// (the peer is sending data: it is inside another collective).
    pub(crate) fn decode(b: &[u8]) -> Option<Fingerprint> {
        if b.len() != LEN || b[..4] != MAGIC {
            return None;
        }
        let op = match b[5] {
            0xff => None,
            i => Some(*ReduceOp::ALL.get(i as usize)?),
        };
        Some(Fingerprint {
            call: *CALLS.get(b[4] as usize)?,
            op,
            dtype: *DType::ALL.get(b[6] as usize)?,
            seq: u64::from_le_bytes(b[8..16].try_into().ok()?),
            count: u64::from_le_bytes(b[16..24].try_into().ok()?),
            root: (b[7] == 1).then(|| u32::from_le_bytes(b[24..28].try_into().expect("4 bytes"))),
        })
    }

    /// The mismatch message between this rank's call and a peer's.
    pub(crate) fn mismatch(&self, me: usize, peer: usize, theirs: Option<&Fingerprint>) -> String {
        let theirs = match theirs {
            Some(fp) => fp.to_string(),
            None => "something that is not a collective of this communicator (its bytes are data: it is further \
                     along, or calls a different collective)"
                .to_string(),
        };
        format!(
            "collective mismatch: rank {me} called {self} but rank {peer} called {theirs}; every rank must call \
             the same collectives, in the same order, with the same element type, count, operator and root"
        )
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{} ({} × {}", self.call.name(), self.seq, self.dtype, self.count)?;
        if let Some(op) = self.op {
            write!(f, ", op {op}")?;
        }
        if let Some(root) = self.root {
            let what = if self.call == Call::SendRecv { "from rank" } else { "root" };
            write!(f, ", {what} {root}")?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_message() {
        let fp = Fingerprint {
            seq: 7,
            call: Call::Reduce,
            op: Some(ReduceOp::Max),
            dtype: DType::BF16,
            count: 1 << 40,
            root: Some(3),
        };
        assert_eq!(Fingerprint::decode(&fp.encode()), Some(fp));
        assert_eq!(fp.to_string(), "reduce #7 (bf16 × 1099511627776, op max, root 3)");
        let other = Fingerprint { call: Call::Broadcast, op: None, ..fp };
        let msg = fp.mismatch(1, 0, Some(&other));
        assert!(msg.contains("rank 1 called reduce #7") && msg.contains("rank 0 called broadcast #7"), "{msg}");
        assert_eq!(Fingerprint::decode(&[0u8; LEN]), None);
    }
}
