//! Fingerprint checks sent ahead: the check of a call that is queued
//! without waiting for it.
//!
//! A waited check ([`World::collective_check`]) sends this rank's
//! fingerprint to every other rank (the world's check peers: every other
//! rank in a world of up to [`CHECK_EVERY_PEER_UP_TO`]) and compares
//! theirs before the call goes on. A check sent ahead
//! ([`World::send_check_ahead`]) puts the same 32 bytes into the same
//! streams at once (what a link does not take now waits in its outbox),
//! the call is queued, and the other ranks' fingerprints are compared
//! later, never waiting: whenever the call's device polls it
//! ([`World::poll_ahead`]; the call is done only once
//! [`World::ahead_done`] says so), and before any later call that uses the
//! links itself ([`World::run`] settles every check first, waiting as a
//! waited check does). The bytes on the links are the same either way, so
//! ranks need not agree on which of their checks were sent ahead.
//!
//! What it changes is when a mismatch is found: after the call was queued,
//! not before. Every rank compares every other rank's fingerprint, so
//! every rank fails the call, with the same message a waited check gives,
//! and the communicator is aborted (which also stops device kernels that a
//! mismatched call left waiting for data).

use std::collections::VecDeque;
use std::time::Instant;

use super::{desync_check, Current, Failure, FailureKind, Fingerprint, World, CHECK_EVERY_PEER_UP_TO, LEN};
use crate::transport::{RecvOp, SendOp};

/// This rank's fingerprints on their way to one rank.
struct Outgoing {
    to: usize,
    /// Bytes its link has not taken yet: the tail of the newest
    /// fingerprints.
    outbox: Vec<u8>,
    /// The calls whose fingerprint is (partly) in the outbox, oldest first.
    unsent: VecDeque<u64>,
}

impl Outgoing {
    /// Takes the first `n` bytes out of the outbox (the link took them).
    fn sent(&mut self, n: usize) {
        self.outbox.drain(..n);
        let left = self.outbox.len().div_ceil(LEN);
        while self.unsent.len() > left {
            self.unsent.pop_front();
        }
    }
}

/// One rank's fingerprints on their way here.
struct Incoming {
    from: usize,
    /// The part of its next fingerprint received so far.
    inbox: [u8; LEN],
    got: usize,
    /// How many of the awaited fingerprints (oldest first) its own were
    /// compared with.
    compared: usize,
}

impl Incoming {
    /// Takes from `bytes` what completes its next fingerprint (no byte
    /// past it: what follows belongs to later calls); returns how many.
    fn fill(&mut self, bytes: &[u8]) -> usize {
        let take = (LEN - self.got).min(bytes.len());
        self.inbox[self.got..self.got + take].copy_from_slice(&bytes[..take]);
        self.got += take;
        take
    }
}

/// The checks of this rank's calls that were sent ahead and not yet
/// compared with every check peer's.
pub(crate) struct Ahead {
    outgoing: Vec<Outgoing>,
    incoming: Vec<Incoming>,
    /// This rank's fingerprints that some check peer's counterpart has not
    /// been compared with, oldest first.
    awaiting: VecDeque<Fingerprint>,
    /// The first check that failed: the call's sequence number and why.
    failed: Option<(u64, Failure)>,
}

impl Ahead {
    /// No check in flight, to ranks `to`, from ranks `from`.
    pub(super) fn new(to: &[usize], from: &[usize]) -> Ahead {
        Ahead {
            outgoing: to.iter().map(|&to| Outgoing { to, outbox: Vec::new(), unsent: VecDeque::new() }).collect(),
            incoming: from.iter().map(|&from| Incoming { from, inbox: [0; LEN], got: 0, compared: 0 }).collect(),
            awaiting: VecDeque::new(),
            failed: None,
        }
    }

    fn is_idle(&self) -> bool {
        self.awaiting.is_empty() && self.outgoing.iter().all(|o| o.outbox.is_empty())
    }

