use std::sync::Arc;

use cuda_sys::{CUDA_ERROR_LAUNCH_FAILED, Driver, Fault};

use super::*;
use crate::error::Result;
use crate::host_pool::HostPool;
use crate::sync::lock;
use crate::testing::model::{self, complete_all, with};

/// A lane on the model GPU, and its driver (for faults).
fn lane() -> (Arc<Driver>, Lane) {
    let driver = model::driver();
    let lane = Lane::new(LaneKind::Upload, model::context(&driver)).unwrap();
    (driver, lane)
}

/// A batch that reserved three numbers and submitted one: as after a failure part-way.
fn stop_after_one_of_three(lane: &Lane) {
    let batch = lane.batch();
    batch.reserve(3);
    assert_eq!(batch.submit(Vec::new(), |_, _, _| Ok(())).unwrap(), 1);
}

#[test]
fn a_batch_that_stops_part_way_completes_its_numbers_with_the_work_before_them() {
    let (_driver, lane) = lane();
    stop_after_one_of_three(&lane);
    assert_eq!(lane.last_submitted(), 3, "2 and 3 are used up");
    assert!(!lane.is_done(3).unwrap(), "not done before the work before them");
    assert!(!lane.is_done(2).unwrap());
    complete_all();
    assert!(lane.is_done(2).unwrap() && lane.is_done(3).unwrap());
    assert_eq!(lane.batch().next_seq(), 4, "the next batch continues after them");
}

