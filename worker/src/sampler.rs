//! Token sampling: greedy, temperature, top-k, top-p, min-p, seeded for reproducibility.

use baton_shared::sampling::SamplingParams;

/// SplitMix64: tiny, fast, and good enough statistically for drawing tokens.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The draw a sampled token takes: [`Rng::next_f64`] as f32.
    pub fn next_draw(&mut self) -> f32 {
        self.next_f64() as f32
    }
}

/// Picks tokens from logits for one sequence; keeps its buffer between calls.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    candidates: Vec<(f32, u32)>,
}

/// Index of the largest value (the first one on ties, as torch.argmax does).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler for `params`; without a seed one is drawn from the clock.
    pub fn new(params: &SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        Self {
            params: params.clone(),
            rng: Rng::new(seed),
            candidates: Vec::new(),
        }
    }

    /// Skip the draws of `tokens` earlier samples (a sequence recomputed after a preemption
    /// or a migration), so a seeded stream continues where it was. Greedy sampling draws
    /// nothing; every other setting draws exactly one number per token.
    pub fn skip(&mut self, tokens: u32) {
        if !self.params.is_greedy() {
            for _ in 0..tokens {
                self.rng.next_u64();
            }
        }
    }

    /// The settings it samples with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next uniform number in [0, 1) of its stream: the one draw a sampled token takes
    /// (for a sampler that runs where the logits are, such as the GPU's `sample_rows`); the
    /// same number [`Sampler::sample`] draws.
    pub fn draw(&mut self) -> f32 {
        self.rng.next_draw()
    }

    /// Whether this sampler always takes the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// Choose the next token from `logits`.
    ///
    /// Only what a setting needs is sorted: with no top-p every restriction is a linear pass
    /// (the draw walks tokens in id order), and top-p sorts just enough of the most likely
    /// tokens to cover its mass. Sorting the whole vocabulary per token (49k entries for
    /// SmolLM2) cost about a millisecond per sequence and step under the OpenAI defaults.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.is_greedy() {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        // Unnormalised probabilities in id order; the most likely token weighs exactly 1.
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) / p.temperature;
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| ((l / p.temperature - max).exp(), i as u32)),
        );
        // Most likely first; equal weights by lower id, so every cut is deterministic.
        let first = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, first);
            c.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let want = p.top_p * c.iter().map(|e| e.0).sum::<f32>();
            // The nucleus is usually a few tokens: sort the top `k`, widening k until it holds
            // the mass (the top k after a selection are the first k of a full sort).
            let mut k = NUCLEUS_GUESS.min(c.len());
            loop {
                if k < c.len() {
                    c.select_nth_unstable_by(k - 1, first);
                }
                c[..k].sort_unstable_by(first);
                let mut cum = 0f32;
                if let Some(at) = c[..k].iter().position(|e| {
                    cum += e.0;
                    cum >= want
                }) {
                    c.truncate(at + 1);
                    break;
                }
                if k == c.len() {
                    break;
                }
                k = (k * 8).min(c.len());
            }
        }
        if p.min_p > 0.0 {
            // Relative to the most likely token left (weight 1 unless top-k/top-p removed it,
            // which they never do).
            let top = c.iter().fold(0f32, |m, e| m.max(e.0));
            let floor = top * p.min_p;
            c.retain(|e| e.0 >= floor);
        }
        let total: f32 = c.iter().map(|e| e.0).sum();
        let mut r = self.rng.next_draw() * total;
        for e in c.iter() {
            if r < e.0 {
                return e.1;
            }
            r -= e.0;
        }
        c[c.len() - 1].1
    }
}

/// Tokens sorted first when looking for a top-p nucleus.
const NUCLEUS_GUESS: usize = 64;

