//! What each rank says it is calling: a collective's fingerprint.
//!
//! Every collective of a communicator gets the next sequence number, and its
//! fingerprint (sequence number and the call's [`Op`]: kind, reduction,
//! element type, element count, root) travels to the ring successor before
//! any data; a successor whose own fingerprint differs stops with an error
//! naming both sides. The
//! check costs one 32-byte message per rank and collective (one extra hop of
//! latency: a few microseconds over shared memory, one round trip on TCP).

use std::fmt;

use crate::op::{Collective, Op};

/// Bytes of an encoded fingerprint.
pub(crate) const LEN: usize = 32;

const MAGIC: [u8; 4] = *b"COHF";

/// One call's identity, as every rank must agree on it: its sequence number
/// and its description. A send/recv's sequence number counts messages from
/// the sender to the receiver; its description names both ranks, so the
/// two sides' fingerprints are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    pub seq: u64,
    pub op: Op,
}

impl Fingerprint {
    pub(crate) fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..12].copy_from_slice(&self.seq.to_le_bytes());
        b[12..].copy_from_slice(&self.op.encode());
        b
    }

    /// Decodes what a peer sent; `None` when it is not a fingerprint at all
    /// (the peer is sending data: it is inside another collective).
    pub(crate) fn decode(b: &[u8]) -> Option<Fingerprint> {
        if b.len() != LEN || b[..4] != MAGIC {
            return None;
        }
        Some(Fingerprint { seq: u64::from_le_bytes(b[4..12].try_into().ok()?), op: Op::decode(&b[12..])? })
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
    /// `all_reduce #7 (f32 × 1024, op sum)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{} ({})", self.op.name(), self.seq, self.op.arguments())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{DType, ReduceOp};

    #[test]
    fn round_trip_and_message() {
        let fp = Fingerprint { seq: 7, op: Op::reduce(DType::BF16, ReduceOp::Max, 3, 1 << 40) };
        assert_eq!(Fingerprint::decode(&fp.encode()), Some(fp));
        assert_eq!(fp.to_string(), "reduce #7 (bf16 × 1099511627776, op max, root 3)");
        let other = Fingerprint { op: Op::broadcast(DType::BF16, 3, 1 << 40), ..fp };
        let msg = fp.mismatch(1, 0, Some(&other), "");
        assert!(msg.contains("rank 1 called reduce #7") && msg.contains("rank 0 called broadcast #7"), "{msg}");
        assert_eq!(Fingerprint::decode(&[0u8; LEN]), None);
    }
}
