//! The pipeline's flags, shared by `baton serve` and `baton coordinator` (flattened into both,
//! as `PipelineSettings` is flattened into `[serve]` and `[coordinator]`), and the one place
//! that turns the resolved settings into a [`PipelineConfig`].

use anyhow::{Result, anyhow};
use baton_coordinator::api::auth::ApiKeys;
use baton_coordinator::api::server::HttpLimits;
use baton_coordinator::pipeline::PipelineConfig;
use baton_coordinator::pipeline::sizing::{
    AutoLimits, HYBRID_MAX_RUNNING, UNMEASURED_MAX_BATCH_TOKENS, UNMEASURED_MAX_RUNNING,
};
use baton_coordinator::planner::SplitPolicy;
use baton_coordinator::speculative::{DraftMethod, MAX_SPECULATIVE_TOKENS, SpeculativeConfig};
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::LoadedModel;
use baton_shared::proto::Dtype;
use baton_shared::settings::{
    ActivationDtypeSetting, KvDtypeSetting, PipelineSettings, SpeculativeSetting, SplitSetting, WeightsSetting,
};
use baton_worker::kv_cache::KvDtype;
use baton_worker::model::{WeightFormat, resolve_format};

/// A clap parser for a settings enum: its names listed in `--help` and in errors.
macro_rules! names {
    ($t:ty) => {
        clap::builder::TypedValueParser::map(clap::builder::PossibleValuesParser::new(<$t>::NAMES), |s| {
            s.parse::<$t>().expect("a listed name parses")
        })
    };
}
pub(super) use names;

/// Flags of the pipeline; each overrides the same key of `[serve]` / `[coordinator]` in
/// baton.toml and `BATON_SERVE__*` / `BATON_COORDINATOR__*` (defaults in `PipelineSettings`).
#[derive(Debug, Default, clap::Args, serde::Serialize)]
pub struct PipelineArgs {
    /// Name clients pass as `model` (default: `smollm2-135m` for the default model, else the
    /// model file or directory name).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// Requests allowed to wait for a slot; more are answered with HTTP 429 [default: 64].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_queue: Option<usize>,
    /// Sequences generated at once (each holds KV on every stage); more wait in the queue
    /// [default: sized from the workers' measured step costs and the KV pool].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_running: Option<usize>,
    /// Tokens per pipeline step; longer prompts are prefilled in chunks [default: sized from the
    /// workers' measured step costs].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
    /// Positions per paged-KV block [default: 16].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_block_size: Option<usize>,
    /// Cap on KV blocks per pipeline [default: what every worker's --kv-cache-mib fits].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_max_blocks: Option<usize>,
    /// How workers store keys and values: f32, or f16 for twice the tokens per KV budget
    /// [default: f32].
    #[arg(long, value_parser = names!(KvDtypeSetting))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_dtype: Option<KvDtypeSetting>,
    /// How layers are split among workers: measured (from each worker's timed layers and head)
    /// or even [default: measured].
    #[arg(long, value_parser = names!(SplitSetting))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<SplitSetting>,
    /// Reuse cached K/V of full blocks a new prompt starts with: true or false [default: true].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_caching: Option<bool>,
    /// Recurrent-state snapshots per stage for a hybrid model's prefix cache; 0 turns its
    /// prefix caching off [default: 32].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_snapshots: Option<usize>,
    /// Largest accepted request body in bytes (HTTP 413 beyond) [default: 4194304].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<usize>,
    /// Open HTTP connections at once; one more gets HTTP 503 with Retry-After [default: 2048].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Seconds a client has to send request headers; slower or idle connections are closed
    /// [default: 10].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_timeout_secs: Option<u64>,
    /// Seconds a client has to send a request body (HTTP 408 beyond) [default: 30].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_timeout_secs: Option<u64>,
    /// Largest request head in bytes (HTTP 431 beyond) [default: 32768].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_header_bytes: Option<usize>,
    /// A key the OpenAI API requires as `Authorization: Bearer KEY` (HTTP 401 otherwise); the
    /// environment (`BATON_SERVE__API_KEY`, `BATON_COORDINATOR__API_KEY`) or --api-key-file keep
    /// it out of the process list.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// A file of accepted API keys, one per line (blank lines and # comments skipped).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// With API keys set, also require one for /metrics, /admin/* and /dashboard (/health and
    /// /ready stay open) [default: false].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protect_admin: Option<bool>,
    /// Wire type of hidden states between stages [default: f32].
    #[arg(long, value_parser = names!(ActivationDtypeSetting))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_dtype: Option<ActivationDtypeSetting>,
    /// Weight format the stages hold: auto (q8_0; a Q8_0 file's blocks as stored), f32 (the
    /// reference numerics), bf16 / f16, q8_0, q4_0 / q4_1 (fewer bytes) or native (each tensor
    /// as the file stores it) [default: auto].
    #[arg(long, value_parser = names!(WeightsSetting))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsSetting>,
    /// Times a request may move to a rebuilt pipeline after a worker failed (re-prefilled from
    /// its tokens so far, its stream continuing) before it fails with HTTP 503 [default: 3].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_migrations: Option<u32>,
    /// Seconds a request may wait for admission, in the queue or for a broken pipeline to be
    /// rebuilt, before it fails with HTTP 503 [default: 60].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_timeout_secs: Option<u64>,
    /// Re-plan a measured split while serving when measured stage times drift 15% from the
    /// plan: true or false [default: true].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live_replan: Option<bool>,
    /// Speculative decoding: off, ngram (prompt lookup: decode steps carry proposals copied
    /// from earlier text) or dflash (a draft model, --draft-model, on the last stage); the last
    /// stage verifies them and output is unchanged [default: off].
    #[arg(long, value_parser = names!(SpeculativeSetting))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeSetting>,
    /// The DFlash draft checkpoint directory for --speculative dflash (config.json with
    /// dflash_config, and safetensors), as the workers see it.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_model: Option<String>,
    /// Proposals per verify step at most, 1 to 16 (a request's `speculative_tokens` may ask for
    /// another number, or 0 for none) [default: 4].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_speculative_tokens: Option<usize>,
}

