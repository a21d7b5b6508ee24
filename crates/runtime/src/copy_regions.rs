//! Batched copies: many (source range, destination range) pairs between a
//! task's buffers, queued as one device operation
//! ([`BufferAccess::copy_regions`](crate::BufferAccess::copy_regions)).
//! The communication layer packs a grouped call's small all-reduces into
//! one buffer with it, and unpacks the reduced buffer the same way.
//!
//! CUDA runs one gather kernel per 128 regions (their addresses and sizes
//! travel as the kernel's argument, so nothing is uploaded first and a
//! captured graph replays it); the CPU copies region by region on the
//! device thread; wgpu records one buffer copy per region into the
//! stream's current command encoder.

use crate::backend::Binding;
use crate::error::ServerError;

/// One copy of a batch: `bytes` bytes from buffer `src` (an index into the
/// task's buffers, inputs then outputs) at byte `src_offset` to buffer
/// `dst` at byte `dst_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRegion {
    pub src: usize,
    pub src_offset: u64,
    pub dst: usize,
    pub dst_offset: u64,
    pub bytes: u64,
}

/// Checks `regions` against the task's `bindings` and resolves each to a
/// (source, destination) pair of equal sizes, leaving out empty ones.
/// Refuses (naming the region) an index past the buffers, a range past its
/// buffer's end, and a destination that overlaps another region's source
/// or destination: the regions of a batch are copied concurrently.
pub(crate) fn resolve(bindings: &[Binding], regions: &[CopyRegion]) -> Result<Vec<(Binding, Binding)>, ServerError> {
    let range = |k: usize, what: &str, index: usize, offset: u64, bytes: u64| -> Result<Binding, ServerError> {
        let b = bindings.get(index).ok_or_else(|| {
            ServerError::InvalidArgument(format!(
                "copy region {k}: {what} buffer {index} does not exist (the task has {} buffers)",
                bindings.len()
            ))
        })?;
        match offset.checked_add(bytes) {
            Some(end) if end <= b.size => Ok(Binding { page: b.page, offset: b.offset + offset, size: bytes }),
            _ => Err(ServerError::InvalidArgument(format!(
                "copy region {k}: {bytes} bytes at offset {offset} run past the end of {what} buffer {index} ({} bytes)",
                b.size
            ))),
        }
    };
    let mut pairs = Vec::with_capacity(regions.len());
    for (k, r) in regions.iter().enumerate() {
        let src = range(k, "source", r.src, r.src_offset, r.bytes)?;
        let dst = range(k, "destination", r.dst, r.dst_offset, r.bytes)?;
        if r.bytes > 0 {
            pairs.push((k, src, dst));
        }
    }
    // Every range as (page, start, end, region, writes), swept in start
    // order: only ranges that overlap are ever compared.
    let mut spans: Vec<(u64, u64, u64, usize, bool)> = Vec::with_capacity(2 * pairs.len());
    for &(k, src, dst) in &pairs {
        spans.push((src.page.0, src.offset, src.offset + src.size, k, false));
        spans.push((dst.page.0, dst.offset, dst.offset + dst.size, k, true));
    }
    spans.sort_unstable_by_key(|s| (s.0, s.1));
    let mut active: Vec<(u64, u64, u64, usize, bool)> = Vec::new();
    for span in spans {
        active.retain(|a| a.0 == span.0 && a.2 > span.1);
        if let Some(a) = active.iter().find(|a| a.4 || span.4) {
            let (first, second) = (a.3.min(span.3), a.3.max(span.3));
            return Err(ServerError::InvalidArgument(if first == second {
                format!("copy region {first}: its source and destination overlap")
            } else {
                format!("copy regions {first} and {second} overlap where one of them writes")
            }));
        }
        active.push(span);
    }
    Ok(pairs.into_iter().map(|(_, src, dst)| (src, dst)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::PageId;

    fn b(page: u64, offset: u64, size: u64) -> Binding {
        Binding { page: PageId(page), offset, size }
    }

    fn region(src: usize, src_offset: u64, dst: usize, dst_offset: u64, bytes: u64) -> CopyRegion {
        CopyRegion { src, src_offset, dst, dst_offset, bytes }
    }

    #[test]
    fn resolves_ranges_inside_their_buffers_and_drops_empty_ones() {
        let bindings = [b(1, 256, 12), b(2, 0, 64)];
        let pairs = resolve(&bindings, &[region(0, 4, 1, 16, 8), region(0, 0, 1, 0, 0)]).unwrap();
        assert_eq!(pairs, vec![(b(1, 260, 8), b(2, 16, 8))]);
    }

    #[test]
    fn refuses_indices_and_ranges_past_the_buffers() {
        let bindings = [b(1, 0, 12), b(2, 0, 64)];
        let err = resolve(&bindings, &[region(0, 0, 2, 0, 4)]).unwrap_err().to_string();
        assert!(err.contains("destination buffer 2 does not exist"), "{err}");
        let err = resolve(&bindings, &[region(0, 0, 1, 0, 4), region(0, 8, 1, 8, 5)]).unwrap_err().to_string();
        assert!(err.contains("copy region 1") && err.contains("source buffer 0 (12 bytes)"), "{err}");
        let err = resolve(&bindings, &[region(0, u64::MAX, 1, 0, 2)]).unwrap_err().to_string();
        assert!(err.contains("run past the end"), "{err}");
    }

    #[test]
    fn refuses_destinations_that_overlap() {
        let bindings = [b(1, 0, 64), b(2, 0, 64)];
        // Two writes into one range.
        let err = resolve(&bindings, &[region(0, 0, 1, 0, 8), region(0, 8, 1, 4, 8)]).unwrap_err().to_string();
        assert!(err.contains("copy regions 0 and 1 overlap"), "{err}");
        // A write into another region's source.
        let err = resolve(&bindings, &[region(0, 0, 1, 0, 8), region(1, 4, 0, 32, 4)]).unwrap_err().to_string();
        assert!(err.contains("copy regions 0 and 1 overlap"), "{err}");
        // A region onto itself.
        let err = resolve(&bindings, &[region(0, 0, 0, 4, 8)]).unwrap_err().to_string();
        assert!(err.contains("copy region 0: its source and destination overlap"), "{err}");
        // Reads may share bytes.
        assert_eq!(resolve(&bindings, &[region(0, 0, 1, 0, 8), region(0, 0, 1, 8, 8)]).unwrap().len(), 2);
    }
}
