//! One copy between host memory and a device buffer, made by each method in turn (the raw
//! driver, `cuMemcpyBatchAsync`, cuda-resident), timed, and verified: the single-copy,
//! sweep and latency cases, one direction or both at once.

use std::time::Instant;

use cuda_resident::cuda_sys::{CUdeviceptr, CUstream, call};
use cuda_resident::{Device, ResidentBuffer};

use crate::baselines::{DriverBaseline, check, memcpy_batch, sync};
use crate::cli::SingleOrder;
use crate::report::{Figure, human};
use crate::timing::{Spread, secs_together};
use crate::{BenchResult, error};

/// Copies a repetition of the latency cases times one by one.
const LATENCY_COPIES: usize = 2000;

/// A value measured for each method: the raw driver, `cuMemcpyBatchAsync` (`None` where the
/// driver lacks it or the case has no batch form) and cuda-resident.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ByMethod<T> {
    pub(crate) raw: T,
    pub(crate) batch: Option<T>,
    pub(crate) ours: T,
}

/// Who makes a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// The raw driver, one call per copy.
    Raw,
    /// `cuMemcpyBatchAsync` with one copy.
    Batch,
    /// cuda-resident.
    Ours,
}

/// The host side of a single copy: the source of an upload or the destination of a download.
pub(crate) enum Host<'a> {
    Src(&'a [u8]),
    Dst(&'a mut [u8]),
}

/// One copy between host memory and the start of a device buffer, which every method can
/// make, waiting until it is done.
///
/// The raw driver uses `cuMemcpy*Async` on `stream` + synchronize for pinned memory, and
/// for pageable memory either the synchronous `cuMemcpyHtoD` / `cuMemcpyDtoH` (bandwidth
/// cases) or the same async call + synchronize (`raw_async`: latency and both-at-once
/// cases, where two synchronous calls would meet on the legacy stream). cuda-resident uses
/// `upload_at` / `download_to_slice` (pageable) or `upload_async_at` / `download_async_at` +
/// fence wait (pinned).
pub(crate) struct Single<'a> {
    d: &'a Device,
    stream: CUstream,
    buffer: ResidentBuffer,
    ptr: CUdeviceptr,
    host: Host<'a>,
    pinned: bool,
    raw_async: bool,
}

// SAFETY: the driver API may be called from any thread and a `CUstream` handle used from
// any of them; the other fields are `Send`. A `Single` is used by one thread at a time.
unsafe impl Send for Single<'_> {}

