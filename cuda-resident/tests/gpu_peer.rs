//! Several GPUs in one host, on real GPUs: device sets, peer access, peer copy batches
//! checked byte for byte against a host model, ordering across devices, per-device budgets
//! and fan-out. Ignored where there is no GPU: `cargo test -- --include-ignored` on a
//! machine with two NVIDIA GPUs (the tests fail, saying so, where there are fewer). Every
//! test here is named `two_gpus_*`, so that `--skip two_gpus_` leaves them out on a machine
//! with one GPU.
//!
//! # Peer access, the staged fallback and the order of tests
//!
//! Peer access is the driver's state of a context: `Device::enable_peer` calls
//! `cuCtxEnablePeerAccess` on the primary contexts, which every `Device` of the process
//! shares, and nothing turns it off again. Which path a peer batch takes is decided per
//! `Device` value (`is_peer_enabled` is true once `enable_peer` was called with that value
//! or a clone), so today a set opened after another test enabled access still stages its
//! copies. A test of the staged path should rely on neither detail: `cargo test` runs the
//! tests of this file as threads of one process, in an order of its own.
//!
//! So every test that opens two GPUs goes through [`two_gpus`], which runs the staged check
//! ([`staged_run`]: ragged batches both ways and a read-after-write chain, on a set of its
//! own) once per process, before the test opens its devices, whichever test comes first;
//! concurrent callers wait for it. No test of this file can enable peer access before that
//! check has finished, whatever the order or the filter; `cargo nextest` (one process per
//! test) runs the check in each process, where it is just as valid. The check records
//! whether access was on before and after it and what each device counted as copied from
//! device memory (`peer_bytes`, zero on the staged path); its outcome is stored, not asserted
//! where it runs: `two_gpus_peer_batches_match_the_model_staged_before_peer_access_is_enabled` alone
//! asserts it, so a fault of the staged path fails that test and not whichever test
//! happened to trigger the check.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use cuda_resident::{Config, Device, DeviceSet, Error, FanOutPath, Fence, ResidentBuffer};

const MIB: u64 = 1 << 20;

/// Checks that `result` is an error of the variant `pattern` whose message gives a fix.
macro_rules! assert_error {
    ($result:expr, $pattern:pat, $what:expr) => {
        match $result {
            Err(e) => {
                let text = e.to_string();
                assert!(matches!(e, $pattern), "{}: expected {}, got: {text}", $what, stringify!($pattern));
                assert!(text.contains("Fix: "), "{}: the message gives no fix: {text}", $what);
            }
            Ok(_) => panic!("{}: expected {}, got Ok", $what, stringify!($pattern)),
        }
    };
}

/// Opens every GPU, after checking that there are two and after the staged check (see the
/// module's documentation). Fails, saying why, with fewer than two GPUs.
fn two_gpus() -> DeviceSet {
    let _ = staged_run();
    open_two()
}

/// Opens every GPU after checking that there are at least two; no staged check.
fn open_two() -> DeviceSet {
    let count = Device::count().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        count >= 2,
        "this test needs two GPUs and the driver sees {count}: run it on the two-GPU machine \
         (and check that CUDA_VISIBLE_DEVICES, if set, lists both)"
    );
    let set = DeviceSet::open_all().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(set.len(), count, "DeviceSet::open_all opens every GPU the driver sees");
    set
}

/// Devices 0 and 1 of the set.
fn pair(set: &DeviceSet) -> (&Device, &Device) {
    (set.get(0).unwrap(), set.get(1).unwrap())
}

/// Enables peer access between every pair of the set and checks that 0 and 1 have it.
fn enable_peers(set: &DeviceSet) {
    let pairs = set.enable_all_peers().unwrap_or_else(|e| panic!("{e}"));
    let (d0, d1) = pair(set);
    assert!(
        d0.is_peer_enabled(d1) && d1.is_peer_enabled(d0),
        "peer access between GPUs 0 and 1 is off after enable_all_peers (which reported {pairs}; \
         can_access_peer: {:?}): these tests expect two GPUs that can peer, as over NVLink \
         (nvidia-smi topo -m shows the links)",
        d0.can_access_peer(d1)
    );
}

fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// The first byte where two byte strings differ (`memcmp` first: fast in debug builds too).
fn first_difference(got: &[u8], expect: &[u8]) -> Option<usize> {
    if got == expect {
        return None;
    }
    let common = got.len().min(expect.len());
    Some(got.iter().zip(expect).position(|(a, b)| a != b).unwrap_or(common))
}

#[track_caller]
fn assert_bytes(got: &[u8], expect: &[u8], what: &str) {
    if let Some(at) = first_difference(got, expect) {
        panic!("{what}: {} bytes (expected {}) differ first at byte {at}", got.len(), expect.len());
    }
}

/// Buffers on one device and what they should hold.
struct Held {
    device: Device,
    buffers: Vec<ResidentBuffer>,
    expect: Vec<Vec<u8>>,
}

impl Held {
    /// Buffers of `sizes` on `device`, filled with random bytes: the poison that a copy
    /// must overwrite exactly where it lands, and nowhere else.
    fn new(device: &Device, rng: &mut fastrand::Rng, sizes: &[u64]) -> Held {
        let buffers: Vec<_> = sizes.iter().map(|&n| device.allocate(n).unwrap()).collect();
        let expect: Vec<_> = sizes.iter().map(|&n| random_vec(rng, n as usize)).collect();
        let writes: Vec<_> = buffers.iter().zip(&expect).map(|(&b, v)| (b, v.as_slice())).collect();
        device.upload_many(&writes).unwrap();
        Held { device: device.clone(), buffers, expect }
    }

    /// Reads every buffer back and compares every byte with the model.
    fn check(&self, what: &str) {
        let got = self.device.download_many(&self.buffers).unwrap();
        for (i, (g, e)) in got.iter().zip(&self.expect).enumerate() {
            if let Some(at) = first_difference(g, e) {
                panic!(
                    "{what}: buffer {i} ({} bytes) on GPU {} differs first at byte {at}",
                    e.len(),
                    self.device.info().ordinal
                );
            }
        }
    }

    /// A random buffer holding at least `len` bytes, and a random offset where they fit.
    fn place(&self, rng: &mut fastrand::Rng, len: u64) -> (usize, u64) {
        let fits: Vec<usize> =
            (0..self.expect.len()).filter(|&i| self.expect[i].len() as u64 >= len).collect();
        let i = fits[rng.usize(..fits.len())];
        (i, rng.u64(0..=self.expect[i].len() as u64 - len))
    }

    fn free(self) {
        for b in self.buffers {
            self.device.free(b).unwrap();
        }
    }
}

/// Source buffers: two past 8 MiB for the large copies, and a spread of small ones down to
/// one byte, with odd sizes.
const SRC_SIZES: [u64; 8] = [9 * MIB + 3, 8 * MIB + 1001, MIB + 17, 300_001, 65_537, 4097, 777, 1];
/// Destination buffers, likewise.
const DST_SIZES: [u64; 8] = [10 * MIB + 7, 9 * MIB + 11, 2 * MIB + 5, 500_003, 65_539, 4099, 513, 1];

