//! How parameters are laid out in gradient buckets: PyTorch DDP's order
//! (buckets filled from the last parameter back, since backward produces
//! the last layer's gradients first), a small first bucket so the first
//! all-reduce starts early, a cap on the rest.

/// Elements each parameter's place in a bucket is rounded up to: 64 floats
/// (256 bytes), the largest storage-binding alignment wgpu asks for, so a
/// gradient's slice of its bucket can be bound on its own on every backend.
/// The padding stays zero and averages to zero.
pub const ALIGN_ELEMS: usize = 64;

/// Where one parameter's gradient lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub bucket: usize,
    /// First element in the bucket.
    pub offset: usize,
    pub len: usize,
}

/// One bucket: the parameters it holds (in the order backward fills them)
/// and its length in elements (padded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    pub params: Vec<usize>,
    pub len: usize,
}

/// Assigns `lens` (elements of each parameter, registration order) to
/// buckets of f32 gradients by PyTorch DDP's rule: from the last parameter
/// back, parameters are added to a bucket until it holds at least its cap,
/// then the bucket is closed (its last parameter may take it past the cap;
/// a parameter larger than the cap closes a bucket by itself). The first
/// bucket's cap is `first_cap_bytes`, every later one's `cap_bytes`.
pub fn plan(lens: &[usize], first_cap_bytes: usize, cap_bytes: usize) -> (Vec<BucketPlan>, Vec<Place>) {
    let mut places = vec![Place { bucket: 0, offset: 0, len: 0 }; lens.len()];
    let mut buckets: Vec<BucketPlan> = Vec::new();
    let mut current = BucketPlan { params: Vec::new(), len: 0 };
    for index in (0..lens.len()).rev() {
        places[index] = Place { bucket: buckets.len(), offset: current.len, len: lens[index] };
        current.params.push(index);
        current.len += lens[index].next_multiple_of(ALIGN_ELEMS);
        let cap = if buckets.is_empty() { first_cap_bytes } else { cap_bytes };
        if current.len * 4 >= cap {
            buckets.push(std::mem::replace(&mut current, BucketPlan { params: Vec::new(), len: 0 }));
        }
    }
    if !current.params.is_empty() {
        buckets.push(current);
    }
    (buckets, places)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_from_the_last_parameter_with_a_small_first_one() {
        // 4 parameters of 1000 floats (4000 bytes, padded to 1024 floats).
        let (buckets, places) = plan(&[1000; 4], 4096, 3 * 4096);
        assert_eq!(buckets.len(), 2);
        assert_eq!(buckets[0].params, [3]);
        assert_eq!(buckets[1].params, [2, 1, 0]);
        assert_eq!(buckets[1].len, 3 * 1024);
        assert_eq!(places[1], Place { bucket: 1, offset: 1024, len: 1000 });
        assert!(places.iter().all(|p| p.offset % ALIGN_ELEMS == 0));
    }

    #[test]
    fn a_parameter_larger_than_the_cap_closes_its_bucket() {
        let (buckets, _) = plan(&[10, 1 << 20, 10], 1 << 20, 1 << 10);
        assert_eq!(buckets.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), [vec![2, 1], vec![0]]);
        let (buckets, _) = plan(&[10, 1 << 20, 10], 100, 100);
        assert_eq!(buckets.len(), 3);
        // A weight and its bias (registered weight first) share a bucket.
        let (buckets, _) = plan(&[1 << 20, 10, 1 << 20, 10], 1 << 20, 25 << 20);
        assert_eq!(buckets.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), [vec![3, 2], vec![1, 0]]);
    }
}
