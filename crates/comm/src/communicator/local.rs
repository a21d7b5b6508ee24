//! The meeting of one call's local parts: each local device's task brings
//! its buffers (host pointers on the CPU backend, staged copies elsewhere),
//! the last to arrive runs the call between ranks for all of them, and each
//! task then writes its staged outputs back on its own device thread.
//!
//! Who touches which bytes when: a task publishes the addresses of its
//! buffers and then blocks until the meeting is `done`; once every local
//! task arrived none returns before `done` (no timeout applies then, the
//! world's own deadline bounds the leader), so the memory stays reserved and
//! untouched by its device thread while the leader uses it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::{AlignedBytes, BufferAccess, DeviceId, ServerError};
use parking_lot::{Condvar, Mutex};

/// A task's input as the leader sees it.
pub(crate) enum InView {
    /// Host-addressable device memory: address and length.
    Ptr(usize, usize),
    /// A staged copy.
    Owned(AlignedBytes),
}

/// A task's output as the leader sees it.
pub(crate) enum OutView {
    Ptr(usize, usize),
    /// Staged: the leader fills a host buffer of this length.
    Staged(usize),
}

/// What the leader gets: each slot's input and output.
pub(crate) struct Views {
    pub ins: Vec<Option<InView>>,
    pub outs: Vec<Option<OutView>>,
}

#[derive(Default)]
struct State {
    arrived: usize,
    present: Vec<bool>,
    ins: Vec<Option<InView>>,
    outs: Vec<Option<OutView>>,
    /// Staged outputs, per slot, once done.
    results: Vec<Option<Vec<u8>>>,
    done: bool,
    failure: Option<ServerError>,
}

/// The leader's work: runs the call over the views, returns staged outputs
/// (per slot) or why it failed.
pub(crate) type Plan = Box<dyn FnOnce(Views) -> Result<Vec<Option<Vec<u8>>>, String> + Send>;

/// One call's meeting of local tasks.
pub(crate) struct Meeting {
    name: &'static str,
    devices: Vec<DeviceId>,
    timeout: Duration,
    plan: Mutex<Option<Plan>>,
    state: Mutex<State>,
    cv: Condvar,
}

impl Meeting {
    pub(crate) fn new(name: &'static str, devices: Vec<DeviceId>, timeout: Duration, plan: Plan) -> Arc<Meeting> {
        let n = devices.len();
        let state = State {
            present: vec![false; n],
            ins: (0..n).map(|_| None).collect(),
            outs: (0..n).map(|_| None).collect(),
            results: vec![None; n],
            ..State::default()
        };
        Arc::new(Meeting {
            name,
            devices,
            timeout,
            plan: Mutex::new(Some(plan)),
            state: Mutex::new(state),
            cv: Condvar::new(),
        })
    }

    fn error(&self, slot: usize, reason: String) -> ServerError {
        ServerError::Collective { collective: self.name.to_string(), device: self.devices[slot], reason }
    }

    /// Fails the call (first failure wins) and wakes every waiter.
    pub(crate) fn fail(&self, err: ServerError) -> ServerError {
        let mut state = self.state.lock();
        let failure = state.failure.get_or_insert(err).clone();
        state.done = true;
        self.cv.notify_all();
        failure
    }

    /// Blocks the calling thread until the call finished; its failure.
    pub(crate) fn wait(&self) -> Result<(), ServerError> {
        let mut state = self.state.lock();
        while !state.done {
            self.cv.wait(&mut state);
        }
        state.failure.clone().map_or(Ok(()), Err)
    }

    /// A local task's body: `has_in`/`has_out` say which buffers (in that
    /// order) the task was queued with.
    pub(crate) fn run_task(
        &self,
        slot: usize,
        has_in: bool,
        has_out: bool,
        access: Result<&mut BufferAccess<'_>, ServerError>,
    ) -> Result<(), ServerError> {
        let access = match access {
            Ok(a) => a,
            Err(err) => return Err(self.fail(err)),
        };
        let mut index = 0;
        let input = if has_in {
            index += 1;
            Some(match access.host_ptr(0) {
                Some(p) => InView::Ptr(p.ptr as usize, p.len),
                None => InView::Owned(access.read(0).map_err(|e| self.fail(e))?),
            })
        } else {
            None
        };
        let output = if has_out {
            let size = access.size(index) as usize;
            Some(match access.host_ptr(index) {
                Some(p) => OutView::Ptr(p.ptr as usize, p.len),
                None => OutView::Staged(size),
            })
        } else {
            None
        };
        let mut state = self.state.lock();
        if let Some(err) = &state.failure {
            return Err(err.clone());
        }
        state.ins[slot] = input;
        state.outs[slot] = output;
        state.present[slot] = true;
        state.arrived += 1;
        if state.arrived == self.devices.len() {
            let views = Views { ins: std::mem::take(&mut state.ins), outs: std::mem::take(&mut state.outs) };
            drop(state);
            let plan = self.plan.lock().take().expect("one leader");
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| plan(views)))
                .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(p.as_ref()))));
            let mut state = self.state.lock();
            match result {
                Ok(results) => state.results = results,
                Err(reason) => {
                    let err = self.error(slot, reason);
                    state.failure.get_or_insert(err);
                }
            }
            state.done = true;
            self.cv.notify_all();
        } else {
            let deadline = Instant::now() + self.timeout;
            while state.arrived < self.devices.len() && state.failure.is_none() {
                if self.cv.wait_until(&mut state, deadline).timed_out() && state.arrived < self.devices.len() {
                    let missing: Vec<String> = (0..self.devices.len())
                        .filter(|&s| !state.present[s])
                        .map(|s| self.devices[s].to_string())
                        .collect();
                    let err = self.error(
                        slot,
                        format!(
                            "local device(s) {} of this rank never reached it within {:.1} s (still busy with \
                             earlier work?)",
                            missing.join(", "),
                            self.timeout.as_secs_f64()
                        ),
                    );
                    state.failure.get_or_insert(err);
                    state.done = true;
                    self.cv.notify_all();
                }
            }
            while !state.done {
                self.cv.wait(&mut state);
            }
            drop(state);
        }
        let mut state = self.state.lock();
        if let Some(err) = &state.failure {
            return Err(err.clone());
        }
        let staged = state.results.get_mut(slot).and_then(Option::take);
        drop(state);
        if let Some(bytes) = staged {
            access.write(index, &bytes).map_err(|e| self.fail(e))?;
        }
        Ok(())
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}
