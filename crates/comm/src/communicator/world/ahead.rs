//! Fingerprint checks sent ahead: the ring check of a call that is queued
//! without waiting for it.
//!
//! A waited check ([`World::check_fingerprint`]) sends this rank's
//! fingerprint to its ring successor and reads its predecessor's before the
//! call goes on. A check sent ahead puts the same 32 bytes into the same
//! stream to the successor at once (what the link does not take now waits
//! in an outbox), queues the call, and reads the predecessor's fingerprint
//! later: whenever the call's device polls it ([`World::poll_ahead`]), and
//! at the latest when its kernels have completed, before it is reported
//! done ([`World::await_ahead`]), or before any later call that uses the
//! links itself ([`World::run`] settles every check first). The bytes on
//! the links are the same either way, so ranks need not agree on which of
//! their checks were sent ahead.
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
    /// The newest fingerprint sent ahead (names waits for the outbox).
    newest: Option<Fingerprint>,
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

    /// How many of the awaited fingerprints belong to calls up to `seq`.
    fn owed_through(&self, seq: u64) -> usize {
        self.awaiting.iter().take_while(|fp| fp.seq <= seq).count()
    }

    /// Whether the fingerprints of calls up to `seq` left the outbox.
    fn sent_through(&self, seq: u64) -> bool {
        self.unsent.front().is_none_or(|&s| s > seq)
    }

    /// The outbox's bytes that belong to calls up to `seq`.
    fn unsent_through(&self, seq: u64) -> usize {
        let later = self.unsent.iter().filter(|&&s| s > seq).count();
        self.outbox.len().saturating_sub(later * LEN)
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
    /// Sends call `fp`'s fingerprint to the ring successor now and leaves
    /// the predecessor's to be compared later (see the module docs). Never
    /// waits. Refuses (as [`World::run`] does) once the communicator was
    /// aborted; a check of an earlier call found failed here aborts it.
    pub(crate) fn send_check_ahead(&mut self, fp: Fingerprint) -> Result<(), Failure> {
        self.refuse_if_aborted(&fp)?;
        if self.size == 1 || self.in_group || !desync_check() {
            return Ok(());
        }
        debug_assert!(!fp.is_p2p(), "a message's check is not sent ahead");
        self.ahead.outbox.extend_from_slice(&fp.encode());
        self.ahead.unsent.push_back(fp.seq);
        self.ahead.awaiting.push_back(fp);
        self.ahead.newest = Some(fp);
        self.move_ahead().map(|_| ())
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

    /// Waits until call `seq`'s check sent ahead was compared, up to the
    /// world's timeout (the predecessor sent its fingerprint before it
    /// queued its own part, so when this rank's part completed it has
    /// usually arrived already). A timeout names the ranks that never
    /// arrived and aborts the communicator, as a waited check's does.
    ///
    /// It also sends this call's fingerprint where the outbox still holds
    /// it: the successor awaits it even if this rank never calls again.
    pub(crate) fn await_ahead(&mut self, seq: u64) -> Result<(), Failure> {
        if self.poll_ahead(seq)? && self.ahead.sent_through(seq) {
            return Ok(());
        }
        let oldest = self.ahead.awaiting.front().map_or(seq, |fp| fp.seq);
        if let Err(failure) = self.settle_ahead(Some(seq)) {
            self.note_ahead_failure(oldest, &failure);
        }
        self.ahead_outcome(seq).map(|_| ())
    }

    /// Sends the outbox and compares every awaited fingerprint (both only
    /// for the calls up to `through`, when given),
    /// waiting under a deadline of the world's timeout; the caller aborts
    /// on failure. Called before every call that uses the links itself.
    pub(super) fn settle_ahead(&mut self, through: Option<u64>) -> Result<(), Failure> {
        if self.ahead.is_idle() {
            return Ok(());
        }
        if let Some((_, failure)) = &self.ahead.failed {
            return Err(failure.clone());
        }
        let (owed, sending) = match through {
            Some(seq) => (self.ahead.owed_through(seq), self.ahead.unsent_through(seq)),
            None => (self.ahead.awaiting.len(), self.ahead.outbox.len()),
        };
        let outbox: Vec<u8> = self.ahead.outbox[..sending].to_vec();
        let mut received = vec![0u8; owed * LEN - self.ahead.got];
        // Timeouts and aborts seen while waiting name the oldest awaited
        // call (the newest sent, when only the outbox is left).
        let fp = self.ahead.awaiting.front().copied().or(self.ahead.newest).expect("a fingerprint was sent ahead");
        let saved = self.current;
        let started = Instant::now();
        self.current = Some(Current { fp, deadline: started + self.timeout, started });
        let (to, from) = (self.next(), self.prev());
        let mut sends = [SendOp::new(to, &outbox)];
        let mut recvs = [RecvOp::copy(from, &mut received)];
        let sends: &mut [SendOp<'_>] = if outbox.is_empty() { &mut [] } else { &mut sends };
        let recvs: &mut [RecvOp<'_>] = if owed == 0 { &mut [] } else { &mut recvs };
        let moved = self.exchange(sends, recvs);
        self.current = saved;
        moved?;
        self.ahead.sent(sending);
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
    /// to) and aborts the communicator. Returns whether anything moved.
    fn move_ahead(&mut self) -> Result<bool, Failure> {
        let result = self.try_move_ahead();
        if let Err(failure) = &result {
            let seq = self.ahead.awaiting.front().map_or(0, |fp| fp.seq);
            self.note_ahead_failure(seq, failure);
        }
        result
    }

    fn try_move_ahead(&mut self) -> Result<bool, Failure> {
        let (to, from) = (self.next(), self.prev());
        let mut moved = false;
        while !self.ahead.outbox.is_empty() {
            let link = self.links[to].as_mut().expect("a link to every other rank");
            let sent = link.try_send(&self.ahead.outbox).map_err(|error| self.link_failure(to, error))?;
            if sent == 0 {
                break;
            }
            self.ahead.sent(sent);
            moved = true;
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
            moved = true;
            if self.ahead.got == LEN {
                self.compare_ahead()?;
            }
        }
        Ok(moved)
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

    use super::super::{World, LEN};
    use crate::communicator::failure::FailureKind;
    use crate::communicator::fingerprint::Fingerprint;
    use crate::op::Op;
    use crate::ops::{DType, ReduceOp};
    use crate::store::{StoreClient, StoreServer};
    use crate::transport::Link;

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
    fn waited_checks(w: &mut [World], fp: Fingerprint) -> Vec<Result<(), super::Failure>> {
        std::thread::scope(|s| {
            let handles: Vec<_> =
                w.iter_mut().map(|world| s.spawn(move || world.run(fp, |w| w.ring_check(&fp)))).collect();
            handles.into_iter().map(|h| h.join().expect("no panic")).collect()
        })
    }

    #[test]
    fn checks_sent_ahead_and_waited_checks_agree_on_the_bytes() {
        let (_server, mut w) = worlds(3, 1 << 16, Duration::from_secs(10));
        for world in w.iter_mut() {
            world.send_check_ahead(sum(1, 4)).expect("sent");
            world.send_check_ahead(sum(2, 4)).expect("sent");
        }
        for (r, world) in w.iter_mut().enumerate() {
            assert_eq!((world.poll_ahead(1), world.poll_ahead(2)), (Ok(true), Ok(true)), "rank {r}");
        }
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
        for (r, world) in rest.iter_mut().enumerate() {
            assert_eq!(world.await_ahead(3), Ok(()), "rank {}", r + 1);
        }
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
        let theirs = w[0].await_ahead(2).expect_err("a mismatch");
        assert_eq!(theirs.kind, FailureKind::Mismatch, "{}", theirs.message);
        assert!(theirs.message.contains("rank 0 called all_reduce #2 (f32 × 4"), "{}", theirs.message);
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
        let deadline = Instant::now() + Duration::from_secs(5);
        while [w[0].poll_ahead(5), w[1].poll_ahead(5)] != [Ok(true), Ok(true)] {
            assert!(Instant::now() < deadline, "the checks never finished");
        }
        for seq in 1..=5 {
            assert_eq!((w[0].poll_ahead(seq), w[1].poll_ahead(seq)), (Ok(true), Ok(true)));
        }
    }

    #[test]
    fn awaiting_a_check_sends_that_calls_fingerprint_and_no_later_one() {
        // 40 bytes: rank 0's calls 2 and 3 stay in its outbox.
        let (_server, mut w) = worlds(2, 40, Duration::from_secs(10));
        for seq in 1..=3 {
            w[0].send_check_ahead(sum(seq, 4)).expect("never waits");
        }
        w[1].send_check_ahead(sum(1, 4)).expect("sent");
        w[1].send_check_ahead(sum(2, 4)).expect("sent");
        assert_eq!(w[0].poll_ahead(1), Ok(true));
        let (first, second) = w.split_at_mut(1);
        std::thread::scope(|s| {
            // Rank 1 reads call 2's fingerprint only as rank 0 sends it.
            let reader = s.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(5);
                while second[0].poll_ahead(2) != Ok(true) {
                    assert!(Instant::now() < deadline, "rank 0 never sent call 2's fingerprint");
                }
            });
            // Only call 2's is sent: rank 1 may never read call 3's (were
            // the link smaller than what is owed, waiting for it all would
            // time out).
            assert_eq!(first[0].await_ahead(2), Ok(()));
            reader.join().expect("no panic");
        });
        // Half of call 3's went out with call 2's, when rank 0 polled.
        let unsent: Vec<u64> = w[0].ahead.unsent.iter().copied().collect();
        assert_eq!((w[0].ahead.outbox.len(), unsent), (LEN / 2, vec![3]));
    }

    #[test]
    fn awaiting_a_check_waits_for_that_call_only_and_names_a_rank_that_never_arrives() {
        let (_server, mut w) = worlds(2, 1 << 16, Duration::from_millis(600));
        w[0].send_check_ahead(sum(1, 4)).expect("sent");
        w[0].send_check_ahead(sum(2, 4)).expect("sent");
        w[1].send_check_ahead(sum(1, 4)).expect("sent");
        let started = Instant::now();
        assert_eq!(w[0].await_ahead(1), Ok(()));
        assert!(started.elapsed() < Duration::from_millis(300), "waited for call 2 as well");
        assert_eq!(w[0].poll_ahead(2), Ok(false));
        // Rank 1 never calls #2.
        let failure = w[0].await_ahead(2).expect_err("a timeout");
        assert_eq!(failure.kind, FailureKind::Timeout, "{}", failure.message);
        assert!(
            failure.message.contains("all_reduce #2") && failure.message.contains("rank(s) 1 never arrived"),
            "{}",
            failure.message
        );
        let refused = w[0].send_check_ahead(sum(3, 4)).expect_err("aborted");
        assert_eq!(refused.kind, FailureKind::Aborted);
    }
}
