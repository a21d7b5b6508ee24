//! [`World`]: this rank's links to every other rank, the store it formed
//! them through, and how a collective waits: deadlines, arrival notes,
//! aborts.
//!
//! Waiting costs nothing on the fast path. Only a rank that has waited
//! longer than [`slow_after`] writes a note to the store that it arrived at
//! the collective, and looks every 200 ms whether another rank aborted the
//! communicator. When the deadline passes, it reads the notes to name the
//! ranks that never arrived, and aborts the communicator through the store,
//! so every live rank stops within a fraction of a second with the same
//! message instead of hanging.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::StoreClient;
use crate::transport::{back_off, exchange, peer_gone, Link, RecvOp, SendOp, Stop};

use super::failure::{Failure, FailureKind};
use super::fingerprint::{Fingerprint, LEN};
use super::keys;
use super::label::Label;
use super::standing::{standings, Standing};

mod ahead;

use ahead::Ahead;

/// Worlds of up to this many ranks check each collective's fingerprint
/// with every other rank; larger ones with their ring neighbours only
/// (n - 1 messages per call and rank would cost more than the check).
/// Only the former send their checks ahead ([`World::sends_checks_ahead`]):
/// a rank that compared every other rank's fingerprint knows the call
/// matched everywhere.
pub(crate) const CHECK_EVERY_PEER_UP_TO: usize = 8;

/// The ranks rank `rank` of `size` sends its collective fingerprints to,
/// and those whose fingerprints it compares: every other rank, or in a
/// world of more than [`CHECK_EVERY_PEER_UP_TO`] its ring successor and
/// predecessor (with two ranks the same).
fn check_peers(rank: usize, size: usize) -> (Peers, Peers) {
    if size <= CHECK_EVERY_PEER_UP_TO {
        let others: Peers = (0..size).filter(|&p| p != rank).collect();
        return (others.clone(), others);
    }
    (smallvec::smallvec![(rank + 1) % size], smallvec::smallvec![(rank + size - 1) % size])
}

/// A few ranks.
pub(crate) type Peers = smallvec::SmallVec<[usize; 8]>;

/// How often a long-waiting rank looks for an abort.
const ABORT_POLL: Duration = Duration::from_millis(200);

/// After how long a waiting rank notes its arrival in the store and starts
/// looking for aborts: 1 s, or a quarter of the timeout when that is less.
fn slow_after(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(1))
}

/// The collective in progress.
#[derive(Clone, Copy)]
struct Current {
    fp: Fingerprint,
    deadline: Instant,
    started: Instant,
}

/// This rank's place among the ranks of one communicator.
pub(crate) struct World {
    pub rank: usize,
    pub size: usize,
    links: Vec<Option<Box<dyn Link>>>,
    /// Its connection to the store (a group shares its parent's).
    store: Arc<StoreClient>,
    /// Store key prefix of this communicator.
    prefix: String,
    pub timeout: Duration,
    /// Set once a collective failed: every later one fails with it.
    aborted: Option<String>,
    current: Option<Current>,
    /// Messages sent to / received from each rank (send/recv).
    sent: Vec<u64>,
    received: Vec<u64>,
    /// Its name and its ranks' job ranks, for every message.
    pub label: Label,
    /// Inside a grouped call, whose one fingerprint was checked already:
    /// its calls skip their own check.
    pub in_group: bool,
    /// Where this rank's collective fingerprints go, and whose it compares
    /// (see [`check_peers`]).
    check_to: Peers,
    check_from: Peers,
    /// Checks of calls queued without waiting for them (see `ahead`).
    ahead: Ahead,
}

impl World {
    pub(crate) fn new(
        rank: usize,
        size: usize,
        links: Vec<Option<Box<dyn Link>>>,
        store: impl Into<Arc<StoreClient>>,
        prefix: String,
        timeout: Duration,
    ) -> World {
        let store = store.into();
        let k = prefix.trim_end_matches('/').rsplit('/').next().unwrap_or("0").to_string();
        let (check_to, check_from) = check_peers(rank, size);
        World {
            ahead: Ahead::new(&check_to, &check_from),
            check_to,
            check_from,
            label: Label::root(&k, size),
            in_group: false,
            rank,
            size,
            links,
            store,
            prefix,
            timeout,
            aborted: None,
            current: None,
            sent: vec![0; size],
            received: vec![0; size],
        }
    }

