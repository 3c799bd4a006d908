//! Which module serves a model: a Hugging Face `architectures` entry (or `model_type`) or a
//! GGUF `general.architecture`, looked up in one table. Adding an architecture is a module in
//! [`super::arch`] and a line here.

use baton_shared::model_config::ModelConfig;

use super::arch::{Architecture, Llama, Qwen2, Qwen3, Qwen3Moe, Qwen3Next, Qwen35, Qwen35Moe};

/// Every architecture this build runs.
pub static ARCHITECTURES: &[&dyn Architecture] = &[&Llama, &Qwen2, &Qwen3, &Qwen3Moe, &Qwen3Next, &Qwen35, &Qwen35Moe];

/// A model whose architecture no module serves.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unsupported architecture '{name}' (supported: {supported})")]
pub struct UnknownArchitecture {
    pub name: String,
    pub supported: String,
}

/// The module for a Hugging Face class / `model_type` or a GGUF architecture name.
pub fn find(name: &str) -> Result<&'static dyn Architecture, UnknownArchitecture> {
    ARCHITECTURES
        .iter()
        .copied()
        .find(|a| a.hf_names().contains(&name) || a.gguf_names().contains(&name))
        .ok_or_else(|| UnknownArchitecture {
            name: name.to_string(),
            supported: ARCHITECTURES.iter().map(|a| a.name()).collect::<Vec<_>>().join(", "),
        })
}

/// The module for a parsed config.
pub fn for_config(c: &ModelConfig) -> &'static dyn Architecture {
    // The config parser accepts exactly the architectures listed here (a test checks both
    // directions), so this lookup cannot miss.
    find(c.architecture.model_type()).expect("every parsed architecture has a module")
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_shared::model_config::Architecture as ConfigArch;

    #[test]
    fn hugging_face_and_gguf_names_find_their_module() {
        assert_eq!(find("LlamaForCausalLM").unwrap().name(), "llama");
        assert_eq!(find("llama").unwrap().name(), "llama");
        assert_eq!(find("Qwen2ForCausalLM").unwrap().name(), "qwen2");
        assert_eq!(find("qwen3").unwrap().name(), "qwen3");
        let e = find("MambaForCausalLM").unwrap_err();
        assert!(
            e.to_string().contains("MambaForCausalLM") && e.supported.contains("qwen3"),
            "{e}"
        );
    }

    #[test]
    fn every_architecture_the_config_parser_accepts_has_a_module_and_back() {
        for arch in [
            ConfigArch::Llama,
            ConfigArch::Qwen2,
            ConfigArch::Qwen3,
            ConfigArch::Qwen3Moe,
            ConfigArch::Qwen3Next,
            ConfigArch::Qwen35,
            ConfigArch::Qwen35Moe,
        ] {
            let m = find(arch.model_type()).unwrap();
            assert!(m.hf_names().contains(&arch.hf_class()), "{arch:?}");
        }
        for m in ARCHITECTURES {
            for name in m.gguf_names() {
                assert!(ConfigArch::parse(name).is_some(), "config parser refuses {name}");
            }
        }
    }
}