    /// Whether call `seq`'s check was compared everywhere (or never sent
    /// ahead).
    fn checked(&self, seq: u64) -> bool {
        self.awaiting.front().is_none_or(|fp| fp.seq > seq)
    }

    /// Whether the fingerprints of calls up to `seq` left every outbox.
    fn sent_through(&self, seq: u64) -> bool {
        self.outgoing.iter().all(|o| o.unsent.front().is_none_or(|&s| s > seq))
    }

    /// The ranks whose fingerprint for call `seq` was not compared yet.
    fn owed_by(&self, seq: u64) -> Vec<usize> {
        let Some(at) = self.awaiting.iter().position(|fp| fp.seq == seq) else {
            return Vec::new();
        };
        self.incoming.iter().filter(|i| i.compared <= at).map(|i| i.from).collect()
    }

    /// The peer to read and compare next, among those `ready` (by index)
    /// that still owe a fingerprint: the one furthest behind, so that calls
    /// are compared in order across the peers and a mismatch is found at
    /// the first call it concerns (an earlier call whose fingerprints are
    /// all here is compared first, and stands).
    fn next_to_compare(&self, ready: impl Fn(usize) -> bool) -> Option<usize> {
        let owed = self.awaiting.len();
        (0..self.incoming.len())
            .filter(|&p| self.incoming[p].compared < owed && ready(p))
            .min_by_key(|&p| self.incoming[p].compared)
    }

    /// Drops the oldest fingerprints every peer's were compared with.
    fn retire_compared(&mut self) {
        let done = self.incoming.iter().map(|i| i.compared).min().unwrap_or(0);
        self.awaiting.drain(..done);
        for incoming in &mut self.incoming {
            incoming.compared -= done;
        }
    }
}

impl World {
    /// Whether a world of `size` ranks may send its checks ahead: one that
    /// compares every other rank's fingerprint ([`CHECK_EVERY_PEER_UP_TO`]).
    /// Waited, a rank that finds a mismatch never queues its call, so no
    /// rank's call can complete. Sent ahead, every rank queued before any
    /// compared, so a rank may end its call as done only once it knows the
    /// call matched on every rank: with ring neighbours only, a rank whose
    /// predecessor agrees would see its call complete (NCCL checks no
    /// types: equal byte counts are enough) and return wrong bytes while a
    /// mismatch is found elsewhere.
    pub(crate) fn sends_checks_ahead(size: usize) -> bool {
        size <= CHECK_EVERY_PEER_UP_TO
    }

    /// Sends call `fp`'s fingerprint to the check peers now and leaves
    /// theirs to be compared later (see the module docs), where
    /// [`World::sends_checks_ahead`] allows it. Never waits. Refuses (as
    /// [`World::run`] does) once the communicator was aborted; a check
    /// found failed here (this call's or an earlier one's) aborts it.
    pub(crate) fn send_check_ahead(&mut self, fp: Fingerprint) -> Result<(), Failure> {
        self.refuse_if_aborted(&fp)?;
        if self.size == 1 || self.in_group || !desync_check() {
            return Ok(());
        }
        debug_assert!(!fp.is_p2p(), "a message's check is not sent ahead");
        debug_assert!(World::sends_checks_ahead(self.size), "{} ranks compare ring neighbours only", self.size);
        let encoded = fp.encode();
        for outgoing in &mut self.ahead.outgoing {
            outgoing.outbox.extend_from_slice(&encoded);
            outgoing.unsent.push_back(fp.seq);
        }
        self.ahead.awaiting.push_back(fp);
        // A failure is kept for the call it belongs to (and aborts).
        let _ = self.move_ahead();
        self.ahead_outcome(fp.seq).map(|_| ())
    }

    /// Where call `seq`'s check sent ahead stands, after moving what the
    /// links move without waiting: `Ok(true)` compared with every check
    /// peer's and equal (or never sent ahead), `Ok(false)` not yet, or why
    /// it failed (this call's mismatch, or the abort of the communicator
    /// by another failure).
    pub(crate) fn poll_ahead(&mut self, seq: u64) -> Result<bool, Failure> {
        if self.aborted.is_none() && !self.ahead.is_idle() {
            // A failure is kept in `ahead.failed` (and aborts), read below.
            let _ = self.move_ahead();
        }
        self.ahead_outcome(seq)
    }

