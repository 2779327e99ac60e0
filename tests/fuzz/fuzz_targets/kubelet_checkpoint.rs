//! libFuzzer's inputs to [`nano_gpu_fuzz::kubelet_checkpoint`] (`hack/fuzz.sh --coverage`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| nano_gpu_fuzz::kubelet_checkpoint(data));