impl<'a> Single<'a> {
    pub(crate) fn new(
        d: &'a Device,
        stream: CUstream,
        buffer: ResidentBuffer,
        host: Host<'a>,
        pinned: bool,
        raw_async: bool,
    ) -> BenchResult<Single<'a>> {
        let ptr = d.device_ptr(buffer).map_err(error)?;
        Ok(Single { d, stream, buffer, ptr, host, pinned, raw_async })
    }

    fn len(&self) -> usize {
        match &self.host {
            Host::Src(src) => src.len(),
            Host::Dst(dst) => dst.len(),
        }
    }

    fn label(&self) -> String {
        let dir = if matches!(self.host, Host::Src(_)) { "H2D" } else { "D2H" };
        let memory = if self.pinned { "pinned" } else { "pageable" };
        format!("{dir} {memory} {}", human(self.len()))
    }

    /// One copy by `method`, waited for.
    fn once(&mut self, method: Method) -> BenchResult<()> {
        let (d, stream, buffer, ptr, len) = (self.d, self.stream, self.buffer, self.ptr, self.len());
        let (pinned, asynchronous) = (self.pinned, self.pinned || self.raw_async);
        let driver = d.driver();
        match (method, &mut self.host) {
            (Method::Raw, Host::Src(src)) if asynchronous => {
                // SAFETY: `len` bytes of live host memory into a buffer of at least `len`
                // bytes; synchronized before the borrow ends.
                check("cuMemcpyHtoDAsync", unsafe {
                    call!(driver, cuMemcpyHtoDAsync_v2(ptr, src.as_ptr().cast(), len, stream))
                })?;
                sync(d, stream)
            }
            (Method::Raw, Host::Src(src)) => {
                // SAFETY: as above, and the call returns when the copy is done.
                check("cuMemcpyHtoD", unsafe {
                    call!(driver, cuMemcpyHtoD_v2(ptr, src.as_ptr().cast(), len))
                })
            }
            (Method::Raw, Host::Dst(dst)) if asynchronous => {
                // SAFETY: `len` bytes of the buffer into live host memory of `len` bytes;
                // synchronized before the borrow ends.
                check("cuMemcpyDtoHAsync", unsafe {
                    call!(driver, cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), ptr, len, stream))
                })?;
                sync(d, stream)
            }
            (Method::Raw, Host::Dst(dst)) => {
                // SAFETY: as above, and the call returns when the copy is done.
                check("cuMemcpyDtoH", unsafe {
                    call!(driver, cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), ptr, len))
                })
            }
            (Method::Batch, Host::Src(src)) => {
                memcpy_batch(d, stream, &mut [ptr], &mut [src.as_ptr() as u64], &mut [len], true)
            }
            (Method::Batch, Host::Dst(dst)) => {
                memcpy_batch(d, stream, &mut [dst.as_mut_ptr() as u64], &mut [ptr], &mut [len], false)
            }
            (Method::Ours, Host::Src(src)) if pinned => {
                // SAFETY: pinned source of `len` bytes, alive until the fence is waited on.
                unsafe { d.upload_async_at(buffer, 0, src.as_ptr(), len) }
                    .and_then(|f| f.wait())
                    .map_err(error)
            }
            (Method::Ours, Host::Src(src)) => d.upload_at(buffer, 0, src).map_err(error),
            (Method::Ours, Host::Dst(dst)) if pinned => {
                // SAFETY: pinned destination of `len` bytes, untouched until the fence is waited on.
                unsafe { d.download_async_at(buffer, 0, dst.as_mut_ptr(), len) }
                    .and_then(|f| f.wait())
                    .map_err(error)
            }
            (Method::Ours, Host::Dst(dst)) => d.download_to_slice(buffer, 0, dst).map_err(error),
        }
    }

    /// Overwrites the copy's destination with 0xA5 (the device range through the raw
    /// driver), so that what cuda-resident moves next is what gets verified.
    fn scramble(&mut self) -> BenchResult<()> {
        match &mut self.host {
            Host::Src(_) => {
                // SAFETY: `len` bytes of a live buffer; synchronized below.
                check("cuMemsetD8Async", unsafe {
                    call!(self.d.driver(), cuMemsetD8Async(self.ptr, 0xA5, self.len(), self.stream))
                })?;
                sync(self.d, self.stream)
            }
            Host::Dst(dst) => {
                dst.fill(0xA5);
                Ok(())
            }
        }
    }

    /// Checks that the host memory and the device range hold the same bytes, reading the
    /// device through the raw driver.
    fn verify(&self) -> BenchResult<()> {
        let mut device = vec![0u8; self.len()];
        // SAFETY: `len` bytes of a live buffer into a vector of `len` bytes.
        check("cuMemcpyDtoH", unsafe {
            call!(self.d.driver(), cuMemcpyDtoH_v2(device.as_mut_ptr().cast(), self.ptr, self.len()))
        })?;
        let host: &[u8] = match &self.host {
            Host::Src(src) => src,
            Host::Dst(dst) => dst,
        };
        if host != &device[..] {
            return Err(crate::mismatch(format!(
                "{}: bytes differ after cuda-resident's copy",
                self.label()
            )));
        }
        Ok(())
    }

    /// The methods, in the order they take turns: the raw driver, the batch API where the
    /// driver has it, cuda-resident.
    fn methods(&self) -> Vec<Method> {
        let batch = self.d.info().batch_memcpy.then_some(Method::Batch);
        [Method::Raw].into_iter().chain(batch).chain([Method::Ours]).collect()
    }

    /// Each method's figure from `figures`, in [`Single::methods`] order.
    fn by_method<T>(&self, figures: impl IntoIterator<Item = T>) -> ByMethod<T> {
        let mut figures = figures.into_iter();
        let raw = figures.next().expect("raw is measured");
        let batch = if self.d.info().batch_memcpy { figures.next() } else { None };
        let ours = figures.next().expect("cuda-resident is measured");
        ByMethod { raw, batch, ours }
    }

    /// The methods take turns: `warm_ups` runs of `step` by each, then `rounds` rounds in
    /// which each method runs `step` once, timed, so that a burst of noise on the link or the
    /// host falls on all of them alike rather than on one method's block of runs
    /// ([`SingleOrder::Blocks`]: each method's `rounds` runs back to back instead). Each
    /// method's seconds a run, in [`Single::methods`] order. cuda-resident's destination is
    /// scrambled before one more run of its `step` and verified after it.
    fn take_turns(
        &mut self,
        warm_ups: usize,
        (rounds, order): (usize, SingleOrder),
        step: impl Fn(&mut Self, Method) -> BenchResult<()>,
    ) -> BenchResult<Vec<Vec<f64>>> {
        let methods = self.methods();
        for &method in &methods {
            (0..warm_ups).try_for_each(|_| step(self, method))?;
        }
        let mut secs = vec![Vec::with_capacity(rounds); methods.len()];
        let timed = |copy: &mut Self, method, secs: &mut Vec<f64>| {
            let t = Instant::now();
            step(copy, method)?;
            secs.push(t.elapsed().as_secs_f64());
            BenchResult::Ok(())
        };
        match order {
            SingleOrder::Turns => {
                for _ in 0..rounds {
                    for (&method, secs) in methods.iter().zip(&mut secs) {
                        timed(self, method, secs)?;
                    }
                }
            }
            SingleOrder::Blocks => {
                for (&method, secs) in methods.iter().zip(&mut secs) {
                    (0..rounds).try_for_each(|_| timed(self, method, secs))?;
                }
            }
        }
        self.scramble()?;
        step(self, Method::Ours)?;
        self.verify()?;
        Ok(secs)
    }

    /// The spread of the seconds of `iters` back-to-back copies by each method: one warm-up
    /// each, then the methods take turns rep by rep ([`Single::take_turns`]).
    pub(crate) fn times(
        &mut self,
        reps: usize,
        order: SingleOrder,
        iters: usize,
    ) -> BenchResult<ByMethod<Spread>> {
        let secs = self.take_turns(1, (reps.max(1), order), |copy, method| {
            (0..iters).try_for_each(|_| copy.once(method))
        })?;
        Ok(self.by_method(secs.into_iter().map(|mut v| Spread::of(&mut v).expect("at least one repetition"))))
    }

    /// Median and 99th percentile, in µs, of one copy by each method, each with the spread
    /// of every copy timed: `LATENCY_COPIES` warm-up copies each, then `reps` times as many
    /// timed one by one, the methods taking turns copy by copy ([`Single::take_turns`]).
    pub(crate) fn latencies(&mut self, reps: usize) -> BenchResult<ByMethod<[Figure; 2]>> {
        let secs =
            self.take_turns(LATENCY_COPIES, (reps * LATENCY_COPIES, SingleOrder::Turns), |copy, method| {
                copy.once(method)
            })?;
        Ok(self.by_method(secs.into_iter().map(|secs| {
            let mut us: Vec<f64> = secs.into_iter().map(|s| s * 1e6).collect();
            let spread = Spread::of(&mut us).expect("reps * LATENCY_COPIES copies timed");
            [Figure::median(spread), Figure { value: us[us.len() * 99 / 100], spread }]
        })))
    }
}