/// One copy of a peer batch, by index into the source's and destination's [`Held`].
#[derive(Clone, Copy, Debug)]
struct PeerCopy {
    src: usize,
    src_offset: u64,
    dst: usize,
    dst_offset: u64,
    len: u64,
}

/// Lengths from 1 byte to 8 MiB, mostly small: 60% up to 256 B, 25% up to 64 KiB, 13% up to
/// 4 MiB and 2% past it (the DMA path whatever the threshold).
fn random_len(rng: &mut fastrand::Rng) -> u64 {
    match rng.u8(0..100) {
        0..=59 => rng.u64(1..=256),
        60..=84 => rng.u64(257..=64 << 10),
        85..=97 => rng.u64((64 << 10) + 1..=4 * MIB),
        _ => rng.u64(4 * MIB + 1..=8 * MIB),
    }
}

/// A copy of `len` bytes to `dst` at `dst_offset` from a random place of the source.
fn sourced(rng: &mut fastrand::Rng, src: &Held, dst: usize, dst_offset: u64, len: u64) -> PeerCopy {
    let (src_index, src_offset) = src.place(rng, len);
    PeerCopy { src: src_index, src_offset, dst, dst_offset, len }
}

/// A random batch: in every batch the smallest copy and copies on either side of 4 MiB
/// (where the implementation switches from the kernel to a DMA per copy today), then up to
/// 600 of random sizes at random (mostly odd) offsets, some followed by a copy that touches
/// theirs (right after or right before), overlaps it, or repeats its range from other bytes.
fn random_copies(rng: &mut fastrand::Rng, src: &Held, dst: &Held) -> Vec<PeerCopy> {
    let mut copies = Vec::new();
    for len in [1, 4 * MIB - 1, 4 * MIB, rng.u64(4 * MIB + 1..=6 * MIB)] {
        let (d, o) = dst.place(rng, len);
        copies.push(sourced(rng, src, d, o, len));
    }
    for _ in 0..rng.usize(1..600) {
        let len = random_len(rng);
        let (d, o) = dst.place(rng, len);
        copies.push(sourced(rng, src, d, o, len));
        let (end, dst_len) = (o + len, dst.expect[d].len() as u64);
        match rng.u8(0..10) {
            0 if end < dst_len => {
                let l = rng.u64(1..=(dst_len - end).min(4096));
                copies.push(sourced(rng, src, d, end, l));
            }
            1 if o > 0 => {
                let l = rng.u64(1..=o.min(4096));
                copies.push(sourced(rng, src, d, o - l, l));
            }
            2 => {
                let start = o + rng.u64(0..len);
                let l = rng.u64(1..=(dst_len - start).min(len + 512));
                copies.push(sourced(rng, src, d, start, l));
            }
            3 => copies.push(sourced(rng, src, d, o, len)),
            _ => {}
        }
    }
    copies
}

/// The model: copies apply in order, so where destinations overlap the later copy wins.
fn apply(src: &Held, dst: &mut Held, copies: &[PeerCopy]) {
    for c in copies {
        let from = &src.expect[c.src][c.src_offset as usize..][..c.len as usize];
        dst.expect[c.dst][c.dst_offset as usize..][..c.len as usize].copy_from_slice(from);
    }
}

/// Submits `copies` as one peer batch into `dst`'s device from `src`'s.
fn submit(src: &Held, dst: &Held, copies: &[PeerCopy]) -> Fence {
    let mut batch = dst.device.peer_copies(&src.device);
    assert!(batch.is_empty());
    for c in copies {
        batch
            .copy(src.buffers[c.src], c.src_offset, dst.buffers[c.dst], c.dst_offset, c.len)
            .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
    assert_eq!(batch.len(), copies.len());
    batch.submit().unwrap_or_else(|e| panic!("{e}"))
}

/// Counters that say which path copies took: DMAs, kernel launches, bytes moved, and bytes
/// copied into the device from device memory (`peer_bytes`, counted by the direct path only).
fn counters(d: &Device) -> [u64; 4] {
    let t = d.telemetry();
    [t.dma_copies, t.kernel_launches, t.bytes_moved, t.peer_bytes]
}

/// Destination bytes written by `copies`: the union of their ranges.
fn covered(copies: &[PeerCopy]) -> u64 {
    let mut spans: Vec<(usize, u64, u64)> =
        copies.iter().map(|c| (c.dst, c.dst_offset, c.dst_offset + c.len)).collect();
    spans.sort_unstable();
    let mut total = 0;
    let mut open: Option<(usize, u64, u64)> = None;
    for (b, start, end) in spans {
        match &mut open {
            Some((ob, _, oe)) if *ob == b && start <= *oe => *oe = (*oe).max(end),
            _ => {
                if let Some((_, os, oe)) = open.replace((b, start, end)) {
                    total += oe - os;
                }
            }
        }
    }
    total + open.map_or(0, |(_, os, oe)| oe - os)
}

/// What ragged batches asked for, and what the two devices counted while they ran.
#[derive(Debug)]
struct Moved {
    route: String,
    copies: usize,
    /// The sum of the copies' lengths.
    requested: u64,
    /// Destination bytes written (overlaps counted once).
    covered: u64,
    on_dst: [u64; 4],
    on_src: [u64; 4],
}

impl Moved {
    /// Checks which path the copies took by the bytes the devices counted as copied from
    /// device memory: none on the staged path (a download and an upload); on the direct path
    /// at least every destination byte written and at most the sum of the copies (overlaps
    /// resolved or not), all on the destination.
    fn assert_path(&self, direct: bool) {
        let (peer_dst, peer_src) = (self.on_dst[3], self.on_src[3]);
        if direct {
            assert!(
                self.covered <= peer_dst && peer_dst <= self.requested,
                "{}: the destination counted {peer_dst} bytes copied from device memory, not between \
                 the {} bytes written and the {} asked for: not the direct path?",
                self.route,
                self.covered,
                self.requested
            );
        } else {
            assert_eq!(
                (peer_dst, peer_src),
                (0, 0),
                "{}: bytes counted as copied from device memory, though peer access was off",
                self.route
            );
        }
    }
}

impl std::fmt::Display for Moved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [dd, dl, dm, dp] = self.on_dst;
        let [sd, sl, sm, sp] = self.on_src;
        write!(
            f,
            "{}: {} copies, {} bytes asked, {} written; destination: {dd} DMAs, {dl} launches, \
             {dm} bytes moved, {dp} peer bytes; source: {sd} DMAs, {sl} launches, {sm} bytes moved, \
             {sp} peer bytes",
            self.route, self.copies, self.requested, self.covered
        )
    }
}