    /// Whether call `seq` is done with its check sent ahead: compared, and
    /// this rank's fingerprint handed to every link (the peers await it
    /// even if this rank never calls again), or nothing moves any more (the
    /// communicator was aborted: a call compared equal everywhere stands,
    /// its data is right, and the peers' fail). Never waits.
    pub(crate) fn ahead_done(&mut self, seq: u64) -> Result<bool, Failure> {
        Ok(self.poll_ahead(seq)? && (self.ahead.sent_through(seq) || self.aborted.is_some()))
    }

    /// The ranks whose fingerprint for call `seq`, sent ahead, was not
    /// compared yet (none once it was, or if it was not sent ahead).
    pub(crate) fn ahead_owed_by(&self, seq: u64) -> Vec<usize> {
        self.ahead.owed_by(seq).into_iter().map(|r| self.label.global(r)).collect()
    }

    /// Sends every outbox and compares every awaited fingerprint, waiting
    /// under a deadline of the world's timeout (a timeout names the oldest
    /// call not compared, or call `next` when only outboxes are left, and
    /// the ranks that never arrived there); the caller aborts on failure.
    /// Called before every call `next` that uses the links itself.
    pub(super) fn settle_ahead(&mut self, next: Fingerprint) -> Result<(), Failure> {
        if self.ahead.is_idle() {
            return Ok(());
        }
        if let Some((_, failure)) = &self.ahead.failed {
            return Err(failure.clone());
        }
        let owed = self.ahead.awaiting.len();
        // Only the oldest fingerprint owed by each rank can be partly in.
        let mut received: Vec<Vec<u8>> =
            self.ahead.incoming.iter().map(|i| vec![0u8; ((owed - i.compared) * LEN).saturating_sub(i.got)]).collect();
        // Sent below, or lost with the abort that follows a failure.
        let outboxes: Vec<(usize, Vec<u8>)> = self
            .ahead
            .outgoing
            .iter_mut()
            .map(|o| {
                o.unsent.clear();
                (o.to, std::mem::take(&mut o.outbox))
            })
            .collect();
        let fp = self.ahead.awaiting.front().copied().unwrap_or(next);
        let saved = self.current;
        let started = Instant::now();
        self.current = Some(Current { fp, deadline: started + self.timeout, started });
        let froms: Vec<usize> = self.ahead.incoming.iter().map(|i| i.from).collect();
        let mut sends: Vec<SendOp<'_>> =
            outboxes.iter().filter(|(_, b)| !b.is_empty()).map(|(to, b)| SendOp::new(*to, b)).collect();
        let mut recvs: Vec<RecvOp<'_>> = froms
            .iter()
            .zip(received.iter_mut())
            .filter(|(_, b)| !b.is_empty())
            .map(|(&from, b)| RecvOp::copy(from, b))
            .collect();
        let moved = self.exchange(&mut sends, &mut recvs);
        drop((sends, recvs));
        self.current = saved;
        moved?;
        // In call order across the peers (see `next_to_compare`): a
        // mismatch then fails its own call, not an earlier one.
        let mut at = vec![0; received.len()];
        let compared = loop {
            let Some(peer) = self.ahead.next_to_compare(|p| at[p] < received[p].len()) else {
                break Ok(());
            };
            at[peer] += self.ahead.incoming[peer].fill(&received[peer][at[peer]..]);
            if self.ahead.incoming[peer].got == LEN {
                if let Err(failure) = self.compare_ahead(peer) {
                    break Err(failure);
                }
            }
        };
        // A call compared everywhere stands, even when a later one failed.
        self.ahead.retire_compared();
        compared
    }

