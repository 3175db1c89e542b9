//! Readbacks at the edges, on the model driver: bad ranges refused before host memory is
//! reserved.

use super::model_tests::Model;
use crate::fake_driver;
use crate::{Config, Device, Error};

fn device(config: Config) -> Device {
    Device::open_with(fake_driver::driver(), 0, config).expect("the model opens")
}

fn small_chunks() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 8 << 10,
        pinned_cap_bytes: 8 << 20,
        ..Config::default()
    }
}

fn out_of_range<T: std::fmt::Debug>(what: &str, result: crate::Result<T>) {
    match result {
        Err(e @ Error::OutOfRange { .. }) => assert!(e.to_string().contains("Fix:"), "{what}: {e}"),
        other => panic!("{what}: expected OutOfRange, got {other:?}"),
    }
}

#[test]
fn a_download_range_past_the_buffer_is_out_of_range_before_any_host_memory_is_reserved() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(61);
    let m = Model::new(&d, &mut rng, &[4096]);
    let b = m.buffers[0];
    let max = u64::MAX;
    for (offset, len) in [(0, max), (1, max), (max, 1), (max, max), (4096, 1), (0, 4097), (4000, max - 3000)]
    {
        let what = format!("offset {offset}, len {len}");
        out_of_range(&format!("download_range {what}"), d.download_range(b, offset, len));
        out_of_range(&format!("download_ranges {what}"), d.download_ranges(&[(b, 0, 8), (b, offset, len)]));
        let mut out = vec![Vec::new(); 2];
        out_of_range(
            &format!("download_into {what}"),
            d.download_into(&[(b, 0, 8), (b, offset, len)], &mut out),
        );
        out_of_range(&format!("read {what}"), d.readbacks().read(b, offset, len));
        out_of_range(&format!("prepare_readbacks {what}"), d.prepare_readbacks(&[(b, offset, len)]));
        if len <= 4097 {
            let mut slice = vec![0u8; len as usize];
            out_of_range(&format!("read_into_slice {what}"), d.read_into_slice(b, offset, &mut slice));
        }
    }
    let mut one = [0u8; 1];
    out_of_range("read_into_slice at u64::MAX", d.read_into_slice(b, max, &mut one));
    // SAFETY: the range is refused before anything is enqueued (checked first).
    let fence = unsafe { d.download_async_at(b, max, one.as_mut_ptr(), 1) };
    out_of_range("download_async_at at u64::MAX", fence);
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
    m.check(&d, "after the refused downloads");
}
