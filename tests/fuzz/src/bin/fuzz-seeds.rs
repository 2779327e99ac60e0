//! Writes each entry point's seeds into `DIR/<target>/seed-<n>` (libFuzzer's starting corpus, for
//! `hack/fuzz.sh --coverage`), and prints the targets' names, one per line.
//!
//! Usage: `fuzz-seeds DIR`

fn main() -> std::io::Result<()> {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: fuzz-seeds DIR");
        std::process::exit(2);
    };
    for (name, _) in nano_gpu_fuzz::TARGETS {
        let corpus = std::path::Path::new(&dir).join(name);
        std::fs::create_dir_all(&corpus)?;
        for (n, seed) in nano_gpu_fuzz::seeds(name).iter().enumerate() {
            std::fs::write(corpus.join(format!("seed-{n}")), seed)?;
        }
        println!("{name}");
    }
    Ok(())
}
