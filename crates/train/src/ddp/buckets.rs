//! How parameters are laid out in gradient buckets: PyTorch DDP's order
//! (buckets filled from the last parameter back, since backward produces
//! the last layer's gradients first), a small first bucket so the first
//! all-reduce starts early, a cap on the rest; and, where parameters may be
//! split ([`DdpOptions::split_parameters`](super::DdpOptions::split_parameters)),
//! a parameter larger than the cap cut into equal pieces of whole rows
//! (element ranges, as ZeRO/FSDP flat buffers are cut), each piece a
//! bucket, so no bucket is larger than the cap by a whole parameter.

use std::ops::Range;

/// Elements each parameter's place in a bucket is rounded up to: 64 floats
/// (256 bytes), the largest storage-binding alignment wgpu asks for, so a
/// gradient's slice of its bucket can be bound on its own on every backend.
/// The padding stays zero and averages to zero.
pub const ALIGN_ELEMS: usize = 64;

/// Rows (entries of a parameter's first dimension) a piece of a split
/// parameter holds a multiple of: every piece then starts at a multiple of
/// [`ALIGN_ELEMS`] elements, in its bucket and in its parameter, whatever
/// the row's length, and a model's row chunk of any operand with that many
/// rows starts on an aligned element too.
pub const SPLIT_ROWS: usize = ALIGN_ELEMS;

/// Where one piece of a parameter's gradient lives: elements
/// `start..start + len` of the parameter at `offset` in bucket `bucket`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub bucket: usize,
    /// First element in the bucket.
    pub offset: usize,
    /// First element of the parameter this piece holds.
    pub start: usize,
    pub len: usize,
}

impl Place {
    /// The parameter's elements this piece holds.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }
}

/// One bucket: the pieces it holds (`(parameter, piece of that parameter)`,
/// in the order backward fills them) and its length in elements (padded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    pub pieces: Vec<(usize, usize)>,
    pub len: usize,
}

impl BucketPlan {
    /// The parameters with a piece in this bucket, in fill order.
    pub fn params(&self) -> Vec<usize> {
        let mut params: Vec<usize> = self.pieces.iter().map(|&(p, _)| p).collect();
        params.dedup();
        params
    }
}

/// Elements a piece boundary of a parameter of `shape` must be a multiple
/// of when parameters are split: [`SPLIT_ROWS`] rows of its first
/// dimension. A scalar (no dimensions) is one indivisible piece.
pub fn split_granule(shape: &[usize]) -> usize {
    let numel: usize = shape.iter().product();
    match shape.first() {
        Some(&rows) if rows > 0 => SPLIT_ROWS * (numel / rows),
        _ => numel.max(1),
    }
}

