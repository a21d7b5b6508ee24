//! Fingerprint checks sent ahead: the ring check of a call that is queued
//! without waiting for it.
//!
//! A waited check ([`World::check_fingerprint`]) sends this rank's
//! fingerprint to its ring successor and reads its predecessor's before the
//! call goes on. A check sent ahead ([`World::send_check_ahead`]) puts the
//! same 32 bytes into the same stream to the successor at once (what the
//! link does not take now waits in an outbox), the call is queued, and the
//! predecessor's fingerprint is read later, never waiting: whenever the
//! call's device polls it ([`World::poll_ahead`]; the call is done only
//! once [`World::ahead_done`] says so), and before any later call that uses
//! the links itself ([`World::run`] settles every check first, waiting as a
//! waited check does). The bytes on the links are the same either way, so
//! ranks need not agree on which of their checks were sent ahead.
//!
//! What it changes is when a mismatch is found: after the call was queued,
//! not before. The call then fails with the same message a waited check
//! gives, and the communicator is aborted (which also stops device
//! kernels that a mismatched call left waiting for data).

use std::collections::VecDeque;
use std::time::Instant;

use super::{desync_check, Current, Failure, FailureKind, Fingerprint, World, LEN};
use crate::transport::{RecvOp, SendOp};

/// The checks of this rank's calls that were sent ahead and not yet
/// compared.
#[derive(Default)]
pub(crate) struct Ahead {
    /// Bytes for the ring successor that its link has not taken yet: the
    /// tail of the newest fingerprints.
    outbox: Vec<u8>,
    /// The calls whose fingerprint is (partly) in the outbox, oldest first.
    unsent: VecDeque<u64>,
    /// The part of the predecessor's next fingerprint received so far.
    inbox: [u8; LEN],
    got: usize,
    /// This rank's fingerprints whose predecessor's counterpart has not
    /// been compared, oldest first.
    awaiting: VecDeque<Fingerprint>,
    /// The first check that failed: the call's sequence number and why.
    failed: Option<(u64, Failure)>,
}

impl Ahead {
    fn is_idle(&self) -> bool {
        self.outbox.is_empty() && self.awaiting.is_empty()
    }

    /// Whether call `seq`'s check was compared (or never sent ahead).
    fn checked(&self, seq: u64) -> bool {
        self.awaiting.front().is_none_or(|fp| fp.seq > seq)
    }

    /// Whether the fingerprints of calls up to `seq` left the outbox.
    fn sent_through(&self, seq: u64) -> bool {
        self.unsent.front().is_none_or(|&s| s > seq)
    }

    /// Takes the first `n` bytes out of the outbox (the link took them).
    fn sent(&mut self, n: usize) {
        self.outbox.drain(..n);
        let left = self.outbox.len().div_ceil(LEN);
        while self.unsent.len() > left {
            self.unsent.pop_front();
        }
    }
}

impl World {
    /// Whether a world of `size` ranks may send its checks ahead: of two
    /// ranks only. A rank compares its predecessor's fingerprint alone.
    /// Waited, a rank that finds a mismatch never queues its call, so no
    /// rank's call can complete. Sent ahead, every rank queued before any
    /// compared: with two ranks each compares the other's and both fail the
    /// call, but with three or more a rank whose predecessor agrees would
    /// see its call complete (NCCL checks no types: equal byte counts are
    /// enough) and return wrong bytes while a mismatch is found elsewhere.
    pub(crate) fn sends_checks_ahead(size: usize) -> bool {
        size <= 2
    }

    /// Sends call `fp`'s fingerprint to the ring successor now and leaves
    /// the predecessor's to be compared later (see the module docs), where
    /// [`World::sends_checks_ahead`] allows it. Never waits. Refuses (as [`World::run`] does) once the communicator was
    /// aborted; a check found failed here (this call's or an earlier one's)
    /// aborts it.
    pub(crate) fn send_check_ahead(&mut self, fp: Fingerprint) -> Result<(), Failure> {
        self.refuse_if_aborted(&fp)?;
        if self.size == 1 || self.in_group || !desync_check() {
            return Ok(());
        }
        debug_assert!(!fp.is_p2p(), "a message's check is not sent ahead");
        self.ahead.outbox.extend_from_slice(&fp.encode());
        self.ahead.unsent.push_back(fp.seq);
        self.ahead.awaiting.push_back(fp);
        // A failure is kept for the call it belongs to (and aborts).
        let _ = self.move_ahead();
        self.ahead_outcome(fp.seq).map(|_| ())
    }

