//! Pages carved into variable-size slices: the engine under sliced and
//! adaptive pools.
//!
//! Each page keeps its slots in a slab linked in offset order, covering the
//! page without gaps or overlap, plus a list of free slots and a list of used
//! ones. Taking a slot splits a free one; freeing merges it with free
//! neighbours; both are O(1). A used slot is free once its bookkeeping `Arc`
//! is the only one left; [`CarvedPages`] finds such slots through a small ring
//! of recently handed-out slots (O(1), catches reserve/drop churn) and, when
//! that and the free lists fail, by sweeping every used slot (O(used)).
//! Freed `Arc`s are kept as spares, so steady-state reservations allocate
//! nothing on the host.

use std::sync::Arc;

use super::{fill_arc, live_size, PageId, PageStorage, SliceHandle, SliceInner};

const NIL: u32 = u32::MAX;
/// Recently handed-out slots checked before the free lists.
const RECENT: usize = 8;
/// Most spare `Arc`s kept per page set.
const MAX_SPARES: usize = 4096;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SlotState {
    Free,
    Used,
    /// Merged away; its index waits in `dead` for reuse.
    Dead,
}

#[derive(Debug)]
struct Slot {
    offset: u64,
    len: u64,
    prev: u32,
    next: u32,
    state: SlotState,
    /// Position in the page's `free` or `used` list.
    pos: u32,
    handle: Option<Arc<SliceInner>>,
}

/// One page and its slots. Slot 0 is always the slot at offset 0.
#[derive(Debug)]
pub(crate) struct CarvedPage {
    pub(crate) id: PageId,
    pub(crate) size: u64,
    slots: Vec<Slot>,
    dead: Vec<u32>,
    free: Vec<u32>,
    used: Vec<u32>,
    /// Reservation tick of the last slot taken from this page.
    pub(crate) last_used: u64,
}

impl CarvedPage {
    fn new(id: PageId, size: u64, tick: u64) -> Self {
        let whole = Slot { offset: 0, len: size, prev: NIL, next: NIL, state: SlotState::Free, pos: 0, handle: None };
        Self { id, size, slots: vec![whole], dead: Vec::new(), free: vec![0], used: Vec::new(), last_used: tick }
    }

    /// First free slot of at least `padded` bytes. O(free slots).
    fn find_fit(&self, padded: u64) -> Option<u32> {
        self.free.iter().copied().find(|&i| self.slots[i as usize].len >= padded)
    }

    fn list_remove(&mut self, i: u32) {
        let (state, pos) = (self.slots[i as usize].state, self.slots[i as usize].pos as usize);
        let list = match state {
            SlotState::Free => &mut self.free,
            SlotState::Used => &mut self.used,
            SlotState::Dead => unreachable!("dead slots are in no list"),
        };
        list.swap_remove(pos);
        if let Some(&moved) = list.get(pos) {
            self.slots[moved as usize].pos = pos as u32;
        }
    }

    fn list_push(&mut self, i: u32, state: SlotState) {
        let list = match state {
            SlotState::Free => &mut self.free,
            SlotState::Used => &mut self.used,
            SlotState::Dead => unreachable!("dead slots are in no list"),
        };
        let slot = &mut self.slots[i as usize];
        slot.state = state;
        slot.pos = list.len() as u32;
        list.push(i);
    }