/// The KV storage a `kv_dtype` setting names.
fn kv_dtype(s: KvDtypeSetting) -> KvDtype {
    match s {
        KvDtypeSetting::F32 => KvDtype::F32,
        KvDtypeSetting::F16 => KvDtype::F16,
    }
}

/// The split policy a `split` setting names.
fn split_policy(s: SplitSetting) -> SplitPolicy {
    match s {
        SplitSetting::Measured => SplitPolicy::Measured,
        SplitSetting::Even => SplitPolicy::Even,
    }
}

/// Speculative decoding as the settings configure it.
pub(super) fn speculative(p: &PipelineSettings) -> Result<SpeculativeConfig> {
    let method = match p.speculative {
        SpeculativeSetting::Off => DraftMethod::Off,
        SpeculativeSetting::Ngram => DraftMethod::Ngram,
        SpeculativeSetting::Dflash => DraftMethod::Dflash,
    };
    anyhow::ensure!(
        (1..=MAX_SPECULATIVE_TOKENS).contains(&p.num_speculative_tokens),
        "num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got {}",
        p.num_speculative_tokens
    );
    match (method, &p.draft_model) {
        (DraftMethod::Dflash, Some(path)) if !path.trim().is_empty() => {
            Ok(SpeculativeConfig::dflash(path.trim(), p.num_speculative_tokens))
        }
        (DraftMethod::Dflash, _) => anyhow::bail!("speculative = dflash needs draft_model (--draft-model DIR)"),
        (_, Some(_)) => anyhow::bail!("draft_model is only used with speculative = dflash (--speculative dflash)"),
        _ => Ok(SpeculativeConfig::new(method, p.num_speculative_tokens)),
    }
}

/// The wire type an `activation_dtype` setting names.
fn activation_dtype(s: ActivationDtypeSetting) -> Dtype {
    match s {
        ActivationDtypeSetting::F32 => Dtype::F32,
        ActivationDtypeSetting::Bf16 => Dtype::Bf16,
        ActivationDtypeSetting::F16 => Dtype::F16,
    }
}

/// The HTTP API's connection limits from the settings.
pub(super) fn http_limits(p: &PipelineSettings) -> Result<HttpLimits> {
    anyhow::ensure!(p.max_connections > 0, "max_connections must be at least 1");
    anyhow::ensure!(p.header_timeout_secs > 0, "header_timeout_secs must be at least 1");
    anyhow::ensure!(p.body_timeout_secs > 0, "body_timeout_secs must be at least 1");
    Ok(HttpLimits {
        max_connections: p.max_connections,
        header_timeout: std::time::Duration::from_secs(p.header_timeout_secs),
        max_header_bytes: p.max_header_bytes,
    })
}

/// The API keys the settings configure (the key and every key in the key file), or `None`
/// for an open API.
pub(super) fn api_keys(p: &PipelineSettings) -> Result<Option<ApiKeys>> {
    let mut keys: Vec<String> = p.api_key.iter().cloned().collect();
    if let Some(path) = &p.api_key_file {
        keys.extend(ApiKeys::read_file(path)?);
    }
    let keys = ApiKeys::new(keys, p.protect_admin).map_err(|e| anyhow!("api_key: {e}"))?;
    match &keys {
        Some(_) => tracing::info!(protect_admin = p.protect_admin, "the OpenAI API requires an API key"),
        None if p.protect_admin => tracing::warn!("protect_admin is set but no API key is: every route is open"),
        None => {}
    }
    Ok(keys)
}

/// A weight format name (`auto`: Q8_0, a Q8_0 file's blocks as stored) for `files`.
pub(super) fn weight_format(name: &str, files: &ModelFiles) -> Result<WeightFormat> {
    resolve_format(name, files).map_err(|e| anyhow!("weights: {e}"))
}

