//! Layer assignment. Today an even split by layer count; the measured split planner replaces
//! `even_split` behind the same signature.

use std::ops::Range;

/// Split `num_layers` into `stages` contiguous ranges whose sizes differ by at most one
/// (earlier stages take the extra layers). Panics if there are more stages than layers.
pub fn even_split(num_layers: usize, stages: usize) -> Vec<Range<usize>> {
    assert!(
        stages > 0 && stages <= num_layers,
        "cannot split {num_layers} layers into {stages} stages"
    );
    let (base, extra) = (num_layers / stages, num_layers % stages);
    let mut start = 0;
    (0..stages)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// Ranges from explicit cut points (`[10, 20]` on 30 layers: 0..10, 10..20, 20..30).
pub fn ranges_from_cuts(num_layers: usize, cuts: &[usize]) -> Result<Vec<Range<usize>>, String> {
    let mut bounds = Vec::with_capacity(cuts.len() + 2);
    bounds.push(0);
    bounds.extend_from_slice(cuts);
    bounds.push(num_layers);
    if bounds.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "layer cuts {cuts:?} must be strictly increasing inside 1..{num_layers}"
        ));
    }
    Ok(bounds.windows(2).map(|w| w[0]..w[1]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_cuts() {
        assert_eq!(ranges_from_cuts(3, &[1]).unwrap(), vec![0..1, 1..3]);
        assert!(ranges_from_cuts(3, &[0]).is_err());
        assert!(ranges_from_cuts(3, &[2, 2]).is_err());
        assert!(ranges_from_cuts(3, &[3]).is_err());
    }

    #[test]
    fn splits_are_contiguous_and_balanced() {
        assert_eq!(even_split(30, 2), vec![0..15, 15..30]);
        assert_eq!(even_split(3, 3), vec![0..1, 1..2, 2..3]);
        assert_eq!(even_split(7, 3), vec![0..3, 3..5, 5..7]);
        for n in 1..12 {
            for s in 1..=n {
                let r = even_split(n, s);
                assert_eq!(r.first().unwrap().start, 0);
                assert_eq!(r.last().unwrap().end, n);
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }
}