/// Random ragged peer batches from `src` into `dst`, each waited on and checked against the
/// model (every byte of every destination buffer); the sources are checked to be unchanged.
fn ragged_peer_batches(dst: &Device, src: &Device, seed: u64, rounds: usize) -> Moved {
    let mut rng = fastrand::Rng::with_seed(seed);
    let source = Held::new(src, &mut rng, &SRC_SIZES);
    let mut target = Held::new(dst, &mut rng, &DST_SIZES);
    let route = format!("GPU {} -> GPU {}", src.info().ordinal, dst.info().ordinal);
    let mut moved = Moved { route, copies: 0, requested: 0, covered: 0, on_dst: [0; 4], on_src: [0; 4] };
    for round in 0..rounds {
        let copies = random_copies(&mut rng, &source, &target);
        let (d_before, s_before) = (counters(dst), counters(src));
        submit(&source, &target, &copies).wait().unwrap();
        let (d_after, s_after) = (counters(dst), counters(src));
        for k in 0..4 {
            moved.on_dst[k] += d_after[k] - d_before[k];
            moved.on_src[k] += s_after[k] - s_before[k];
        }
        moved.copies += copies.len();
        moved.requested += copies.iter().map(|c| c.len).sum::<u64>();
        moved.covered += covered(&copies);
        apply(&source, &mut target, &copies);
        target.check(&format!("{}, round {round} of {} copies", moved.route, copies.len()));
    }
    source.check(&format!("{}: the sources are only read", moved.route));
    source.free();
    target.free();
    moved
}

/// What the staged check found.
struct StagedRun {
    /// Whether either GPU had peer access to the other before the check.
    enabled_before: bool,
    /// The same, after it.
    enabled_after: bool,
    /// What the batches moved, each way, or the panic that stopped them.
    outcome: Result<[Moved; 2], String>,
}

fn panic_text(payload: Box<dyn Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => payload.downcast_ref::<&str>().map_or("a panic without a message", |s| s).to_owned(),
    }
}