/// The pipeline configuration for `model` from resolved settings: `worker_model` is the model
/// as workers resolve it, `stages` the pipeline's stage count and `max_context` the most
/// tokens per request. Explicit cuts and the cluster token are the caller's.
pub(super) fn pipeline_config(
    p: &PipelineSettings,
    model: &LoadedModel,
    worker_model: String,
    stages: usize,
    max_context: usize,
) -> Result<PipelineConfig> {
    // With no running or queued slot every request would wait forever.
    anyhow::ensure!(p.max_running != Some(0), "max_running must be at least 1");
    anyhow::ensure!(p.max_batch_tokens != Some(0), "max_batch_tokens must be at least 1");
    anyhow::ensure!(p.max_queue > 0, "max_queue must be at least 1");
    anyhow::ensure!(p.kv_block_size > 0, "kv_block_size must be at least 1");
    anyhow::ensure!(p.kv_max_blocks != Some(0), "kv_max_blocks must be at least 1");
    anyhow::ensure!(p.queue_timeout_secs > 0, "queue_timeout_secs must be at least 1");
    weight_format(p.weights.as_str(), &model.files)?;
    // A hybrid model's linear-attention layers keep a recurrent state per sequence: its prefix
    // cache reuses a prefix only up to a block whose state every stage snapshotted, so the
    // snapshots turn it on or off (verify steps roll the state back by replay on each stage).
    let hybrid = model.config.linear_attention.is_some();
    let speculative = speculative(p)?;
    let state_snapshots = match hybrid && p.prefix_caching {
        true => p.state_snapshots,
        false => 0,
    };
    if hybrid && p.prefix_caching && state_snapshots == 0 {
        tracing::warn!(
            "prefix caching is off for this model: state_snapshots is 0, and its linear-attention layers need them"
        );
    }
    // Each stage keeps one recurrent-state slot per running sequence, allocated at load: an
    // unset limit is sized (within the slots that fit each stage's budget), and where nothing
    // is measured a hybrid keeps as many as a stage's default slots.
    let max_running = match (hybrid, p.max_running) {
        (_, Some(n)) => n,
        (true, None) => HYBRID_MAX_RUNNING,
        (false, None) => UNMEASURED_MAX_RUNNING,
    };
    Ok(PipelineConfig {
        max_context,
        stages,
        split: split_policy(p.split),
        activation_dtype: activation_dtype(p.activation_dtype),
        weights: p.weights.as_str().to_string(),
        max_queue: p.max_queue,
        max_running,
        max_batch_tokens: p
            .max_batch_tokens
            .unwrap_or(UNMEASURED_MAX_BATCH_TOKENS)
            .max(p.max_running.unwrap_or(1)),
        auto_limits: AutoLimits {
            max_running: p.max_running.is_none(),
            max_batch_tokens: p.max_batch_tokens.is_none(),
        },
        kv_block_size: p.kv_block_size,
        kv_max_blocks: p.kv_max_blocks,
        kv_dtype: kv_dtype(p.kv_dtype),
        prefix_caching: p.prefix_caching && (!hybrid || state_snapshots > 0),
        state_snapshots,
        max_migrations: p.max_migrations,
        queue_timeout: std::time::Duration::from_secs(p.queue_timeout_secs),
        live_replan: p.live_replan.then(Default::default),
        speculative,
        ..PipelineConfig::new(worker_model, &model.config, model.tokenizer.eos_ids.clone())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        pipeline: PipelineArgs,
    }

    #[test]
    fn flags_parse_to_settings_names_and_serialize_only_when_given() {
        let cli = Cli::try_parse_from(["t", "--kv-dtype", "f16", "--weights", "q8_0", "--max-queue", "3"]).unwrap();
        assert_eq!(
            serde_json::to_value(&cli.pipeline).unwrap(),
            serde_json::json!({"kv_dtype": "f16", "weights": "q8_0", "max_queue": 3})
        );
        let e = Cli::try_parse_from(["t", "--split", "random"]).unwrap_err().to_string();
        assert!(e.contains("measured") && e.contains("even"), "{e}");
        assert_eq!(
            serde_json::to_value(PipelineArgs::default()).unwrap(),
            serde_json::json!({})
        );
    }

    #[test]
    fn every_setting_converts() {
        for s in KvDtypeSetting::ALL {
            assert_eq!(kv_dtype(*s).to_string(), s.as_str());
        }
        for s in SplitSetting::ALL {
            assert_eq!(split_policy(*s).to_string(), s.as_str());
        }
        for s in ActivationDtypeSetting::ALL {
            assert_eq!(baton_shared::wire::parse_dtype(s.as_str()), Some(activation_dtype(*s)));
        }
        for s in WeightsSetting::ALL.iter().filter(|w| **w != WeightsSetting::Auto) {
            assert_eq!(s.as_str().parse::<WeightFormat>().unwrap().name(), s.as_str());
        }
    }
}
