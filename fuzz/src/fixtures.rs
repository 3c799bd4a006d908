//! What the targets hold fixed while the input varies: the tiny Llama checkpoint of the test
//! suite, a byte-level tokenizer with a ChatML template, real chat templates, and a fake
//! generator behind the real HTTP router.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use baton_coordinator::api::{self, AppState};
use baton_coordinator::generation::{
    FinishReason, GenerationRequest, Generator, SubmitError, TokenEvent, TokenLogprobs,
};
use baton_shared::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// The tiny tied Llama checkpoint (3 layers, hidden 64, vocab 320, context 256).
pub fn tiny_llama_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/tiny/llama_tied"
    ))
}

/// GPT-2's byte-to-character table, so that token id == byte value.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in printable.iter().zip(chars) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// ChatML, with a Python string method (as SmolLM2/Qwen templates use them).
pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A byte-level BPE `tokenizer.json` (ids 0..256 are the bytes, 256..259 ChatML specials, two
/// merges) and
/// its `tokenizer_config.json`.
pub fn byte_level_tokenizer_files() -> (String, String) {
    let mut vocab: serde_json::Map<String, Value> = byte_chars()
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    // The merges' results (ids after the specials at 256..259).
    vocab.insert("Ġt".into(), json!(259));
    vocab.insert("he".into(), json!(260));
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(256, "<|endoftext|>"), special(257, "<|im_start|>"), special(258, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": [["Ġ", "t"], ["h", "e"]]}
    });
    let config = json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": false,
        "chat_template": CHATML,
    });
    (tokenizer.to_string(), config.to_string())
}

/// The byte-level tokenizer, loaded once.
pub fn byte_level_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let (tokenizer, config) = byte_level_tokenizer_files();
        let dir = crate::scratch_dir("byte-level-tokenizer");
        crate::write(&dir, "tokenizer.json", tokenizer.as_bytes());
        crate::write(&dir, "tokenizer_config.json", config.as_bytes());
        Tokenizer::from_hf_dir(&dir).expect("the byte-level tokenizer loads")
    })
}

/// Chat templates as models ship them (abridged where they only differ in wording).
pub const TEMPLATES: &[&str] = &[
    CHATML,
    // SmolLM2-Instruct.
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    // Llama 3 Instruct.
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    // Mistral/Llama 2 style: alternation enforced with raise_exception.
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
    // Qwen2.5 (no tools), with a default system prompt and Python methods.
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}{{- '<|im_start|>' + message.role + '\\n' + message.content.lstrip().replace('\\r', '') + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
];

/// A generator that answers every accepted request at once, from its prompt: a few of the
/// prompt's ids back (with logprobs when asked), then `Done` — or a refusal or a failure,
/// chosen by the first prompt id, so every response path of the API runs.
pub struct FakeGenerator {
    pub vocab: usize,
    pub max_context: usize,
}

impl Generator for FakeGenerator {
    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, SubmitError> {
        req.check(self.vocab, self.max_context)?;
        let first = req.prompt[0];
        match first % 13 {
            11 => return Err(SubmitError::Overloaded("fake queue full".into())),
            12 => return Err(SubmitError::Unavailable("fake pipeline down".into())),
            _ => {}
        }
        let n = req.params.max_tokens.min(8);
        let (tx, rx) = mpsc::channel(n + 2);
        if first % 5 == 1 {
            let _ = tx.try_send(TokenEvent::PromptCached {
                tokens: req.prompt.len() - 1,
            });
        }
        for i in 0..n {
            let id = req.prompt[(i * 7 + 3) % req.prompt.len()];
            let logprobs = req.logprobs.then(|| TokenLogprobs {
                logprob: -0.5 * i as f32,
                top: (0..req.top_logprobs)
                    .map(|k| ((id + k as u32 + 1) % self.vocab as u32, -1.0 - k as f32))
                    .collect(),
            });
            let _ = tx.try_send(TokenEvent::Token { id, logprobs });
        }
        let end = match first % 7 {
            3 => TokenEvent::Failed {
                message: "fake stage failure".into(),
                retriable: first % 2 == 0,
            },
            _ if n == req.params.max_tokens => TokenEvent::Done {
                reason: FinishReason::Length,
            },
            _ => TokenEvent::Done {
                reason: FinishReason::Stop,
            },
        };
        let _ = tx.try_send(end);
        Ok(rx)
    }

    fn ready(&self) -> bool {
        true
    }
}

/// A runtime and the real API router over the byte-level tokenizer and [`FakeGenerator`].
pub fn http_app() -> &'static (tokio::runtime::Runtime, axum::Router) {
    static APP: OnceLock<(tokio::runtime::Runtime, axum::Router)> = OnceLock::new();
    APP.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let tok = Arc::new(byte_level_tokenizer().clone());
        let max_context = 256;
        let generator = Arc::new(FakeGenerator {
            vocab: tok.vocab_size(),
            max_context,
        });
        let state = AppState::new("fuzz-model", tok, max_context, generator);
        (rt, api::router(state))
    })
}
