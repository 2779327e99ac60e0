//! libFuzzer's inputs to [`nano_gpu_fuzz::http_routes`] (`hack/fuzz.sh --coverage`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| nano_gpu_fuzz::http_routes(data));
