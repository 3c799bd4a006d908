//! Mixture-of-experts routing: each row's top-k experts from its router logits, grouped by
//! expert, so a layer runs every active expert once over all the rows sent to it (its
//! weights read once per micro-batch) and adds each result back into its row.
//!
//! Every row's choice and sum depend on that row alone: the experts a row is sent to are
//! added into it in ascending expert order (as transformers adds them), whichever other rows
//! share the batch.

/// Which rows go to which expert, with what weight; rebuilt by [`route`] for every batch,
/// keeping its memory (routing a batch no larger than an earlier one allocates nothing).
#[derive(Debug, Default, Clone)]
pub struct Routing {
    /// Rows routed.
    rows: usize,
    /// Expert `e`'s entries are `starts[e]..starts[e + 1]` of `row_of` and `weight_of`.
    starts: Vec<usize>,
    /// The row of each entry, ascending within an expert.
    row_of: Vec<u32>,
    weight_of: Vec<f32>,
    /// Each row's chosen `(expert, weight)`, `top_k` per row.
    chosen: Vec<(u32, f32)>,
    /// One row's probabilities.
    probs: Vec<f32>,
    /// Where each expert's next entry goes while grouping.
    next: Vec<usize>,
}

impl Routing {
    /// Rows of the batch routed.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The rows sent to `expert` (ascending) and their weights.
    pub fn expert(&self, expert: usize) -> (&[u32], &[f32]) {
        let at = self.span(expert);
        (&self.row_of[at.clone()], &self.weight_of[at])
    }

    /// Experts each row is sent to.
    pub fn top_k(&self) -> usize {
        self.chosen.len() / self.rows.max(1)
    }

    /// Every entry's row and weight, expert after expert (a device uploads them once per
    /// batch and reads each expert's [`span`](Self::span) of them).
    pub fn entries(&self) -> (&[u32], &[f32]) {
        (&self.row_of, &self.weight_of)
    }

    /// Where `expert`'s entries sit in [`entries`](Self::entries).
    pub fn span(&self, expert: usize) -> std::ops::Range<usize> {
        self.starts[expert]..self.starts[expert + 1]
    }

    /// Row `row`'s chosen experts and weights, largest probability first.
    pub fn chosen(&self, row: usize) -> &[(u32, f32)] {
        let k = self.top_k();
        &self.chosen[row * k..(row + 1) * k]
    }
}

/// Route every `experts`-wide row of `logits`: the softmax over experts, the `top_k` largest
/// probabilities (ties to the lower expert), divided by their sum when `normalize`.
pub fn route(logits: &[f32], experts: usize, top_k: usize, normalize: bool, r: &mut Routing) {
    assert!(experts > 0 && top_k <= experts, "route: {top_k} of {experts} experts");
    let rows = logits.len() / experts;
    r.rows = rows;
    r.chosen.clear();
    r.probs.resize(experts, 0.0);
    for row in logits.chunks_exact(experts) {
        softmax(row, &mut r.probs);
        let first = r.chosen.len();
        for _ in 0..top_k {
            // Small k: repeated selection, taken probabilities marked below any real one.
            let (best, p) = r
                .probs
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |b, (e, &p)| if p > b.1 { (e, p) } else { b });
            r.chosen.push((best as u32, p));
            r.probs[best] = f32::NEG_INFINITY;
        }
        if normalize {
            let sum: f32 = r.chosen[first..].iter().map(|c| c.1).sum();
            r.chosen[first..].iter_mut().for_each(|c| c.1 /= sum);
        }
    }
    r.starts.clear();
    r.starts.resize(experts + 1, 0);
    for &(e, _) in &r.chosen {
        r.starts[e as usize + 1] += 1;
    }
    for e in 0..experts {
        r.starts[e + 1] += r.starts[e];
    }
    r.row_of.resize(r.chosen.len(), 0);
    r.weight_of.resize(r.chosen.len(), 0.0);
    r.next.clear();
    r.next.extend_from_slice(&r.starts[..experts]);
    for (i, &(e, w)) in r.chosen.iter().enumerate() {
        let at = &mut r.next[e as usize];
        r.row_of[*at] = (i / top_k.max(1)) as u32;
        r.weight_of[*at] = w;
        *at += 1;
    }
}

