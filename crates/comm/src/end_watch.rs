//! [`EndWatch`]: how a waiter looks, from its own thread, whether the
//! device work of its collective ended (`work::Work`'s waits and a
//! `device::Solo`'s).

use std::time::Instant;

use cohort_runtime::backend::{EndSignal, END_SIGNAL_REPOLL};
use cohort_runtime::Client;
use smallvec::SmallVec;

/// A waiter's looks at the devices its collective runs on, from its own
/// thread: each look polls a device (ending what ended there) unless the
/// device's end signal, a host word it writes once the parts running at
/// the last poll ended (CUDA, see `Client::poll_collectives_signal`), is
/// not written yet; every `END_SIGNAL_REPOLL` it polls anyway (the word
/// may stand behind another thread's longer part).
pub(crate) struct EndWatch<'a> {
    clients: &'a [Client],
    signals: SmallVec<[Option<EndSignal>; 4]>,
    last_poll: Instant,
}

impl<'a> EndWatch<'a> {
    pub(crate) fn new(clients: &'a [Client]) -> Self {
        Self { clients, signals: clients.iter().map(|_| None).collect(), last_poll: Instant::now() }
    }

    /// Polls the devices whose signal says to; whether it polled any (only
    /// then can the collective have ended by this thread's hand).
    pub(crate) fn look(&mut self) -> bool {
        let repoll = self.last_poll.elapsed() >= END_SIGNAL_REPOLL;
        let mut polled = false;
        for (client, signal) in self.clients.iter().zip(self.signals.iter_mut()) {
            if repoll || signal.as_ref().is_none_or(EndSignal::reached) {
                *signal = client.poll_collectives_signal();
                polled = true;
            }
        }
        if polled {
            self.last_poll = Instant::now();
        }
        polled
    }
}