/// Assigns `lens` (elements of each parameter, registration order) to
/// buckets of f32 gradients, from the last parameter back. The first
/// bucket's cap is `first_cap_bytes`, every later one's `cap_bytes`.
///
/// PyTorch DDP's rule: a parameter is added whole, and the bucket is closed
/// once it holds at least its cap (so a parameter larger than the cap makes
/// a bucket larger than the cap). A parameter larger than `cap_bytes` whose
/// `granules` entry is smaller than its length is cut instead: into the
/// fewest pieces, a power of two of them, of at most `cap_bytes` each
/// (rounded up to whole granules; the last piece takes the rest), each
/// piece closing its bucket. Equal pieces keep the products that compute
/// them efficient: a power of two of them divides a layer's rows evenly,
/// and a GEMM on a fraction of a power-of-two row count fills the GPU's
/// waves about as well as the whole one (slivers of a few rows would
/// not). Pieces of a parameter are in element order; a parameter's last
/// piece is padded to [`ALIGN_ELEMS`]. The result depends only on the
/// arguments (every rank computes the same layout).
///
/// Returns the buckets and, per parameter, its pieces in element order.
pub fn plan(
    lens: &[usize],
    granules: &[usize],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> (Vec<BucketPlan>, Vec<Vec<Place>>) {
    assert_eq!(lens.len(), granules.len(), "plan: one granule per parameter");
    let mut places: Vec<Vec<Place>> = vec![Vec::new(); lens.len()];
    let mut buckets: Vec<BucketPlan> = Vec::new();
    let mut current = BucketPlan { pieces: Vec::new(), len: 0 };
    for index in (0..lens.len()).rev() {
        let (len, granule) = (lens[index], granules[index].max(1));
        let split = granule < len && len.saturating_mul(4) > cap_bytes;
        let piece = if split {
            let pieces = len.saturating_mul(4).div_ceil(cap_bytes.max(1)).next_power_of_two();
            len.div_ceil(granule).div_ceil(pieces) * granule
        } else {
            len
        };
        let mut start = 0;
        loop {
            let take = piece.min(len - start);
            current.pieces.push((index, places[index].len()));
            places[index].push(Place { bucket: buckets.len(), offset: current.len, start, len: take });
            start += take;
            current.len += if start == len { take.next_multiple_of(ALIGN_ELEMS) } else { take };
            let cap = if buckets.is_empty() { first_cap_bytes } else { cap_bytes };
            if split || current.len * 4 >= cap {
                buckets.push(std::mem::replace(&mut current, BucketPlan { pieces: Vec::new(), len: 0 }));
            }
            if start >= len {
                break;
            }
        }
    }
    if !current.pieces.is_empty() {
        buckets.push(current);
    }
    (buckets, places)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(lens: &[usize], first: usize, cap: usize) -> (Vec<BucketPlan>, Vec<Vec<Place>>) {
        plan(lens, lens, first, cap)
    }

    fn params(buckets: &[BucketPlan]) -> Vec<Vec<usize>> {
        buckets.iter().map(BucketPlan::params).collect()
    }

    #[test]
    fn buckets_fill_from_the_last_parameter_with_a_small_first_one() {
        // 4 parameters of 1000 floats (4000 bytes, padded to 1024 floats).
        let (buckets, places) = whole(&[1000; 4], 4096, 3 * 4096);
        assert_eq!(params(&buckets), [vec![3], vec![2, 1, 0]]);
        assert_eq!(buckets[1].len, 3 * 1024);
        assert_eq!(places[1], [Place { bucket: 1, offset: 1024, start: 0, len: 1000 }]);
        assert!(places.iter().flatten().all(|p| p.offset % ALIGN_ELEMS == 0));
    }

    #[test]
    fn a_parameter_larger_than_the_cap_closes_its_bucket() {
        let (buckets, _) = whole(&[10, 1 << 20, 10], 1 << 20, 1 << 10);
        assert_eq!(params(&buckets), [vec![2, 1], vec![0]]);
        let (buckets, _) = whole(&[10, 1 << 20, 10], 100, 100);
        assert_eq!(buckets.len(), 3);
        // A weight and its bias (registered weight first) share a bucket.
        let (buckets, _) = whole(&[1 << 20, 10, 1 << 20, 10], 1 << 20, 25 << 20);
        assert_eq!(params(&buckets), [vec![3, 2], vec![1, 0]]);
    }

    /// Every element of every parameter is in exactly one piece, pieces in
    /// element order, no two pieces overlap in a bucket, all aligned.
    fn check_cover(lens: &[usize], granules: &[usize], buckets: &[BucketPlan], places: &[Vec<Place>]) {
        for (i, pieces) in places.iter().enumerate() {
            let mut next = 0;
            for (k, p) in pieces.iter().enumerate() {
                assert_eq!(p.start, next, "parameter {i} piece {k} starts where the last ended");
                assert!(k + 1 == pieces.len() || p.len % granules[i] == 0, "inner pieces are whole granules");
                assert_eq!(p.offset % ALIGN_ELEMS, 0);
                assert!(buckets[p.bucket].pieces.contains(&(i, k)));
                next += p.len;
            }
            assert_eq!(next, lens[i], "parameter {i} is covered");
        }
        for (b, bucket) in buckets.iter().enumerate() {
            let mut end = 0;
            for &(i, k) in &bucket.pieces {
                let p = places[i][k];
                assert_eq!((p.bucket, p.offset), (b, end), "pieces are packed in fill order");
                end = p.offset + if p.start + p.len == lens[i] { p.len.next_multiple_of(ALIGN_ELEMS) } else { p.len };
            }
            assert_eq!(end, bucket.len);
        }
    }

    #[test]
    fn split_parameters_make_equal_pieces_each_closing_a_bucket() {
        // The large MLP: 8 × (4096² weight, 4096 bias), caps 1 and 25 MiB.
        let (w, depth) = (4096, 8);
        let lens: Vec<usize> = (0..2 * depth).map(|i| if i % 2 == 0 { w * w } else { w }).collect();
        let granules: Vec<usize> = (0..2 * depth).map(|i| if i % 2 == 0 { 64 * w } else { 64 }).collect();
        let (buckets, places) = plan(&lens, &granules, 1 << 20, 25 << 20);
        check_cover(&lens, &granules, &buckets, &places);
        // 64 MiB over 25: 3 pieces, rounded up to 4 of 1024 rows (16 MiB).
        assert!(places.iter().step_by(2).all(|p| p.len() == 4 && p.iter().all(|p| p.len == 1024 * w)));
        assert!(places.iter().skip(1).step_by(2).all(|p| p.len() == 1), "biases stay whole");
        assert_eq!(buckets.len(), 32);
        // Each layer's bias goes with its weight's first piece.
        assert_eq!(buckets[0].pieces, [(15, 0), (14, 0)]);
        assert_eq!(buckets[0].len, 1024 * w + w);
        assert!(buckets[1..].iter().all(|b| b.len == 1024 * w || b.len == 1024 * w + w));
        // The last bucket: the last quarter of weight 0, nothing else.
        assert_eq!(buckets.last().unwrap().pieces, [(0, 3)]);
        // A cap of 8 MiB: 8 pieces of 512 rows.
        let (buckets, places) = plan(&lens, &granules, 1 << 20, 8 << 20);
        check_cover(&lens, &granules, &buckets, &places);
        assert!(places[0].iter().all(|p| p.len == 512 * w) && places[0].len() == 8);
        assert_eq!(buckets.len(), 64);
        // Rows that do not divide evenly (1000 rows, a cap of 100 rows: 16
        // pieces of 64 rows, the granule): the last piece takes the rest.
        let (_, places) = plan(&[1000 * 64], &[64 * 64], 1 << 20, 100 * 64 * 4);
        let rows: Vec<usize> = places[0].iter().map(|p| p.len / 64).collect();
        assert_eq!(rows.len(), 16);
        assert!(rows[..15].iter().all(|&r| r == 64) && rows[15] == 40, "{rows:?}");
        // 1000 rows, a cap of 300 rows: 4 pieces of 256 rows (4 granules).
        let (_, places) = plan(&[1000 * 64], &[64 * 64], 1 << 20, 300 * 64 * 4);
        assert_eq!(places[0].iter().map(|p| p.len / 64).collect::<Vec<_>>(), [256, 256, 256, 232]);
    }

    #[test]
    fn a_cap_of_one_element_makes_one_granule_per_bucket() {
        let lens = [256 * 8, 256];
        let granules = [64 * 8, 64];
        let (buckets, places) = plan(&lens, &granules, 4, 4);
        check_cover(&lens, &granules, &buckets, &places);
        assert_eq!(places[0].len(), 4);
        assert_eq!(places[1].len(), 4);
        assert_eq!(buckets.len(), 8);
        // Unsplittable parameters: one bucket each, as PyTorch's rule gives.
        let (buckets, _) = whole(&lens, 1, 1);
        assert_eq!(buckets.len(), 2);
    }

    #[test]
    fn granules_follow_the_first_dimension() {
        assert_eq!(split_granule(&[4096, 4096]), 64 * 4096);
        assert_eq!(split_granule(&[10]), 64);
        assert_eq!(split_granule(&[]), 1);
        assert_eq!(split_granule(&[0, 5]), 1);
    }
}
