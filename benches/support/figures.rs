//! Helpers every bench binary shares (each includes this file with
//! `#[path]`, as a bench is a crate of its own).

/// The median of `samples`, sorted in place (not empty).
pub(crate) fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Whether the row `name` runs: no filter word on the command line
/// (`cargo bench --bench <bench> -- word`), or one that `name` contains.
pub(crate) fn selected(name: &str) -> bool {
    let words: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    words.is_empty() || words.iter().any(|w| name.contains(w.as_str()))
}
