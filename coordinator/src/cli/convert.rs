//! `baton convert`: GGUF (or a Hugging Face directory) to a Hugging Face directory with
//! safetensors weights in f32 or bf16, config.json, tokenizer.json and tokenizer_config.json.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use baton_worker::model::{StageWeights, arch, registry};
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use safetensors::{Dtype, tensor::TensorView};

use super::{Ctx, ModelArg};

#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Output directory (created; must be empty if it exists).
    #[arg(long)]
    pub out: PathBuf,
    /// Weight type of the written safetensors.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
}

pub fn run(ctx: &Ctx, a: ConvertArgs) -> Result<()> {
    let model = ctx.open_model(&a.model)?;
    if a.out.exists() && std::fs::read_dir(&a.out)?.next().is_some() {
        bail!("{}: output directory exists and is not empty", a.out.display());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let cfg = &model.config;
    StageWeights::validate_files(&model.files, cfg)?;
    let arch = registry::for_config(cfg);
    let wanted = arch::stage_tensors(arch, cfg, 0..cfg.num_layers, true, true);
    let pb = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::new(wanted.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template("converting [{bar:30}] {pos}/{len} tensors {msg}")?.progress_chars("=> "),
    );
    let bf = a.dtype == "bf16";
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(wanted.len());
    for spec in wanted {
        let name = spec.hf.clone();
        pb.set_message(name.clone());
        let values = model.files.load_f32(&spec, ctx.settings.check_weights)?;
        let bytes: Vec<u8> = if bf {
            values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()
        } else {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        blobs.push((name, spec.shape, bytes));
        pb.inc(1);
    }
    let dtype = if bf { Dtype::BF16 } else { Dtype::F32 };
    let views = blobs
        .iter()
        .map(|(n, shape, bytes)| Ok((n.clone(), TensorView::new(dtype, shape.clone(), bytes)?)))
        .collect::<Result<Vec<_>>>()?;
    pb.set_message("writing model.safetensors");
    safetensors::serialize_to_file(views, None, &a.out.join("model.safetensors"))?;
    pb.finish_and_clear();

    let tok = &model.tokenizer;
    let eos = tok.eos_ids.first().copied();
    let mut config = cfg.to_hf_json(tok.bos_id, eos);
    config["torch_dtype"] = serde_json::json!(if bf { "bfloat16" } else { "float32" });
    write_json(&a.out.join("config.json"), &config)?;
    write_json(
        &a.out.join("generation_config.json"),
        &serde_json::json!({ "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_ids }),
    )?;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
    write_json(
        &a.out.join("tokenizer_config.json"),
        &serde_json::json!({
            "bos_token": name(tok.bos_id),
            "eos_token": name(eos),
            "add_bos_token": tok.add_bos,
            "chat_template": tok.chat_template,
        }),
    )?;
    tok.inner()
        .save(a.out.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("writing tokenizer.json: {e}"))?;
    println!("{}", a.out.display());
    Ok(())
}

fn write_json(path: &std::path::Path, v: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)?).with_context(|| format!("writing {}", path.display()))
}