    fn new_slot(&mut self, slot: Slot) -> u32 {
        match self.dead.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Unlinks `k` from the offset chain and retires its index.
    fn kill(&mut self, k: u32) {
        let (prev, next) = (self.slots[k as usize].prev, self.slots[k as usize].next);
        if prev != NIL {
            self.slots[prev as usize].next = next;
        }
        if next != NIL {
            self.slots[next as usize].prev = prev;
        }
        let slot = &mut self.slots[k as usize];
        slot.state = SlotState::Dead;
        slot.handle = None;
        self.dead.push(k);
    }

    /// Takes `padded` bytes at the start of free slot `i`, splitting off the
    /// rest as a new free slot. O(1); allocation-free with a spare `Arc`.
    fn take(&mut self, i: u32, padded: u64, size: u64, spare: Option<Arc<SliceInner>>) -> SliceHandle {
        debug_assert_eq!(self.slots[i as usize].state, SlotState::Free);
        debug_assert!(self.slots[i as usize].len >= padded);
        self.list_remove(i);
        let (offset, len, next) = {
            let s = &self.slots[i as usize];
            (s.offset, s.len, s.next)
        };
        if len > padded {
            let rest = Slot {
                offset: offset + padded,
                len: len - padded,
                prev: i,
                next,
                state: SlotState::Free,
                pos: 0,
                handle: None,
            };
            let j = self.new_slot(rest);
            if next != NIL {
                self.slots[next as usize].prev = j;
            }
            self.slots[i as usize].next = j;
            self.slots[i as usize].len = padded;
            self.list_push(j, SlotState::Free);
        }
        let arc = fill_arc(spare, self.id, offset, size);
        let handle = SliceHandle::from_arc(&arc);
        self.slots[i as usize].handle = Some(arc);
        self.list_push(i, SlotState::Used);
        handle
    }

    /// Whether used slot `i` is held only by the pool.
    fn is_releasable(&self, i: u32) -> bool {
        let slot = &self.slots[i as usize];
        slot.state == SlotState::Used && slot.handle.as_ref().is_some_and(|a| Arc::strong_count(a) == 1)
    }

    /// Frees used slot `i` (which nothing else holds), merging it with free
    /// neighbours; returns the index of the resulting free slot. O(1).
    fn release(&mut self, i: u32, spares: &mut Vec<Arc<SliceInner>>) -> u32 {
        self.list_remove(i);
        if let Some(arc) = self.slots[i as usize].handle.take() {
            if spares.len() < MAX_SPARES {
                spares.push(arc);
            }
        }
        let next = self.slots[i as usize].next;
        if next != NIL && self.slots[next as usize].state == SlotState::Free {
            self.list_remove(next);
            self.slots[i as usize].len += self.slots[next as usize].len;
            self.kill(next);
        }
        let prev = self.slots[i as usize].prev;
        if prev != NIL && self.slots[prev as usize].state == SlotState::Free {
            self.slots[prev as usize].len += self.slots[i as usize].len;
            self.kill(i);
            return prev;
        }
        self.list_push(i, SlotState::Free);
        i
    }

    /// Frees every slot nothing holds any more. O(used slots).
    fn sweep(&mut self, spares: &mut Vec<Arc<SliceInner>>) {
        let mut k = 0;
        while k < self.used.len() {
            let i = self.used[k];
            if self.is_releasable(i) {
                self.release(i, spares); // moves the last used slot into position k
            } else {
                k += 1;
            }
        }
    }

    /// Live slices and their requested bytes. O(used slots).
    fn live(&self) -> (u64, u64) {
        let mut count = 0;
        let mut bytes = 0;
        for &i in &self.used {
            if let Some(size) = self.slots[i as usize].handle.as_ref().and_then(live_size) {
                count += 1;
                bytes += size;
            }
        }
        (count, bytes)
    }

    fn has_live(&self) -> bool {
        self.used.iter().any(|&i| !self.is_releasable(i))
    }

    /// The slots in offset order as `(offset, len, used)`, for tests.
    #[cfg(test)]
    pub(crate) fn layout(&self) -> Vec<(u64, u64, bool)> {
        let mut out = Vec::new();
        let mut i = 0u32;
        while i != NIL {
            let s = &self.slots[i as usize];
            out.push((s.offset, s.len, s.state == SlotState::Used));
            i = s.next;
        }
        out
    }
}

/// A set of carved pages with its spare `Arc`s and recent-slot ring.
#[derive(Debug, Default)]
pub(crate) struct CarvedPages {
    pub(crate) pages: Vec<CarvedPage>,
    spares: Vec<Arc<SliceInner>>,
    /// `(page index, slot index)` of recently handed-out slots.
    recent: [(u32, u32); RECENT],
    recent_next: usize,
}

impl CarvedPages {
    pub(crate) fn new() -> Self {
        Self { recent: [(NIL, NIL); RECENT], ..Self::default() }
    }