/// Seconds of `iters` copies of `up` and `iters` of `down` at the same time, by `method`:
/// each direction on its own thread, both released together, the clock running until the
/// later one is done.
fn time_both(up: &mut Single, down: &mut Single, iters: usize, method: Method) -> BenchResult<f64> {
    let d = up.d;
    secs_together(
        d,
        || (0..iters).try_for_each(|_| up.once(method)),
        || (0..iters).try_for_each(|_| down.once(method)),
    )
}

/// Runs `f` with `src` and `dst` registered with the driver (pinned), and unregisters them
/// afterwards whatever `f` returned.
pub(crate) fn with_pinned<R>(
    d: &Device,
    src: &mut [u8],
    dst: &mut [u8],
    f: impl FnOnce(&mut [u8], &mut [u8]) -> BenchResult<R>,
) -> BenchResult<R> {
    // SAFETY: both slices are borrowed for this whole call, so they stay alive and unmoved
    // until unpinned below.
    unsafe { d.pin_host(src.as_mut_ptr(), src.len()) }.map_err(error)?;
    // SAFETY: as above.
    if let Err(e) = unsafe { d.pin_host(dst.as_mut_ptr(), dst.len()) } {
        // SAFETY: pinned just above; nothing uses it.
        let _ = unsafe { d.unpin_host(src.as_mut_ptr()) };
        return Err(error(e));
    }
    let result = f(src, dst);
    // SAFETY: every copy that `f` made has been waited for.
    let unpinned = unsafe { d.unpin_host(src.as_mut_ptr()).and(d.unpin_host(dst.as_mut_ptr())) };
    let value = result?;
    unpinned.map_err(error)?;
    Ok(value)
}

