#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| baton_fuzz::targets::http_chat(data));
