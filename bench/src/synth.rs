//! `baton-bench synth`: a GGUF file of a Llama, Qwen3 or Qwen3-MoE shape with random Q8_0
//! weights and the default model's tokenizer, named as llama.cpp names them, so speed can be
//! measured (by Baton and by llama.cpp on the very same file) at shapes whose real weights
//! cannot be downloaded here.
//!
//! The weights are uniform in ±√(3 / columns) (unit-variance outputs for unit-variance
//! inputs), the norms are ones: the model computes like a real one of its shape and says
//! nothing sensible.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use baton_shared::gguf::writer::{TensorHeader, header_bytes, padding};
use baton_shared::gguf::{GgufFile, GgufValue};

/// ggml type ids.
const F32: u32 = 0;
const Q8_0: u32 = 8;
/// Values per Q8_0 block, and its bytes (an f16 scale and 32 quants).
const BLOCK: usize = 32;
const BLOCK_BYTES: usize = 34;

/// Shapes of released models, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// Qwen3-30B-A3B: 48 layers of 128 experts (8 active), hidden 2048.
    Qwen3_30bA3b,
    /// Qwen3-8B: 36 dense layers, hidden 4096.
    Qwen3_8b,
    /// Llama 3.1 8B: 32 dense layers, hidden 4096.
    Llama3_8b,
}

/// Families the generator writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Family {
    Llama,
    Qwen3,
    Qwen3moe,
}

/// The command's flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Where to write the GGUF file.
    #[arg(long)]
    pub out: PathBuf,
    /// Start from a released model's shape (every other flag overrides a part of it).
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    #[arg(long, value_enum)]
    pub arch: Option<Family>,
    /// Decoder layers (e.g. fewer than the preset's, to fit memory).
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Dense MLP width.
    #[arg(long)]
    pub ffn: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[arg(long)]
    pub head_dim: Option<usize>,
    #[arg(long)]
    pub experts: Option<usize>,
    #[arg(long)]
    pub experts_used: Option<usize>,
    /// One expert's MLP width.
    #[arg(long)]
    pub expert_ffn: Option<usize>,
    /// The GGUF whose tokenizer (and so vocabulary) the model gets (default: the default model).
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// A model shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub family: Family,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `(experts, used, expert ffn)` for a mixture of experts.
    pub moe: Option<(usize, usize, usize)>,
}

impl Preset {
    fn shape(self) -> Shape {
        match self {
            Preset::Qwen3_30bA3b => Shape {
                family: Family::Qwen3moe,
                layers: 48,
                hidden: 2048,
                ffn: 6144,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                moe: Some((128, 8, 768)),
            },
            Preset::Qwen3_8b => Shape {
                family: Family::Qwen3,
                layers: 36,
                hidden: 4096,
                ffn: 12288,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                moe: None,
            },
            Preset::Llama3_8b => Shape {
                family: Family::Llama,
                layers: 32,
                hidden: 4096,
                ffn: 14336,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                moe: None,
            },
        }
    }
}

impl Args {
    /// The shape the flags describe: the preset's with each given flag applied.
    pub fn shape(&self) -> Result<Shape> {
        let mut s = match (self.preset, self.arch) {
            (Some(p), _) => p.shape(),
            (None, Some(family)) => Shape {
                family,
                layers: 0,
                hidden: 0,
                ffn: 0,
                heads: 0,
                kv_heads: 0,
                head_dim: 0,
                moe: None,
            },
            (None, None) => bail!("give --preset or --arch"),
        };
        if let Some(f) = self.arch {
            s.family = f;
        }
        let set = |v: &mut usize, flag: Option<usize>| {
            if let Some(f) = flag {
                *v = f;
            }
        };
        set(&mut s.layers, self.layers);
        set(&mut s.hidden, self.hidden);
        set(&mut s.ffn, self.ffn);
        set(&mut s.heads, self.heads);
        set(&mut s.kv_heads, self.kv_heads);
        set(&mut s.head_dim, self.head_dim);
        if s.head_dim == 0 && s.heads > 0 {
            s.head_dim = s.hidden / s.heads;
        }
        if s.kv_heads == 0 {
            s.kv_heads = s.heads;
        }
        if s.family == Family::Qwen3moe {
            let (mut e, mut u, mut f) = s.moe.unwrap_or((0, 0, 0));
            set(&mut e, self.experts);
            set(&mut u, self.experts_used);
            set(&mut f, self.expert_ffn);
            s.moe = Some((e, u, f));
        } else {
            s.moe = None;
        }
        s.check()?;
        Ok(s)
    }
}