    fn remember(&mut self, page: usize, slot: u32) {
        self.recent[self.recent_next] = (page as u32, slot);
        self.recent_next = (self.recent_next + 1) % RECENT;
    }

    fn take_in(&mut self, p: usize, i: u32, padded: u64, size: u64, tick: u64) -> SliceHandle {
        let spare = self.spares.pop();
        let page = &mut self.pages[p];
        page.last_used = tick;
        let handle = page.take(i, padded, size, spare);
        self.remember(p, i);
        handle
    }

    /// Serves `padded` bytes from an existing page without sweeping: first a
    /// recently handed-out slot that was dropped, then the free lists.
    /// O(RECENT + free slots); `None` when nothing known to be free fits.
    pub(crate) fn try_reserve(&mut self, padded: u64, size: u64, tick: u64) -> Option<SliceHandle> {
        for back in 1..=RECENT {
            let (p, i) = self.recent[(self.recent_next + RECENT - back) % RECENT];
            let Some(page) = self.pages.get_mut(p as usize) else { continue };
            if (i as usize) < page.slots.len() && page.is_releasable(i) {
                let r = page.release(i, &mut self.spares);
                if page.slots[r as usize].len >= padded {
                    return Some(self.take_in(p as usize, r, padded, size, tick));
                }
            }
        }
        for p in 0..self.pages.len() {
            if let Some(i) = self.pages[p].find_fit(padded) {
                return Some(self.take_in(p, i, padded, size, tick));
            }
        }
        None
    }

    /// Frees every slot nothing holds, in every page. O(used slots).
    pub(crate) fn sweep(&mut self) {
        for page in &mut self.pages {
            page.sweep(&mut self.spares);
        }
    }

    /// Adds a freshly allocated page and serves `padded` bytes from its start.
    pub(crate) fn add_page_and_take(
        &mut self,
        id: PageId,
        page_size: u64,
        padded: u64,
        size: u64,
        tick: u64,
    ) -> SliceHandle {
        debug_assert!(padded <= page_size);
        self.pages.push(CarvedPage::new(id, page_size, tick));
        let p = self.pages.len() - 1;
        self.take_in(p, 0, padded, size, tick)
    }

    /// Gives back each page for which `due(page)` holds and that is empty
    /// after a sweep of it. Returns the number of pages freed. O(pages + used
    /// slots of the due pages).
    pub(crate) fn free_empty_pages(
        &mut self,
        storage: &mut dyn PageStorage,
        mut due: impl FnMut(&CarvedPage) -> bool,
    ) -> u64 {
        let mut freed = 0;
        let spares = &mut self.spares;
        self.pages.retain_mut(|page| {
            if !due(page) {
                return true;
            }
            page.sweep(spares);
            if page.used.is_empty() {
                storage.free_page(page.id);
                freed += 1;
                false
            } else {
                true
            }
        });
        if freed > 0 {
            // Page indices shifted: forget the ring.
            self.recent = [(NIL, NIL); RECENT];
        }
        freed
    }

    /// Gives back every page, live or not. O(pages).
    pub(crate) fn release_all(&mut self, storage: &mut dyn PageStorage) {
        for page in self.pages.drain(..) {
            storage.free_page(page.id);
        }
        self.recent = [(NIL, NIL); RECENT];
    }

    /// Live slices and their requested bytes. O(used slots).
    pub(crate) fn live(&self) -> (u64, u64) {
        self.pages.iter().map(CarvedPage::live).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Whether any slice is held by a user. O(used slots).
    pub(crate) fn has_live(&self) -> bool {
        self.pages.iter().any(CarvedPage::has_live)
    }

    /// Sum of the page sizes. O(pages).
    pub(crate) fn bytes_reserved(&self) -> u64 {
        self.pages.iter().map(|p| p.size).sum()
    }

    pub(crate) fn page_count(&self) -> u64 {
        self.pages.len() as u64
    }
}