/// Log-probability of `token` under `logits`, and the `k` most likely `(id, logprob)` pairs
/// (best first; on ties the lower id first, as argmax).
pub fn log_softmax_top(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Summing in f64 keeps the normaliser exact enough over a 150k-entry vocabulary.
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < k || l > top[top.len() - 1].1 {
                let at = top.partition_point(|e| e.1 >= l);
                top.insert(at, (i as u32, l));
                top.truncate(k);
            }
        }
    }
    (
        logits[token as usize] - lse,
        top.into_iter().map(|(i, l)| (i, l - lse)).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn log_softmax_top_is_normalised_and_sorted() {
        let logits = [1.0, 3.0, 2.0, -1.0, 3.0];
        let (lp, top) = log_softmax_top(&logits, 1, 3);
        let total: f32 = logits.iter().map(|l| (l - logits[1] + lp).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(
            top.iter().map(|e| e.0).collect::<Vec<_>>(),
            vec![1, 4, 2],
            "ties keep the lower id first"
        );
        assert!((top[0].1 - lp).abs() < 1e-6);
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(&SamplingParams::greedy(4));
        assert_eq!(s.sample(&[0.1, 3.0, 2.0, 3.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_varied() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = || {
            let mut s = Sampler::new(&params(|_| {}));
            (0..40).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.iter().any(|&x| x != a[0]), "sampling at temperature 1 should vary");
    }

    #[test]
    fn a_resumed_sampler_continues_the_seeded_stream() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut whole = Sampler::new(&params(|_| {}));
        let all: Vec<u32> = (0..30).map(|_| whole.sample(&logits)).collect();
        let mut resumed = Sampler::new(&params(|_| {}));
        resumed.skip(12);
        let rest: Vec<u32> = (0..18).map(|_| resumed.sample(&logits)).collect();
        assert_eq!(rest, all[12..]);
        // Greedy draws nothing, so skipping changes nothing.
        let mut greedy = Sampler::new(&SamplingParams::greedy(4));
        greedy.skip(5);
        assert_eq!(greedy.sample(&[0.1, 3.0, 2.0]), 1);
    }

    /// Brute force: the softmax of `logits / t` restricted to the full-sort nucleus of `top_p`.
    fn nucleus_probs(logits: &[f32], t: f32, top_p: f32) -> Vec<f64> {
        let max = logits.iter().fold(f32::MIN, |m, &l| m.max(l)) as f64;
        let w: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / t as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut order: Vec<usize> = (0..w.len()).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        let mut keep = vec![false; w.len()];
        let mut cum = 0.0;
        for &i in &order {
            keep[i] = true;
            cum += w[i] / total;
            if cum >= top_p as f64 {
                break;
            }
        }
        let kept: f64 = (0..w.len()).filter(|&i| keep[i]).map(|i| w[i]).sum();
        (0..w.len()).map(|i| if keep[i] { w[i] / kept } else { 0.0 }).collect()
    }

    #[test]
    fn draws_follow_the_softmax_and_the_nucleus() {
        // A 1,000-token vocabulary: a few likely tokens over a long flat tail, so a 0.9 nucleus
        // holds hundreds of tokens (past the first sorted guess) and the plain draw walks them all.
        let logits: Vec<f32> = (0..1000u32)
            .map(|i| {
                if i % 199 == 5 {
                    6.0 - (i / 199) as f32
                } else {
                    ((i * 7919) % 1000) as f32 * 1e-3
                }
            })
            .collect();
        for (t, top_p) in [(1.0f32, 1.0f32), (0.7, 1.0), (1.0, 0.9), (1.3, 0.5), (1.0, 0.05)] {
            let want = nucleus_probs(&logits, t, top_p);
            let mut s = Sampler::new(&params(|p| {
                p.temperature = t;
                p.top_p = top_p;
            }));
            let n = 40_000;
            let mut counts = vec![0u32; logits.len()];
            for _ in 0..n {
                counts[s.sample(&logits) as usize] += 1;
            }
            for (i, (&c, &p)) in counts.iter().zip(&want).enumerate() {
                let freq = c as f64 / n as f64;
                if p == 0.0 {
                    assert_eq!(c, 0, "t={t} top_p={top_p}: token {i} is outside the nucleus");
                } else {
                    // Five standard deviations of a binomial frequency, plus float slack.
                    let sd = (p * (1.0 - p) / n as f64).sqrt();
                    assert!(
                        (freq - p).abs() < 5.0 * sd + 1e-6,
                        "t={t} top_p={top_p} token {i}: {freq} vs {p}"
                    );
                }
            }
        }
    }

    #[test]
    fn top_k_and_min_p_restrict_choices() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let mut s = Sampler::new(&params(|p| p.top_k = 2));
        for _ in 0..100 {
            assert!(matches!(s.sample(&logits), 0 | 1));
        }
        let mut s = Sampler::new(&params(|p| p.min_p = 0.5));
        for _ in 0..100 {
            assert!(matches!(s.sample(&logits), 0 | 1 | 4));
        }
        let mut s = Sampler::new(&params(|p| p.top_p = 0.01));
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 0);
        }
    }
}