impl Shape {
    fn check(&self) -> Result<()> {
        let dims = [self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim];
        if dims.contains(&0) {
            bail!("layers, hidden, heads and head width must all be set and positive: {self:?}");
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            bail!("{} heads are not a multiple of {} KV heads", self.heads, self.kv_heads);
        }
        let mut widths = vec![self.hidden, self.heads * self.head_dim];
        match self.moe {
            Some((e, u, f)) => {
                if e == 0 || u == 0 || u > e || f == 0 {
                    bail!("experts {e}, used {u}, expert ffn {f}: need 0 < used <= experts and a width");
                }
                widths.push(f);
            }
            None if self.ffn == 0 => bail!("--ffn must be positive"),
            None => widths.push(self.ffn),
        }
        if let Some(w) = widths.iter().find(|w| !w.is_multiple_of(BLOCK)) {
            bail!("every matrix width must be a multiple of {BLOCK} (Q8_0 blocks); {w} is not");
        }
        Ok(())
    }

    /// Parameters in the decoder layers, and those one token reads.
    fn layer_params(&self) -> (usize, usize) {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let attention = h * q * 2 + h * kv * 2;
        let (all, active) = match self.moe {
            Some((e, u, f)) => (attention + e * 3 * h * f + e * h, attention + u * 3 * h * f + e * h),
            None => (attention + 3 * h * self.ffn, attention + 3 * h * self.ffn),
        };
        (self.layers * all, self.layers * active)
    }
}

/// One tensor to generate.
struct Planned {
    header: TensorHeader,
    /// Q8_0 values drawn uniformly within ±this, or f32 ones (norms).
    fill: Fill,
}

enum Fill {
    Q8 {
        bound: f32,
    },
    Ones,
    /// f32 values within ±bound (the router, kept in f32 as llama.cpp keeps it).
    F32 {
        bound: f32,
    },
}

fn plan(shape: &Shape, vocab: usize) -> Vec<Planned> {
    let (h, q, kv, d) = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.head_dim,
    );
    let mut out = Vec::new();
    let mut q8 = |name: String, rows_shape: Vec<usize>| {
        let cols = *rows_shape.last().unwrap();
        let n: usize = rows_shape.iter().product();
        out.push(Planned {
            header: TensorHeader {
                name,
                shape: rows_shape,
                ggml_type: Q8_0,
                n_bytes: n / BLOCK * BLOCK_BYTES,
            },
            fill: Fill::Q8 {
                bound: (3.0 / cols as f32).sqrt(),
            },
        });
    };
    q8("token_embd.weight".into(), vec![vocab, h]);
    for l in 0..shape.layers {
        q8(format!("blk.{l}.attn_q.weight"), vec![q, h]);
        q8(format!("blk.{l}.attn_k.weight"), vec![kv, h]);
        q8(format!("blk.{l}.attn_v.weight"), vec![kv, h]);
        q8(format!("blk.{l}.attn_output.weight"), vec![h, q]);
        match shape.moe {
            Some((e, _, f)) => {
                q8(format!("blk.{l}.ffn_gate_exps.weight"), vec![e, f, h]);
                q8(format!("blk.{l}.ffn_up_exps.weight"), vec![e, f, h]);
                q8(format!("blk.{l}.ffn_down_exps.weight"), vec![e, h, f]);
            }
            None => {
                q8(format!("blk.{l}.ffn_gate.weight"), vec![shape.ffn, h]);
                q8(format!("blk.{l}.ffn_up.weight"), vec![shape.ffn, h]);
                q8(format!("blk.{l}.ffn_down.weight"), vec![h, shape.ffn]);
            }
        }
    }
    let f32s = |name: String, shape: Vec<usize>, fill: Fill| Planned {
        header: TensorHeader {
            n_bytes: 4 * shape.iter().product::<usize>(),
            name,
            shape,
            ggml_type: F32,
        },
        fill,
    };
    for l in 0..shape.layers {
        out.push(f32s(format!("blk.{l}.attn_norm.weight"), vec![h], Fill::Ones));
        out.push(f32s(format!("blk.{l}.ffn_norm.weight"), vec![h], Fill::Ones));
        if shape.family != Family::Llama {
            out.push(f32s(format!("blk.{l}.attn_q_norm.weight"), vec![d], Fill::Ones));
            out.push(f32s(format!("blk.{l}.attn_k_norm.weight"), vec![d], Fill::Ones));
        }
        if let Some((e, _, _)) = shape.moe {
            let bound = (3.0 / h as f32).sqrt();
            out.push(f32s(
                format!("blk.{l}.ffn_gate_inp.weight"),
                vec![e, h],
                Fill::F32 { bound },
            ));
        }
    }
    out.push(f32s("output_norm.weight".into(), vec![h], Fill::Ones));
    out
}