/// `out = softmax(x)`, with the maximum subtracted first.
fn softmax(x: &[f32], out: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - max).exp();
        sum += *o;
    }
    out.iter_mut().for_each(|o| *o /= sum);
}

/// The `width`-wide rows of `x` routed to `expert`, packed into `out`; how many there are.
pub fn gather(x: &[f32], width: usize, r: &Routing, expert: usize, out: &mut [f32]) -> usize {
    let (rows, _) = r.expert(expert);
    for (&row, o) in rows.iter().zip(out.chunks_exact_mut(width)) {
        let row = row as usize;
        o.copy_from_slice(&x[row * width..(row + 1) * width]);
    }
    rows.len()
}

/// `out[row] += weight · y[i]` for the `i`-th row routed to `expert`.
pub fn scatter_add(y: &[f32], width: usize, r: &Routing, expert: usize, out: &mut [f32]) {
    let (rows, weights) = r.expert(expert);
    for ((&row, &w), yr) in rows.iter().zip(weights).zip(y.chunks_exact(width)) {
        let row = row as usize;
        for (o, &v) in out[row * width..(row + 1) * width].iter_mut().zip(yr) {
            *o += v * w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_takes_its_largest_experts_grouped_by_expert() {
        // Row 0 prefers experts 2 then 0; row 1 prefers 0 then 3; row 2 prefers 2 then 3.
        let logits = [1.0, -1.0, 3.0, 0.0, 2.0, -5.0, 0.0, 1.0, 0.0, 0.0, 4.0, 2.0];
        let mut r = Routing::default();
        route(&logits, 4, 2, false, &mut r);
        assert_eq!(r.rows(), 3);
        let e: Vec<u32> = r.chosen(0).iter().map(|c| c.0).collect();
        assert_eq!(e, [2, 0]);
        assert_eq!(r.expert(0).0, &[0, 1]);
        assert!(r.expert(1).0.is_empty());
        assert_eq!(r.expert(2).0, &[0, 2]);
        assert_eq!(r.expert(3).0, &[1, 2]);
        // The entries, expert after expert, and each expert's span of them.
        assert_eq!(r.entries().0, &[0, 1, 0, 2, 1, 2]);
        assert_eq!([r.span(0), r.span(1), r.span(2), r.span(3)], [0..2, 2..2, 2..4, 4..6]);
        assert_eq!(r.entries().1[r.span(2)], *r.expert(2).1);
        // Unnormalized weights are the softmax probabilities themselves.
        let z: f32 = [1.0f32, -1.0, 3.0, 0.0].iter().map(|v| (v - 3.0).exp()).sum();
        assert!((r.chosen(0)[0].1 - 1.0 / z).abs() < 1e-6);
        let buffers = |r: &Routing| {
            [
                r.row_of.as_ptr() as usize,
                r.next.as_ptr() as usize,
                r.chosen.as_ptr() as usize,
            ]
        };
        let before = buffers(&r);
        route(&logits, 4, 2, true, &mut r);
        assert_eq!(
            buffers(&r),
            before,
            "a second batch of the same size reuses every buffer"
        );
        for row in 0..3 {
            let s: f32 = r.chosen(row).iter().map(|c| c.1).sum();
            assert!((s - 1.0).abs() < 1e-6, "row {row} sums to {s}");
        }
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let mut r = Routing::default();
        route(&[0.5, 0.5, 0.5], 3, 2, true, &mut r);
        assert_eq!(r.chosen(0), &[(0, 0.5), (1, 0.5)]);
    }

    #[test]
    fn gather_and_scatter_move_routed_rows_and_weigh_them() {
        let mut r = Routing::default();
        route(&[0.0, 9.0, 9.0, 0.0], 2, 1, true, &mut r);
        let x = [1.0, 2.0, 3.0, 4.0];
        let mut packed = [0.0; 4];
        assert_eq!(gather(&x, 2, &r, 1, &mut packed), 1);
        assert_eq!(&packed[..2], &[1.0, 2.0]);
        let mut out = [10.0; 4];
        scatter_add(&[1.0, 1.0], 2, &r, 0, &mut out);
        assert_eq!(out, [10.0, 10.0, 11.0, 11.0]);
    }
}