/// Ragged peer batches both ways and the read-after-write chain, before any test of this
/// process enables peer access: the staged path. Runs once per process (see the module's
/// documentation).
fn staged_run() -> &'static StagedRun {
    static STAGED: OnceLock<StagedRun> = OnceLock::new();
    STAGED.get_or_init(|| {
        let set = open_two();
        let (d0, d1) = pair(&set);
        let enabled = || d0.is_peer_enabled(d1) || d1.is_peer_enabled(d0);
        let enabled_before = enabled();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let forth = ragged_peer_batches(d1, d0, 0x57A6ED, 2);
            let back = ragged_peer_batches(d0, d1, 0x57A6EE, 2);
            read_after_write_chain(d0, d1, 0x57A6EF);
            [forth, back]
        }))
        .map_err(panic_text);
        StagedRun { enabled_before, enabled_after: enabled(), outcome }
    })
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_a_device_set_opens_every_gpu_and_names_each_by_index() {
    let set = two_gpus();
    let count = set.len();
    assert!(!set.is_empty());
    for (i, d) in set.devices().iter().enumerate() {
        assert_eq!(d.info().ordinal, i, "devices() is in ordinal order");
        assert_eq!(set.get(i).unwrap().info().ordinal, i);
    }
    assert_error!(set.get(count), Error::NotInSet { .. }, "DeviceSet::get past the end");
    assert_error!(set.get(usize::MAX), Error::NotInSet { .. }, "DeviceSet::get(usize::MAX)");

    // A chosen few, in the order given: index 0 is GPU 1.
    let chosen = DeviceSet::from_devices(vec![Device::open(1).unwrap(), Device::open(0).unwrap()]);
    assert_eq!(chosen.len(), 2);
    assert_eq!(chosen.get(0).unwrap().info().ordinal, 1);
    assert_eq!(chosen.get(1).unwrap().info().ordinal, 0);
    assert_error!(chosen.get(2), Error::NotInSet { .. }, "from_devices: get past the end");

    // One config for every device; a bad one is refused before anything opens.
    let config = Config::default().with_budget_fraction(0.5).with_chunk_bytes(4 * MIB);
    let configured = DeviceSet::open_all_configured(config.clone()).unwrap();
    assert!(configured.devices().iter().all(|d| d.config() == &config));
    let bad = Config::default().with_budget_fraction(1.5);
    assert_error!(DeviceSet::open_all_configured(bad), Error::InvalidConfig { .. }, "budget_fraction 1.5");

    // An empty peer batch submits to a fence that is already done.
    let (d0, d1) = pair(&set);
    let batch = d1.peer_copies(d0);
    assert!(batch.is_empty());
    assert_eq!(batch.len(), 0);
    let fence = batch.submit().unwrap();
    fence.wait().unwrap();
    assert!(fence.is_complete().unwrap());
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_peer_access_is_enabled_both_ways_and_enabling_again_is_ok() {
    let set = two_gpus();
    let (d0, d1) = pair(&set);
    let (forth, back) = (d0.can_access_peer(d1).unwrap(), d1.can_access_peer(d0).unwrap());
    assert!(
        forth && back,
        "GPU 0 -> 1 peer access possible: {forth}, 1 -> 0: {back}; the test machine's GPUs are \
         linked by NVLink and should peer (nvidia-smi topo -m shows the links)"
    );
    d0.enable_peer(d1).unwrap();
    assert!(d0.is_peer_enabled(d1), "enable_peer enables access from the device to its peer");
    assert!(d1.is_peer_enabled(d0), "enable_peer enables the other direction too");
    d0.enable_peer(d1).unwrap_or_else(|e| panic!("enabling twice is Ok: {e}"));
    d1.enable_peer(d0).unwrap_or_else(|e| panic!("enabling from the other side is Ok: {e}"));
    let pairs = set.enable_all_peers().unwrap();
    println!("enable_all_peers over {} GPUs after enable_peer: {pairs} pair(s) with access", set.len());
    assert!(pairs >= 1, "enable_all_peers counts the pairs with access, 0 and 1 among them");
    assert!(d0.is_peer_enabled(d1) && d1.is_peer_enabled(d0));
    // A device and itself: always possible, enabling is a no-op.
    assert!(d0.can_access_peer(d0).unwrap());
    d0.enable_peer(d0).unwrap();
    assert!(d0.is_peer_enabled(d0));

    // A second set over the same GPUs shares their primary contexts, which already have peer
    // access (cuCtxEnablePeerAccess would say CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
    // enabling there is Ok too, and it then reports access.
    let again = DeviceSet::open_all().unwrap();
    let (e0, e1) = pair(&again);
    e1.enable_peer(e0).unwrap_or_else(|e| panic!("enabling in a second DeviceSet is Ok: {e}"));
    again.enable_all_peers().unwrap();
    assert!(e0.is_peer_enabled(e1) && e1.is_peer_enabled(e0));
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_peer_batches_match_the_model_staged_before_peer_access_is_enabled() {
    let _count_checked = open_two();
    let run = staged_run();
    let moved = match &run.outcome {
        Ok(moved) => moved,
        Err(panic) => panic!("peer batches before peer access was enabled (the staged path) failed: {panic}"),
    };
    assert!(
        !run.enabled_before,
        "peer access between GPUs 0 and 1 was already on when the staged check ran, so the \
         staged path was not exercised: did DeviceSet::open_all enable it?"
    );
    assert!(
        !run.enabled_after,
        "peer access was on after peer batches alone: a peer batch must not enable it (that is \
         enable_peer's job), and the batches above may not have taken the staged path"
    );
    for m in moved {
        println!("staged: {m}");
        m.assert_path(false);
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_peer_batches_match_the_model_with_peer_access() {
    let set = two_gpus();
    enable_peers(&set);
    let (d0, d1) = pair(&set);
    for moved in [ragged_peer_batches(d1, d0, 0x9EE4, 3), ragged_peer_batches(d0, d1, 0x9EE5, 3)] {
        println!("{moved}");
        moved.assert_path(true);
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_peer_batches_both_ways_at_once() {
    let set = two_gpus();
    enable_peers(&set);
    let (d0, d1) = pair(&set);

    // Submit one batch each way, then wait for both. The two batches touch different
    // buffers: neither reads what the other writes.
    let mut rng = fastrand::Rng::with_seed(0xB07);
    let src0 = Held::new(d0, &mut rng, &SRC_SIZES);
    let mut dst1 = Held::new(d1, &mut rng, &DST_SIZES);
    let src1 = Held::new(d1, &mut rng, &SRC_SIZES);
    let mut dst0 = Held::new(d0, &mut rng, &DST_SIZES);
    for round in 0..2 {
        let forth = random_copies(&mut rng, &src0, &dst1);
        let back = random_copies(&mut rng, &src1, &dst0);
        let f = submit(&src0, &dst1, &forth);
        let b = submit(&src1, &dst0, &back);
        f.wait().unwrap();
        b.wait().unwrap();
        apply(&src0, &mut dst1, &forth);
        apply(&src1, &mut dst0, &back);
        dst1.check(&format!("round {round}: GPU 0 -> 1, submitted with 1 -> 0"));
        dst0.check(&format!("round {round}: GPU 1 -> 0, submitted with 0 -> 1"));
    }
    src0.check("the sources on GPU 0 are only read");
    src1.check("the sources on GPU 1 are only read");
    for h in [src0, dst1, src1, dst0] {
        h.free();
    }

    // Two threads, one per direction, each with its own buffers, submitting at once. (Each
    // thread's counters include the other's work, so the path is not checked here.)
    let threads: Vec<_> = [(d1.clone(), d0.clone(), 0xB08), (d0.clone(), d1.clone(), 0xB09)]
        .into_iter()
        .map(|(dst, src, seed)| std::thread::spawn(move || ragged_peer_batches(&dst, &src, seed, 2)))
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Upload to GPU `d0` (not waited on), peer copy to `d1` (not waited on), read back on
/// `d1`: the bytes must be the uploaded ones, for one large copy and for many small ones.
/// Then a peer batch back to `d0` of what just arrived, again without a host wait.
fn read_after_write_chain(d0: &Device, d1: &Device, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);

    // Large: an upload from pageable memory (pipelined through pinned staging, so still in
    // flight when the copy is submitted), a peer DMA, a download.
    let len = 32 * MIB + 5;
    let src = d0.allocate(len).unwrap();
    let dst = d1.allocate(len).unwrap();
    d0.upload(src, &random_vec(&mut rng, len as usize)).unwrap();
    d1.upload(dst, &random_vec(&mut rng, len as usize)).unwrap();
    let data = random_vec(&mut rng, len as usize);
    let mut up = d0.uploads();
    up.write(src, 0, &data).unwrap();
    let uploaded = up.submit().unwrap();
    let mut peer = d1.peer_copies(d0);
    peer.copy(src, 0, dst, 0, len).unwrap();
    let copied = peer.submit().unwrap();
    assert_bytes(&d1.download(dst).unwrap(), &data, "upload, peer copy, download with no host wait");
    assert!(uploaded.is_complete().unwrap() && copied.is_complete().unwrap());

    // Small: a packed upload (scatter kernel), small peer copies, a download batch.
    let small = 2 * MIB + 3;
    let src2 = d0.allocate(small).unwrap();
    let dst2 = d1.allocate(small).unwrap();
    let back0 = d0.allocate(small).unwrap();
    let mut expect_src2 = random_vec(&mut rng, small as usize);
    let mut expect_dst2 = random_vec(&mut rng, small as usize);
    let mut expect_back0 = random_vec(&mut rng, small as usize);
    d0.upload(src2, &expect_src2).unwrap();
    d1.upload(dst2, &expect_dst2).unwrap();
    d0.upload(back0, &expect_back0).unwrap();
    let pieces: Vec<(u64, Vec<u8>)> =
        (0..500u64).map(|i| (i * 4000 + i % 7, random_vec(&mut rng, 1 + (i as usize * 37) % 3000))).collect();
    let mut up = d0.uploads();
    for (o, v) in &pieces {
        up.write(src2, *o, v).unwrap();
        expect_src2[*o as usize..][..v.len()].copy_from_slice(v);
    }
    let _uploaded = up.submit().unwrap();
    // Each piece to a shifted place on GPU 1 (disjoint: pieces are 4000 apart, at most 3000).
    let mut peer = d1.peer_copies(d0);
    for (o, v) in &pieces {
        let to = o + 1001;
        peer.copy(src2, *o, dst2, to, v.len() as u64).unwrap();
        expect_dst2[to as usize..][..v.len()].copy_from_slice(v);
    }
    let _copied = peer.submit().unwrap();
    let mut reads = d1.downloads();
    let slots: Vec<_> =
        pieces.iter().map(|(o, v)| reads.read(dst2, o + 1001, v.len() as u64).unwrap()).collect();
    let done = reads.submit().unwrap().wait().unwrap();
    for (i, ((_, v), slot)) in pieces.iter().zip(&slots).enumerate() {
        assert_bytes(done.get(*slot), v, &format!("small piece {i}: upload, peer copy, download"));
    }

    // And back: GPU 1 -> 0 of what just arrived, then GPU 0 -> 1 of that, no host waits.
    let mut peer = d0.peer_copies(d1);
    peer.copy(dst2, 0, back0, 0, small).unwrap();
    let _back = peer.submit().unwrap();
    expect_back0.copy_from_slice(&expect_dst2);
    let mut peer = d1.peer_copies(d0);
    peer.copy(back0, 17, dst, 5, small - 17).unwrap();
    let _forth = peer.submit().unwrap();
    let mut expect_dst = data;
    expect_dst[5..][..(small - 17) as usize].copy_from_slice(&expect_back0[17..]);
    assert_bytes(&d0.download(back0).unwrap(), &expect_back0, "peer copy of what a peer copy wrote");
    assert_bytes(&d1.download(dst).unwrap(), &expect_dst, "a chain of peer copies, there and back");
    assert_bytes(&d1.download(dst2).unwrap(), &expect_dst2, "small peer copies, whole buffer");
    assert_bytes(&d0.download(src2).unwrap(), &expect_src2, "the packed upload");
    for (d, b) in [(d0, src), (d1, dst), (d0, src2), (d1, dst2), (d0, back0)] {
        d.free(b).unwrap();
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_reads_after_writes_are_ordered_on_the_gpus_without_host_waits() {
    let set = two_gpus();
    enable_peers(&set);
    let (d0, d1) = pair(&set);
    read_after_write_chain(d0, d1, 0x4A3);
    read_after_write_chain(d1, d0, 0x4A4);
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_writes_after_reads_and_writes_are_ordered_on_the_gpus() {
    let set = two_gpus();
    enable_peers(&set);
    let (d0, d1) = pair(&set);
    let mut rng = fastrand::Rng::with_seed(0x3A4);
    let len = 32 * MIB + 9;
    let src = d0.allocate(len).unwrap();
    let dst = d1.allocate(len).unwrap();
    d1.upload(dst, &random_vec(&mut rng, len as usize)).unwrap();

    // Write after read: a peer copy reads src, an upload overwrites src at once; the copy
    // sees the old bytes. Once through an async DMA from pinned memory (enqueued at once),
    // once through a batch of small writes (the scatter kernel).
    let old = random_vec(&mut rng, len as usize);
    d0.upload(src, &old).unwrap();
    let mut new = d0.pinned(len as usize).unwrap();
    rng.fill(&mut new);
    let mut peer = d1.peer_copies(d0);
    peer.copy(src, 0, dst, 0, len).unwrap();
    let copied = peer.submit().unwrap();
    // SAFETY: `new` is pinned, `len` bytes long, and neither written nor dropped until the
    // fence is waited on just below.
    let overwrite = unsafe { d0.upload_async_at(src, 0, new.as_ptr(), len as usize) }.unwrap();
    overwrite.wait().unwrap();
    copied.wait().unwrap();
    assert_bytes(&d1.download(dst).unwrap(), &old, "a peer copy followed by an upload over its source");
    assert_bytes(&d0.download(src).unwrap(), &new, "the upload after the peer copy");

    let mut expect_src = new.to_vec();
    let mut expect_dst = old; // what the first copy left there
    let mut peer = d1.peer_copies(d0);
    let ranges: Vec<(u64, u64)> = (0..400u64).map(|i| (i * 9000 + i % 5, 1 + (i * 31) % 4000)).collect();
    for &(o, l) in &ranges {
        peer.copy(src, o, dst, o, l).unwrap();
    }
    let copied = peer.submit().unwrap();
    let mut up = d0.uploads();
    let patches: Vec<Vec<u8>> = ranges.iter().map(|&(_, l)| random_vec(&mut rng, l as usize)).collect();
    for (&(o, _), p) in ranges.iter().zip(&patches) {
        up.write(src, o, p).unwrap();
    }
    let overwrite = up.submit().unwrap();
    for (&(o, l), p) in ranges.iter().zip(&patches) {
        let (o, l) = (o as usize, l as usize);
        expect_dst[o..o + l].copy_from_slice(&expect_src[o..o + l]);
        expect_src[o..o + l].copy_from_slice(p);
    }
    overwrite.wait().unwrap();
    copied.wait().unwrap();
    assert_bytes(
        &d1.download(dst).unwrap(),
        &expect_dst,
        "small peer copies followed by small uploads over their sources",
    );
    assert_bytes(&d0.download(src).unwrap(), &expect_src, "the small uploads after the peer copies");

    // Write after write on the destination: a peer copy, then an upload over part of what
    // it writes (no host wait between): the upload wins there.
    let patch = random_vec(&mut rng, 1_000_001);
    let mut peer = d1.peer_copies(d0);
    peer.copy(src, 0, dst, 0, len).unwrap();
    let copied = peer.submit().unwrap();
    d1.upload_at(dst, 777, &patch).unwrap();
    copied.wait().unwrap();
    let mut expect = expect_src.clone();
    expect[777..][..patch.len()].copy_from_slice(&patch);
    assert_bytes(&d1.download(dst).unwrap(), &expect, "a peer copy, then an upload over part of it");

    // And the other way: an upload in flight, then a peer copy over part of it: the copy wins.
    let mut over = d1.pinned(len as usize).unwrap();
    rng.fill(&mut over);
    // SAFETY: `over` is pinned, `len` bytes long, and kept unchanged until the fences are
    // waited on below.
    let uploaded = unsafe { d1.upload_async_at(dst, 0, over.as_ptr(), len as usize) }.unwrap();
    let mut peer = d1.peer_copies(d0);
    peer.copy(src, 5, dst, 3, 5 * MIB).unwrap().copy(src, 100, dst, len - 200, 200).unwrap();
    let copied = peer.submit().unwrap();
    copied.wait().unwrap();
    uploaded.wait().unwrap();
    let mut expect = over.to_vec();
    expect[3..][..5 * MIB as usize].copy_from_slice(&expect_src[5..][..5 * MIB as usize]);
    expect[(len - 200) as usize..].copy_from_slice(&expect_src[100..300]);
    assert_bytes(&d1.download(dst).unwrap(), &expect, "an upload, then peer copies over part of it");
    d0.free(src).unwrap();
    d1.free(dst).unwrap();
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_freeing_buffers_right_after_submit_keeps_the_bytes_right() {
    let set = two_gpus();
    enable_peers(&set);
    let (d0, d1) = pair(&set);
    let mut rng = fastrand::Rng::with_seed(0xF4EE);
    // Eight copies of 32 MiB (256 MiB over the link, most of a millisecond) so that the
    // frees below come while the batch is still in flight.
    let len = 32 * MIB + 3;
    let data = random_vec(&mut rng, len as usize);
    let small = random_vec(&mut rng, 4099);
    let src = d0.allocate(len).unwrap();
    let small_src = d0.allocate(4099).unwrap();
    let dst = d1.allocate(8 * len).unwrap();
    let doomed_dst = d1.allocate(len).unwrap();
    d0.upload(src, &data).unwrap();
    d0.upload(small_src, &small).unwrap();
    let mut expect_dst = vec![0xA5u8; 8 * len as usize]; // poison; the copies cover all of it
    d1.upload(dst, &expect_dst).unwrap();

    let mut peer = d1.peer_copies(d0);
    for k in 0..8 {
        peer.copy(src, 0, dst, k * len, len).unwrap();
        expect_dst[(k * len) as usize..][..len as usize].copy_from_slice(&data);
    }
    peer.copy(small_src, 1, dst, 5, 4000).unwrap();
    expect_dst[5..4005].copy_from_slice(&small[1..4001]);
    peer.copy(src, 0, doomed_dst, 0, len).unwrap();
    let fence = peer.submit().unwrap();
    // Freed at once, before any wait: the source on the other GPU, and a destination.
    d0.free(src).unwrap();
    d0.free(small_src).unwrap();
    d1.free(doomed_dst).unwrap();
    let in_flight = !fence.is_complete().unwrap();
    println!(
        "after the frees: batch in flight: {in_flight}; deferred frees on GPU 0: {}, on GPU 1: {}",
        d0.telemetry().memory.deferred_frees,
        d1.telemetry().memory.deferred_frees
    );
    assert_error!(d0.device_ptr(src), Error::FreedBuffer { .. }, "a source handle freed while in flight");
    assert_error!(
        d1.device_ptr(doomed_dst),
        Error::FreedBuffer { .. },
        "a destination freed while in flight"
    );

    // Whatever takes the memory now must neither change what the copies read nor be
    // written by them: new buffers of the same sizes, written at once from pinned memory.
    let mut fill0 = d0.pinned(len as usize).unwrap();
    rng.fill(&mut fill0);
    let mut fill1 = d1.pinned(len as usize).unwrap();
    rng.fill(&mut fill1);
    let reuse0 = d0.allocate(len).unwrap();
    let reuse_small = d0.allocate(4099).unwrap();
    let reuse1 = d1.allocate(len).unwrap();
    // SAFETY: both regions are pinned, `len` bytes long, and unchanged until the fences are
    // waited on below.
    let (w0, w1) = unsafe {
        (
            d0.upload_async_at(reuse0, 0, fill0.as_ptr(), len as usize).unwrap(),
            d1.upload_async_at(reuse1, 0, fill1.as_ptr(), len as usize).unwrap(),
        )
    };
    let small_fill = random_vec(&mut rng, 4099);
    d0.upload(reuse_small, &small_fill).unwrap();
    for f in [&fence, &w0, &w1] {
        f.wait().unwrap();
    }
    assert_bytes(&d1.download(dst).unwrap(), &expect_dst, "copies whose sources were freed at submit");
    assert_bytes(&d0.download(reuse0).unwrap(), &fill0, "a buffer allocated after the source was freed");
    assert_bytes(&d0.download(reuse_small).unwrap(), &small_fill, "a small buffer allocated after the free");
    assert_bytes(&d1.download(reuse1).unwrap(), &fill1, "a buffer allocated after a destination was freed");

    for (d, b) in [(d0, reuse0), (d0, reuse_small), (d1, reuse1), (d1, dst)] {
        d.free(b).unwrap();
    }
    d0.synchronize().unwrap();
    d1.synchronize().unwrap();
    d0.trim().unwrap();
    d1.trim().unwrap();
    for d in [d0, d1] {
        let deferred = d.telemetry().memory.deferred_bytes;
        assert_eq!(deferred, 0, "GPU {}: deferred frees left once all work completed", d.info().ordinal);
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_each_device_has_its_own_budget() {
    let _ = two_gpus(); // the GPU count and the staged check
    let fraction = 0.02;
    let set = DeviceSet::open_all_configured(Config::default().with_budget_fraction(fraction)).unwrap();
    let (d0, d1) = pair(&set);
    const CHUNK: u64 = 256 * MIB;

    /// Allocates chunks until the budget refuses; returns them and the refusal's limit.
    fn fill(d: &Device) -> (Vec<ResidentBuffer>, u64) {
        let mut held = Vec::new();
        loop {
            match d.allocate(CHUNK) {
                Ok(b) => held.push(b),
                Err(Error::OverBudget {
                    requested,
                    needed,
                    held: held_bytes,
                    in_use,
                    library,
                    limit,
                    ..
                }) => {
                    assert_eq!(requested, CHUNK);
                    assert!(held_bytes + needed > limit && held_bytes >= in_use + library);
                    return (held, limit);
                }
                Err(e) => panic!("GPU {}: expected OverBudget, got: {e}", d.info().ordinal),
            }
            assert!(held.len() < 10_000, "the budget never refused");
        }
    }

    let d1_before = (d1.allocated_bytes(), d1.telemetry().memory.reserved_bytes);
    let (held0, limit0) = fill(d0);
    let total0 = d0.info().total_memory as f64;
    assert!(!held0.is_empty(), "GPU 0's budget of {fraction} held no {CHUNK}-byte buffer");
    assert!(
        d0.allocated_bytes() as f64 <= fraction * total0,
        "GPU 0 holds {} of {total0}",
        d0.allocated_bytes()
    );
    assert_error!(d0.allocate(CHUNK), Error::OverBudget { .. }, "GPU 0, full");
    assert_eq!(
        (d1.allocated_bytes(), d1.telemetry().memory.reserved_bytes),
        d1_before,
        "filling GPU 0's budget changed GPU 1's accounting"
    );

    // GPU 1 still has all of its own budget, whatever GPU 0 holds.
    let (held1, limit1) = fill(d1);
    let total1 = d1.info().total_memory as f64;
    println!(
        "GPU 0: {} x {CHUNK} B under a limit of {limit0}; GPU 1: {} under {limit1}",
        held0.len(),
        held1.len()
    );
    assert!(
        held1.len() + 1 >= held0.len() && limit1 as f64 >= 0.9 * fraction * total1,
        "GPU 1 got {} chunks under a limit of {limit1} while GPU 0 was full ({} chunks, limit {limit0})",
        held1.len(),
        held0.len()
    );
    assert!(d1.allocated_bytes() as f64 <= fraction * total1);

    // Freeing on GPU 0 gives room on GPU 0 only.
    let held0_bytes = d0.allocated_bytes();
    for b in held0 {
        d0.free(b).unwrap();
    }
    assert_eq!(d0.allocated_bytes(), 0);
    assert_error!(
        d1.allocate(CHUNK),
        Error::OverBudget { .. },
        format!("GPU 1 after GPU 0 freed {held0_bytes} bytes")
    );
    let b = d0.allocate(CHUNK).unwrap();
    d0.free(b).unwrap();
    for b in held1 {
        d1.free(b).unwrap();
    }
    assert_eq!((d0.allocated_bytes(), d1.allocated_bytes()), (0, 0));
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_bad_peer_copies_fail_the_batch_and_change_nothing() {
    let set = two_gpus();
    let (d0, d1) = pair(&set);
    let other1 = Device::open(1).unwrap(); // GPU 1 again, with an allocator of its own
    let mut rng = fastrand::Rng::with_seed(0xBAD);
    let s0 = d0.allocate(4096).unwrap();
    let t1 = d1.allocate(4096).unwrap();
    let u0 = d0.allocate(4096).unwrap(); // on the source device, passed as a destination
    let v1 = d1.allocate(4096).unwrap(); // on the destination device, passed as a source
    let theirs = other1.allocate(4096).unwrap();
    let freed0 = d0.allocate(4096).unwrap();
    let freed1 = d1.allocate(4096).unwrap();
    d0.free(freed0).unwrap();
    d1.free(freed1).unwrap();
    let poison: Vec<Vec<u8>> = (0..4).map(|_| random_vec(&mut rng, 4096)).collect();
    d0.upload_many(&[(s0, &poison[0]), (u0, &poison[1])]).unwrap();
    d1.upload_many(&[(t1, &poison[2]), (v1, &poison[3])]).unwrap();
    let before = (counters(d0), counters(d1));

    type Bad = (&'static str, ResidentBuffer, u64, ResidentBuffer, u64, u64);
    let foreign: [Bad; 3] = [
        ("a source buffer of the destination device", v1, 0, t1, 0, 16),
        ("a destination buffer of the source device", s0, 0, u0, 0, 16),
        ("a destination buffer of another Device of the same GPU", s0, 0, theirs, 0, 16),
    ];
    let out_of_range: [Bad; 6] = [
        ("a source range past the end", s0, 4000, t1, 0, 100),
        ("a destination range past the end", s0, 0, t1, 4000, 100),
        ("a source offset of u64::MAX", s0, u64::MAX, t1, 0, 16),
        ("a destination offset of u64::MAX", s0, 0, t1, u64::MAX, 16),
        ("a length of u64::MAX", s0, 0, t1, 0, u64::MAX),
        ("offsets whose sum with the length overflows", s0, u64::MAX - 8, t1, u64::MAX - 8, 16),
    ];
    let freed: [Bad; 2] =
        [("a freed source", freed0, 0, t1, 0, 16), ("a freed destination", s0, 0, freed1, 0, 16)];
    let check = |cases: &[Bad], variant: fn(&Error) -> bool| {
        for &(what, src, src_offset, dst, dst_offset, len) in cases {
            let mut batch = d1.peer_copies(d0);
            batch.copy(s0, 7, t1, 9, 1000).unwrap(); // a good copy first: it must not land either
            match batch.copy(src, src_offset, dst, dst_offset, len) {
                Err(e) => {
                    assert!(variant(&e), "{what}: wrong error: {e}");
                    assert!(e.to_string().contains("Fix: "), "{what}: the message gives no fix: {e}");
                }
                Ok(_) => panic!("{what}: accepted"),
            }
            match batch.submit() {
                Err(e) => assert!(variant(&e), "{what}: submit failed with another error: {e}"),
                Ok(_) => panic!("{what}: the batch submitted"),
            }
        }
    };
    check(&foreign, |e| matches!(e, Error::ForeignBuffer { .. }));
    check(&out_of_range, |e| matches!(e, Error::OutOfRange { .. }));
    check(&freed, |e| matches!(e, Error::FreedBuffer { .. }));

    // Inside one GPU, a buffer of the other is foreign either way.
    let mut batch = d0.peer_copies(d0);
    assert_error!(
        batch.copy(s0, 0, t1, 0, 16),
        Error::ForeignBuffer { .. },
        "GPU 0 batch, destination on GPU 1"
    );
    assert_error!(batch.copy(t1, 0, u0, 0, 16), Error::ForeignBuffer { .. }, "GPU 0 batch, source on GPU 1");
    assert!(batch.submit().is_err());

    // A buffer freed between copy and submit.
    let gone = d0.allocate(4096).unwrap();
    let mut batch = d1.peer_copies(d0);
    batch.copy(s0, 0, t1, 0, 4096).unwrap().copy(gone, 0, t1, 0, 16).unwrap();
    d0.free(gone).unwrap();
    assert_error!(batch.submit(), Error::FreedBuffer { .. }, "a source freed between copy and submit");

    assert_eq!((counters(d0), counters(d1)), before, "a failed batch enqueued something");
    assert_bytes(&d0.download(s0).unwrap(), &poison[0], "the source");
    assert_bytes(&d0.download(u0).unwrap(), &poison[1], "GPU 0's buffer passed as a destination");
    assert_bytes(&d1.download(t1).unwrap(), &poison[2], "the destination after failed batches");
    assert_bytes(&d1.download(v1).unwrap(), &poison[3], "GPU 1's buffer passed as a source");
    for (d, b) in [(d0, s0), (d0, u0), (d1, t1), (d1, v1)] {
        d.free(b).unwrap();
    }
    other1.free(theirs).unwrap();
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_fan_out_reaches_every_device_by_both_paths() {
    let set = two_gpus();
    enable_peers(&set);
    let mut rng = fastrand::Rng::with_seed(0xFA40);
    const OFFSET: u64 = 3;
    const TAIL: u64 = 5;
    for len in [1u64, 4097, 1_000_003, 64 * MIB] {
        // Poisoned once; each fan-out below writes other bytes, and what is not a target
        // keeps what it had.
        let (buffers, mut expect): (Vec<ResidentBuffer>, Vec<Vec<u8>>) = set
            .devices()
            .iter()
            .map(|d| {
                let b = d.allocate(OFFSET + len + TAIL).unwrap();
                let poison = random_vec(&mut rng, (OFFSET + len + TAIL) as usize);
                d.upload(b, &poison).unwrap();
                (b, poison)
            })
            .unzip();
        let base = random_vec(&mut rng, len as usize);
        for (k, (path, targets)) in [
            (Some(FanOutPath::EachLink), vec![0, 1]),
            (Some(FanOutPath::FirstThenPeers), vec![0, 1]),
            (Some(FanOutPath::FirstThenPeers), vec![1, 0]),
            (Some(FanOutPath::EachLink), vec![1]),
            (Some(FanOutPath::FirstThenPeers), vec![1]),
            (None, vec![1, 0]),
        ]
        .into_iter()
        .enumerate()
        {
            // Fresh random bytes, or for the large case the same ones rotated (cheaper to
            // make, and different at every byte but by chance).
            let mut data = if len > 8 * MIB {
                let mut d = base.clone();
                d.rotate_left(k * 4099 + 1);
                d
            } else {
                random_vec(&mut rng, len as usize)
            };
            let list: Vec<(usize, ResidentBuffer)> = targets.iter().map(|&i| (i, buffers[i])).collect();
            let fences = match path {
                Some(p) => set.fan_out_via(p, &data, &list, OFFSET),
                None => set.fan_out(&data, &list, OFFSET),
            }
            .unwrap_or_else(|e| panic!("fan-out of {len} bytes by {path:?} to {targets:?}: {e}"));
            assert_eq!(fences.len(), targets.len(), "one fence per target");
            for &i in &targets {
                expect[i][OFFSET as usize..][..len as usize].copy_from_slice(&data);
            }
            data.fill(0x5A); // the caller's bytes are free again once fan_out returns
            for f in &fences {
                f.wait().unwrap();
            }
            for (i, (d, &b)) in set.devices().iter().zip(&buffers).enumerate() {
                let what = format!("fan-out of {len} bytes by {path:?} to {targets:?}: GPU {i}");
                assert_bytes(&d.download(b).unwrap(), &expect[i], &what);
            }
        }
        for (d, b) in set.devices().iter().zip(buffers) {
            d.free(b).unwrap();
        }
    }

    // Bad targets: an error with a fix, and nothing written anywhere, the good targets included.
    let (d0, d1) = pair(&set);
    let b0 = d0.allocate(4096).unwrap();
    let b1 = d1.allocate(4096).unwrap();
    let poison = [random_vec(&mut rng, 4096), random_vec(&mut rng, 4096)];
    d0.upload(b0, &poison[0]).unwrap();
    d1.upload(b1, &poison[1]).unwrap();
    let data = random_vec(&mut rng, 1000);
    for path in [FanOutPath::EachLink, FanOutPath::FirstThenPeers] {
        let what = format!("{path:?}");
        let past = set.len();
        assert_error!(
            set.fan_out_via(path, &data, &[(0, b0), (1, b1), (past, b1)], 0),
            Error::NotInSet { .. },
            format!("{what}: a target index past the set")
        );
        assert_error!(
            set.fan_out_via(path, &data, &[(0, b0), (1, b0)], 0),
            Error::ForeignBuffer { .. },
            format!("{what}: GPU 0's buffer given for GPU 1")
        );
        assert_error!(
            set.fan_out_via(path, &data, &[(0, b0), (1, b1)], 3097),
            Error::OutOfRange { .. },
            format!("{what}: an offset that runs past the buffers")
        );
        assert_error!(
            set.fan_out_via(path, &data, &[(0, b0), (1, b1)], u64::MAX),
            Error::OutOfRange { .. },
            format!("{what}: offset u64::MAX")
        );
    }
    d0.synchronize().unwrap();
    d1.synchronize().unwrap();
    assert_bytes(&d0.download(b0).unwrap(), &poison[0], "GPU 0 after failed fan-outs");
    assert_bytes(&d1.download(b1).unwrap(), &poison[1], "GPU 1 after failed fan-outs");
    d0.free(b0).unwrap();
    d1.free(b1).unwrap();
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_pinned_staging_of_one_device_serves_the_other() {
    let set = two_gpus();
    let (d0, d1) = pair(&set);
    let mut rng = fastrand::Rng::with_seed(0x9147);
    let len = 3 * MIB as usize + 11;
    for (owner, user) in [(d0, d1), (d1, d0)] {
        let what =
            format!("GPU {}'s pinned staging used by GPU {}", owner.info().ordinal, user.info().ordinal);
        let b = user.allocate(len as u64 + 8).unwrap();
        let mut poison = random_vec(&mut rng, len + 8);
        user.upload(b, &poison).unwrap();
        let mut up = owner.pinned(len).unwrap();
        rng.fill(&mut up);
        let mut down = owner.pinned(len).unwrap();
        rng.fill(&mut down); // poisoned: the download must overwrite every byte
        // SAFETY: both regions are pinned (portable: every context may use them), `len` bytes
        // long, and neither read, written nor dropped until the fences are waited on.
        unsafe {
            let f = user.upload_async_at(b, 5, up.as_ptr(), len).unwrap_or_else(|e| panic!("{what}: {e}"));
            let g = user
                .download_async_at(b, 5, down.as_mut_ptr(), len)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            f.wait().unwrap();
            g.wait().unwrap();
        }
        assert_bytes(&down, &up, &format!("{what}: the download into it"));
        poison[5..][..len].copy_from_slice(&up);
        assert_bytes(&user.download(b).unwrap(), &poison, &format!("{what}: the upload from it"));
        user.free(b).unwrap();
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_a_copy_batch_inside_one_gpu() {
    let set = two_gpus();
    let (d0, _) = pair(&set);
    let moved = ragged_peer_batches(d0, d0, 0x5E1F, 3);
    println!("{moved}");
    moved.assert_path(true); // one GPU: always direct, no host staging

    // Within one buffer: sources and destinations apart, so that no copy reads what
    // another writes.
    let mut rng = fastrand::Rng::with_seed(0x5E20);
    let b = d0.allocate(2 * MIB).unwrap();
    let mut expect = random_vec(&mut rng, 2 * MIB as usize);
    d0.upload(b, &expect).unwrap();
    let copies =
        [(0u64, MIB + 1, 300_001u64), (11, MIB + 400_000, 10), (3, MIB + 400_005, 7), (999, 2 * MIB - 1, 1)];
    let mut batch = d0.peer_copies(d0);
    for &(from, to, len) in &copies {
        batch.copy(b, from, b, to, len).unwrap();
    }
    batch.submit().unwrap().wait().unwrap();
    for &(from, to, len) in &copies {
        let (from, to, len) = (from as usize, to as usize, len as usize);
        let bytes = expect[from..from + len].to_vec();
        expect[to..to + len].copy_from_slice(&bytes);
    }
    assert_bytes(&d0.download(b).unwrap(), &expect, "copies within one buffer");
    d0.free(b).unwrap();
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn two_gpus_block_tables_move_with_copy_ranges_both_ways() {
    let set = two_gpus();
    enable_peers(&set);
    let (d0, d1) = pair(&set);
    let mut rng = fastrand::Rng::with_seed(0xB10C);
    for (src, dst) in [(d0, d1), (d1, d0)] {
        // Two pools of 1024 blocks of 4 KiB each side; blocks move to shuffled slots, and
        // a second table of odd-sized pieces at odd offsets.
        let (pool, block) = (4u64 << 20, 4096u64);
        let from: Vec<Vec<u8>> = (0..2).map(|_| random_vec(&mut rng, pool as usize)).collect();
        let a: Vec<ResidentBuffer> = from
            .iter()
            .map(|v| {
                let b = src.allocate(pool).unwrap();
                src.upload(b, v).unwrap();
                b
            })
            .collect();
        let mut expect: Vec<Vec<u8>> = (0..2).map(|_| random_vec(&mut rng, pool as usize)).collect();
        let b: Vec<ResidentBuffer> = expect
            .iter()
            .map(|v| {
                let b = dst.allocate(pool).unwrap();
                dst.upload(b, v).unwrap();
                b
            })
            .collect();
        let mut batch = dst.peer_copies(src);
        for k in 0..2 {
            let mut slots: Vec<u64> = (0..pool / block).collect();
            rng.shuffle(&mut slots);
            let mut table: Vec<(u64, u64, u64)> = slots
                .iter()
                .take(700)
                .enumerate()
                .map(|(i, &s)| (i as u64 * block, s * block, block))
                .collect();
            // Odd pieces too, some overlapping earlier blocks: later ranges win.
            table.extend((0..300).map(|_| {
                let len = rng.u64(1..3000);
                (rng.u64(0..pool - len), rng.u64(0..pool - len), len)
            }));
            batch.copy_ranges(a[k], b[k], &table).unwrap();
            for &(so, d, len) in &table {
                let (so, d, len) = (so as usize, d as usize, len as usize);
                expect[k][d..d + len].copy_from_slice(&from[k][so..so + len]);
            }
        }
        batch.submit().unwrap().wait().unwrap();
        // A table in ascending slots, alone in its batch and into a third pair of pools:
        // checked in one pass and built as it is added.
        let third_src = random_vec(&mut rng, pool as usize);
        let a3 = src.allocate(pool).unwrap();
        src.upload(a3, &third_src).unwrap();
        let mut third = random_vec(&mut rng, pool as usize);
        let b3 = dst.allocate(pool).unwrap();
        dst.upload(b3, &third).unwrap();
        let mut blocks: Vec<u64> = (0..pool / block).collect();
        rng.shuffle(&mut blocks);
        let table: Vec<(u64, u64, u64)> = blocks
            .iter()
            .take(900)
            .enumerate()
            .map(|(slot, &blk)| (blk * block, slot as u64 * block, block))
            .collect();
        let mut ascending = dst.peer_copies(src);
        ascending.copy_ranges(a3, b3, &table).unwrap();
        for &(so, d, len) in &table {
            let (so, d, len) = (so as usize, d as usize, len as usize);
            third[d..d + len].copy_from_slice(&third_src[so..so + len]);
        }
        ascending.submit().unwrap().wait().unwrap();
        assert_bytes(&dst.download(b3).unwrap(), &third, "ascending block table destination");
        src.free(a3).unwrap();
        dst.free(b3).unwrap();
        for k in 0..2 {
            assert_bytes(&dst.download(b[k]).unwrap(), &expect[k], "block table destination");
            assert_bytes(&src.download(a[k]).unwrap(), &from[k], "block table source unchanged");
            src.free(a[k]).unwrap();
            dst.free(b[k]).unwrap();
        }
    }
}
