//! libFuzzer's inputs to [`nano_gpu_fuzz::pod_demand`] (`hack/fuzz.sh --coverage`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| nano_gpu_fuzz::pod_demand(data));