    /// Moves what the links take and hand over now; compares every whole
    /// fingerprint received. A failure is kept (for the call it belongs
    /// to) and aborts the communicator.
    fn move_ahead(&mut self) -> Result<(), Failure> {
        let result = self.try_move_ahead();
        self.ahead.retire_compared();
        if let Err(failure) = &result {
            if self.ahead.failed.is_none() {
                let seq = self.ahead.awaiting.front().map_or(0, |fp| fp.seq);
                self.note_ahead_failure(seq, failure);
            }
        }
        result
    }

    fn try_move_ahead(&mut self) -> Result<(), Failure> {
        for peer in 0..self.ahead.outgoing.len() {
            let outgoing = &mut self.ahead.outgoing[peer];
            let to = outgoing.to;
            while !outgoing.outbox.is_empty() {
                let link = self.links[to].as_mut().expect("a link to every other rank");
                let sent = match link.try_send(&outgoing.outbox) {
                    Ok(sent) => sent,
                    Err(error) => return Err(self.link_failure(to, error)),
                };
                if sent == 0 {
                    break;
                }
                outgoing.sent(sent);
            }
        }
        // In call order across the peers (see `next_to_compare`), until
        // every peer that owes a fingerprint has nothing more now.
        let mut idle = 0u64;
        while let Some(peer) = self.ahead.next_to_compare(|p| idle & 1 << p == 0) {
            let incoming = &mut self.ahead.incoming[peer];
            let from = incoming.from;
            let link = self.links[from].as_mut().expect("a link to every other rank");
            // Takes no byte past the awaited fingerprint: what follows it
            // belongs to later calls.
            let took = link
                .try_recv(&mut |bytes: &[u8]| incoming.fill(bytes))
                .map_err(|error| self.link_failure(from, error))?;
            if took == 0 {
                idle |= 1 << peer;
            } else if self.ahead.incoming[peer].got == LEN {
                self.compare_ahead(peer)?;
            }
        }
        Ok(())
    }

