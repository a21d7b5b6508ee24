//! [`Fnv1a`]: a 64-bit digest that every rank, machine and build computes
//! alike (unlike std's hasher), for values ranks compare or derive from the
//! same input: call fingerprints, group lists, parameter names, ports.

/// FNV-1a over bytes fed in order.
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    /// The digest of `bytes` alone.
    pub fn of(bytes: impl IntoIterator<Item = u8>) -> u64 {
        Fnv1a::default().write(bytes).finish()
    }

    /// Feeds `bytes`.
    pub fn write(mut self, bytes: impl IntoIterator<Item = u8>) -> Self {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    /// The digest so far.
    pub fn finish(self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::Fnv1a;

    #[test]
    fn matches_the_published_fnv1a_vectors() {
        assert_eq!(Fnv1a::of(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(Fnv1a::of(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(Fnv1a::of(*b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(Fnv1a::default().write(*b"foo").write(*b"bar").finish(), Fnv1a::of(*b"foobar"));
    }
}