/// H2D (`src` into `b`), then D2H (`b` into `dst`), `iters` copies a sample, by each method;
/// cuda-resident's copies verified.
pub(crate) fn up_down(
    d: &Device,
    baseline: &DriverBaseline,
    (reps, order): (usize, SingleOrder),
    b: ResidentBuffer,
    (src, dst): (&[u8], &mut [u8]),
    pinned: bool,
    iters: usize,
) -> BenchResult<(ByMethod<Spread>, ByMethod<Spread>)> {
    let up = Single::new(d, baseline.stream, b, Host::Src(src), pinned, false)?.times(reps, order, iters)?;
    let down =
        Single::new(d, baseline.stream, b, Host::Dst(dst), pinned, false)?.times(reps, order, iters)?;
    Ok((up, down))
}

/// Both directions at once: `src` into `b` while `other` comes into `dst`, `iters` copies
/// each way a sample. The spread of the raw driver's and cuda-resident's seconds (no batch
/// form); cuda-resident's copies verified.
pub(crate) fn both_ways(
    d: &Device,
    baseline: &DriverBaseline,
    reps: usize,
    (b, other): (ResidentBuffer, ResidentBuffer),
    (src, dst): (&[u8], &mut [u8]),
    pinned: bool,
    iters: usize,
) -> BenchResult<ByMethod<Spread>> {
    // `other` gets known bytes first, so that what comes down can be checked.
    Single::new(d, baseline.stream, other, Host::Src(src), pinned, true)?.once(Method::Raw)?;
    let mut up = Single::new(d, baseline.stream, b, Host::Src(src), pinned, true)?;
    let mut down = Single::new(d, baseline.second, other, Host::Dst(dst), pinned, true)?;
    // One warm-up each, then the two take turns rep by rep, so that a burst of noise on the
    // link or the host falls on both alike; spreads. cuda-resident's destinations are
    // scrambled before its last run and verified after it.
    let methods = [Method::Raw, Method::Ours];
    let mut secs = [Vec::with_capacity(reps), Vec::with_capacity(reps)];
    for method in methods {
        time_both(&mut up, &mut down, iters, method)?;
    }
    for _ in 0..reps.max(1) {
        for (method, secs) in methods.into_iter().zip(&mut secs) {
            secs.push(time_both(&mut up, &mut down, iters, method)?);
        }
    }
    up.scramble()?;
    down.scramble()?;
    time_both(&mut up, &mut down, iters, Method::Ours)?;
    up.verify()?;
    down.verify()?;
    let [raw, ours] = secs.map(|mut v| Spread::of(&mut v).expect("at least one repetition"));
    Ok(ByMethod { raw, batch: None, ours })
}