    /// Compares the whole fingerprint in check peer `peer`'s inbox with
    /// the oldest of this rank's it was not compared with.
    fn compare_ahead(&mut self, peer: usize) -> Result<(), Failure> {
        let incoming = &mut self.ahead.incoming[peer];
        let expected = self.ahead.awaiting[incoming.compared];
        let (theirs, from) = (incoming.inbox, incoming.from);
        incoming.got = 0;
        if let Err(failure) = self.compare(&expected, &theirs, from) {
            self.note_ahead_failure(expected.seq, &failure);
            return Err(failure);
        }
        self.ahead.incoming[peer].compared += 1;
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

    /// Call `seq`'s check as it stands now (see [`World::poll_ahead`]): a
    /// call compared everywhere stands even after a later call failed; one
    /// not compared everywhere when the communicator was aborted fails.
    fn ahead_outcome(&self, seq: u64) -> Result<bool, Failure> {
        match &self.ahead.failed {
            Some((at, failure)) if *at == seq => Err(failure.clone()),
            _ if self.ahead.checked(seq) => Ok(true),
            _ => match &self.aborted {
                Some(why) => {
                    let call = match self.ahead.awaiting.iter().find(|fp| fp.seq == seq) {
                        Some(fp) => fp.to_string(),
                        None => format!("#{seq}"),
                    };
                    let message = format!(
                        "{call}{} stopped: the communicator was aborted before every rank's fingerprint of it was \
                         compared: {why}",
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
        let (server, worlds, _) = worlds_and_pipes(size, capacity, timeout);
        (server, worlds)
    }

    /// [`worlds`], and the pipes between them: `[r][p]` carries rank `r`'s
    /// bytes to rank `p`.
    fn worlds_and_pipes(size: usize, capacity: usize, timeout: Duration) -> (StoreServer, Vec<World>, Vec<Vec<Pipe>>) {
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
        (server, worlds, pipes)
    }

    /// Puts rank `rank`'s fingerprint `fp` straight into its pipes to
    /// every other rank, as if it sent its check ahead without reading.
    fn sent_unread(pipes: &[Vec<Pipe>], rank: usize, fp: Fingerprint) {
        for (peer, pipe) in pipes[rank].iter().enumerate() {
            if peer != rank {
                pipe.0.lock().extend(fp.encode());
            }
        }
    }

    /// Three ranks over roomy links, rank 0 having sent calls 1 and 2 (f32
    /// sums of 4) ahead; the test puts the others' fingerprints in.
    fn rank_0_sent_two_ahead() -> (StoreServer, Vec<World>, Vec<Vec<Pipe>>) {
        let (server, mut w, pipes) = worlds_and_pipes(3, 1 << 16, Duration::from_secs(10));
        w[0].send_check_ahead(sum(1, 4)).expect("sent");
        w[0].send_check_ahead(sum(2, 4)).expect("sent");
        (server, w, pipes)
    }

    /// Polls every world until each answers call `seq`'s check (bounded).
    fn outcomes(w: &mut [World], seq: u64) -> Vec<Result<bool, Failure>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let outcomes: Vec<Result<bool, Failure>> = w.iter_mut().map(|world| world.ahead_done(seq)).collect();
            if outcomes.iter().all(|o| o != &Ok(false)) {
                return outcomes;
            }
            assert!(Instant::now() < deadline, "never compared: {outcomes:?}");
        }
    }

    fn sum(seq: u64, count: usize) -> Fingerprint {
        Fingerprint::of(seq, Op::all_reduce(DType::F32, ReduceOp::Sum, count))
    }

    /// Every rank's waited check of call `fp` at once.
    fn waited_checks(w: &mut [World], fp: Fingerprint) -> Vec<Result<(), Failure>> {
        std::thread::scope(|s| {
            let handles: Vec<_> =
                w.iter_mut().map(|world| s.spawn(move || world.run(fp, |w| w.collective_check(&fp)))).collect();
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
        // theirs ahead (what rank 0 waits for).
        let (first, rest) = w.split_at_mut(1);
        let waited = std::thread::scope(|s| {
            let waiter = s.spawn(|| first[0].run(sum(3, 4), |w| w.collective_check(&sum(3, 4))));
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

    /// Three ranks that all queued before comparing, rank 1 calling
    /// another size: every rank compares every other rank's fingerprint,
    /// so every rank fails the call, rank 0 too (whose ring predecessor,
    /// rank 2, agrees with it) and names rank 1.
    #[test]
    fn with_three_ranks_a_mismatch_sent_ahead_fails_the_call_on_every_rank() {
        let (_server, mut w) = worlds(3, 1 << 16, Duration::from_secs(10));
        for (r, world) in w.iter_mut().enumerate() {
            // A rank may find the mismatch at once: kept for the call.
            let _ = world.send_check_ahead(sum(1, if r == 1 { 8 } else { 4 }));
        }
        let outcomes = outcomes(&mut w, 1);
        for (r, outcome) in outcomes.iter().enumerate() {
            let failure = outcome.as_ref().expect_err("every rank fails the call");
            assert_eq!(failure.kind, FailureKind::Mismatch, "rank {r}: {}", failure.message);
            assert!(failure.message.contains("rank 1 called all_reduce #1 (f32 × 8"), "rank {r}: {}", failure.message);
        }
        assert!((1..=8).all(World::sends_checks_ahead));
        assert!(!World::sends_checks_ahead(9));
    }

    /// Waited, a world of up to eight compares every rank's fingerprint
    /// (every rank names the odd one); a larger one its ring neighbours only
    /// (the odd rank and its successor fail; the others go on, and their
    /// calls wait for the odd one, which never queues).
    #[test]
    fn a_waited_check_compares_every_rank_up_to_eight_and_ring_neighbours_beyond() {
        for (size, odd) in [(4, 2), (9, 4)] {
            let (_server, mut w) = worlds(size, 1 << 16, Duration::from_secs(10));
            let results: Vec<Result<(), Failure>> = std::thread::scope(|s| {
                let handles: Vec<_> = w
                    .iter_mut()
                    .map(|world| {
                        let fp = sum(1, if world.rank == odd { 8 } else { 4 });
                        s.spawn(move || world.run(fp, |w| w.collective_check(&fp)))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("no panic")).collect()
            });
            let failed: Vec<usize> = (0..size).filter(|&r| results[r].is_err()).collect();
            let expected: Vec<usize> = if size <= 8 { (0..size).collect() } else { vec![odd, odd + 1] };
            assert_eq!(failed, expected, "{size} ranks: {results:?}");
            for result in &results {
                if let Err(failure) = result {
                    assert_eq!(failure.kind, FailureKind::Mismatch, "{}", failure.message);
                    assert!(failure.message.contains(&format!("rank {odd} called")), "{}", failure.message);
                }
            }
        }
    }

    /// Rank 0 sent calls 1 and 2 ahead; rank 1's fingerprints of both are
    /// in, rank 2's of call 1 agrees and its call 2 differs: compared in
    /// call order across the ranks, call 1 (compared everywhere) stands,
    /// and the mismatch fails call 2 only.
    #[test]
    fn a_later_mismatch_fails_its_own_call_and_an_earlier_one_compared_everywhere_stands() {
        let (_server, mut w, pipes) = rank_0_sent_two_ahead();
        sent_unread(&pipes, 1, sum(1, 4));
        sent_unread(&pipes, 1, sum(2, 8));
        sent_unread(&pipes, 2, sum(1, 4));
        assert_eq!(w[0].poll_ahead(1), Ok(true), "both ranks' call 1 agrees");
        assert_eq!(w[0].ahead_done(1), Ok(true));
        let failure = w[0].poll_ahead(2).expect_err("rank 1's call 2 differs");
        assert_eq!(failure.kind, FailureKind::Mismatch, "{}", failure.message);
        assert!(failure.message.contains("rank 1 called all_reduce #2 (f32 × 8"), "{}", failure.message);
    }

    /// The same found while a waited call settles the checks sent ahead.
    #[test]
    fn a_mismatch_found_while_settling_keeps_an_earlier_call_compared_everywhere() {
        let (_server, mut w, pipes) = rank_0_sent_two_ahead();
        sent_unread(&pipes, 1, sum(1, 4));
        sent_unread(&pipes, 1, sum(2, 4));
        sent_unread(&pipes, 2, sum(1, 4));
        sent_unread(&pipes, 2, sum(2, 8));
        let stopped = w[0].run(sum(3, 4), |w| w.collective_check(&sum(3, 4))).expect_err("call 2 differs");
        assert!(stopped.message.contains("settling the checks sent ahead"), "{}", stopped.message);
        assert_eq!(w[0].ahead_done(1), Ok(true), "call 1 matched on every rank");
        assert_eq!(w[0].poll_ahead(2).map_err(|f| f.kind), Err(FailureKind::Mismatch));
    }

    /// A peer that sends bytes that are no fingerprint (a hostile or
    /// desynchronised process) fails the call with a mismatch that says so,
    /// and aborts; nothing panics.
    #[test]
    fn bytes_that_are_no_fingerprint_fail_the_call_and_say_so() {
        let (_server, mut w, pipes) = rank_0_sent_two_ahead();
        sent_unread(&pipes, 1, sum(1, 4));
        pipes[2][0].0.lock().extend([0xFFu8; crate::communicator::fingerprint::LEN]);
        let failure = w[0].poll_ahead(1).expect_err("rank 2 sent junk");
        assert_eq!(failure.kind, FailureKind::Mismatch, "{}", failure.message);
        assert!(failure.message.contains("not a collective of this communicator"), "{}", failure.message);
        assert_eq!(w[0].send_check_ahead(sum(3, 4)).map_err(|f| f.kind), Err(FailureKind::Aborted));
    }

    /// A call compared with one rank but not yet with another is never
    /// done, and fails once a later call's mismatch aborts.
    #[test]
    fn a_call_not_compared_with_every_rank_fails_at_a_later_mismatch() {
        let (_server, mut w, pipes) = rank_0_sent_two_ahead();
        sent_unread(&pipes, 1, sum(1, 4));
        sent_unread(&pipes, 1, sum(2, 8));
        assert_eq!(w[0].poll_ahead(2).map_err(|f| f.kind), Err(FailureKind::Mismatch));
        let stopped = w[0].ahead_done(1).expect_err("rank 2's fingerprint of call 1 never came");
        assert_eq!(stopped.kind, FailureKind::Aborted, "{}", stopped.message);
        assert!(
            stopped.message.contains("all_reduce #1") && stopped.message.contains("before every rank's"),
            "{}",
            stopped.message
        );
    }

    /// A call is done only once every other rank's fingerprint arrived:
    /// until then the ranks it waits for are named.
    #[test]
    fn a_check_sent_ahead_waits_for_the_last_rank_and_names_it() {
        let (_server, mut w) = worlds(4, 1 << 16, Duration::from_secs(10));
        for world in &mut w[..3] {
            world.send_check_ahead(sum(1, 4)).expect("sent");
        }
        for world in &mut w[..3] {
            assert_eq!(world.ahead_done(1), Ok(false), "rank {} has not heard from rank 3", world.rank);
        }
        assert_eq!(w[0].ahead_owed_by(1), vec![3]);
        assert_eq!(w[3].ahead_owed_by(1), Vec::<usize>::new(), "rank 3 sent nothing ahead");
        w[3].send_check_ahead(sum(1, 4)).expect("sent");
        until_done(&mut w, 1);
        assert!(w.iter().all(|world| world.ahead_owed_by(1).is_empty()));
    }

    /// A call compared equal whose own fingerprint still waits in the
    /// outbox when the communicator is aborted (nothing moves after an
    /// abort) ends as done instead of staying undecided until its timeout.
    #[test]
    fn a_compared_call_whose_fingerprint_is_stuck_in_the_outbox_ends_at_an_abort() {
        // 40-byte links (one fingerprint and 8 bytes of the next); rank 1
        // sent its fingerprints but never reads.
        let (_server, mut w, pipes) = worlds_and_pipes(3, 40, Duration::from_secs(10));
        for seq in 1..=2 {
            sent_unread(&pipes, 1, sum(seq, 4));
            w[2].send_check_ahead(sum(seq, 4)).expect("sent");
            w[0].send_check_ahead(sum(seq, 4)).expect("sent");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while w[0].poll_ahead(2) != Ok(true) {
            let _ = w[2].poll_ahead(2);
            assert!(Instant::now() < deadline, "rank 2's call 2 never arrived");
        }
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
        // Three ranks over 40-byte links: rank 0's call 2 does not fit
        // beside its call 1 until rank 1 (which sent, unread) reads.
        let (_server, mut w, pipes) = worlds_and_pipes(3, 40, Duration::from_secs(10));
        for seq in 1..=2 {
            w[0].send_check_ahead(sum(seq, 4)).expect("never waits");
            sent_unread(&pipes, 1, sum(seq, 4));
            w[2].send_check_ahead(sum(seq, 4)).expect("sent");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while w[0].poll_ahead(2) != Ok(true) {
            let _ = w[2].poll_ahead(2);
            assert!(Instant::now() < deadline, "rank 2's call 2 never arrived");
        }
        assert_eq!(w[0].ahead_done(1), Ok(true));
        // Compared, but partly still in the outbox: rank 1 has not read.
        assert_eq!(w[0].ahead_done(2), Ok(false));
        pipes[0][1].0.lock().clear();
        assert_eq!(w[0].ahead_done(2), Ok(true), "the rest left once rank 1 read");
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
        assert!(w[0].ahead.incoming[0].got > 0, "part of call 2's fingerprint is in");
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
        let failure = w[0].run(sum(3, 4), |w| w.collective_check(&sum(3, 4))).expect_err("a timeout");
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
