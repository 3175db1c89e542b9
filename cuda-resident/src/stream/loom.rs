//! Model checks of the timeline's protocol under every interleaving loom explores (run with
//! `RUSTFLAGS="--cfg loom"`, docs/reliability.md): the lane's own [`Completed`],
//! [`retire_front`] and [`covering`], with the driver replaced by a thread that plays the
//! device (it writes a submission's bytes, then sets its event).

use std::collections::VecDeque;

use loom::cell::UnsafeCell;

use super::lane::{Completed, covering, retire_front};
use crate::sync::shim::atomic::{AtomicBool, Ordering};
use crate::sync::shim::{Arc, Mutex, lock, thread};

/// A submission in flight: its number and its event.
struct Work {
    seq: u64,
    event: usize,
}

/// What the lane's lock guards (the part the model needs).
#[derive(Default)]
struct State {
    inflight: VecDeque<Work>,
    retired: Vec<u64>,
}

/// A lane of two submissions and the device that runs them.
struct Lane {
    state: Mutex<State>,
    completed: Completed,
    /// The events of submissions 1 and 2: set by the device once their work is done.
    events: [AtomicBool; 2],
    /// The bytes each submission brings (a download into pinned memory).
    bytes: [UnsafeCell<u8>; 2],
}

// SAFETY: `bytes[i]` is written by the device thread alone, before it sets `events[i]`,
// and read only by threads that learned that submission `i + 1` completed; loom checks
// that every such read happens after the write.
unsafe impl Sync for Lane {}

impl Lane {
    fn new() -> Lane {
        Lane {
            state: Mutex::new(State::default()),
            completed: Completed::new(),
            events: [AtomicBool::new(false), AtomicBool::new(false)],
            bytes: [UnsafeCell::new(0), UnsafeCell::new(0)],
        }
    }

    /// Records submission `seq` (`Lane::submit`: under the lock, in order).
    fn record(&self, seq: u64) {
        lock(&self.state).inflight.push_back(Work { seq, event: seq as usize - 1 });
    }

    /// The device runs submission `i + 1`: its bytes, then its event.
    fn complete(&self, i: usize) {
        // SAFETY: the device thread is the only writer (see `Sync` above).
        self.bytes[i].with_mut(|b| unsafe { *b = i as u8 + 1 });
        self.events[i].store(true, Ordering::Release);
    }

    /// Retires while `done` (`Lane::retire_while`).
    fn retire_while(&self, done: impl FnMut(&Work) -> crate::error::Result<bool>) {
        let mut state = lock(&self.state);
        let State { inflight, retired } = &mut *state;
        retire_front(inflight, |w| w.seq, &self.completed, done, |w| retired.push(w.seq)).unwrap();
    }

    /// `Lane::poll`: asks each event at the head.
    fn poll(&self) {
        self.retire_while(|w| Ok(self.events[w.event].load(Ordering::Acquire)));
    }

    /// `Lane::wait`: the fast path, else the covering event, waited for, then retires
    /// through it.
    fn wait(&self, seq: u64) {
        if self.completed.covers(seq) {
            return;
        }
        let Some((through, event)) =
            covering(&lock(&self.state).inflight, |w| w.seq, seq).map(|w| (w.seq, w.event))
        else {
            return;
        };
        // `cuEventSynchronize`.
        while !self.events[event].load(Ordering::Acquire) {
            thread::yield_now();
        }
        self.retire_while(|w| Ok(w.seq <= through));
    }

    /// The bytes of submission `i + 1`, which the caller knows completed.
    fn read(&self, i: usize) -> u8 {
        // SAFETY: read after the write, or loom reports the race (see `Sync` above).
        self.bytes[i].with(|b| unsafe { *b })
    }
}

/// While a poller races the submitter and a waiter: a waiter for submission 2 returns
/// only once 2 is done, and sees its bytes and those of 1 (stream order); a thread that
/// finds a number covered sees that submission's bytes; the completed number never goes
/// back; each submission retires once, in order.
#[test]
fn loom_timeline_wait_poll_and_record() {
    loom::model(|| {
        let lane = Arc::new(Lane::new());
        lane.record(1);
        let poller = {
            let lane = Arc::clone(&lane);
            thread::spawn(move || {
                lane.poll();
                let seen = lane.completed.get();
                if lane.completed.covers(1) {
                    assert_eq!(lane.read(0), 1, "covered, so its bytes are in");
                }
                lane.poll();
                assert!(lane.completed.get() >= seen, "the completed number went back");
            })
        };
        lane.record(2);
        let device = {
            let lane = Arc::clone(&lane);
            thread::spawn(move || {
                lane.complete(0);
                lane.complete(1);
            })
        };
        lane.wait(2);
        assert!(lane.completed.covers(2), "a wait returned before its submission was done");
        assert_eq!((lane.read(0), lane.read(1)), (1, 2));
        poller.join().unwrap();
        device.join().unwrap();
        assert_eq!(lock(&lane.state).retired, vec![1, 2]);
        assert!(lock(&lane.state).inflight.is_empty());
    });
}