#[test]
fn when_no_marker_can_be_recorded_the_stream_is_waited_for_and_everything_retires() {
    let (driver, lane) = lane();
    // The first record is the submission's, the second the marker's.
    driver.faults().inject(Fault::new("cuEventRecord", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    stop_after_one_of_three(&lane);
    assert_eq!(with(|g| g.stream_syncs), 1, "the stream was synchronized instead");
    assert!(lane.is_known_done(3), "and everything up to the reserved numbers retired");
    assert_eq!(lane.oldest_in_flight(), None);
}

#[test]
fn a_wait_for_a_number_that_never_got_an_event_waits_for_the_newest_work() {
    let (driver, lane) = lane();
    // Neither the marker nor the stream synchronize: a context in trouble.
    driver.faults().inject(Fault::new("cuEventRecord", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    driver.faults().inject(Fault::new("cuStreamSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    stop_after_one_of_three(&lane);
    let first = {
        let state = lock(&lane.state);
        assert_eq!(state.inflight.iter().map(|f| f.seq).collect::<Vec<_>>(), vec![1]);
        model::id(state.inflight[0].event)
    };
    assert!(!lane.is_known_done(3));
    // Number 3 has no event of its own: waiting for it waits for submission 1, the
    // newest work in flight, rather than returning at once.
    assert!(lane.wait(3).unwrap(), "it had to wait");
    assert_eq!(with(|g| g.event_waits.clone()), vec![first]);
    assert!(lane.is_done(1).unwrap());
}

#[test]
fn staging_of_a_submission_whose_record_and_synchronize_fail_is_never_lent_again() {
    let (driver, lane) = lane();
    let pool = Arc::new(HostPool::new(model::context(&driver), 1 << 20, 0, false));
    let lease = Arc::new(pool.try_acquire(4096).unwrap().expect("room in the pool"));
    driver.faults().inject(Fault::new("cuEventRecord", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    driver.faults().inject(Fault::new("cuStreamSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    let err = lane.batch().submit(vec![Arc::clone(&lease)], |_, _, _| Ok(())).unwrap_err();
    assert!(err.to_string().contains("cuEventRecord"), "{err}");
    drop(lease);
    assert!(pool.stats().lent_bytes > 0, "what the copy may still use is not back in the pool");
    drop(lane);
    assert_eq!(pool.stats().lent_bytes, 0, "returned once the lane is gone");
}

#[test]
fn a_wait_retires_everything_up_to_its_submission_without_querying_each() {
    let (driver, lane) = lane();
    let pool = Arc::new(HostPool::new(model::context(&driver), 1 << 20, 0, false));
    let leases: Vec<_> = (0..3).map(|_| Arc::new(pool.try_acquire(4096).unwrap().unwrap())).collect();
    let seqs: Vec<u64> =
        leases.iter().map(|l| lane.batch().submit(vec![Arc::clone(l)], |_, _, _| Ok(())).unwrap()).collect();
    let later = lane.batch().submit(Vec::new(), |_, _, _| Ok(())).unwrap();
    drop(leases);
    complete_all();
    driver.faults().record();
    assert!(lane.wait(seqs[2]).unwrap());
    let counts = driver.faults().counts();
    assert_eq!(counts.get("cuEventQuery").map_or(0, |c| c.calls), 0, "{counts:?}");
    assert!(lane.is_known_done(seqs[2]), "the three are retired");
    assert_eq!(pool.stats().lent_bytes, 0, "and their staging is back");
    assert!(!lane.is_known_done(later), "a later one is left for a poll");
    assert!(lane.is_done(later).unwrap());
}

/// Device memory of 4096 bytes, and pinned memory holding random bytes and poison.
struct SideCopy {
    dev: u64,
    src: *mut u8,
    out: *mut u8,
}

impl SideCopy {
    fn new(lane: &Lane) -> SideCopy {
        let raw = &lane.ctx.raw;
        let (src, out) = (raw.mem_host_alloc(4096).unwrap(), raw.mem_host_alloc(4096).unwrap());
        let mut rng = fastrand::Rng::with_seed(7);
        // SAFETY: two fresh pinned allocations of 4096 bytes.
        unsafe {
            std::slice::from_raw_parts_mut(src, 4096).fill_with(|| rng.u8(..));
            std::slice::from_raw_parts_mut(out, 4096).fill(0xA5);
        }
        SideCopy { dev: raw.mem_alloc(4096).unwrap(), src, out }
    }

    /// The bytes up on the lane's stream (a submission); down on the side stream.
    fn enqueue(&self, batch: &LaneBatch<'_>) -> Result<()> {
        // SAFETY: live pinned and device allocations of 4096 bytes.
        batch.submit(Vec::new(), |raw, stream, _| unsafe {
            raw.memcpy_htod_async(self.dev, self.src, 4096, stream)
        })?;
        batch.submit_side(0, |raw, side| {
            // SAFETY: as above; `out` is not read before the copy is waited for.
            unsafe { raw.memcpy_dtoh_async(self.out, self.dev, 4096, side) }
        })
    }

    fn came_back(&self) -> bool {
        // SAFETY: live pinned allocations, no copy in flight (the model runs work when waited for).
        unsafe { std::slice::from_raw_parts(self.out, 4096) == std::slice::from_raw_parts(self.src, 4096) }
    }
}

#[test]
fn side_work_starts_after_the_lanes_last_submission() {
    let (_driver, lane) = lane();
    let c = SideCopy::new(&lane);
    let batch = lane.batch();
    c.enqueue(&batch).unwrap();
    // Waiting for the side stream alone runs the upload first.
    let side = lock(&lane.state).side.as_ref().unwrap().stream;
    lane.ctx.raw.stream_synchronize(side).unwrap();
    assert!(c.came_back());
    batch.join_side().unwrap();
}

#[test]
fn after_a_join_the_next_number_covers_the_side_work() {
    let (_driver, lane) = lane();
    let c = SideCopy::new(&lane);
    let batch = lane.batch();
    c.enqueue(&batch).unwrap();
    batch.join_side().unwrap();
    let seq = batch.submit(Vec::new(), |_, _, _| Ok(())).unwrap();
    drop(batch);
    assert!(!c.came_back(), "nothing ran yet");
    lane.wait(seq).unwrap();
    assert!(c.came_back(), "waiting for the number ran the side work");
}

#[test]
fn a_batch_dropped_with_side_work_unjoined_completes_its_numbers_after_it() {
    let (_driver, lane) = lane();
    let c = SideCopy::new(&lane);
    let batch = lane.batch();
    batch.reserve(3);
    c.enqueue(&batch).unwrap();
    drop(batch);
    lane.wait(3).unwrap();
    assert!(c.came_back(), "the marker for 2 and 3 came after the side work");
}

#[test]
fn a_join_that_cannot_enqueue_its_wait_synchronizes_the_side_stream() {
    let (driver, lane) = lane();
    let c = SideCopy::new(&lane);
    // The first wait is the side stream's for the lane, the second the join's.
    driver.faults().inject(Fault::new("cuStreamWaitEvent", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    let batch = lane.batch();
    c.enqueue(&batch).unwrap();
    batch.join_side().unwrap();
    assert_eq!(with(|g| g.stream_syncs), 1);
    assert!(c.came_back(), "done before the join returned");
}

#[test]
fn side_work_whose_end_cannot_be_recorded_fails_and_is_joined_by_a_synchronize() {
    let (driver, lane) = lane();
    let c = SideCopy::new(&lane);
    // The first record is the upload's submission, the second the side work's end.
    driver.faults().inject(Fault::new("cuEventRecord", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    let batch = lane.batch();
    let err = c.enqueue(&batch).unwrap_err();
    assert!(err.to_string().contains("cuEventRecord"), "{err}");
    // A later side end recorded fine does not make the lost one joinable by a wait.
    batch.submit_side(1, |_, _| Ok(())).unwrap();
    batch.join_side().unwrap();
    assert_eq!(with(|g| g.stream_syncs), 1);
    assert!(c.came_back());
}

#[test]
fn a_side_stream_that_cannot_be_made_fails_with_nothing_enqueued_and_the_next_try_makes_it() {
    let (driver, lane) = lane();
    driver.faults().inject(Fault::new("cuStreamCreate", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    let batch = lane.batch();
    let ran = std::cell::Cell::new(false);
    let side_work = || {
        batch.submit_side(0, |_, _| {
            ran.set(true);
            Ok(())
        })
    };
    let err = side_work().unwrap_err();
    assert!(err.to_string().contains("cuStreamCreate") && !ran.get(), "{err}");
    // A second event fails: the stream and the first event are released.
    driver.faults().inject(Fault::new("cuEventCreate", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    side_work().unwrap_err();
    assert!(!ran.get());
    side_work().unwrap();
    assert!(ran.get());
    drop(batch);
    drop(lane);
    // Counted from the first fault on: the lane's own stream was made before.
    let counts = driver.faults().counts();
    let made = |entry: &str| counts.get(entry).map_or(0, |c| c.succeeded);
    assert_eq!(made("cuStreamCreate"), 2, "{counts:?}");
    assert_eq!(made("cuStreamDestroy_v2"), 2 + 1, "{counts:?}");
    assert_eq!(made("cuEventCreate"), 3, "{counts:?}");
    assert_eq!(made("cuEventDestroy_v2"), 3, "{counts:?}");
}

#[test]
fn a_fence_outlives_its_device_and_its_wait_counts_as_a_host_wait() {
    let d = crate::testing::device(crate::testing::small_chunks());
    let b = d.allocate(4096).unwrap();
    let fence = {
        let mut batch = d.uploads();
        batch.write(b, 0, &[7u8; 4096]).unwrap();
        batch.submit().unwrap()
    };
    let early = fence.clone();
    assert!(!fence.is_complete().unwrap(), "the model runs nothing until the host waits");
    early.wait().unwrap();
    assert_eq!(d.telemetry().host_waits, 1);
    let mut batch = d.uploads();
    batch.write(b, 0, &[8u8; 4096]).unwrap();
    let late = batch.submit().unwrap();
    drop(d);
    // The device went first; its lanes and context stay with the fences.
    assert!(late.is_complete().unwrap(), "dropping the device waited for its copies");
    late.wait().unwrap();
    // SAFETY: the null stream of a context that is still alive.
    unsafe { late.make_stream_wait(std::ptr::null_mut()) }.unwrap();
    assert!(fence.is_complete().unwrap());
}

#[test]
fn a_failed_submission_with_a_working_stream_returns_its_staging_after_waiting() {
    let (driver, lane) = lane();
    let pool = Arc::new(HostPool::new(model::context(&driver), 1 << 20, 0, false));
    let lease = Arc::new(pool.try_acquire(4096).unwrap().expect("room in the pool"));
    driver.faults().inject(Fault::new("cuEventRecord", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
    lane.batch().submit(vec![Arc::clone(&lease)], |_, _, _| Ok(())).unwrap_err();
    assert_eq!(with(|g| g.stream_syncs), 1);
    drop(lease);
    assert_eq!(pool.stats().lent_bytes, 0);
}
