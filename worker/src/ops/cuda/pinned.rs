//! Page-locked host memory for the rows a stage exchanges with the host (its hidden rows in,
//! its hidden rows or logits out). From pageable memory the driver copies through a buffer of
//! its own and the host waits for that; from page-locked memory a copy is a DMA the stream runs
//! by itself. So an upload returns at once and the host goes on enqueuing the kernels that
//! follow it (the stream runs them after the copy), and a download moves at the bus's speed.

use cudarc::driver::{CudaEvent, CudaStream, DriverError, PinnedHostSlice, result, sys};

/// One page-locked buffer, grown to the largest transfer, and the event after its last copy.
pub struct PinnedRows {
    buf: Option<PinnedHostSlice<f32>>,
    /// Recorded on the stream after each copy out of `buf`; the host waits on it before it
    /// writes `buf` again or frees it, since the copies are the driver's, not cudarc's.
    copied: CudaEvent,
}

impl PinnedRows {
    /// An empty buffer on `stream`'s context.
    pub fn new(stream: &CudaStream) -> Result<Self, DriverError> {
        Ok(Self {
            buf: None,
            copied: stream.context().new_event(None)?,
        })
    }

    /// The first `n` values of the buffer, once its last copy is done (grown if too small).
    fn room(
        buf: &mut Option<PinnedHostSlice<f32>>,
        copied: &CudaEvent,
        stream: &CudaStream,
        n: usize,
    ) -> Result<*mut f32, DriverError> {
        copied.synchronize()?;
        if buf.as_ref().is_none_or(|b| b.len() < n) {
            *buf = None;
            // SAFETY: what the allocation holds is written before it is read: by the host
            // before an upload, by the copy before a download's read.
            let fresh = unsafe {
                stream
                    .context()
                    .alloc_pinned_with_flags::<f32>(n.max(1).next_power_of_two(), 0)
            }?;
            *buf = Some(fresh);
        }
        match buf.as_mut() {
            Some(b) => b.as_mut_ptr(),
            None => unreachable!("allocated above"),
        }
    }

    /// Copy `host` to the device address `dst` (which holds at least `host.len()` values)
    /// asynchronously on `stream`.
    pub fn upload(&mut self, stream: &CudaStream, host: &[f32], dst: sys::CUdeviceptr) -> Result<(), DriverError> {
        if host.is_empty() {
            return Ok(());
        }
        let ptr = Self::room(&mut self.buf, &self.copied, stream, host.len())?;
        // SAFETY: `room` returned at least `host.len()` values that no copy is using.
        let room = unsafe { std::slice::from_raw_parts_mut(ptr, host.len()) };
        room.copy_from_slice(host);
        // SAFETY: `dst` holds `host.len()` values (the caller's), and `room` is neither written
        // nor freed before `copied`, recorded next, has passed.
        unsafe { result::memcpy_htod_async(dst, &*room, stream.cu_stream()) }?;
        self.copied.record(stream)
    }

    /// Copy `host.len()` values from the device address `src` into `host`, after the work
    /// enqueued before it.
    pub fn download(
        &mut self,
        stream: &CudaStream,
        src: sys::CUdeviceptr,
        host: &mut [f32],
    ) -> Result<(), DriverError> {
        if host.is_empty() {
            return Ok(());
        }
        let ptr = Self::room(&mut self.buf, &self.copied, stream, host.len())?;
        // SAFETY: as in `upload`; the copy writes `room`, and the host reads it only after the
        // stream has finished.
        let room = unsafe { std::slice::from_raw_parts_mut(ptr, host.len()) };
        // SAFETY: `src` holds `host.len()` values (the caller's).
        unsafe { result::memcpy_dtoh_async(&mut *room, src, stream.cu_stream()) }?;
        stream.synchronize()?;
        host.copy_from_slice(room);
        Ok(())
    }
}

impl Drop for PinnedRows {
    fn drop(&mut self) {
        // A copy still reading the buffer must finish before the buffer is freed.
        let _ = self.copied.synchronize();
    }
}
