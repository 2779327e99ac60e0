//! The names pods use to ask for GPUs, and the request annotations that refine them.

/// A share of one card (1..=100) or whole cards (a multiple of 100), per container, in limits.
pub const GPU_PERCENT: &str = "nano-gpu/gpu-percent";

/// Optional GPU memory in MiB per container on its card (for whole cards: the least memory per card).
/// Accounted by the allocator, never advertised as device IDs.
pub const GPU_MEMORY: &str = "nano-gpu/gpu-memory";

/// The Aliyun gpushare resource, accepted as GPU memory when gpushare compatibility is on.
pub const GPUSHARE_MEMORY: &str = "aliyun.com/gpu-mem";
/// gpushare's card count in a Node's status (published by its device plugin, read by its tools).
pub const GPUSHARE_COUNT: &str = "aliyun.com/gpu-count";

/// Pod annotation restricting which card models may serve the pod: models separated by `|`,
/// matched against the inventory model name or its label form (`nano-gpu/gpu.model`).
pub const GPU_MODEL_ANNOTATION: &str = "nano-gpu/gpu-model";

/// Every extended resource the allocator manages when gpushare compatibility is off.
pub const MANAGED: [&str; 2] = [GPU_PERCENT, GPU_MEMORY];
