//! Per-request timings from a stream's chunk arrival times, and their aggregation per
//! concurrency level.

use serde_json::{Value, json};

/// The `p`-th percentile (0–100) of ascending `sorted` values, by linear interpolation between
/// the two closest ranks (numpy's default method); `None` for no values.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = p.clamp(0.0, 100.0) / 100.0 * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// p50/p90/p99 and mean of a set of durations or rates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Summary {
    /// `None` for no values (a level where every request failed).
    pub fn of(mut values: Vec<f64>) -> Option<Self> {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        Some(Self {
            p50: percentile(&values, 50.0)?,
            p90: percentile(&values, 90.0)?,
            p99: percentile(&values, 99.0)?,
            mean: values.iter().sum::<f64>() / values.len() as f64,
        })
    }

    fn json(s: Option<Self>) -> Value {
        match s {
            Some(s) => json!({ "p50": s.p50, "p90": s.p90, "p99": s.p99, "mean": s.mean }),
            None => Value::Null,
        }
    }
}

/// A content chunk as it arrived: seconds since the request was sent, and the cumulative
/// `usage.completion_tokens` it carried, if the server reports usage on every chunk.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    pub at: f64,
    pub cumulative_tokens: Option<u64>,
}

/// Timings of one successful request, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Send → first content chunk.
    pub ttft: f64,
    /// One entry per output token after the first chunk's.
    pub itl: Vec<f64>,
    /// Send → `[DONE]`.
    pub e2e: f64,
    pub output_tokens: u64,
}

impl Sample {
    /// Timings from the content chunks of a finished stream and the final usage count.
    ///
    /// Tokens per chunk come from differences of cumulative usage when every chunk reports it;
    /// otherwise each chunk counts as one token. A chunk of `n` tokens contributes `n` equal
    /// inter-token latencies of gap/`n` (the tokens are taken to have been spread evenly over
    /// the gap); a chunk that adds no token passes its gap on to the next one. The output
    /// count is the final usage when the server sent it, else the sum over chunks.
    pub fn from_stream(chunks: &[Arrival], e2e: f64, final_usage: Option<u64>) -> Result<Self, String> {
        let first = chunks
            .first()
            .ok_or_else(|| "the stream ended without any generated text".to_string())?;
        let counts: Vec<u64> = if chunks.iter().all(|c| c.cumulative_tokens.is_some()) {
            let mut prev = 0;
            chunks
                .iter()
                .map(|c| {
                    let cum = c.cumulative_tokens.unwrap_or(prev);
                    let n = cum.saturating_sub(prev);
                    prev = prev.max(cum);
                    n
                })
                .collect()
        } else {
            vec![1; chunks.len()]
        };
        let mut itl = Vec::new();
        let mut carried = 0.0;
        for (pair, &n) in chunks.windows(2).zip(&counts[1..]) {
            let gap = pair[1].at - pair[0].at + carried;
            if n == 0 {
                carried = gap;
                continue;
            }
            carried = 0.0;
            itl.extend(std::iter::repeat_n(gap / n as f64, n as usize));
        }
        Ok(Self {
            ttft: first.at,
            itl,
            e2e,
            output_tokens: final_usage.unwrap_or_else(|| counts.iter().sum()),
        })
    }

    /// Time per output token after the first: (E2E − TTFT) / (tokens − 1). Unlike ITL it
    /// does not depend on how the server grouped tokens into chunks.
    pub fn tpot(&self) -> Option<f64> {
        (self.output_tokens > 1).then(|| (self.e2e - self.ttft) / (self.output_tokens - 1) as f64)
    }
}

/// The results of one concurrency level.
#[derive(Debug, Clone, PartialEq)]
pub struct Level {
    pub concurrency: usize,
    pub requests_ok: usize,
    pub requests_failed: usize,
    /// Requests never sent because the level's deadline passed first.
    pub requests_not_sent: usize,
    /// The error of the first request that failed.
    pub first_error: Option<String>,
    /// Seconds from the level's first send until its last request finished.
    pub wall_s: f64,
    /// Output tokens of the successful requests.
    pub output_tokens: u64,
    pub ttft: Option<Summary>,
    pub itl: Option<Summary>,
    pub tpot: Option<Summary>,
    pub e2e: Option<Summary>,
    /// Each successful request's output tokens over its E2E latency.
    pub stream_tok_per_s: Option<Summary>,
}

impl Level {
    /// Aggregate outcomes (in completion order) of a level that ran for `wall_s` seconds.
    pub fn aggregate(concurrency: usize, planned: usize, outcomes: &[Result<Sample, String>], wall_s: f64) -> Self {
        let ok: Vec<&Sample> = outcomes.iter().filter_map(|o| o.as_ref().ok()).collect();
        let pick = |f: &dyn Fn(&Sample) -> Option<f64>| Summary::of(ok.iter().filter_map(|s| f(s)).collect());
        Self {
            concurrency,
            requests_ok: ok.len(),
            requests_failed: outcomes.len() - ok.len(),
            requests_not_sent: planned.saturating_sub(outcomes.len()),
            first_error: outcomes.iter().find_map(|o| o.as_ref().err().cloned()),
            wall_s,
            output_tokens: ok.iter().map(|s| s.output_tokens).sum(),
            ttft: pick(&|s| Some(s.ttft)),
            itl: Summary::of(ok.iter().flat_map(|s| s.itl.iter().copied()).collect()),
            tpot: pick(&|s| s.tpot()),
            e2e: pick(&|s| Some(s.e2e)),
            stream_tok_per_s: pick(&|s| (s.e2e > 0.0).then(|| s.output_tokens as f64 / s.e2e)),
        }
    }

