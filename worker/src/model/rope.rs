//! Rotary position embedding frequencies, computed in f32 the way transformers does, with the
//! supported scaling rules applied.

use baton_shared::model_config::{ModelConfig, RopeScaling};

/// Inverse frequencies for one head (`rotary_dim / 2` of them: the rotated part of a head).
#[derive(Debug, Clone)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub head_dim: usize,
}

impl Rope {
    /// Frequencies for a model's rotated head width, theta and scaling.
    pub fn new(cfg: &ModelConfig) -> Self {
        let d = cfg.rotary_dim;
        let mut inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / (cfg.rope_theta as f32).powf((2 * i) as f32 / d as f32))
            .collect();
        match cfg.rope_scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    original_max_position_embeddings as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Self { inv_freq, head_dim: d }
    }

    /// Fill `cos`/`sin` (each `rotary_dim / 2` long) for one position.
    pub fn tables(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = f * pos as f32;
            *c = angle.cos();
            *s = angle.sin();
        }
    }
}
