//! A byte buffer whose start is aligned to a cache line.
//!
//! Why: the 512-bit kernels load 64 bytes at a time, and a load that straddles two cache lines
//! costs two. Quantized rows of SmolLM2's widths are whole multiples of 64 bytes, so aligning the
//! buffer's start aligns every row.

use std::ops::{Deref, DerefMut};

/// One cache line.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
struct Line([i8; 64]);

/// A growable `[i8]` starting on a 64-byte boundary.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct AlignedI8 {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedI8 {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Self {
        Self {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    /// Grow or shrink to `len` values; new ones are zero.
    pub fn resize(&mut self, len: usize) {
        self.lines.resize(len.div_ceil(64), Line([0; 64]));
        if len > self.len {
            // Bytes past the old length in its last line may be stale: zero them.
            let old = self.len;
            self.len = len;
            self[old..].fill(0);
        }
        self.len = len;
    }
}

impl Deref for AlignedI8 {
    type Target = [i8];

    fn deref(&self) -> &[i8] {
        // SAFETY: `lines` holds at least `len` initialized bytes, contiguous (repr(C) array).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
}

impl DerefMut for AlignedI8 {
    fn deref_mut(&mut self) -> &mut [i8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

impl std::fmt::Debug for AlignedI8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedI8({} bytes)", self.len)
    }
}

impl From<&[i8]> for AlignedI8 {
    fn from(v: &[i8]) -> Self {
        let mut a = Self::zeros(v.len());
        a.copy_from_slice(v);
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_cache_line_and_keeps_its_contents_when_resized() {
        let mut a = AlignedI8::from(&[1i8, 2, 3][..]);
        assert_eq!(a.as_ptr() as usize % 64, 0);
        assert_eq!(&a[..], &[1, 2, 3]);
        a.resize(2);
        a.resize(200);
        assert_eq!(a.as_ptr() as usize % 64, 0);
        assert_eq!(&a[..3], &[1, 2, 0], "bytes past a shrink come back as zero");
        assert!(a[3..].iter().all(|&v| v == 0));
        assert_eq!(a.len(), 200);
    }
}