    /// Output tokens of the successful requests over the level's wall time.
    pub fn output_tok_per_s(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.output_tokens as f64 / self.wall_s
        } else {
            0.0
        }
    }

    /// The level as a JSON object (durations in seconds).
    pub fn json(&self) -> Value {
        json!({
            "concurrency": self.concurrency,
            "requests_ok": self.requests_ok,
            "requests_failed": self.requests_failed,
            "requests_not_sent": self.requests_not_sent,
            "first_error": self.first_error,
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            "output_tok_per_s": self.output_tok_per_s(),
            "stream_tok_per_s_mean": self.stream_tok_per_s.map(|s| s.mean),
            "ttft_s": Summary::json(self.ttft),
            "itl_s": Summary::json(self.itl),
            "tpot_s": Summary::json(self.tpot),
            "e2e_s": Summary::json(self.e2e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentile_interpolates_linearly() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert!(close(percentile(&v, 90.0).unwrap(), 3.7));
        assert!(close(percentile(&v, 99.0).unwrap(), 3.97));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        // Out-of-range p is clamped rather than indexing past the end.
        assert_eq!(percentile(&v, 250.0), Some(4.0));
        assert_eq!(percentile(&v, -1.0), Some(1.0));
    }

    #[test]
    fn summary_sorts_and_drops_non_finite() {
        let s = Summary::of(vec![3.0, f64::NAN, 1.0, 2.0, f64::INFINITY]).unwrap();
        assert_eq!((s.p50, s.mean), (2.0, 2.0));
        assert!(s.p50 <= s.p90 && s.p90 <= s.p99);
        assert_eq!(Summary::of(vec![]), None);
        assert_eq!(Summary::of(vec![f64::NAN]), None);
    }

    fn arrivals(at: &[f64]) -> Vec<Arrival> {
        at.iter()
            .map(|&at| Arrival {
                at,
                cumulative_tokens: None,
            })
            .collect()
    }

    #[test]
    fn one_token_per_chunk() {
        let s = Sample::from_stream(&arrivals(&[0.5, 0.6, 0.8]), 0.9, Some(3)).unwrap();
        assert_eq!(s.ttft, 0.5);
        assert_eq!(s.itl.len(), 2);
        assert!(close(s.itl[0], 0.1) && close(s.itl[1], 0.2));
        assert_eq!(s.output_tokens, 3);
        assert!(close(s.tpot().unwrap(), 0.2));
        // Without a usage chunk the chunks are counted.
        assert_eq!(
            Sample::from_stream(&arrivals(&[0.5, 0.6]), 0.7, None)
                .unwrap()
                .output_tokens,
            2
        );
    }

    #[test]
    fn multi_token_chunks_split_their_gap() {
        let chunks = [(0.5, 1), (0.8, 4), (0.9, 4), (1.0, 5)].map(|(at, c)| Arrival {
            at,
            cumulative_tokens: Some(c),
        });
        let s = Sample::from_stream(&chunks, 1.0, Some(5)).unwrap();
        // 0.3 over 3 tokens, then a chunk with no new token hands its 0.1 to the next one.
        assert_eq!(s.itl.len(), 4);
        for (got, want) in s.itl.iter().zip([0.1, 0.1, 0.1, 0.2]) {
            assert!(close(*got, want), "{:?}", s.itl);
        }
    }

    #[test]
    fn a_stream_without_text_is_a_failure() {
        let e = Sample::from_stream(&[], 1.0, Some(0)).unwrap_err();
        assert!(e.contains("without any generated text"), "{e}");
    }

    #[test]
    fn level_aggregates_successes_and_reports_the_first_error() {
        let ok = |ttft: f64, e2e: f64| Sample {
            ttft,
            itl: vec![0.01; 7],
            e2e,
            output_tokens: 8,
        };
        let outcomes = vec![
            Ok(ok(0.1, 1.0)),
            Err("HTTP 429: queue full".to_string()),
            Ok(ok(0.3, 2.0)),
            Err("timed out".to_string()),
        ];
        let l = Level::aggregate(4, 6, &outcomes, 2.0);
        assert_eq!((l.requests_ok, l.requests_failed, l.requests_not_sent), (2, 2, 2));
        assert_eq!(l.first_error.as_deref(), Some("HTTP 429: queue full"));
        assert_eq!(l.output_tokens, 16);
        assert_eq!(l.output_tok_per_s(), 8.0);
        assert!(close(l.ttft.unwrap().p50, 0.2));
        assert!(close(l.stream_tok_per_s.unwrap().mean, 6.0));
        let j = l.json();
        assert_eq!(j["requests_ok"], 2);
        assert_eq!(j["itl_s"]["p99"], 0.01);

        let failed = Level::aggregate(1, 1, &[Err("connection refused".into())], 0.01);
        assert_eq!(failed.ttft, None);
        assert_eq!(failed.output_tok_per_s(), 0.0);
        assert!(failed.json()["ttft_s"].is_null());
    }
}