fn metadata(shape: &Shape, tokenizer: &GgufFile) -> Vec<(String, GgufValue)> {
    let arch = match shape.family {
        Family::Llama => "llama",
        Family::Qwen3 => "qwen3",
        Family::Qwen3moe => "qwen3moe",
    };
    let u = |v: usize| GgufValue::U32(v as u32);
    let k = |key: &str| format!("{arch}.{key}");
    let mut m = vec![
        ("general.architecture".to_string(), GgufValue::String(arch.into())),
        ("general.name".into(), GgufValue::String(format!("synthetic {arch}"))),
        (k("block_count"), u(shape.layers)),
        (k("context_length"), u(4096)),
        (k("embedding_length"), u(shape.hidden)),
        (k("feed_forward_length"), u(shape.ffn.max(1))),
        (k("attention.head_count"), u(shape.heads)),
        (k("attention.head_count_kv"), u(shape.kv_heads)),
        (k("attention.key_length"), u(shape.head_dim)),
        (k("attention.value_length"), u(shape.head_dim)),
        (k("attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-6)),
        (k("rope.freq_base"), GgufValue::F32(1e6)),
        ("general.file_type".into(), u(7)),
    ];
    if let Some((e, used, f)) = shape.moe {
        m.push((k("expert_count"), u(e)));
        m.push((k("expert_used_count"), u(used)));
        m.push((k("expert_feed_forward_length"), u(f)));
    }
    m.extend(
        tokenizer
            .metadata
            .iter()
            .filter(|(key, _)| key.starts_with("tokenizer."))
            .map(|(key, v)| (key.clone(), v.clone())),
    );
    m
}

/// A small, fast generator (xorshift64*): the file is gigabytes of noise.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn write_data(w: &mut impl Write, t: &Planned, noise: &mut Noise) -> std::io::Result<()> {
    let n = t.header.n_bytes;
    match t.fill {
        Fill::Q8 { bound } => {
            let scale = half::f16::from_f32(bound / 127.0).to_bits();
            let mut block = [0u8; BLOCK_BYTES];
            block[..2].copy_from_slice(&scale.to_le_bytes());
            for _ in 0..n / BLOCK_BYTES {
                for chunk in block[2..].chunks_mut(8) {
                    let r = noise.next().to_le_bytes();
                    // Quants in -127..=127 (i8 -128 is never used by Q8_0 quantizers).
                    for (q, b) in chunk.iter_mut().zip(r) {
                        *q = ((b % 255) as i32 - 127) as i8 as u8;
                    }
                }
                w.write_all(&block)?;
            }
        }
        Fill::Ones => {
            for _ in 0..n / 4 {
                w.write_all(&1f32.to_le_bytes())?;
            }
        }
        Fill::F32 { bound } => {
            for _ in 0..n / 4 {
                let unit = (noise.next() >> 40) as f32 / (1u64 << 24) as f32;
                w.write_all(&((2.0 * unit - 1.0) * bound).to_le_bytes())?;
            }
        }
    }
    w.write_all(&vec![0u8; padding(n)])
}

/// Write the model the flags describe.
pub fn run(args: &Args) -> Result<()> {
    let shape = args.shape()?;
    let tok_path = match &args.tokenizer_from {
        Some(p) => p.clone(),
        None => default_gguf()?,
    };
    let tokenizer = GgufFile::open(&tok_path).with_context(|| format!("reading {}", tok_path.display()))?;
    let vocab = tokenizer
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .map(<[GgufValue]>::len)
        .with_context(|| format!("{}: no tokenizer.ggml.tokens", tok_path.display()))?;
    write(&args.out, &shape, &tokenizer, vocab, args.seed)
}

/// Write `shape` with `vocab` embedding rows and `tokenizer`'s tokenizer to `out`.
pub fn write(out: &Path, shape: &Shape, tokenizer: &GgufFile, vocab: usize, seed: u64) -> Result<()> {
    let tensors = plan(shape, vocab);
    let bytes: usize = tensors.iter().map(|t| t.header.n_bytes).sum();
    let (all, active) = shape.layer_params();
    eprintln!(
        "synth: {:?}, {} layers: {:.2} B layer parameters ({:.2} B read per token), vocabulary {vocab}, {:.2} GB",
        shape.family,
        shape.layers,
        all as f64 / 1e9,
        active as f64 / 1e9,
        bytes as f64 / 1e9
    );
    let file = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    w.write_all(&header_bytes(
        &metadata(shape, tokenizer),
        tensors.iter().map(|t| &t.header),
    ))?;
    let mut noise = Noise(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for t in &tensors {
        write_data(&mut w, t, &mut noise).with_context(|| format!("writing {}", out.display()))?;
    }
    w.flush()?;
    println!("{}", out.display());
    Ok(())
}

fn default_gguf() -> Result<PathBuf> {
    let path = baton_shared::fetch::baton_home()
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        bail!(
            "{}: not found; run `baton fetch` or pass --tokenizer-from",
            path.display()
        );
    }
    Ok(path)
}
