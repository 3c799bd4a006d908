#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| baton_fuzz::targets::tokenizer_gguf(data));