    /// Where call `seq`'s check sent ahead stands, after moving what the
    /// links move without waiting: `Ok(true)` compared and equal (or never
    /// sent ahead), `Ok(false)` not yet, or why it failed (this call's
    /// mismatch, or the abort of the communicator by another failure).
    pub(crate) fn poll_ahead(&mut self, seq: u64) -> Result<bool, Failure> {
        if self.aborted.is_none() && !self.ahead.is_idle() {
            // A failure is kept in `ahead.failed` (and aborts), read below.
            let _ = self.move_ahead();
        }
        self.ahead_outcome(seq)
    }

    /// Whether call `seq` is done with its check sent ahead: compared, and
    /// this rank's fingerprint handed to the link (the successor awaits it
    /// even if this rank never calls again), or nothing moves any more (the
    /// communicator was aborted: a call compared equal stands, its data is
    /// right, and the successor's fails). Never waits.
    pub(crate) fn ahead_done(&mut self, seq: u64) -> Result<bool, Failure> {
        Ok(self.poll_ahead(seq)? && (self.ahead.sent_through(seq) || self.aborted.is_some()))
    }

    /// Sends the whole outbox and compares every awaited fingerprint,
    /// waiting under a deadline of the world's timeout (a timeout names
    /// the oldest call not compared, or call `next` when only the outbox is
    /// left, and the ranks that never arrived there); the caller aborts on
    /// failure. Called before every call `next` that uses the links itself.
    pub(super) fn settle_ahead(&mut self, next: Fingerprint) -> Result<(), Failure> {
        if self.ahead.is_idle() {
            return Ok(());
        }
        if let Some((_, failure)) = &self.ahead.failed {
            return Err(failure.clone());
        }
        let owed = self.ahead.awaiting.len();
        // Only the oldest awaited fingerprint can be partly received.
        let mut received = vec![0u8; (owed * LEN).saturating_sub(self.ahead.got)];
        // Sent below, or lost with the abort that follows a failure.
        let outbox = std::mem::take(&mut self.ahead.outbox);
        self.ahead.unsent.clear();
        let fp = self.ahead.awaiting.front().copied().unwrap_or(next);
        let saved = self.current;
        let started = Instant::now();
        self.current = Some(Current { fp, deadline: started + self.timeout, started });
        let (to, from) = (self.next(), self.prev());
        let receiving = !received.is_empty();
        let mut sends = [SendOp::new(to, &outbox)];
        let mut recvs = [RecvOp::copy(from, &mut received)];
        let sends: &mut [SendOp<'_>] = if outbox.is_empty() { &mut [] } else { &mut sends };
        let recvs: &mut [RecvOp<'_>] = if receiving { &mut recvs } else { &mut [] };
        let moved = self.exchange(sends, recvs);
        self.current = saved;
        moved?;
        let mut at = 0;
        while at < received.len() {
            let take = (LEN - self.ahead.got).min(received.len() - at);
            self.ahead.inbox[self.ahead.got..self.ahead.got + take].copy_from_slice(&received[at..at + take]);
            self.ahead.got += take;
            at += take;
            if self.ahead.got == LEN {
                self.compare_ahead()?;
            }
        }
        Ok(())
    }

    /// Moves what the links take and hand over now; compares every whole
    /// fingerprint received. A failure is kept (for the call it belongs
    /// to) and aborts the communicator.
    fn move_ahead(&mut self) -> Result<(), Failure> {
        let result = self.try_move_ahead();
        if let Err(failure) = &result {
            let seq = self.ahead.awaiting.front().map_or(0, |fp| fp.seq);
            self.note_ahead_failure(seq, failure);
        }
        result
    }

    fn try_move_ahead(&mut self) -> Result<(), Failure> {
        let (to, from) = (self.next(), self.prev());
        while !self.ahead.outbox.is_empty() {
            let link = self.links[to].as_mut().expect("a link to every other rank");
            let sent = link.try_send(&self.ahead.outbox).map_err(|error| self.link_failure(to, error))?;
            if sent == 0 {
                break;
            }
            self.ahead.sent(sent);
        }
        while !self.ahead.awaiting.is_empty() {
            let (inbox, got) = (&mut self.ahead.inbox, &mut self.ahead.got);
            let link = self.links[from].as_mut().expect("a link to every other rank");
            // Takes no byte past the awaited fingerprint: what follows it
            // belongs to later calls.
            let took = link
                .try_recv(&mut |bytes: &[u8]| {
                    let take = (LEN - *got).min(bytes.len());
                    inbox[*got..*got + take].copy_from_slice(&bytes[..take]);
                    *got += take;
                    take
                })
                .map_err(|error| self.link_failure(from, error))?;
            if took == 0 {
                break;
            }
            if self.ahead.got == LEN {
                self.compare_ahead()?;
            }
        }
        Ok(())
    }

    /// Compares the whole fingerprint in the inbox with the oldest awaited.
    fn compare_ahead(&mut self) -> Result<(), Failure> {
        let expected = self.ahead.awaiting.front().copied().expect("a fingerprint is awaited");
        let theirs = self.ahead.inbox;
        self.ahead.got = 0;
        if let Err(failure) = self.compare(&expected, &theirs, self.prev()) {
            self.note_ahead_failure(expected.seq, &failure);
            return Err(failure);
        }
        self.ahead.awaiting.pop_front();
        Ok(())
    }

    /// Keeps the first failure of a check sent ahead, for call `seq`, and
    /// aborts the communicator with it.
    fn note_ahead_failure(&mut self, seq: u64, failure: &Failure) {
        if self.ahead.failed.is_none() {
            self.ahead.failed = Some((seq, failure.clone()));
        }
        self.abort(&failure.message);
    }

    /// The oldest call whose check sent ahead is not compared yet.
    pub(super) fn ahead_front(&self) -> Option<Fingerprint> {
        self.ahead.awaiting.front().copied()
    }

    /// Call `seq`'s check as it stands now (see [`World::poll_ahead`]).
    fn ahead_outcome(&self, seq: u64) -> Result<bool, Failure> {
        match &self.ahead.failed {
            Some((at, failure)) if *at == seq => Err(failure.clone()),
            Some((at, _)) if *at > seq => Ok(true),
            _ if self.ahead.checked(seq) => Ok(true),
            _ => match &self.aborted {
                Some(why) => {
                    let call = match self.ahead.awaiting.iter().find(|fp| fp.seq == seq) {
                        Some(fp) => fp.to_string(),
                        None => format!("#{seq}"),
                    };
                    let message = format!(
                        "{call}{} stopped: the communicator was aborted by an earlier failure: {why}",
                        self.label
                    );
                    Err(Failure::new(FailureKind::Aborted, message))
                }
                None => Ok(false),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::io;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use parking_lot::Mutex;

    use super::super::World;
    use crate::communicator::failure::Failure;
    use crate::communicator::failure::FailureKind;
    use crate::communicator::fingerprint::Fingerprint;
    use crate::op::Op;
    use crate::ops::{DType, ReduceOp};
    use crate::store::{StoreClient, StoreServer};
    use crate::transport::Link;
    use crate::transport::{RecvOp, SendOp};

    /// One direction of an in-memory link, holding at most `capacity` bytes.
    #[derive(Clone)]
    struct Pipe(Arc<Mutex<VecDeque<u8>>>, usize);

    struct MemLink {
        out: Pipe,
        inn: Pipe,
    }

    impl Link for MemLink {
        fn try_send(&mut self, data: &[u8]) -> io::Result<usize> {
            let mut q = self.out.0.lock();
            let n = (self.out.1 - q.len()).min(data.len());
            q.extend(&data[..n]);
            Ok(n)
        }
        fn try_recv(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
            let mut q = self.inn.0.lock();
            let bytes: Vec<u8> = q.iter().copied().collect();
            let n = if bytes.is_empty() { 0 } else { take(&bytes) };
            q.drain(..n);
            Ok(n)
        }
        fn kind(&self) -> &'static str {
            "mem"
        }
    }

    /// `size` worlds linked every pair through pipes of `capacity` bytes,
    /// on one store, with `timeout`.
    fn worlds(size: usize, capacity: usize, timeout: Duration) -> (StoreServer, Vec<World>) {
        let server = StoreServer::bind("127.0.0.1:0", "s").expect("bind");
        let pipes: Vec<Vec<Pipe>> =
            (0..size).map(|_| (0..size).map(|_| Pipe(Default::default(), capacity)).collect()).collect();
        let worlds = (0..size)
            .map(|r| {
                let links = (0..size)
                    .map(|p| {
                        (p != r).then(|| {
                            Box::new(MemLink { out: pipes[r][p].clone(), inn: pipes[p][r].clone() }) as Box<dyn Link>
                        })
                    })
                    .collect();
                let store = StoreClient::connect(server.local_addr(), "s", Duration::from_secs(5)).expect("connect");
                World::new(r, size, links, store, "cohort/comm/7/".into(), timeout)
            })
            .collect();
        (server, worlds)
    }

    fn sum(seq: u64, count: usize) -> Fingerprint {
        Fingerprint::of(seq, Op::all_reduce(DType::F32, ReduceOp::Sum, count))
    }

    /// Every rank's waited check of call `fp` at once.
    fn waited_checks(w: &mut [World], fp: Fingerprint) -> Vec<Result<(), Failure>> {
        std::thread::scope(|s| {
            let handles: Vec<_> =
                w.iter_mut().map(|world| s.spawn(move || world.run(fp, |w| w.ring_check(&fp)))).collect();
            handles.into_iter().map(|h| h.join().expect("no panic")).collect()
        })
    }

    /// Polls every world until call `seq` is done on each (bounded).
    fn until_done(w: &mut [World], seq: u64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        // Every world polls each round: one's progress needs the others'.
        loop {
            let done: Vec<bool> = w.iter_mut().map(|world| world.ahead_done(seq) == Ok(true)).collect();
            if done.iter().all(|&d| d) {
                break;
            }
            assert!(Instant::now() < deadline, "call {seq} never done everywhere");
        }
    }

    #[test]
    fn checks_sent_ahead_and_waited_checks_agree_on_the_bytes() {
        let (_server, mut w) = worlds(3, 1 << 16, Duration::from_secs(10));
        for world in w.iter_mut() {
            world.send_check_ahead(sum(1, 4)).expect("sent");
            world.send_check_ahead(sum(2, 4)).expect("sent");
        }
        until_done(&mut w, 2);
        // Call 3: rank 0 waits for its check while ranks 1 and 2 send
        // theirs ahead (rank 2's is what rank 0 waits for).
        let (first, rest) = w.split_at_mut(1);
        let waited = std::thread::scope(|s| {
            let waiter = s.spawn(|| first[0].run(sum(3, 4), |w| w.ring_check(&sum(3, 4))));
            for world in rest.iter_mut() {
                world.send_check_ahead(sum(3, 4)).expect("sent");
            }
            waiter.join().expect("no panic")
        });
        assert_eq!(waited, Ok(()));
        until_done(rest, 3);
        // Call 5, waited everywhere, after call 4 was sent ahead everywhere:
        // `run` settles call 4 first.
        for world in w.iter_mut() {
            world.send_check_ahead(sum(4, 4)).expect("sent");
        }
        let results = waited_checks(&mut w, sum(5, 8));
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        for (r, world) in w.iter_mut().enumerate() {
            assert_eq!(world.poll_ahead(4), Ok(true), "rank {r}");
        }
    }

    #[test]
    fn data_after_checks_sent_ahead_arrives_whole() {
        // Small links: fingerprints and data queue behind each other.
        let (_server, mut w) = worlds(3, 48, Duration::from_secs(10));
        for seq in 1..=3 {
            for world in w.iter_mut() {
                world.send_check_ahead(sum(seq, 4)).expect("sent");
            }
        }
        let got: Vec<Result<Vec<u8>, Failure>> = std::thread::scope(|s| {
            let handles: Vec<_> = w
                .iter_mut()
                .map(|world| {
                    s.spawn(move || {
                        let mine = vec![world.rank as u8 + 1; 100];
                        let mut theirs = vec![0u8; 100];
                        let (to, from) = (world.next(), world.prev());
                        world
                            .run(sum(4, 25), |w| {
                                let mut sends = [SendOp::new(to, &mine)];
                                let mut recvs = [RecvOp::copy(from, &mut theirs)];
                                w.exchange(&mut sends, &mut recvs)
                            })
                            .map(|()| theirs)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("no panic")).collect()
        });
        for (r, bytes) in got.into_iter().enumerate() {
            let from = (r + 2) % 3;
            assert_eq!(bytes, Ok(vec![from as u8 + 1; 100]), "rank {r}");
        }
    }

    /// Why only two ranks send their checks ahead: three ranks that all
    /// queued before comparing, rank 1 calling another size. Ranks 1 and 2
    /// find the mismatch; rank 0, whose predecessor (rank 2) agrees with
    /// it, cannot, and would end its call as done.
    #[test]
    fn with_three_ranks_a_check_sent_ahead_misses_a_mismatch_elsewhere_so_only_two_send_ahead() {
        let (_server, mut w) = worlds(3, 1 << 16, Duration::from_secs(10));
        for (r, world) in w.iter_mut().enumerate() {
            // Ranks 1 and 2 may find the mismatch at once: kept for the call.
            let _ = world.send_check_ahead(sum(1, if r == 1 { 8 } else { 4 }));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let outcomes = loop {
            let outcomes: Vec<Result<bool, Failure>> = w.iter_mut().map(|world| world.ahead_done(1)).collect();
            if outcomes.iter().all(|o| o != &Ok(false)) {
                break outcomes;
            }
            assert!(Instant::now() < deadline, "never compared: {outcomes:?}");
        };
        assert_eq!(outcomes[0], Ok(true), "rank 0 compared rank 2's fingerprint only");
        assert!(outcomes[1..].iter().all(|o| o.as_ref().is_err_and(|f| f.kind == FailureKind::Mismatch)));
        assert!(World::sends_checks_ahead(2) && World::sends_checks_ahead(1));
        assert!(!World::sends_checks_ahead(3) && !World::sends_checks_ahead(8));
    }

    /// A call compared equal whose own fingerprint still waits in the
    /// outbox when the communicator is aborted (nothing moves after an
    /// abort) ends as done instead of staying undecided until its timeout.
    #[test]
    fn a_compared_call_whose_fingerprint_is_stuck_in_the_outbox_ends_at_an_abort() {
        // 40-byte links (one fingerprint and 8 bytes of the next); rank
        // 1, rank 0's successor, never reads. Rank 2 is its predecessor.
        let (_server, mut w) = worlds(3, 40, Duration::from_secs(10));
        w[2].send_check_ahead(sum(1, 4)).expect("sent");
        w[2].send_check_ahead(sum(2, 4)).expect("sent");
        w[0].send_check_ahead(sum(1, 4)).expect("sent");
        w[0].send_check_ahead(sum(2, 4)).expect("sent");
        assert_eq!(w[2].poll_ahead(2), Ok(false), "rank 2 sends the rest of its fingerprint");
        assert_eq!(w[0].poll_ahead(2), Ok(true), "rank 2's fingerprints arrived and agree");
        assert_eq!(w[0].ahead_done(2), Ok(false), "24 bytes of its own wait for rank 1 to read");
        w[0].abort("a test's abort");
        assert_eq!(w[0].ahead_done(2), Ok(true));
        assert_eq!(w[0].ahead_done(1), Ok(true));
    }

    #[test]
    fn a_mismatch_sent_ahead_fails_that_call_names_both_and_aborts() {
        let (_server, mut w) = worlds(2, 1 << 16, Duration::from_secs(10));
        for world in w.iter_mut() {
            world.send_check_ahead(sum(1, 4)).expect("sent");
        }
        w[0].send_check_ahead(sum(2, 4)).expect("sent");
        // Rank 0's fingerprint is there already: the call fails at once.
        let failure = w[1].send_check_ahead(sum(2, 8)).expect_err("a mismatch");
        assert_eq!(w[1].poll_ahead(2), Err(failure.clone()), "kept for the call");
        assert_eq!(failure.kind, FailureKind::Mismatch);
        assert!(
            failure.message.contains("rank 1 called all_reduce #2 (f32 × 8")
                && failure.message.contains("rank 0 called all_reduce #2 (f32 × 4"),
            "{}",
            failure.message
        );
        // The earlier call stands; a later one is refused.
        assert_eq!(w[1].poll_ahead(1), Ok(true));
        let refused = w[1].send_check_ahead(sum(3, 4)).expect_err("refused");
        assert_eq!(refused.kind, FailureKind::Aborted);
        assert!(refused.message.contains("aborted by an earlier failure"), "{}", refused.message);
        // Rank 0 finds it too, from its own side.
        let theirs = w[0].poll_ahead(2).expect_err("a mismatch");
        assert_eq!(theirs.kind, FailureKind::Mismatch, "{}", theirs.message);
        assert!(theirs.message.contains("rank 0 called all_reduce #2 (f32 × 4"), "{}", theirs.message);
    }

    #[test]
    fn an_abort_from_elsewhere_stops_the_checks_not_yet_compared() {
        let (_server, mut w) = worlds(2, 1 << 16, Duration::from_secs(10));
        w[0].send_check_ahead(sum(1, 4)).expect("sent");
        w[0].abort("rank 0's device failed");
        let stopped = w[0].poll_ahead(1).expect_err("aborted");
        assert_eq!(stopped.kind, FailureKind::Aborted);
        assert!(stopped.message.contains("all_reduce #1") && stopped.message.contains("device failed"), "{stopped:?}");
        assert_eq!(w[0].send_check_ahead(sum(2, 4)).map_err(|f| f.kind), Err(FailureKind::Aborted));
    }

    #[test]
    fn a_full_link_keeps_checks_in_the_outbox_until_the_peer_reads() {
        // 40 bytes hold one fingerprint and a part of the next.
        let (_server, mut w) = worlds(2, 40, Duration::from_secs(10));
        for seq in 1..=5 {
            w[0].send_check_ahead(sum(seq, 4)).expect("never waits");
        }
        for seq in 1..=5 {
            w[1].send_check_ahead(sum(seq, 4)).expect("never waits");
        }
        until_done(&mut w, 5);
        for seq in 1..=5 {
            assert_eq!((w[0].poll_ahead(seq), w[1].poll_ahead(seq)), (Ok(true), Ok(true)));
        }
    }

    #[test]
    fn a_call_is_done_once_compared_and_its_fingerprint_left() {
        // A ring of three over 40-byte links: rank 0's call 2 does not fit
        // beside its call 1 until rank 1 reads.
        let (_server, mut w) = worlds(3, 40, Duration::from_secs(10));
        w[0].send_check_ahead(sum(1, 4)).expect("never waits");
        w[0].send_check_ahead(sum(2, 4)).expect("never waits");
        w[2].send_check_ahead(sum(1, 4)).expect("sent");
        w[2].send_check_ahead(sum(2, 4)).expect("sent");
        let deadline = Instant::now() + Duration::from_secs(5);
        while w[0].poll_ahead(2) != Ok(true) {
            let _ = w[2].poll_ahead(2);
            assert!(Instant::now() < deadline, "rank 2's call 2 never arrived");
        }
        assert_eq!(w[0].ahead_done(1), Ok(true));
        // Compared, but partly still in the outbox: rank 1 has not read.
        assert_eq!(w[0].ahead_done(2), Ok(false));
        w[1].send_check_ahead(sum(1, 4)).expect("sent");
        w[1].send_check_ahead(sum(2, 4)).expect("sent");
        until_done(&mut w, 2);
    }

    #[test]
    fn a_waited_call_settles_a_partly_received_check_first() {
        // 40 bytes: rank 0 receives rank 1's call 1 and a part of call 2.
        let (_server, mut w) = worlds(2, 40, Duration::from_secs(10));
        for world in [1, 0] {
            w[world].send_check_ahead(sum(1, 4)).expect("sent");
            w[world].send_check_ahead(sum(2, 4)).expect("sent");
        }
        assert_eq!((w[0].poll_ahead(1), w[0].poll_ahead(2)), (Ok(true), Ok(false)));
        assert!(w[0].ahead.got > 0, "part of call 2's fingerprint is in");
        let results = waited_checks(&mut w, sum(3, 4));
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        for world in w.iter_mut() {
            assert_eq!(world.ahead_done(2), Ok(true));
        }
    }

    #[test]
    fn a_waited_call_names_the_call_a_rank_never_arrived_at() {
        let (_server, mut w) = worlds(2, 1 << 16, Duration::from_millis(600));
        w[0].send_check_ahead(sum(1, 4)).expect("sent");
        w[0].send_check_ahead(sum(2, 4)).expect("sent");
        w[1].send_check_ahead(sum(1, 4)).expect("sent");
        assert_eq!(w[0].ahead_done(1), Ok(true));
        assert_eq!(w[0].ahead_done(2), Ok(false));
        // Rank 1 never calls #2: rank 0's next waited call times out on it.
        let failure = w[0].run(sum(3, 4), |w| w.ring_check(&sum(3, 4))).expect_err("a timeout");
        assert_eq!(failure.kind, FailureKind::Timeout, "{}", failure.message);
        assert!(
            failure.message.contains("all_reduce #2") && failure.message.contains("rank(s) 1 never arrived"),
            "{}",
            failure.message
        );
        let refused = w[0].send_check_ahead(sum(4, 4)).expect_err("aborted");
        assert_eq!(refused.kind, FailureKind::Aborted);
    }
}
