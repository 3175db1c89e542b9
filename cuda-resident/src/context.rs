//! The device's primary context, retained once and released when the last user is gone.
//!
//! Everything that owns driver resources tied to the context (the device core, the pinned
//! pool and the pinned regions it lends, which may outlive the `Device` inside a
//! `Downloaded`) holds an `Arc<Context>`, so the context outlives every allocation made in it.

use cuda_sys::{CUcontext, CUdevice};

use crate::error::Result;
use crate::raw::Raw;

/// A retained primary context.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) raw: Raw,
    pub(crate) ctx: CUcontext,
    pub(crate) device: CUdevice,
}

// SAFETY: a CUcontext is a handle the driver lets any thread use (cuCtxSetCurrent makes it
// current per thread); the struct only carries it.
unsafe impl Send for Context {}
// SAFETY: as above; nothing here is mutated after construction.
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn retain(raw: Raw, device: CUdevice) -> Result<Context> {
        let ctx = raw.primary_ctx_retain(device)?;
        Ok(Context { raw, ctx, device })
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<&Raw> {
        self.raw.set_current(self.ctx)?;
        Ok(&self.raw)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Nothing can be reported from a drop; the release fails only if the driver is
        // already gone, and then there is nothing left to release.
        let _ = crate::raw::release_retrying(|| self.raw.primary_ctx_release(self.device));
    }
}
