//! What each rank says it is calling: a collective's fingerprint.
//!
//! Every collective of a communicator gets the next sequence number, and its
//! fingerprint (sequence number and the call's [`Op`]: kind, reduction,
//! element type, element count, root) travels to every other rank before
//! any data (to the ring successor only in a job of more than eight ranks:
//! `World::collective_check`); a rank whose own fingerprint differs stops
//! with an error naming both sides. The check costs one 32-byte message per
//! rank, collective and peer (one extra hop of latency: a few microseconds
//! over shared memory, one round trip on TCP).

use std::fmt;

use crate::digest::Fnv1a;
use crate::op::{Collective, Op};

/// Bytes of an encoded fingerprint.
pub(crate) const LEN: usize = 32;

const MAGIC: [u8; 4] = *b"COHF";
/// A grouped call's fingerprint.
const GROUP_MAGIC: [u8; 4] = *b"COHG";

/// What stands for the calls of a grouped call in its one fingerprint: how
/// many, and a digest of their descriptions in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupOf {
    pub calls: u32,
    pub digest: u64,
}

/// One call's identity, as every rank must agree on it: its sequence number
/// and its description. A send/recv's sequence number counts messages from
/// the sender to the receiver; its description names both ranks, so the
/// two sides' fingerprints are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    pub seq: u64,
    /// The call (a barrier's for a grouped call: its calls are `group`).
    pub op: Op,
    /// A grouped call's calls.
    pub group: Option<GroupOf>,
}

impl Fingerprint {
    /// Call number `seq`, `op`.
    pub(crate) fn of(seq: u64, op: Op) -> Fingerprint {
        Fingerprint { seq, op, group: None }
    }

    /// Grouped call number `seq` of `ops`, in order: one fingerprint for
    /// all of them (their count and a digest of their descriptions).
    pub(crate) fn of_group(seq: u64, ops: &[Op]) -> Fingerprint {
        let digest = ops.iter().fold(Fnv1a::default(), |d, op| d.write(op.encode())).finish();
        let group = GroupOf { calls: ops.len() as u32, digest };
        Fingerprint { seq, op: Op::barrier(), group: Some(group) }
    }

    pub(crate) fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[4..12].copy_from_slice(&self.seq.to_le_bytes());
        match self.group {
            None => {
                b[..4].copy_from_slice(&MAGIC);
                b[12..].copy_from_slice(&self.op.encode());
            }
            Some(g) => {
                b[..4].copy_from_slice(&GROUP_MAGIC);
                b[12..16].copy_from_slice(&g.calls.to_le_bytes());
                b[16..24].copy_from_slice(&g.digest.to_le_bytes());
            }
        }
        b
    }

    /// Decodes what a peer sent; `None` when it is not a fingerprint at all
    /// (the peer is sending data: it is inside another collective).
    pub(crate) fn decode(b: &[u8]) -> Option<Fingerprint> {
        if b.len() != LEN {
            return None;
        }
        let seq = u64::from_le_bytes(b[4..12].try_into().ok()?);
        if b[..4] == GROUP_MAGIC {
            let calls = u32::from_le_bytes(b[12..16].try_into().ok()?);
            let digest = u64::from_le_bytes(b[16..24].try_into().ok()?);
            return Some(Fingerprint { seq, op: Op::barrier(), group: Some(GroupOf { calls, digest }) });
        }
        if b[..4] != MAGIC {
            return None;
        }
        Some(Fingerprint { seq, op: Op::decode(&b[12..])?, group: None })
    }

    /// Whether it is a point-to-point message (its sequence counts messages
    /// between two ranks, not the communicator's collectives).
    pub(crate) fn is_p2p(&self) -> bool {
        self.op.collective() == Collective::SendRecv
    }

    /// The mismatch message between this rank's call and a peer's (ranks
    /// by job rank), `within` naming the group (see `Label`'s Display).
    pub(crate) fn mismatch(
        &self,
        me: usize,
        peer: usize,
        theirs: Option<&Fingerprint>,
        within: impl fmt::Display,
    ) -> String {
        let theirs = match theirs {
            Some(fp) => fp.to_string(),
            None => "something that is not a collective of this communicator (its bytes are data: it is further \
                     along, or calls a different collective)"
                .to_string(),
        };
        format!(
            "collective mismatch{within}: rank {me} called {self} but rank {peer} called {theirs}; every rank must call \
             the same collectives, in the same order, with the same element type, count, operator and root"
        )
    }
}

impl fmt::Display for Fingerprint {
    /// `all_reduce #7 (f32 × 1024, op sum)`; `group #7 (100 calls, digest
    /// 1f2e…)` for a grouped call.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.group {
            None => write!(f, "{} #{} ({})", self.op.name(), self.seq, self.op.arguments()),
            Some(g) => write!(f, "group #{} ({} calls, digest {:016x})", self.seq, g.calls, g.digest),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{DType, ReduceOp};

    #[test]
    fn round_trip_and_message() {
        let fp = Fingerprint::of(7, Op::reduce(DType::BF16, ReduceOp::Max, 3, 1 << 40));
        assert_eq!(Fingerprint::decode(&fp.encode()), Some(fp));
        assert_eq!(fp.to_string(), "reduce #7 (bf16 × 1099511627776, op max, root 3)");
        let other = Fingerprint { op: Op::broadcast(DType::BF16, 3, 1 << 40), ..fp };
        let msg = fp.mismatch(1, 0, Some(&other), "");
        assert!(msg.contains("rank 1 called reduce #7") && msg.contains("rank 0 called broadcast #7"), "{msg}");
        assert_eq!(Fingerprint::decode(&[0u8; LEN]), None);
        let ops = [Op::reduce(DType::F32, ReduceOp::Sum, 0, 8), Op::broadcast(DType::F32, 0, 8)];
        let group = Fingerprint::of_group(7, &ops);
        assert_eq!(Fingerprint::decode(&group.encode()), Some(group));
        assert_ne!(group, Fingerprint::of_group(7, &ops[..1]));
        assert_ne!(group, Fingerprint::of_group(7, &[ops[1], ops[0]]));
        let msg = group.mismatch(0, 1, Some(&fp), "");
        assert!(msg.contains("rank 0 called group #7 (2 calls") && msg.contains("rank 1 called reduce #7"), "{msg}");
    }
}