    /// Store key prefix of this communicator (`cohort/comm/<k>/`).
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store this communicator was formed through.
    pub(crate) fn store(&self) -> &StoreClient {
        &self.store
    }

    /// Its store connection, to share (with the groups split from it, and
    /// their observers).
    pub(crate) fn shared_store(&self) -> Arc<StoreClient> {
        self.store.clone()
    }

    /// The transport to `peer` ("shm", "tcp"; "self" for this rank).
    pub(crate) fn link_kind(&self, peer: usize) -> &'static str {
        self.links[peer].as_ref().map_or("self", |l| l.kind())
    }

    /// The next message number to `peer` (send) or from it (recv).
    pub(crate) fn next_p2p(&mut self, peer: usize, sending: bool) -> u64 {
        let counter = if sending { &mut self.sent[peer] } else { &mut self.received[peer] };
        *counter += 1;
        *counter
    }

    /// Runs one collective: refuses at once if the communicator was aborted;
    /// otherwise settles the checks sent ahead of earlier calls (their bytes
    /// come first on the links), runs `body` under the timeout, and aborts
    /// the communicator (for every rank) if either fails.
    pub(crate) fn run(
        &mut self,
        fp: Fingerprint,
        body: impl FnOnce(&mut World) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        self.refuse_if_aborted(&fp)?;
        // A failure there (an earlier call's mismatch, a link, the timeout
        // of a check still owed) stops this call too, and says so.
        let settled = self.settle_ahead(fp).map_err(|failure| {
            let message =
                format!("{fp}{} stopped while settling the checks sent ahead: {}", self.label, failure.message);
            Failure::new(failure.kind, message)
        });
        let result = settled.and_then(|()| {
            // The call's own clock starts after the checks before it.
            let started = Instant::now();
            self.current = Some(Current { fp, deadline: started + self.timeout, started });
            body(self)
        });
        self.current = None;
        if let Err(failure) = &result {
            self.abort(&failure.message);
        }
        result
    }

    /// The refusal of call `fp` once the communicator was aborted.
    fn refuse_if_aborted(&self, fp: &Fingerprint) -> Result<(), Failure> {
        match &self.aborted {
            Some(why) => {
                let message =
                    format!("{fp}{} refused: the communicator was aborted by an earlier failure: {why}", self.label);
                Err(Failure::new(FailureKind::Aborted, message))
            }
            None => Ok(()),
        }
    }

    /// Marks the communicator aborted and tells the other ranks (first
    /// abort wins in the store).
    pub(crate) fn abort(&mut self, why: &str) {
        #[cfg(feature = "mpi")]
        crate::transport::mpi::note_failure();
        if self.aborted.is_none() {
            self.aborted = Some(why.to_string());
            let key = keys::abort(&self.prefix);
            let me = self.label.global(self.rank);
            let _ = self.store.compare_set(&key, None, format!("rank {me}: {why}").as_bytes());
        }
    }

    /// Sends and receives until all finish, under the collective's deadline.
    pub(crate) fn exchange(&mut self, sends: &mut [SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<(), Failure> {
        let current = self.current.expect("exchange inside World::run");
        let slow = slow_after(self.timeout);
        let (rank, size) = (self.rank, self.size);
        let (store, prefix, label) = (&self.store, &self.prefix, &self.label);
        let me = label.global(rank);
        let mut noted = false;
        let mut last_poll = Instant::now();
        // A peer whose process went away (its store will fired) fails the
        // exchange once a later pass still got nothing from it: bytes it
        // wrote before it died are read first.
        let mut gone: Option<(usize, String)> = None;
        let mut idle = |passes: u64, waiting_on: &[usize]| -> Result<(), Failure> {
            if let Some((peer, why)) = &gone {
                if waiting_on.contains(peer) {
                    return Err(Failure::from(format!(
                        "{}{label}: rank {} went away ({why}) while rank {me} waited for its bytes; its process \
                         exited, crashed or was killed (see the launcher's summary for how)",
                        current.fp,
                        label.global(*peer)
                    )));
                }
                gone = None;
            }
            back_off(passes);
            if passes < 2048 || !passes.is_multiple_of(64) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= current.deadline {
                let message = timeout_message(store, prefix, label, &current, rank, size, waiting_on);
                return Err(Failure::new(FailureKind::Timeout, message));
            }
            if now - current.started < slow {
                return Ok(());
            }
            if !noted {
                noted = true;
                let _ = store.set(&keys::arrived(prefix, current.fp.seq, rank), b"");
            }
            if now - last_poll >= ABORT_POLL {
                last_poll = now;
                match store.get(&keys::abort(prefix)) {
                    Ok(Some(why)) => {
                        let message = format!(
                            "{}{label} stopped: the communicator was aborted by {}",
                            current.fp,
                            String::from_utf8_lossy(&why)
                        );
                        return Err(Failure::new(FailureKind::Aborted, message));
                    }
                    // The store's host died (rank 0, without a launcher):
                    // no peer can be heard from, so stop now, not at the
                    // deadline.
                    Err(
                        e @ (crate::store::StoreError::Disconnected { .. } | crate::store::StoreError::Broken { .. }),
                    ) => {
                        let message = format!(
                            "{} stopped on rank {me}: lost the rendezvous store ({e}); the process that served it \
                             (rank 0 under mpirun or srun, the launcher under `cohort run`) has probably died",
                            current.fp
                        );
                        return Err(Failure::new(FailureKind::Other, message));
                    }
                    _ => {}
                }
                for &peer in waiting_on {
                    if let Ok(Some(why)) = store.get(&keys::gone(prefix, peer)) {
                        gone = Some((peer, String::from_utf8_lossy(&why).into_owned()));
                        break;
                    }
                }
            }
            Ok(())
        };
        let stopped = exchange(&mut self.links, sends, recvs, &mut idle);
        stopped.map_err(|stop| match stop {
            Stop::Idle(why) => why,
            Stop::Link { peer, error } => self.link_failure(peer, error),
        })
    }

    /// A failed link to `peer`, for the call in progress (or the oldest
    /// check sent ahead).
    fn link_failure(&self, peer: usize, error: std::io::Error) -> Failure {
        let how = if peer_gone(&error) { "closed (it exited or crashed)" } else { "failed" };
        let kind = self.link_kind(peer);
        let call = match self.current.map(|c| c.fp).or(self.ahead_front()) {
            Some(fp) => fp.to_string(),
            None => "a collective".to_string(),
        };
        let (label, peer) = (&self.label, self.label.global(peer));
        Failure::from(format!("{call}{label}: the {kind} link to rank {peer} {how}: {error}"))
    }

    /// The fingerprint check every collective starts with: this rank's
    /// goes to every rank of [`check_peers`], and theirs are compared with
    /// it (a mismatch names the first rank in order that differs). Inside a
    /// grouped call (checked once for all its calls) it checks nothing.
    pub(crate) fn collective_check(&mut self, fp: &Fingerprint) -> Result<(), Failure> {
        if self.size == 1 || self.in_group {
            return Ok(());
        }
        let (to, from) = (self.check_to.clone(), self.check_from.clone());
        self.exchange_fingerprints(fp, &to, &from, fp)
    }

    /// Sends this rank's fingerprint `fp` to `to` and checks the one `from`
    /// sends against `expected` (either may be this rank: nothing to send,
    /// or nothing to check).
    pub(crate) fn check_fingerprint(
        &mut self,
        fp: &Fingerprint,
        to: usize,
        from: usize,
        expected: &Fingerprint,
    ) -> Result<(), Failure> {
        let others = |peer: usize| -> Peers { (peer != self.rank).then_some(peer).into_iter().collect() };
        let (to, from) = (others(to), others(from));
        self.exchange_fingerprints(fp, &to, &from, expected)
    }

    /// Sends this rank's fingerprint `fp` to each rank of `to`, and
    /// compares the one each rank of `from` sends with `expected` (a
    /// mismatch names the first rank in order that differs). Nothing with
    /// `COHORT_DESYNC_CHECK=0`.
    fn exchange_fingerprints(
        &mut self,
        fp: &Fingerprint,
        to: &[usize],
        from: &[usize],
        expected: &Fingerprint,
    ) -> Result<(), Failure> {
        if (to.is_empty() && from.is_empty()) || !desync_check() {
            return Ok(());
        }
        let mine = fp.encode();
        let mut theirs: smallvec::SmallVec<[[u8; LEN]; 8]> = smallvec::smallvec![[0u8; LEN]; from.len()];
        let mut sends: smallvec::SmallVec<[SendOp<'_>; 8]> = to.iter().map(|&p| SendOp::new(p, &mine)).collect();
        let mut recvs: smallvec::SmallVec<[RecvOp<'_>; 8]> =
            from.iter().zip(theirs.iter_mut()).map(|(&p, t)| RecvOp::copy(p, t)).collect();
        self.exchange(&mut sends, &mut recvs)?;
        drop(recvs);
        from.iter().zip(&theirs).try_for_each(|(&peer, fingerprint)| self.compare(expected, fingerprint, peer))
    }

    /// Compares the fingerprint `theirs` that rank `from` sent with the one
    /// this rank `expected`: a mismatch names both calls.
    fn compare(&self, expected: &Fingerprint, theirs: &[u8; LEN], from: usize) -> Result<(), Failure> {
        let got = Fingerprint::decode(theirs);
        if got.as_ref() != Some(expected) {
            let (me, peer) = (self.label.global(self.rank), self.label.global(from));
            let message = expected.mismatch(me, peer, got.as_ref(), &self.label);
            return Err(Failure::new(FailureKind::Mismatch, message));
        }
        Ok(())
    }
}

/// Whether collectives check fingerprints (`COHORT_DESYNC_CHECK=0` turns
/// the check off, to measure what it costs; every rank must agree, since it
/// changes what crosses the links). Read once; an unusable value is refused
/// by `Communicator::connect`, and means the default (on) here.
fn desync_check() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        cohort_runtime::config::DESYNC_CHECK.get().unwrap_or(cohort_runtime::config::DESYNC_CHECK.fallback)
    })
}

