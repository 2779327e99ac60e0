//! Writes openb-style pod lists along every axis the FGD paper varies (see
//! `nano_gpu_tests::variants`), from the released default list in `../shared`, into a directory
//! (an ignored cache: nothing derived from the trace is committed), and prints what each holds.
//!
//! Usage: openb-variants [--out DIR] [--seed N]
//!   DIR defaults to `target/openb-variants`; N (default 1) seeds every sample.

use std::path::PathBuf;

fn main() -> Result<(), String> {
    let value = nano_gpu_tests::flag_value;
    let out = value("--out").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/openb-variants"));
    let seed: u64 = value("--seed").map_or(Ok(1), |s| s.parse().map_err(|_| format!("--seed {s}")))?;
    let written = nano_gpu_tests::variants::write_all(&out, seed)?;
    println!(
        "{:<34} {:>6} {:>9} {:>9} {:>10} {:>9}",
        "list", "pods", "cpu-only%", "sharing%", "multigpu%", "gpuspec%"
    );
    for (path, list) in written {
        let s = list.shares();
        println!(
            "{:<34} {:>6} {:>9.2} {:>9.2} {:>10.2} {:>9.2}",
            path.file_name().unwrap_or_default().to_string_lossy(),
            list.len(),
            s[0],
            s[1],
            s[2],
            s[3]
        );
    }
    Ok(())
}