/// Why a collective timed out: the ranks that never noted their arrival,
/// and the ones this rank was still waiting for.
#[allow(clippy::too_many_arguments)]
fn timeout_message(
    store: &StoreClient,
    prefix: &str,
    label: &Label,
    current: &Current,
    rank: usize,
    size: usize,
    waiting_on: &[usize],
) -> String {
    let _ = store.set(&keys::arrived(prefix, current.fp.seq, rank), b"");
    let seq = current.fp.seq;
    let others: Vec<usize> = (0..size).filter(|&r| r != rank).collect();
    // An unreadable store tells nothing: every other rank then counts as
    // never arrived.
    let standings = standings(store, prefix, seq, current.fp.is_p2p(), &others)
        .unwrap_or_else(|_| vec![Standing::Behind(None); others.len()]);
    let mut missing: Vec<String> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    for (&r, standing) in others.iter().zip(standings) {
        let g = label.global(r);
        match standing {
            Standing::Waiting => {}
            Standing::Gone(why) => notes.push(format!("rank {g} went away ({why})")),
            Standing::Finished => notes.push(format!("rank {g} finished #{seq} and went on")),
            Standing::Called => {
                notes.push(format!("rank {g} called #{seq} but its devices never started it (busy with earlier work?)"))
            }
            Standing::Behind(Some(issued)) => {
                missing.push(g.to_string());
                notes.push(format!("rank {g} last reported calling #{issued}"));
            }
            Standing::Behind(None) => missing.push(g.to_string()),
        }
    }
    let mut waiting: Vec<usize> = waiting_on.to_vec();
    waiting.sort_unstable();
    waiting.dedup();
    let waiting: Vec<String> = waiting.iter().map(|&r| label.global(r).to_string()).collect();
    let me = label.global(rank);
    let missing = match (missing.is_empty(), notes.is_empty()) {
        (true, true) => "every rank arrived but the data did not move (a rank is stuck inside it)".to_string(),
        (true, false) => notes.join("; "),
        (false, true) => format!("rank(s) {} never arrived", missing.join(", ")),
        (false, false) => format!("rank(s) {} never arrived ({})", missing.join(", "), notes.join("; ")),
    };
    format!(
        "{}{label} timed out after {:.1} s on rank {me}: {missing}; rank {me} was waiting for rank(s) {}. Every \
         rank must call the same collectives in the same order; raise COHORT_TIMEOUT (seconds) if the work \
         before it legitimately takes that long",
        current.fp,
        (current.deadline - current.started).as_secs_f64(),
        waiting.join(", ")
    )
}
